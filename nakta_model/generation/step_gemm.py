"""The decode step's linears as GEMMs, for the buckets where a step holds many rows.

Why: ``decode_linear`` streams each weight with the rows on the narrow side of its MMA tile
(``BLOCK_M = max(16, rows)``), which pays while a step holds a few rows and stops at 64
(``decode_linear.MAX_BATCH``). With 64..1024 rows a decode linear is a real GEMM (``M`` = rows):
cuBLAS (``torch.mm``) for bf16/fp16/fp32 weights and cuBLASLt's row-wise scaled FP8 GEMM
(``fp8_gemm.fp8_matmul``, ``torch._scaled_mm``) for e4m3 weights, with the small elementwise
work around them done by the scoring/prefill path's fused kernels. :func:`decode_gemm` takes
``decode_linear``'s arguments, so the step switches path per bucket with one call:

* NORM (``norm_weight``, ``eps``): the RMSNorm kernel (``rms_norm``), then the GEMM; with
  ``norm_residual`` the row to normalize is ``round(x + norm_residual)``, which the norm kernel
  adds in the same pass and :func:`decode_gemm` returns beside the product (the step defers
  a ``wo`` / ``w2`` product's residual add into the next norm this way: one launch and one
  pass over the rows fewer, the same rounding as a separate add);
* RESIDUAL: ``round(residual + round(x @ W^T))``, the GEMM's output added in place (eager's
  ``h = x + attn_out``, the same two roundings as ``decode_linear``);
* SWIGLU: the ``[rows, 2F]`` projection is written, then the SwiGLU kernel;
* ROPE: the ``wqkv`` projection is written, then ``apply_rope_qkv_`` rotates Q and K in place
  (Meta's pairs) and writes K/V into the cache slots; the Q columns are returned (a view with
  the projection's row stride, as the HF-pairs branch of the step already hands attention).

So every rounding point is ``decode_linear``'s; only the GEMM's summation order differs.

FP8 weights (an ``Fp8Linear``'s ``weight`` + ``weight_scale``) run W8A8 here, as the scorer does
(``fp8.py``): the norm before ``wqkv``/``w13`` is the quantizing RMSNorm (``rms_norm_fp8``), the
SwiGLU before ``w2`` the quantizing SwiGLU (``swiglu_fp8``: :func:`decode_gemm` then returns
its ``QuantRows``, which the ``w2`` call takes as ``x``), the attention output goes through
``quantize_rows``; the GEMM is ``fp8_matmul`` (row-wise scales, output in the model's dtype; on
the CPU / interpreter its exact fp32 reference), except at ``fp8_kernel_rows`` (8..64 by
default): there the GEMM is ``fp8_decode_gemm`` (Triton, the weight on the MMA's wide side,
split-K for narrow weights), with the RESIDUAL add fused into its epilogue at the same two
roundings, and ROPE too (the rotation and the K/V write of ``apply_rope_qkv_``, one launch
fewer a layer). Unlike ``decode_linear``'s FP8 path (e4m3
weights, activations in the model's dtype: W8A16), activations are quantized per row, as in
prefill and scoring: FP8 decoding above the crossover is the scorer's math.

The crossover (:func:`crossover`): rows at which a step's linears take this path, per dtype
(``"fp8"`` for FP8 models); a step of more than ``decode_linear.MAX_BATCH`` rows always does.
The defaults (``CROSSOVER``) come from ``kernel_benchmark/bench_decode_gemm.py``; ``_TUNE``
(benchmarks, tests) overrides them. ``FP8_KERNEL_ROWS`` (rows range of ``fp8_decode_gemm``) is
overridden the same way: ``_TUNE`` keys ``fp8_kernel_min`` / ``fp8_kernel_max``. These are
measured constants, not user settings. Everything here is CUDA-graph capturable: no host syncs
on CUDA, outputs from the caching allocator (a captured graph's private pool), cuBLAS/cuBLASLt handles their own workspace.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nakta_model.kernels import decode_linear as _dl
from nakta_model.kernels import fp8_decode_gemm as _fp8_small
from nakta_model.kernels import fp8_gemm as _fp8_gemm
from nakta_model.kernels import fp8_quant as _fp8
from nakta_model.kernels import rmsnorm as _rmsnorm
from nakta_model.kernels import rope as _rope
from nakta_model.kernels import swiglu as _swiglu
from nakta_model.kernels._checks import check_dtype, check_same_device, check_tensor, fp8_mma
from nakta_model.kernels.decode_linear import RopeArgs
from nakta_model.kernels.fp8_quant import FP8_DTYPE, QuantRows

__all__ = [
    "CROSSOVER",
    "FP8_KERNEL_ROWS",
    "MAX_ROWS",
    "crossover",
    "crossover_key",
    "decode_gemm",
    "decode_gemm_reference",
    "fp8_kernel_rows",
    "use_fp8_kernel",
    "use_gemm",
]

MAX_ROWS = 1024  # rows a decode step may hold (the engine's largest bucket)

# Rows from which a step's linears run as GEMMs, per activation dtype / "fp8" (W8A8 models),
# from kernel_benchmark/bench_decode_gemm (7B, the step's linears under CUDA graphs; the
# catalogue's decode_gemm table): decode_linear wins at 1 row, the GEMMs from 8 rows on. Rows 2
# and 4 were not measured and stay on decode_linear; fp32 (tests, CPU) keeps 64.
CROSSOVER: dict[str, int] = {"bfloat16": 8, "float16": 8, "float32": 64, "fp8": 8}
_TUNE: dict[str, int] = {}  # overrides CROSSOVER and FP8_KERNEL_ROWS (benchmarks, tests)


def crossover_key(dtype: torch.dtype, quant: str | None) -> str:
    """The ``CROSSOVER`` key of a model: ``"fp8"`` for FP8 weights, else its dtype's name."""
    return "fp8" if quant == "fp8" else str(dtype).removeprefix("torch.")


