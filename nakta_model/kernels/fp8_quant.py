"""FP8 (e4m3) row quantization: one fp32 scale per row, round to nearest even.

Why per row: the FP8 GEMMs scale each activation row (token) and each weight row (output
channel) by its own factor, so a single outlier costs precision in its row only, and the
scales fold into the GEMM epilogue (``fp8_gemm.py``). The same rule quantizes both:

    amax  = max(|x_row|, MIN_AMAX)          (of the values as stored: bf16 stays bf16)
    scale = amax / 448                      fp32, correctly rounded: what dequantizes
    q     = e4m3_rne(clamp(x * (448 / amax), -448, 448))

The per-element step is one fp32 multiply by the row's reciprocal, correctly rounded in Triton
and PyTorch alike, so a kernel and :func:`quantize_rows_reference` agree bit for bit; the
clamp catches the product that rounds past 448 (e4m3fn has no infinity: an overflow would be
NaN). ``MIN_AMAX`` keeps an all-zero row finite (its codes are 0 whatever its scale).

Weights are quantized once, at load or convert time, by the same rule over each output channel
(:func:`quantize_weight`); activations by the kernels that produce them (RMSNorm, SwiGLU) or by
:func:`quantize_rows` (the attention output).
"""

from __future__ import annotations

import torch

from nakta_model.kernels._checks import FLOAT_DTYPES, check_dtype, check_tensor, rows_view

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "MIN_AMAX",
    "QuantRows",
    "dequantize_rows",
    "quantize_rows_reference",
    "quantize_weight",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-12


class QuantRows(tuple):
    """``(q [M, K] e4m3, scale [M] fp32)``: rows quantized by this module's rule. A tuple, so
    kernels can return it and callers unpack it; the type tells an FP8 GEMM apart from a
    plain tensor input."""

    __slots__ = ()

    def __new__(cls, q: torch.Tensor, scale: torch.Tensor) -> QuantRows:
        return super().__new__(cls, (q, scale))

    @property
    def q(self) -> torch.Tensor:
        return self[0]

    @property
    def scale(self) -> torch.Tensor:
        return self[1]


def quantize_rows_reference(x: torch.Tensor) -> QuantRows:
    """Plain PyTorch: ``x [..., K]`` (fp32/fp16/bf16) as ``QuantRows(q [M, K], scale [M])``
    with ``M`` the product of the leading dims; any device."""
    check_tensor("x", x)
    check_dtype("x", x, FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension, got a scalar")
    x2 = x.reshape(-1, x.shape[-1]).float()
    if x2.shape[1] == 0:
        empty = torch.empty(x2.shape, dtype=FP8_DTYPE, device=x.device)
        return QuantRows(empty, torch.ones(x2.shape[0], dtype=torch.float32, device=x.device))
    amax = x2.abs().amax(dim=1).clamp_min(MIN_AMAX)
    inv = FP8_MAX / amax
    q = (x2 * inv[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return QuantRows(q, amax / FP8_MAX)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q [M, K] * scale [M, 1]`` in fp32: what a quantized row stands for."""
    check_tensor("q", q)
    check_tensor("scale", scale)
    check_dtype("q", q, (FP8_DTYPE,))
    check_dtype("scale", scale, (torch.float32,))
    if q.dim() != 2 or scale.shape != (q.shape[0],):
        raise ValueError(
            f"q must be [M, K] and scale [M], got {tuple(q.shape)} and {tuple(scale.shape)}"
        )
    return q.float() * scale[:, None]


@torch.no_grad()
def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear layer's ``weight [N, K]`` as ``(e4m3 [N, K], fp32 scale [N])``: round to
    nearest, one scale per output channel, no calibration data. Works in chunks of rows so a
    large matrix never needs an fp32 copy of itself (load time on the GPU)."""
    check_tensor("weight", weight)
    check_dtype("weight", weight, FLOAT_DTYPES)
    if weight.dim() != 2:
        raise ValueError(f"weight must be [out_features, in_features], got {tuple(weight.shape)}")
    w = rows_view("weight", weight) if weight.stride(-1) == 1 else weight.contiguous()
    n, k = w.shape
    q = torch.empty((n, k), dtype=FP8_DTYPE, device=w.device)
    scale = torch.empty(n, dtype=torch.float32, device=w.device)
    chunk = max(1, (64 << 20) // max(1, 4 * k))  # ~64 MB of fp32 at a time
    for lo in range(0, n, chunk):
        rows = quantize_rows_reference(w[lo : lo + chunk])
        q[lo : lo + chunk] = rows.q
        scale[lo : lo + chunk] = rows.scale
    return q, scale
