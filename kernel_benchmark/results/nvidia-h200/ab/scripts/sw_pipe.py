import triton, triton.language as tl
from nakta_model.kernels.swiglu import _exp


@triton.jit
def _div_exact(x, d, MODE: tl.constexpr):
    if MODE == 0:
        return tl.math.div_rn(x, d)
    else:
        big = d > 18446744073709551616.0
        scale = tl.where(big, 5.421010862427522e-20, 1.0)
        xs = x * scale
        ds = d * scale
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [ds], dtype=tl.float32, is_pure=True, pack=1)
        r = tl.fma(r, tl.fma(-ds, r, 1.0), r)
        q = xs * r
        q = tl.fma(r, tl.fma(-ds, q, xs), q)
        sign = x.to(tl.uint32, bitcast=True) & 0x80000000
        q = ((q.to(tl.uint32, bitcast=True) & 0x7FFFFFFF) | sign).to(tl.float32, bitcast=True)
        return tl.where(q != q, tl.where(d == 1.0, x, x * 0.0), q)


@triton.jit
def fwd_pipe(G, U, OUT, n_rows, n_cols, stride_g, stride_u, stride_out,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, STAGES: tl.constexpr):
    col_blocks = tl.cdiv(n_cols, BLOCK_N)
    n_tiles = tl.cdiv(n_rows, BLOCK_M) * col_blocks
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
        t = tile.to(tl.int64)
        rows = (t // col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (t % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dtype = OUT.dtype.element_ty
        if MODE == 2:
            silu = tl.fdiv(g, 1.0 + tl.exp(-g), ieee_rounding=False).to(dtype)
        else:
            silu = _div_exact(g, 1.0 + _exp(-g, True), MODE).to(dtype)
        out = (silu.to(tl.float32) * u).to(dtype)
        tl.store(OUT + rows[:, None] * stride_out + cols[None, :], out, mask=mask)


def launch(g, u, out, bm, bn, nw, mode, stages, programs):
    n_rows, n_cols = g.shape
    fwd_pipe[(programs,)](g, u, out, n_rows, n_cols, g.stride(0), u.stride(0), out.stride(0), BLOCK_M=bm, BLOCK_N=bn, MODE=mode, STAGES=stages, num_warps=nw)
    return out


from triton.language.extra import libdevice


@triton.jit
def rms_pipe(X, W, Y, n_rows, n_cols, stride_x, stride_y, eps, inv_n,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    n_tiles = tl.cdiv(n_rows, BLOCK_M)
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
        rows = tile.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < n_rows) & cmask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        ss = tl.sum(x * x, axis=1)
        rstd = libdevice.rsqrt(ss * inv_n + eps)
        dtype = Y.dtype.element_ty
        y = (x * rstd[:, None]).to(dtype).to(tl.float32) * w[None, :]
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(dtype), mask=mask)


def rms_launch(x, w, y, bm, nw, stages, programs):
    n_rows, n_cols = x.shape
    rms_pipe[(programs,)](x, w, y, n_rows, n_cols, x.stride(0), y.stride(0), 1e-6, 1.0 / n_cols, BLOCK_M=bm, BLOCK_N=triton.next_power_of_2(n_cols), STAGES=stages, num_warps=nw)
    return y