def crossover(dtype: torch.dtype, quant: str | None = None) -> int:
    """Rows from which the decode step's linears are GEMMs (``CROSSOVER``, then ``_TUNE``); at
    most ``decode_linear.MAX_BATCH + 1``."""
    key = crossover_key(dtype, quant)
    table = {**CROSSOVER, **_TUNE}
    if key not in table:
        raise ValueError(f"no decode GEMM crossover for {key!r}; keys: {sorted(table)}")
    rows = table[key]
    if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= _dl.MAX_BATCH + 1:
        raise ValueError(
            f"decode GEMM crossover for {key} must be an int in [1, {_dl.MAX_BATCH + 1}] "
            f"(decode_linear stops at {_dl.MAX_BATCH} rows), got {rows!r}"
        )
    return rows


# Rows [lo, hi] at which an FP8 step's GEMMs run ``fp8_decode_gemm`` instead of cuBLASLt: at
# 8-64 rows cuBLASLt's row-wise scaled GEMMs stream the 7B weights at well under copy bandwidth
# (docs/experiments.md); the Triton kernel keeps the weight on the MMA's wide side and splits K
# for the narrow ones. hi is at most the kernel's MAX_ROWS (64). ``bench_decode_gemm``'s
# triton_fp8 path and ``tune_fp8_decode --kernel gemm`` measure it.
FP8_KERNEL_ROWS = (8, _fp8_small.MAX_ROWS)


