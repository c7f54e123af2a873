import triton, triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def rms_fwd(X, W, Y, n_rows, n_cols, stride_x, stride_y, eps, inv_n,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVICT: tl.constexpr, NATIVE: tl.constexpr, ONE_D: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    w = tl.load(W + cols, mask=cmask, other=0.0, eviction_policy="evict_last" if EVICT else "")
    dtype = Y.dtype.element_ty
    if ONE_D:
        row = pid
        x = tl.load(X + row * stride_x + cols, mask=cmask, other=0.0, eviction_policy="evict_first" if EVICT else "")
        xf = x.to(tl.float32)
        rstd = libdevice.rsqrt(tl.sum(xf * xf, axis=0) * inv_n + eps)
        n = (xf * rstd).to(dtype)
        if NATIVE:
            y = n * w
        else:
            y = (n.to(tl.float32) * w.to(tl.float32)).to(dtype)
        tl.store(Y + row * stride_y + cols, y, mask=cmask, cache_modifier=".cs" if EVICT else "")
    else:
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < n_rows) & cmask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first" if EVICT else "")
        xf = x.to(tl.float32)
        rstd = libdevice.rsqrt(tl.sum(xf * xf, axis=1) * inv_n + eps)
        n = (xf * rstd[:, None]).to(dtype)
        if NATIVE:
            y = n * w[None, :]
        else:
            y = (n.to(tl.float32) * w.to(tl.float32)[None, :]).to(dtype)
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], y, mask=mask, cache_modifier=".cs" if EVICT else "")


def launch(x, w, y, bm, nw, evict, native, one_d):
    n_rows, n_cols = x.shape
    grid = (triton.cdiv(n_rows, bm),)
    rms_fwd[grid](x, w, y, n_rows, n_cols, x.stride(0), y.stride(0), 1e-6, 1.0 / n_cols, BLOCK_M=bm, BLOCK_N=triton.next_power_of_2(n_cols), EVICT=evict, NATIVE=native, ONE_D=one_d, num_warps=nw)
    return y


@triton.jit
def rms_rows(X, W, Y, n_rows, n_cols, stride_x, stride_y, eps, inv_n,
             BLOCK_N: tl.constexpr, RPP: tl.constexpr):
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dtype = Y.dtype.element_ty
    base = tl.program_id(0).to(tl.int64) * RPP
    for i in tl.static_range(RPP):
        row = base + i
        ok = cmask & (row < n_rows)
        x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        rstd = libdevice.rsqrt(tl.sum(x * x, axis=0) * inv_n + eps)
        y = (x * rstd).to(dtype).to(tl.float32) * w
        tl.store(Y + row * stride_y + cols, y.to(dtype), mask=ok)


def rows_launch(x, w, y, rpp, nw):
    n_rows, n_cols = x.shape
    rms_rows[(triton.cdiv(n_rows, rpp),)](x, w, y, n_rows, n_cols, x.stride(0), y.stride(0), 1e-6, 1.0 / n_cols, BLOCK_N=triton.next_power_of_2(n_cols), RPP=rpp, num_warps=nw)
    return y
