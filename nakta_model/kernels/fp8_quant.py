"""FP8 (e4m3) row quantization: one fp32 scale per row, round to nearest even.

Why per row: the FP8 GEMMs scale each activation row (token) and each weight row (output
channel) by its own factor, so a single outlier costs precision in its row only, and the
scales fold into the GEMM epilogue (``fp8_gemm.py``). The same rule quantizes both:

    amax  = max(|x_row|, MIN_AMAX)          (of the values as stored: bf16 stays bf16)
    scale = amax / 448                      fp32, correctly rounded: what dequantizes
    q     = e4m3_rne(clamp(x * (448 / amax), -448, 448))

Both divisions are correctly rounded (IEEE ``div.rn`` in the kernels, tensor-by-tensor division
in the reference) and the per-element step is one fp32 multiply by ``448 / amax``, so a kernel
and :func:`quantize_rows_reference` agree bit for bit; the
clamp catches the product that rounds past 448 (e4m3fn has no infinity: an overflow would be
NaN). ``MIN_AMAX`` keeps an all-zero row finite (its codes are 0 whatever its scale).

Weights are quantized once, at load or convert time, by the same rule over each output channel
(:func:`quantize_weight`); activations by the kernels that produce them (RMSNorm, SwiGLU) or by
:func:`quantize_rows` (the attention output).

Kernel (:func:`quantize_rows`): memory-bound, so the floor is reading ``x`` once and writing one
byte per element. A row up to ``MAX_SINGLE_BLOCK`` columns is held in registers by one program
(``BLOCK_M`` rows of narrow widths), so ``x`` is read once; wider rows loop over column blocks
twice, the second pass reading the row back from L2 (``evict_last`` then ``evict_first``, as
the RMSNorm kernel's looped rows do). ``kernel_benchmark/bench_fp8.py`` times both layouts.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from nakta_model.kernels._checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_tensor,
    check_triton_device,
    interpreter_enabled,
    rows_view,
)
from nakta_model.kernels._triton_math import fp8_codes, fp8_row_scales

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "MIN_AMAX",
    "QuantRows",
    "dequantize_rows",
    "quantize_rows",
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


# ----------------------------------------------------------------------------------------------
# 1. Triton kernel
# ----------------------------------------------------------------------------------------------


# The row/token count is not specialised on: every batch size runs one compiled kernel.
@triton.jit(do_not_specialize=["n_rows"])
def _quantize_rows_kernel(
    X, Q, S, n_rows, n_cols, stride_xm, stride_xk, stride_qm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
    MIN_AMAX: tl.constexpr, EMULATE_RNE: tl.constexpr,
):  # fmt: skip
    """Rows ``[pid * BLOCK_M, ...)``: amax, the two scales, the codes (module docstring)."""
    pid = tl.program_id(0).to(tl.int64)
    if SINGLE_BLOCK:
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        x = tl.load(X + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
        x = x.to(tl.float32)
        inv, scale = fp8_row_scales(tl.max(tl.abs(x), axis=1), MIN_AMAX)
        q = fp8_codes(x, inv[:, None], EMULATE_RNE)
        tl.store(Q + rows[:, None] * stride_qm + cols[None, :], q, mask=mask)
        tl.store(S + rows, scale, mask=rows < n_rows)
    else:
        cols = tl.arange(0, BLOCK_N)
        amax = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            x = tl.load(X + pid * stride_xm + c * stride_xk, mask=c < n_cols, other=0.0,
                        eviction_policy="evict_last")  # fmt: skip
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        inv, scale = fp8_row_scales(tl.max(amax, axis=0), MIN_AMAX)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            x = tl.load(X + pid * stride_xm + c * stride_xk, mask=c < n_cols, other=0.0,
                        eviction_policy="evict_first")  # fmt: skip
            q = fp8_codes(x.to(tl.float32), inv, EMULATE_RNE)
            tl.store(Q + pid * stride_qm + c, q, mask=c < n_cols)
        tl.store(S + pid, scale)


# ----------------------------------------------------------------------------------------------
# 2. Launch configuration and launcher
# ----------------------------------------------------------------------------------------------

MAX_SINGLE_BLOCK = 16384  # widest row (padded to a power of two) held in registers at once
LOOP_BLOCK_N = 4096  # column block of wider rows
# Launch values by the padded row width held (single block): ~32 fp32 values per thread, at
# least 2048 elements per program (narrow rows pack several rows). Not yet tuned on a GPU:
# ``bench_fp8.py`` times these beside the looped layout. ``_TUNE`` overrides any key (BLOCK_N
# forces the looped layout with that block; set by the benchmark and the tests only).
_CONFIGS: dict[int, dict[str, int]] = {
    4096: dict(BLOCK_M=1, num_warps=8),
    8192: dict(BLOCK_M=1, num_warps=8),
    16384: dict(BLOCK_M=1, num_warps=16),
}
_TUNE: dict[str, int] = {}


def _config(n_cols: int) -> dict[str, int]:
    """``BLOCK_M``, ``BLOCK_N``, ``SINGLE_BLOCK`` and ``num_warps`` for rows of ``n_cols``."""
    full = triton.next_power_of_2(max(1, n_cols))
    if "BLOCK_N" in _TUNE:
        cfg = dict(BLOCK_M=1, BLOCK_N=_TUNE["BLOCK_N"], num_warps=8)
        cfg["SINGLE_BLOCK"] = cfg["BLOCK_N"] >= n_cols
    elif full > MAX_SINGLE_BLOCK:
        cfg = dict(BLOCK_M=1, BLOCK_N=LOOP_BLOCK_N, num_warps=8, SINGLE_BLOCK=False)
    else:
        base = _CONFIGS.get(full) or dict(
            BLOCK_M=max(1, 2048 // full), num_warps=max(1, min(8, full // 256))
        )
        cfg = dict(base, BLOCK_N=full, SINGLE_BLOCK=True)
    cfg.update({k: v for k, v in _TUNE.items() if k != "BLOCK_N"})
    if not cfg["SINGLE_BLOCK"]:
        cfg["BLOCK_M"] = 1
    return cfg


def _rows2d(x: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` as ``[M, K]`` without a copy: 2-D inputs with any strides; more leading
    dims must collapse into one row stride."""
    if x.dim() == 2:
        return x
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError as e:
        raise ValueError(
            f"x with shape {tuple(x.shape)} and strides {x.stride()} cannot be viewed as "
            "[rows, K] with one row stride; pass a 2-D view or collapsible leading dims"
        ) from e