def fp8_kernel_rows() -> tuple[int, int]:
    """``(lo, hi)``: rows at which FP8 GEMMs take ``fp8_decode_gemm`` (``FP8_KERNEL_ROWS``, then
    ``_TUNE``'s ``fp8_kernel_min`` / ``fp8_kernel_max``); ``lo > hi`` means never."""
    lo, hi = FP8_KERNEL_ROWS
    lo, hi = _TUNE.get("fp8_kernel_min", lo), _TUNE.get("fp8_kernel_max", hi)
    for name, v in (("min", lo), ("max", hi)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"fp8 kernel rows {name} must be an int >= 0, got {v!r}")
    if hi > _fp8_small.MAX_ROWS:
        raise ValueError(
            f"fp8 kernel rows max must be <= {_fp8_small.MAX_ROWS} (fp8_decode_gemm's limit), "
            f"got {hi}"
        )
    return lo, hi


def use_fp8_kernel(rows: int, device: torch.device) -> bool:
    """Whether an FP8 GEMM of ``rows`` rows on ``device`` runs ``fp8_decode_gemm`` (which adds
    the residual in its epilogue) rather than cuBLASLt (:func:`fp8_kernel_rows`)."""
    lo, hi = fp8_kernel_rows()
    return lo <= rows <= hi and fp8_mma(device)


def use_gemm(rows: int, dtype: torch.dtype, quant: str | None = None) -> bool:
    """Whether a step of ``rows`` runs its linears as GEMMs (:func:`crossover`)."""
    return rows >= crossover(dtype, quant)


# ------------------------------------------------------------------------------------- checks
def _check_quant_rows(
    x: QuantRows, weight, weight_scale, norm_weight, residual, rope, out_dtype
) -> torch.dtype:
    """``x`` already quantized (the FP8 SwiGLU's output): an FP8 weight's input, no norm, no
    rope; ``out_dtype`` (or the residual's dtype) says what the GEMM writes."""
    q, s = check_tensor("x.q", x.q), check_tensor("x.scale", x.scale)
    check_dtype("x.q", q, (FP8_DTYPE,))
    check_dtype("x.scale", s, (torch.float32,))
    if q.dim() != 2 or s.shape != (q.shape[0],):
        raise ValueError(
            f"x must be QuantRows of q [M, K] and scale [M], got {tuple(q.shape)} and "
            f"{tuple(s.shape)}"
        )
    if not 1 <= q.shape[0] <= MAX_ROWS:
        raise ValueError(f"x must have 1..{MAX_ROWS} rows (decode batch), got {q.shape[0]}")
    if weight.dtype != FP8_DTYPE or weight_scale is None:
        raise TypeError("x given as QuantRows needs an FP8 weight with its weight_scale")
    if norm_weight is not None or rope is not None:
        raise ValueError("x given as QuantRows is already normalized: no norm_weight or rope")
    out_dtype = out_dtype or (residual.dtype if residual is not None else None)
    if out_dtype not in _fp8_gemm.OUT_DTYPES:
        raise TypeError(f"x given as QuantRows needs out_dtype in {_fp8_gemm.OUT_DTYPES}")
    if residual is not None:
        _dl._check_matrix("residual", residual, out_dtype)
    return out_dtype


def _check(
    x, weight, weight_scale, norm_weight, eps, residual, swiglu, rope, out_dtype, for_kernel: bool
) -> torch.dtype:
    """``decode_linear``'s checks with up to ``MAX_ROWS`` rows; returns the product's dtype."""
    if isinstance(x, QuantRows):
        _dl._check_weight_scale(_dl._check_matrix("weight", weight, (FP8_DTYPE,)), weight_scale)
        dt = _check_quant_rows(x, weight, weight_scale, norm_weight, residual, rope, out_dtype)
        if x.q.shape[1] != weight.shape[1]:
            raise ValueError(f"weight must have K={x.q.shape[1]} columns, got {weight.shape}")
        if swiglu and weight.shape[0] % 2:
            raise ValueError(f"swiglu needs an even number of weight rows, got {weight.shape}")
        if residual is not None and residual.shape != (x.q.shape[0], weight.shape[0]):
            raise ValueError(f"residual must have shape {(x.q.shape[0], weight.shape[0])}")
        if residual is not None and swiglu:
            raise ValueError("residual, swiglu and rope are exclusive epilogues: give at most one")
        check_same_device(x_q=x.q, x_scale=x.scale, weight=weight, weight_scale=weight_scale,
                          residual=residual)  # fmt: skip
        return dt
    if out_dtype not in (None, getattr(x, "dtype", None)):
        raise TypeError(f"out_dtype must be None or x's dtype, got {out_dtype}")
    # an e4m3 cache's rope is checked by the kernel that writes it (fp8_decode_gemm, rope)
    e4m3_cache = rope is not None and getattr(rope, "k_scale", None) is not None
    return _dl._check_args(
        x, weight, norm_weight, eps, residual, swiglu, None if e4m3_cache else rope, None, None,
        for_kernel=for_kernel, weight_scale=weight_scale, max_rows=MAX_ROWS,
    )  # fmt: skip


