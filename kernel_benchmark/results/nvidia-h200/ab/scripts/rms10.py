"""RMSNorm 1-row forward variants bisecting Nakta vs Liger (bf16, llama rounding)."""
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _k(Y, X, W, RSTD, sy, sx, n_cols, eps, inv_n, offset, BLOCK: tl.constexpr, STORE_RSTD: tl.constexpr,
       DIV: tl.constexpr, W_FP32: tl.constexpr, W_LATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * sx + cols, mask=mask, other=0)
    if not W_LATE:
        w = tl.load(W + cols, mask=mask, other=0)
    xf = x.to(tl.float32)
    if DIV:
        ms = tl.sum(xf * xf, axis=0) / n_cols
    else:
        ms = tl.sum(xf * xf, axis=0) * inv_n
    rstd = libdevice.rsqrt(ms + eps)
    if STORE_RSTD:
        tl.store(RSTD + row, rstd)
    if W_LATE:
        w = tl.load(W + cols, mask=mask, other=0)
    xn = (xf * rstd).to(x.dtype)
    if W_FP32:
        y = xn * (offset + w)
    else:
        y = xn.to(tl.float32) * w.to(tl.float32)
    tl.store(Y + row * sy + cols, y.to(Y.dtype.element_ty), mask=mask)


def launch(x, w, y, rstd, store_rstd, div, w_fp32, w_late, num_warps=8):
    n_rows, n = x.shape
    return _k[(n_rows,)](y, x, w, rstd, y.stride(0), x.stride(0), n, 1e-6, 1.0 / n, 0.0, BLOCK=triton.next_power_of_2(n),
              STORE_RSTD=store_rstd, DIV=div, W_FP32=w_fp32, W_LATE=w_late, num_warps=num_warps)
