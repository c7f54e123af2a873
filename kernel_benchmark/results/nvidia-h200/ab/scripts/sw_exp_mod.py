import triton, triton.language as tl
from nakta_model.kernels.swiglu import _exp
from nakta_model.kernels._triton_math import div_rn_by_ge1, round_to

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
    g = g.to(tl.float32)
    u = u.to(tl.float32)
    dtype = OUT.dtype.element_ty
    if MODE == 0:  # branch-free exact
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