def _check_norm_residual(x, norm_weight, norm_residual) -> None:
    """``norm_residual``: with a norm, of x's shape and dtype (the rows the kernel adds)."""
    if norm_residual is None:
        return
    if norm_weight is None or isinstance(x, QuantRows):
        raise ValueError("norm_residual needs norm_weight and x in the model's dtype")
    check_tensor("norm_residual", norm_residual)
    if norm_residual.shape != x.shape or norm_residual.dtype != x.dtype:
        raise ValueError(
            f"norm_residual must have x's shape {tuple(x.shape)} and dtype {x.dtype}, got "
            f"{tuple(norm_residual.shape)} {norm_residual.dtype}"
        )
    check_same_device(x=x, norm_residual=norm_residual)


# ------------------------------------------------------------------------------------ the path
def _run(
    kernels: bool, x, weight, weight_scale, norm_weight, eps, residual, swiglu, rope, out_dtype,
    norm_residual=None,
) -> torch.Tensor | QuantRows | tuple:  # fmt: skip
    """The path with the fused kernels (``kernels``) or their PyTorch references around the
    GEMM (cuBLAS / cuBLASLt, or ``fp8_decode_gemm`` at ``fp8_kernel_rows``; never in the
    reference, whose FP8 GEMM is ``fp8_matmul_reference``)."""
    fp8, added = weight_scale is not None, None
    if fp8:
        if isinstance(x, QuantRows):
            xq = x
        elif norm_weight is not None:
            fn = _rmsnorm.rms_norm_fp8 if kernels else _rmsnorm.rms_norm_fp8_reference
            xq = fn(x, norm_weight, eps, residual=norm_residual)
            if norm_residual is not None:
                xq, added = xq
        else:
            xq = (_fp8.quantize_rows if kernels else _fp8.quantize_rows_reference)(x)
        fused_add = kernels and use_fp8_kernel(xq.q.shape[0], xq.q.device)
        if fused_add:  # the residual add, or RoPE + the K/V write, in the kernel's epilogue
            y = _fp8_small.fp8_decode_gemm(
                xq.q, xq.scale, weight, weight_scale, out_dtype, residual=residual, rope=rope
            )
            if rope is not None:
                q_cols = rope.n_q_heads * rope.head_dim
                return y[:, :q_cols] if added is None else (y[:, :q_cols], added)
        else:
            fn = _fp8_gemm.fp8_matmul if kernels else _fp8_gemm.fp8_matmul_reference
            y = fn(xq.q, xq.scale, weight, weight_scale, out_dtype)
    else:
        fused_add = False
        h = x
        if norm_weight is not None:
            fn = _rmsnorm.rms_norm if kernels else _rmsnorm.rms_norm_reference
            h = fn(x, norm_weight, eps, residual=norm_residual)
            if norm_residual is not None:
                h, added = h
        if h.device.type == "cpu" and h.dtype == torch.bfloat16 and not h.is_contiguous():
            h = h.contiguous()  # torch's CPU bf16 matmul reads strided rows' padding (see
            # decode_linear_reference)
        y = F.linear(h, weight)
    out = _epilogue(kernels, y, fp8, residual, fused_add, swiglu, rope)
    return out if added is None else (out, added)


