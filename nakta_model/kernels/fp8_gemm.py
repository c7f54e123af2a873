"""FP8 GEMM with per-row scales: ``out = (q_x @ q_w^T) * s_x[:, None] * s_w[None, :]``.

On CUDA this is cuBLASLt through ``torch._scaled_mm`` (row-wise scales, bf16 output): at the 7B
block shapes on an H100 it ran 1,145-1,283 TFLOP/s against bf16's 722-771 (issue 27's
measurement; ``kernel_benchmark/bench_fp8.py`` measures it again beside bf16 and a per-tensor
scaled GEMM). cuBLASLt takes the weight column-major, which ``q_w.t()`` of a row-major
``[N, K]`` weight already is: no copy.

Where cuBLASLt refuses the shape (``K`` or ``N`` not a multiple of 16: the tiny real
checkpoints, hidden 172) or off the GPU, :func:`fp8_matmul_reference` computes the same
function exactly: e4m3 values are exact in fp32 (and their products too, 8 significant bits),
so the only difference from cuBLASLt is the order of the fp32 sums.
"""

from __future__ import annotations

import torch

from nakta_model.kernels._checks import check_dtype, check_same_device, check_tensor
from nakta_model.kernels.fp8_quant import FP8_DTYPE

__all__ = ["fp8_matmul", "fp8_matmul_reference", "scaled_mm_supported"]

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ALIGN = 16


def _check(
    xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, out_dtype
) -> None:
    for name, t in (("xq", xq), ("xs", xs), ("wq", wq), ("ws", ws)):
        check_tensor(name, t)
    check_dtype("xq", xq, (FP8_DTYPE,))
    check_dtype("wq", wq, (FP8_DTYPE,))
    check_dtype("xs", xs, (torch.float32,))
    check_dtype("ws", ws, (torch.float32,))
    if xq.dim() != 2 or wq.dim() != 2 or xq.shape[1] != wq.shape[1]:
        raise ValueError(
            f"xq must be [M, K] and wq [N, K] with the same K, got {tuple(xq.shape)} and "
            f"{tuple(wq.shape)}"
        )
    if xs.shape != (xq.shape[0],) or ws.shape != (wq.shape[0],):
        raise ValueError(
            f"xs must be [{xq.shape[0]}] and ws [{wq.shape[0]}] (one scale per row), got "
            f"{tuple(xs.shape)} and {tuple(ws.shape)}"
        )
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    check_same_device(xq=xq, xs=xs, wq=wq, ws=ws)


def scaled_mm_supported(xq: torch.Tensor, wq: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """cuBLASLt's row-wise scaled GEMM takes this call: CUDA, compute capability >= 8.9,
    ``K`` and ``N`` multiples of 16, both operands row-major with aligned rows."""
    if not xq.is_cuda or out_dtype != torch.bfloat16 or xq.shape[0] == 0:
        return False
    if torch.cuda.get_device_capability(xq.device) < (8, 9):
        return False
    k, n = xq.shape[1], wq.shape[0]
    return (
        k % _ALIGN == 0
        and n % _ALIGN == 0
        and xq.stride(1) == 1
        and wq.stride(1) == 1
        and xq.stride(0) % _ALIGN == 0
        and wq.stride(0) % _ALIGN == 0
    )


def fp8_matmul(
    xq: torch.Tensor,
    xs: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``[M, N]`` in ``out_dtype``: rows ``xq [M, K]`` (scales ``xs [M]``) times the weight
    ``wq [N, K]`` (scales ``ws [N]``) transposed, accumulated in fp32, scaled, then rounded."""
    _check(xq, xs, wq, ws, out_dtype)
    if scaled_mm_supported(xq, wq, out_dtype):
        return torch._scaled_mm(
            xq, wq.t(), scale_a=xs[:, None], scale_b=ws[None, :], out_dtype=out_dtype
        )
    return fp8_matmul_reference(xq, xs, wq, ws, out_dtype)


def fp8_matmul_reference(
    xq: torch.Tensor,
    xs: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Plain PyTorch with the same semantics, in fp32 (exact products; see the module
    docstring); any device."""
    _check(xq, xs, wq, ws, out_dtype)
    acc = torch.matmul(xq.float(), wq.float().t())
    return (acc * xs[:, None] * ws[None, :]).to(out_dtype)
