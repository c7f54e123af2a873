"""SwiGLU forward silu arithmetic variants (MODE), for exhaustive bit checks and A/B timing."""
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _rcp_approx(x):
    return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _silu(g, MODE: tl.constexpr):
    if MODE == 0:  # current exact: libdevice expf + div.rn
        s = tl.math.div_rn(g, 1.0 + libdevice.exp(-g))
    elif MODE == 1:  # libdevice expf + div.full
        s = tl.fdiv(g, 1.0 + libdevice.exp(-g), ieee_rounding=False)
    elif MODE == 2:  # libdevice expf + rcp.approx * g
        s = g * _rcp_approx(1.0 + libdevice.exp(-g))
    elif MODE == 3:  # libdevice expf + rcp.approx, one residual correction
        d = 1.0 + libdevice.exp(-g)
        r = _rcp_approx(d)
        q = g * r
        s = tl.fma(tl.fma(-q, d, g), r, q)
    elif MODE == 4:  # current fast: ex2 + div.full
        s = tl.fdiv(g, 1.0 + tl.exp(-g), ieee_rounding=False)
    elif MODE == 5:  # ex2 + div.rn
        s = tl.math.div_rn(g, 1.0 + tl.exp(-g))
    else:  # libdevice expf + div.full reciprocal then multiply
        s = g * tl.fdiv(1.0, 1.0 + libdevice.exp(-g), ieee_rounding=False)
    return s


@triton.jit
def _fwd(G, U, OUT, n_rows, n_cols, sg, su, so, BLOCK_N: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    cb = tl.cdiv(n_cols, BLOCK_N)
    r = pid // cb
    c = (pid % cb) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = c < n_cols
    g = tl.load(G + r * sg + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + r * su + c, mask=m, other=0.0).to(tl.float32)
    dt = OUT.dtype.element_ty
    s = _silu(g, MODE).to(dt).to(tl.float32)
    tl.store(OUT + r * so + c, (s * u).to(dt), mask=m)


def launch(g, u, out, mode, block_n=512, num_warps=1):
    n_rows, n_cols = g.shape
    grid = (n_rows * triton.cdiv(n_cols, block_n),)
    _fwd[grid](g, u, out, n_rows, n_cols, g.stride(0), u.stride(0), out.stride(0), BLOCK_N=block_n, MODE=mode, num_warps=num_warps)
    return out