def _epilogue(kernels: bool, y, fp8: bool, residual, fused_add: bool, swiglu: bool, rope):
    """The product's epilogue: the residual add (unless the FP8 kernel made it), SwiGLU, or
    RoPE + the K/V cache write (returning the Q columns)."""
    if residual is not None:
        return y if fused_add else y.add_(residual)
    if swiglu:
        if fp8:
            return (_swiglu.swiglu_fp8 if kernels else _swiglu.swiglu_fp8_reference)(y)
        return (_swiglu.swiglu if kernels else _swiglu.swiglu_reference)(y)
    if rope is not None:
        r = rope
        fn = _rope.apply_rope_qkv_ if kernels else _rope.apply_rope_qkv_reference
        fn(
            y, r.positions, r.cos, r.sin, r.n_q_heads, r.n_kv_heads, r.head_dim,
            interleaved=True, k_cache=r.k_cache, v_cache=r.v_cache, cache_slots=r.cache_slots,
            k_scale=r.k_scale, v_scale=r.v_scale,
        )  # fmt: skip
        return y[:, : r.n_q_heads * r.head_dim]
    return y


def decode_gemm(
    x: torch.Tensor | QuantRows,
    weight: torch.Tensor,
    *,
    weight_scale: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float | None = None,
    residual: torch.Tensor | None = None,
    swiglu: bool = False,
    rope: RopeArgs | None = None,
    out_dtype: torch.dtype | None = None,
    norm_residual: torch.Tensor | None = None,
) -> torch.Tensor | QuantRows | tuple:
    """``decode_linear``'s product and prologue/epilogues for up to ``MAX_ROWS`` rows, as a
    cuBLAS (bf16/fp16/fp32) or cuBLASLt W8A8 (FP8 weights) GEMM with the fused RMSNorm,
    SwiGLU and RoPE kernels around it (module docstring). Returns ``[rows, N]`` (``[rows, F]``
    with swiglu, the Q columns ``[rows, n_q_heads * head_dim]`` with rope); with an FP8 weight
    and swiglu, the ``QuantRows`` that the next FP8 GEMM takes as ``x``. ``out_dtype``: the
    product's dtype, x's by default; needed for a ``QuantRows`` x without a residual. With
    ``norm_residual`` (NORM only): ``(that, h)``, ``h = round(x + norm_residual)`` the row the
    norm normalized."""
    _check_norm_residual(x, norm_weight, norm_residual)
    dt = _check(x, weight, weight_scale, norm_weight, eps, residual, swiglu, rope, out_dtype, True)
    return _run(True, x, weight, weight_scale, norm_weight, eps, residual, swiglu, rope, dt,
                norm_residual)  # fmt: skip


def decode_gemm_reference(
    x: torch.Tensor | QuantRows,
    weight: torch.Tensor,
    *,
    weight_scale: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float | None = None,
    residual: torch.Tensor | None = None,
    swiglu: bool = False,
    rope: RopeArgs | None = None,
    out_dtype: torch.dtype | None = None,
    norm_residual: torch.Tensor | None = None,
) -> torch.Tensor | QuantRows | tuple:
    """:func:`decode_gemm` in plain PyTorch, any device: the kernels' references
    (``rms_norm_reference``, ``swiglu_reference``, ``apply_rope_qkv_reference``, their FP8
    variants) and ``F.linear`` / ``fp8_matmul_reference``. Without FP8 weights this is
    ``decode_linear_reference``'s chain, for up to ``MAX_ROWS`` rows."""
    _check_norm_residual(x, norm_weight, norm_residual)
    dt = _check(x, weight, weight_scale, norm_weight, eps, residual, swiglu, rope, out_dtype, False)
    return _run(False, x, weight, weight_scale, norm_weight, eps, residual, swiglu, rope, dt,
                norm_residual)  # fmt: skip
