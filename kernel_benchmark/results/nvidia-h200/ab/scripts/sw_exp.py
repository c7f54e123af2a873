import triton, triton.language as tl
from nakta_model.kernels.swiglu import _exp
from nakta_model.kernels._triton_math import round_to
from sw_pipe import _div_exact


@triton.jit
def div_rn_by_ge1(x, d, ACCURATE: tl.constexpr):
    return _div_exact(x, d, 1)

@triton.jit
def fwd(G, U, OUT, n_rows, n_cols, stride_g, stride_u, stride_out,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    col_blocks = tl.cdiv(n_cols, BLOCK_N)
    rows = (pid // col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0)
    u = tl.load(U + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0)
    if MODE == 3:
        tl.debug_barrier()
    g = g.to(tl.float32)
    u = u.to(tl.float32)
    dtype = OUT.dtype.element_ty
    if MODE == 0 or MODE == 3:  # branch-free exact
        silu = div_rn_by_ge1(g, 1.0 + _exp(-g, True), True).to(dtype)
    elif MODE == 1:  # div.rn exact (old)
        silu = tl.math.div_rn(g, 1.0 + _exp(-g, True)).to(dtype)
    else:  # fast, Liger-like
        silu = (g * tl.sigmoid(g)).to(dtype)
    out = (silu.to(tl.float32) * u).to(dtype)
    tl.store(OUT + rows[:, None] * stride_out + cols[None, :], out, mask=mask)


def launch(g, u, out, bm, bn, nw, mode):
    n_rows, n_cols = g.shape
    grid = (triton.cdiv(n_rows, bm) * triton.cdiv(n_cols, bn),)
    fwd[grid](g, u, out, n_rows, n_cols, g.stride(0), u.stride(0), out.stride(0), BLOCK_M=bm, BLOCK_N=bn, MODE=mode, num_warps=nw)
    return out


@triton.jit
def fwd_joint(G, U, OUT, n_rows, n_cols, stride_g, stride_u, stride_out,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    col_blocks = tl.cdiv(n_cols, BLOCK_N)
    rows = (pid // col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    pg = G + rows[:, None] * stride_g + cols[None, :]
    pu = U + rows[:, None] * stride_u + cols[None, :]
    gu = tl.load(tl.join(pg, pu), mask=tl.join(mask, mask), other=0.0).to(tl.float32)
    g, u = tl.split(gu)
    dtype = OUT.dtype.element_ty
    if MODE == 0:
        silu = div_rn_by_ge1(g, 1.0 + _exp(-g, True), True).to(dtype)
    else:
        silu = tl.math.div_rn(g, 1.0 + _exp(-g, True)).to(dtype)
    out = (silu.to(tl.float32) * u).to(dtype)
    tl.store(OUT + rows[:, None] * stride_out + cols[None, :], out, mask=mask)


@triton.jit
def fwd_bb(G, U, OUT, n_rows, n_cols, stride_g, stride_u, stride_out,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr):
    """Loads in their own basic block: a runtime branch separates them from the arithmetic."""
    pid = tl.program_id(0).to(tl.int64)
    col_blocks = tl.cdiv(n_cols, BLOCK_N)
    rows = (pid // col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0)
    u = tl.load(U + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0)
    dtype = OUT.dtype.element_ty
    if n_rows > 0:
        gf = g.to(tl.float32)
        silu = div_rn_by_ge1(gf, 1.0 + _exp(-gf, True), True).to(dtype)
        out = (silu.to(tl.float32) * u.to(tl.float32)).to(dtype)
        tl.store(OUT + rows[:, None] * stride_out + cols[None, :], out, mask=mask)


@triton.jit(noinline=True)
def _silu_mul_noinline(g, u, OUT_DTYPE: tl.constexpr):
    gf = g.to(tl.float32)
    silu = div_rn_by_ge1(gf, 1.0 + _exp(-gf, True), True).to(OUT_DTYPE)
    return (silu.to(tl.float32) * u.to(tl.float32)).to(OUT_DTYPE)


@triton.jit
def fwd_call(G, U, OUT, n_rows, n_cols, stride_g, stride_u, stride_out,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    col_blocks = tl.cdiv(n_cols, BLOCK_N)
    rows = (pid // col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0)
    u = tl.load(U + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0)
    out = _silu_mul_noinline(g, u, OUT.dtype.element_ty)
    tl.store(OUT + rows[:, None] * stride_out + cols[None, :], out, mask=mask)


def launch_call(g, u, out, bm, bn, nw):
    n_rows, n_cols = g.shape
    grid = (triton.cdiv(n_rows, bm) * triton.cdiv(n_cols, bn),)
    fwd_call[grid](g, u, out, n_rows, n_cols, g.stride(0), u.stride(0), out.stride(0), BLOCK_M=bm, BLOCK_N=bn, MODE=0, num_warps=nw)
    return out


@triton.jit
def fwd_vb(G, U, OUT, n_rows, n_cols, stride_g, stride_u, stride_out,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr):
    """Volatile loads then a CTA barrier: the loads cannot sink below the barrier."""
    pid = tl.program_id(0).to(tl.int64)
    col_blocks = tl.cdiv(n_cols, BLOCK_N)
    rows = (pid // col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0, volatile=True)
    u = tl.load(U + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0, volatile=True)
    if MODE == 1:
        tl.debug_barrier()
    dtype = OUT.dtype.element_ty
    gf = g.to(tl.float32)
    silu = div_rn_by_ge1(gf, 1.0 + _exp(-gf, True), True).to(dtype)
    out = (silu.to(tl.float32) * u.to(tl.float32)).to(dtype)
    tl.store(OUT + rows[:, None] * stride_out + cols[None, :], out, mask=mask)


def launch_vb(g, u, out, bm, bn, nw, mode):
    n_rows, n_cols = g.shape
    grid = (triton.cdiv(n_rows, bm) * triton.cdiv(n_cols, bn),)
    fwd_vb[grid](g, u, out, n_rows, n_cols, g.stride(0), u.stride(0), out.stride(0), BLOCK_M=bm, BLOCK_N=bn, MODE=mode, num_warps=nw)
    return out


@triton.jit
def _rcp(d):
    return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [d], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def fwd_hybrid(G, U, OUT, n_rows, n_cols, stride_g, stride_u, stride_out,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr):
    """Unguarded div.rn fast path; a tile with any lane outside its proven range (divisor
    > 2^64, zero gate, NaN) or a NaN up redoes the division with IEEE div.rn."""
    pid = tl.program_id(0).to(tl.int64)
    col_blocks = tl.cdiv(n_cols, BLOCK_N)
    rows = (pid // col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dtype = OUT.dtype.element_ty
    d = 1.0 + _exp(-g, True)
    r = _rcp(d)
    r = tl.fma(r, tl.fma(-d, r, 1.0), r)
    q = g * r
    q = tl.fma(r, tl.fma(-d, q, g), q)
    if MODE == 0:
        odd = (d > 18446744073709551616.0) | (q != q) | (g == 0.0) | (u != u)
    else:
        odd = (d > 18446744073709551616.0) | (q != q) | (g == 0.0)
    if tl.max(odd.to(tl.int32)) > 0:
        q = tl.math.div_rn(g, d)
    silu = q.to(dtype)
    out = (silu.to(tl.float32) * u).to(dtype)
    tl.store(OUT + rows[:, None] * stride_out + cols[None, :], out, mask=mask)


def launch_hybrid(g, u, out, bm, bn, nw, mode=0):
    n_rows, n_cols = g.shape
    grid = (triton.cdiv(n_rows, bm) * triton.cdiv(n_cols, bn),)
    fwd_hybrid[grid](g, u, out, n_rows, n_cols, g.stride(0), u.stride(0), out.stride(0), BLOCK_M=bm, BLOCK_N=bn, MODE=mode, num_warps=nw)
    return out