def quantize_rows_launch(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Launch the kernel on ``x [M, K]`` into ``q [M, K]`` (unit-stride rows), ``scale [M]``."""
    n_rows, n_cols = x.shape
    if n_rows == 0:
        return
    cfg = _config(n_cols)
    grid = (triton.cdiv(n_rows, cfg["BLOCK_M"]),)
    _quantize_rows_kernel[grid](
        x, q, scale, n_rows, n_cols, x.stride(0), x.stride(1), q.stride(0),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], SINGLE_BLOCK=cfg["SINGLE_BLOCK"],
        MIN_AMAX=MIN_AMAX, EMULATE_RNE=interpreter_enabled(), num_warps=cfg["num_warps"],
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# 3. Public function
# ----------------------------------------------------------------------------------------------


def quantize_rows(x: torch.Tensor) -> QuantRows:
    """``x [..., K]`` (fp32/fp16/bf16, CUDA or the interpreter, any strides for 2-D) as
    ``QuantRows(q [M, K] e4m3 contiguous, scale [M] fp32)``, bit for bit
    :func:`quantize_rows_reference`."""
    check_tensor("x", x)
    check_dtype("x", x, FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension, got a scalar")
    check_triton_device("x", x)
    if x.shape[-1] == 0:
        return quantize_rows_reference(x)
    x2 = _rows2d(x)
    q = torch.empty(x2.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    quantize_rows_launch(x2, q, scale)
    return QuantRows(q, scale)


# ----------------------------------------------------------------------------------------------
# 4. References
# ----------------------------------------------------------------------------------------------


def quantize_rows_reference(x: torch.Tensor) -> QuantRows:
    """Plain PyTorch: ``x [..., K]`` (fp32/fp16/bf16) as ``QuantRows(q [M, K], scale [M])``
    with ``M`` the product of the leading dims; any device."""
    check_tensor("x", x)
    check_dtype("x", x, FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension, got a scalar")
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).float()
    if x2.shape[1] == 0:
        empty = torch.empty(x2.shape, dtype=FP8_DTYPE, device=x.device)
        return QuantRows(empty, torch.ones(x2.shape[0], dtype=torch.float32, device=x.device))
    amax = x2.abs().amax(dim=1).clamp_min(MIN_AMAX)
    # Tensor by tensor: IEEE division on every device. ``FP8_MAX / amax`` would not be: PyTorch
    # computes a Python number over a tensor as ``reciprocal(amax) * 448`` (two roundings; 26%
    # of random amax values land 1 ulp off), and CUDA divides a tensor by a Python number as a
    # multiply by its fp32 reciprocal (1/448 is not exact).
    fp8_max = torch.full_like(amax, FP8_MAX)
    inv = fp8_max / amax
    q = (x2 * inv[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return QuantRows(q, amax / fp8_max)


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
