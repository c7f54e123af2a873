"""Decode-step linear layers: one launch per weight matrix, its neighbours fused in.

Why: decoding a few tokens at a time is a stream of the weights through the GPU, and each
extra launch per layer costs launch and tail time. So each matmul of a decode step is one
kernel that also does the small elementwise work around it:

* NORM prologue (``norm_weight``, ``eps``): the input is Meta's RMSNorm of ``x``,
  ``round(round(x * rsqrt(mean(x^2) + eps)) * norm_weight)`` rounded to x's dtype where eager
  Meta rounds (``rms_norm_reference``). Every program recomputes the rows' 1/rms from ``x``
  (``B x K`` elements, L2-resident) instead of paying a separate launch.
* RESIDUAL epilogue (``residual [B, N]``): ``round(residual + round(x @ W^T))``, eager's
  ``h = x + attn_out``.
* SWIGLU epilogue (``swiglu=True``, ``weight`` = fused ``w13 [2F, K]``, gate rows first): the
  program owning output columns ``[n0, n0 + BLOCK_N)`` accumulates gate rows ``n0..`` and up
  rows ``F + n0..`` together and writes ``swiglu_reference`` of the rounded pair; the
  ``[B, 2F]`` projection is never written.
* ROPE epilogue (``rope=RopeArgs(...)``, ``weight`` = fused ``wqkv``): Q and K are rounded to
  the dtype, rotated in fp32 by Meta's adjacent pairs (2i, 2i+1) at ``positions[b]`` and
  rounded; the output holds the rotated Q only, while the rotated K and the raw V rows go to
  ``k_cache[cache_slots[b]]`` / ``v_cache[cache_slots[b]]`` (``apply_rope_qkv_reference``).
  Tiles hold an even number of rows starting at an even row, so every pair stays in one tile;
  a tile may straddle heads or the Q/K/V boundaries (masks pick each row's destination).
  An out-of-range position or cache slot turns that row's Q into NaN and skips its cache
  write (no host sync on CUDA); the CPU, or ``NAKTA_DEBUG=1``, raises ValueError instead.
* ``out_dtype=torch.float32`` (plain or NORM only): the fp32 accumulator itself, unrounded
  (LM-head logits). Eager Meta rounds logits to the dtype first; round this output to x's
  dtype to get its values up to summation order.

* FP8 weights (``weight`` e4m3 ``[N, K]`` with ``weight_scale`` fp32 ``[N]``, every variant):
  the codes are read (half the bytes of bf16), converted in registers (exactly: e4m3 values
  are exact in fp16/bf16/fp32), accumulated in fp32, and each column's sum is multiplied by
  its row's scale before the epilogue's first rounding; so the result is the same chain run
  on the fp32 dequantized weight ``weight.float() * weight_scale[:, None]`` up to summation
  order (``decode_linear_reference`` with ``weight_scale``).

Kernel (in ``_decode_linear_kernels.py``): each program owns ``BLOCK_N`` output columns
(``2 * BLOCK_N`` weight rows with SWIGLU) for every batch row and walks K in ``BLOCK_K`` tiles;
no split-K, so no atomics and results do not depend on the launch. ``USE_DOT`` computes
``W_tile @ x_tile^T`` with ``tl.dot``, the batch padded to ``BLOCK_M = max(16, next_pow2(B))``
(weights on the wide side of the MMA); otherwise (batch 1 by default) elementwise products are
accumulated in fp32 and reduced over K once at the end. fp32 inputs use ``input_precision="ieee"``. The launch is
CUDA-graph capturable: no host syncs (unless ``NAKTA_DEBUG=1``), no allocation except the
output when ``out`` is not given, and a grid that depends on shapes only.

Launch configurations: ``_CONFIGS`` per (dtype, batch bucket), plus per-shape entries keyed
(dtype, bucket, variant, N, K); ``BLOCK_N`` chosen to fill the GPU unless given (``_config``);
``_TUNE`` overrides all (set by ``kernel_benchmark/bench_decode.py --tune`` and the tests only).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from nakta_model.kernels import _decode_linear_configs as _knobs
from nakta_model.kernels._checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_index,
    check_ndim,
    check_no_overlap,
    check_positive_int,
    check_range,
    check_same_device,
    check_tensor,
    check_triton_device,
    debug_checks,
    dependent_launch,
    device_family,
    interpreter_enabled,
    sm_count,
    tracing,
)
from nakta_model.kernels._decode_linear_configs import _CONFIGS, _DEVICE_CONFIGS
from nakta_model.kernels._decode_linear_kernels import _decode_linear_kernel
from nakta_model.kernels.fp8_quant import FP8_DTYPE
from nakta_model.kernels.rmsnorm import rms_norm_reference
from nakta_model.kernels.rope import apply_rope_qkv_reference
from nakta_model.kernels.swiglu import FAST_IS_EXACT_DTYPES, swiglu_reference

MAX_BATCH = 64


@dataclass(frozen=True)
class RopeArgs:
    """What the ROPE epilogue needs: per-row positions and cache slots, the fp32 cos/sin tables
    (``build_rope_cache``), the head layout of ``wqkv`` and the caches to write K/V into."""

    positions: torch.Tensor  # int [B]
    cos: torch.Tensor  # fp32 [max_pos, head_dim // 2]
    sin: torch.Tensor  # fp32 [max_pos, head_dim // 2]
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    k_cache: torch.Tensor  # [slots, n_kv_heads, head_dim]
    v_cache: torch.Tensor  # [slots, n_kv_heads, head_dim]
    cache_slots: torch.Tensor  # int [B]


# ------------------------------------------------------------------------------------------------
# 1. Launch configuration and launcher
# ------------------------------------------------------------------------------------------------

# The tables (``_CONFIGS`` per (weight dtype, batch bucket) and per shape, ``_DEVICE_CONFIGS``
# per device family) are in ``_decode_linear_configs.py``, with what measured them.
_TUNE: dict[str, int] = {}

_PROGRAMS_PER_SM = 2  # grid target: ~2 programs per SM (0.9 slack: 4096 / 16 = 256 on 132 SMs)
_FMA_TILE_ELEMS = 8192  # fp32 accumulator elements per program on the CUDA-core path
_BLOCK_N_RANGE = {False: (4, 64), True: (16, 128)}  # (min, max) tile rows, by USE_DOT
_DEFAULT_SMS = 132  # H100 SXM / H200; used off the GPU so interpreter runs pick GPU-like tiles


def _block_n(n_cols: int, rows_per_col: int, use_dot: bool, sms: int) -> int:
    """Largest power of two of output columns per program that still gives ~2 programs per SM
    (within the path's tile limits, counted in weight rows)."""
    lo, hi = _BLOCK_N_RANGE[use_dot]
    lo_cols = max(2, lo // rows_per_col)
    hi_cols = max(lo_cols, hi // rows_per_col)
    target = 0.9 * _PROGRAMS_PER_SM * sms
    bn = lo_cols
    while bn * 2 <= hi_cols and triton.cdiv(n_cols, bn * 2) >= target:
        bn *= 2
    return bn


def _block_k(k: int, tile_n: int, block_m: int, use_dot: bool, elem: int) -> int:
    """CUDA-core path: an fp32 accumulator of ``_FMA_TILE_ELEMS`` (``TILE_N x BLOCK_M x
    BLOCK_K``); ``tl.dot`` path: 512 bytes of each weight row per step."""
    if use_dot:
        bk = 512 // elem
    else:
        bk = max(64, min(1024 // elem, _FMA_TILE_ELEMS // (tile_n * block_m)))
    return min(bk, max(16, triton.next_power_of_2(k)))


def _config(
    dtype: torch.dtype, batch: int, n_cols: int, k: int, variant: str, device: torch.device,
    weight_dtype: torch.dtype | None = None,
) -> dict[str, int]:  # fmt: skip
    """The launch config of one call: the (dtype, batch bucket) entry, then the per-shape entry,
    then ``_TUNE``; block sizes not set there are derived from the shape. ``dtype`` is x's;
    an FP8 ``weight_dtype`` looks up the FP8 rows instead (``_decode_linear_configs.py``).
    ``DOT_F16`` (fp16 MMA operands, ``_dot_loop``) holds only for FP8 weights, bf16 x and
    ``USE_DOT``, where a table row or ``_TUNE`` asks and ``NAKTA_FP8_DOT_F16`` is not 0;
    ``PREFETCH`` (``_fma_prefetch_loop``) only for FP8 weights, CUDA cores, batch 1."""
    bucket = triton.next_power_of_2(batch)
    x_dtype = dtype
    if weight_dtype == FP8_DTYPE:
        dtype = weight_dtype
    name = str(dtype).removeprefix("torch.")
    cfg = dict(_CONFIGS[(name, bucket)])
    cfg.update(_CONFIGS.get((name, bucket, variant, n_cols, k), {}))
    cfg.update(
        _DEVICE_CONFIGS.get(device_family(device), {}).get((name, bucket, variant, n_cols, k), {})
    )
    cfg.update(_TUNE)
    use_dot = bool(cfg["USE_DOT"])
    rows_per_col = 2 if variant == "swiglu" else 1
    block_m = max(16, bucket) if use_dot else bucket
    sms = sm_count(device, _DEFAULT_SMS)
    block_n = cfg.get("BLOCK_N") or _block_n(n_cols, rows_per_col, use_dot, sms)
    tile_n = rows_per_col * block_n
    block_k = cfg.get("BLOCK_K") or _block_k(k, tile_n, block_m, use_dot, dtype.itemsize)
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    out = dict(BLOCK_M=block_m, BLOCK_N=block_n, TILE_N=tile_n, BLOCK_K=block_k)
    out |= dict(USE_DOT=int(use_dot), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    f16 = use_dot and x_dtype == torch.bfloat16 and dtype == FP8_DTYPE and FP8_DOT_F16
    out["DOT_F16"] = int(bool(cfg.get("DOT_F16", 0)) and f16)
    fma_fp8 = not use_dot and block_m == 1 and dtype == FP8_DTYPE
    out["PREFETCH"] = int(bool(cfg.get("PREFETCH", 0)) and fma_fp8)
    if use_dot:
        out["num_stages"] = _stages_that_fit(out, x_dtype.itemsize, dtype.itemsize)
    _check_config(out, variant)
    return out


# Shared memory a tensor-core program's pipeline may take (Hopper allows 227 KiB a block; the
# rest is left for the epilogue's layout conversions). Derived entries (no tuned row for the
# shape) at small batch buckets asked for 4 stages of a 128 x 256 weight tile: 288 KiB, which
# Triton refuses at launch (an H200 run of the 7B LM head at 2, 4 and 16 rows); the tuned rows
# that ran take at most 200 KiB.
SMEM_BUDGET = 216 * 1024


def _stages_that_fit(cfg: dict[str, int], x_bytes: int, w_bytes: int) -> int:
    """``num_stages`` lowered (not below 2) until the pipelined x and weight tiles fit
    :data:`SMEM_BUDGET`; one stage of the pipeline holds a ``BLOCK_M x BLOCK_K`` x tile and a
    ``TILE_N x BLOCK_K`` weight tile."""
    per_stage = cfg["BLOCK_K"] * (cfg["BLOCK_M"] * x_bytes + cfg["TILE_N"] * w_bytes)
    stages = cfg["num_stages"]
    while stages > 2 and stages * per_stage > SMEM_BUDGET:
        stages -= 1
    return stages


# The escape hatch from fp16 MMA operands for FP8 weights (``_dot_loop``'s ``DOT_F16``):
# ``NAKTA_FP8_DOT_F16=0`` at import (or this flag False) converts the e4m3 codes to bf16, two
# more conversions a weight pair, for activations beyond fp16's 65504 (inf there).
FP8_DOT_F16 = os.environ.get("NAKTA_FP8_DOT_F16", "1") not in ("", "0")


def _check_config(cfg: dict[str, int], variant: str) -> None:
    """A tuned or hand-set config the kernel cannot run raises here, not inside Triton."""
    for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps"):
        v = cfg[key]
        if v < 1 or v & (v - 1):
            raise ValueError(f"launch config {key} must be a power of two, got {v}")
    if variant == "rope" and cfg["BLOCK_N"] < 2:
        raise ValueError("launch config BLOCK_N must be >= 2 with rope (pairs stay in a tile)")
    if cfg["USE_DOT"] and (cfg["TILE_N"] < 16 or cfg["BLOCK_K"] < 16 or cfg["BLOCK_M"] < 16):
        raise ValueError(f"launch config with USE_DOT needs tiles of at least 16, got {cfg}")


def weight_words(weight: torch.Tensor) -> torch.Tensor | None:
    """The e4m3 weight as int32 words of four codes (``PREFETCH``, sm_89+'s e4m3x2 cvt), or
    None where there is none (K, row stride or start not a multiple of 4; an older GPU): the
    launch then runs ``PREFETCH=0`` (the same sums; in another order once compiled)."""
    old = weight.is_cuda and torch.cuda.get_device_capability(weight.device) < (8, 9)
    if old or weight.shape[1] % 4 or weight.stride(0) % 4 or weight.storage_offset() % 4:
        return None
    return weight.view(torch.int32)


def _variant(residual, swiglu: bool, rope) -> str:
    if rope is not None:
        return "rope"
    if swiglu:
        return "swiglu"
    return "residual" if residual is not None else "plain"


# Programmatic dependent launch pays at batch 1 and costs at 32 (H200, 7B: 3.74 vs 3.81 ms a
# token at batch 1, 6.07 vs 5.65 at 32: early blocks land unevenly; docs/experiments.md).
PDL_MAX_BATCH = 1


def _launch(
    x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, eps: float | None,
    residual: torch.Tensor | None, swiglu: bool, rope: RopeArgs | None, out: torch.Tensor,
    weight_scale: torch.Tensor | None = None,
) -> None:  # fmt: skip
    batch, k = x.shape
    n_w_rows = weight.shape[0]
    variant = _variant(residual, swiglu, rope)
    n_cols = n_w_rows // 2 if swiglu else n_w_rows
    cfg = _config(x.dtype, batch, n_cols, k, variant, x.device, weight.dtype)
    words = weight_words(weight) if cfg["PREFETCH"] else None
    w_arg, stride_wn = (weight, weight.stride(0)) if words is None else (words, words.stride(0))
    interp = interpreter_enabled()
    upcast = interp and x.dtype == torch.bfloat16
    prec = "ieee" if (x.dtype == torch.float32 or upcast) else None
    dummy = x
    if rope is not None:
        r = rope
        rope_ptrs = (r.positions, r.cos, r.sin, r.k_cache, r.v_cache, r.cache_slots)
        q_cols = r.n_q_heads * r.head_dim
        qk_cols = q_cols + r.n_kv_heads * r.head_dim
        rope_ints = (q_cols, qk_cols, r.cos.shape[0], min(r.k_cache.shape[0], r.v_cache.shape[0]))
        rope_strides = (r.cos.stride(0), r.cos.stride(1), r.sin.stride(0), r.sin.stride(1),
                        r.k_cache.stride(0), r.k_cache.stride(1),
                        r.v_cache.stride(0), r.v_cache.stride(1))  # fmt: skip
        head_dim = r.head_dim
    else:
        rope_ptrs = (dummy,) * 6
        rope_ints = (0, 0, 0, 0)
        rope_strides = (0,) * 8
        head_dim = 2
    pos, cos, sin, kc, vc, slots = rope_ptrs
    grid = (triton.cdiv(n_cols, cfg["BLOCK_N"]),)
    pdl = batch <= PDL_MAX_BATCH and dependent_launch(x.device)
    launch = {"launch_pdl": True} if pdl else {}
    _decode_linear_kernel[grid](
        x, w_arg, weight_scale if weight_scale is not None else dummy,
        norm_weight if norm_weight is not None else dummy,
        residual if residual is not None else dummy, out, pos, cos, sin, kc, vc, slots,
        batch, k, n_w_rows, n_cols,
        x.stride(0), stride_wn, weight_scale.stride(0) if weight_scale is not None else 0,
        norm_weight.stride(0) if norm_weight is not None else 0,
        residual.stride(0) if residual is not None else 0, out.stride(0),
        float(eps) if eps is not None else 0.0, 1.0 / k,
        *rope_ints, *rope_strides,
        HEAD_DIM=head_dim, NORM=norm_weight is not None, RESIDUAL=residual is not None,
        SWIGLU=swiglu, ROPE=rope is not None, W_FP8=weight_scale is not None,
        USE_DOT=bool(cfg["USE_DOT"]),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], TILE_N=cfg["TILE_N"],
        BLOCK_K=cfg["BLOCK_K"], EVEN_K=k % cfg["BLOCK_K"] == 0, PREC=prec, UPCAST=upcast,
        FAST_SILU=x.dtype in FAST_IS_EXACT_DTYPES, ACCURATE=not interp, EMULATE_RNE=interp,
        NORM_BLOCK=_knobs.norm_block(k, cfg["BLOCK_M"], cfg["BLOCK_K"], cfg["num_warps"]),
        EARLY_W=_knobs.EARLY_WEIGHT and cfg["BLOCK_M"] == 1 and not cfg["USE_DOT"],
        PDL=pdl, DOT_F16=bool(cfg["DOT_F16"]), PREFETCH=words is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------
# 2. Input checks
# ------------------------------------------------------------------------------------------------


def _check_matrix(
    name: str, t: object, dtype: torch.dtype | tuple[torch.dtype, ...] | None = None
) -> torch.Tensor:
    """A 2-D float tensor with a unit-stride last dimension (rows may have any stride)."""
    t = check_tensor(name, t)
    allowed = FLOAT_DTYPES if dtype is None else dtype if isinstance(dtype, tuple) else (dtype,)
    check_dtype(name, t, allowed)
    check_ndim(name, t, 2)
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must be unit-stride along its last dimension, got {t.stride()}")
    return t


def _check_rope(rope: object, x: torch.Tensor, weight: torch.Tensor) -> RopeArgs:
    if not isinstance(rope, RopeArgs):
        raise TypeError(f"rope must be a RopeArgs, got {type(rope).__name__}")
    r = rope
    for name in ("n_q_heads", "n_kv_heads", "head_dim"):
        check_positive_int(f"rope.{name}", getattr(r, name))
    if r.head_dim % 2:
        raise ValueError(f"rope.head_dim must be even (Meta's pairs), got {r.head_dim}")
    if r.n_q_heads % r.n_kv_heads:
        raise ValueError(
            f"rope.n_kv_heads ({r.n_kv_heads}) must divide rope.n_q_heads ({r.n_q_heads})"
        )
    width = (r.n_q_heads + 2 * r.n_kv_heads) * r.head_dim
    if weight.shape[0] != width:
        raise ValueError(
            f"weight must be wqkv with (n_q_heads + 2 * n_kv_heads) * head_dim = {width} rows "
            f"for rope, got shape {tuple(weight.shape)}"
        )
    batch = x.shape[0]
    check_index("rope.positions", r.positions, batch, per="batch row")
    check_index("rope.cache_slots", r.cache_slots, batch, per="batch row")
    for name in ("cos", "sin"):
        t = check_tensor(f"rope.{name}", getattr(r, name))
        check_dtype(f"rope.{name}", t, (torch.float32,))
        check_ndim(f"rope.{name}", t, 2)
        if t.shape[1] != r.head_dim // 2 or t.shape[0] < 1:
            raise ValueError(
                f"rope.{name} must have shape [max_pos, head_dim // 2 = {r.head_dim // 2}], "
                f"got {tuple(t.shape)}"
            )
    if r.cos.shape != r.sin.shape:
        raise ValueError(
            f"rope.cos and rope.sin must have the same shape, got {tuple(r.cos.shape)} "
            f"and {tuple(r.sin.shape)}"
        )
    for name in ("k_cache", "v_cache"):
        c = check_tensor(f"rope.{name}", getattr(r, name))
        check_ndim(f"rope.{name}", c, 3)
        if c.shape[1:] != (r.n_kv_heads, r.head_dim):
            raise ValueError(
                f"rope.{name} must have shape [slots, n_kv_heads={r.n_kv_heads}, "
                f"head_dim={r.head_dim}], got {tuple(c.shape)}"
            )
        if c.dtype != x.dtype:
            raise TypeError(f"rope.{name} must have x's dtype {x.dtype}, got {c.dtype}")
        if c.stride(2) != 1:
            raise ValueError(
                f"rope.{name} must be unit-stride in its last dimension, got {c.stride()}"
            )
    if not tracing() and r.k_cache.data_ptr() == r.v_cache.data_ptr():
        raise ValueError("rope.k_cache and rope.v_cache must be different tensors")
    return r


def _check_weight_scale(weight: torch.Tensor, weight_scale: object) -> None:
    """``weight_scale`` is required iff ``weight`` is FP8 (e4m3): fp32 ``[N]``, one per row."""
    if weight.dtype != FP8_DTYPE:
        if weight_scale is not None:
            raise ValueError(
                f"weight_scale is only for an FP8 (float8_e4m3fn) weight, got a {weight.dtype} "
                "weight; drop weight_scale or pass the quantized weight"
            )
        return
    if weight_scale is None:
        raise ValueError(
            "weight is FP8 (float8_e4m3fn): pass weight_scale, its fp32 [N] per-row scales"
        )
    check_tensor("weight_scale", weight_scale)
    check_dtype("weight_scale", weight_scale, (torch.float32,))
    if weight_scale.shape != (weight.shape[0],):
        raise ValueError(
            f"weight_scale must have shape [{weight.shape[0]}] (one per weight row), "
            f"got {tuple(weight_scale.shape)}"
        )


def _check_args(
    x, weight, norm_weight, eps, residual, swiglu, rope, out, out_dtype, *, for_kernel: bool,
    weight_scale=None, max_rows: int = MAX_BATCH,
) -> torch.dtype:  # fmt: skip
    """Validate a ``decode_linear`` call (or, with ``max_rows``, the decode step's GEMM path,
    ``generation/step_gemm.py``, which takes the same arguments); returns the output dtype."""
    x = _check_matrix("x", x)
    weight = _check_matrix("weight", weight, (x.dtype, FP8_DTYPE))
    _check_weight_scale(weight, weight_scale)
    batch, k = x.shape
    if not 1 <= batch <= max_rows:
        raise ValueError(f"x must have 1..{max_rows} rows (decode batch), got {batch}")
    if k < 1 or weight.shape[1] != k:
        raise ValueError(
            f"weight must have shape [N, K={k}] (nn.Linear layout), got {tuple(weight.shape)}"
        )
    if weight.shape[0] < 1:
        raise ValueError(f"weight must have at least one row, got shape {tuple(weight.shape)}")
    if not isinstance(swiglu, bool):
        raise TypeError(f"swiglu must be a bool, got {type(swiglu).__name__}")
    if sum([residual is not None, swiglu, rope is not None]) > 1:
        raise ValueError("residual, swiglu and rope are exclusive epilogues: give at most one")
    if norm_weight is not None:
        norm_weight = check_tensor("norm_weight", norm_weight)
        check_dtype("norm_weight", norm_weight, (x.dtype,))
        if norm_weight.dim() != 1 or norm_weight.shape[0] != k:
            raise ValueError(f"norm_weight must have shape [{k}], got {tuple(norm_weight.shape)}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(f"eps must be a positive float with norm_weight, got {eps!r}")
    elif eps is not None:
        raise ValueError("eps is only used with norm_weight; pass norm_weight or drop eps")
    if swiglu and weight.shape[0] % 2:
        raise ValueError(
            f"swiglu needs the fused w13 weight with an even number of rows [2F, K], "
            f"got shape {tuple(weight.shape)}"
        )
    if rope is not None:
        rope = _check_rope(rope, x, weight)
        n_out = rope.n_q_heads * rope.head_dim
    else:
        n_out = weight.shape[0] // 2 if swiglu else weight.shape[0]
    if out_dtype not in (None, x.dtype, torch.float32):
        raise TypeError(f"out_dtype must be None, x's dtype or torch.float32, got {out_dtype}")
    out_dtype = out_dtype or x.dtype
    if out_dtype != x.dtype and (residual is not None or swiglu or rope is not None):
        raise ValueError(
            "out_dtype=torch.float32 is for logits: only without residual, swiglu and rope"
        )
    if residual is not None:
        residual = _check_matrix("residual", residual, x.dtype)
        if residual.shape != (batch, n_out):
            raise ValueError(
                f"residual must have shape {(batch, n_out)}, got {tuple(residual.shape)}"
            )
    if out is not None:
        out = _check_matrix("out", out, out_dtype)
        if out.shape != (batch, n_out):
            raise ValueError(f"out must have shape {(batch, n_out)}, got {tuple(out.shape)}")
    tensors = dict(x=x, weight=weight, weight_scale=weight_scale, norm_weight=norm_weight,
                   residual=residual, out=out)  # fmt: skip
    if rope is not None:
        tensors |= {f"rope.{f}": getattr(rope, f) for f in
                    ("positions", "cos", "sin", "k_cache", "v_cache", "cache_slots")}  # fmt: skip
    check_same_device(**tensors)
    _check_no_aliasing(x, weight, norm_weight, residual, rope, out, weight_scale)
    if rope is not None and (not x.is_cuda or debug_checks() or not for_kernel):
        check_range("rope.positions", rope.positions, rope.cos.shape[0], "the cos/sin rows")
        n_slots = min(rope.k_cache.shape[0], rope.v_cache.shape[0])
        check_range("rope.cache_slots", rope.cache_slots, n_slots, "the cache's slots")
    if for_kernel:
        check_triton_device("x", x)
    return out_dtype


def _check_no_aliasing(x, weight, norm_weight, residual, rope, out, weight_scale=None) -> None:
    """Every program reads all of x (and the norm weight): writes must not land there. ``out``
    may be ``residual`` itself (each element is read, then written, by one program)."""
    reads = dict(x=x, weight=weight, norm_weight=norm_weight, weight_scale=weight_scale)
    writes = {"out": out}
    if rope is not None:
        writes |= {"rope.k_cache": rope.k_cache, "rope.v_cache": rope.v_cache}
    for wname, w in writes.items():
        if w is None:
            continue
        for rname, r in reads.items():
            if r is not None:
                check_no_overlap(wname, w, rname, r)
    if out is not None and residual is not None and not tracing():
        same = out.data_ptr() == residual.data_ptr() and out.stride() == residual.stride()
        if not same:
            check_no_overlap("out", out, "residual", residual)


# ------------------------------------------------------------------------------------------------
# 3. Public function
# ------------------------------------------------------------------------------------------------


def decode_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    weight_scale: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float | None = None,
    residual: torch.Tensor | None = None,
    swiglu: bool = False,
    rope: RopeArgs | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x [B, K] @ weight [N, K]^T`` for a decode batch (B <= 64), with an optional RMSNorm
    prologue and one optional epilogue (residual add, SwiGLU on fused w13, or RoPE + KV-cache
    write on fused wqkv); see the module docstring. Returns ``out`` (allocated when None):
    ``[B, N]``, ``[B, F]`` with swiglu, ``[B, n_q_heads * head_dim]`` with rope.

    ``weight`` is x's dtype, or FP8 e4m3 with ``weight_scale`` (fp32 ``[N]``, one per row):
    the e4m3 codes are read (half the bytes of bf16) and converted in registers, and each
    output column's fp32 sum is multiplied by its row's scale before any rounding."""
    out_dtype = _check_args(
        x,
        weight,
        norm_weight,
        eps,
        residual,
        swiglu,
        rope,
        out,
        out_dtype,
        for_kernel=True,
        weight_scale=weight_scale,
    )
    if out is None:
        n_out = _out_cols(weight, swiglu, rope)
        out = torch.empty(x.shape[0], n_out, dtype=out_dtype, device=x.device)
    _launch(x, weight, norm_weight, eps, residual, swiglu, rope, out, weight_scale)
    return out


def _out_cols(weight: torch.Tensor, swiglu: bool, rope: RopeArgs | None) -> int:
    if rope is not None:
        return rope.n_q_heads * rope.head_dim
    return weight.shape[0] // 2 if swiglu else weight.shape[0]


# ------------------------------------------------------------------------------------------------
# 4. Reference
# ------------------------------------------------------------------------------------------------


def decode_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    weight_scale: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float | None = None,
    residual: torch.Tensor | None = None,
    swiglu: bool = False,
    rope: RopeArgs | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The eager Meta chain, op by op (any device): ``rms_norm_reference``, ``F.linear`` in the
    dtype, then the residual add, ``swiglu_reference`` or ``apply_rope_qkv_reference`` (which
    writes the caches). ``out_dtype=torch.float32``: ``F.linear`` on fp32 copies. An FP8
    ``weight``: ``F.linear`` in fp32 on the dequantized weight ``weight.float() *
    weight_scale[:, None]``, rounded once to the output dtype (where the bf16 path's fp32
    accumulator is rounded)."""
    out_dtype = _check_args(
        x,
        weight,
        norm_weight,
        eps,
        residual,
        swiglu,
        rope,
        out,
        out_dtype,
        for_kernel=False,
        weight_scale=weight_scale,
    )
    h = x if norm_weight is None else rms_norm_reference(x, norm_weight, eps)
    if h.device.type == "cpu" and h.dtype == torch.bfloat16 and not h.is_contiguous():
        # torch 2.13's CPU bf16 matmul (oneDNN, AVX512-BF16/AMX machines) reads a strided
        # input's row padding and multiplies it by zero: NaN or inf there turns the row to NaN
        h = h.contiguous()
    if weight_scale is not None:
        y = F.linear(h.float(), weight.float() * weight_scale[:, None]).to(out_dtype)
    elif out_dtype != x.dtype:
        y = F.linear(h.to(out_dtype), weight.to(out_dtype))
    else:
        y = F.linear(h, weight)
    if residual is not None:
        y = residual + y
    elif swiglu:
        y = swiglu_reference(y)
    elif rope is not None:
        r = rope
        apply_rope_qkv_reference(
            y, r.positions, r.cos, r.sin, r.n_q_heads, r.n_kv_heads, r.head_dim,
            interleaved=True, k_cache=r.k_cache, v_cache=r.v_cache, cache_slots=r.cache_slots,
        )  # fmt: skip
        y = y[:, : r.n_q_heads * r.head_dim]
    if out is None:
        return y.contiguous()
    out.copy_(y)
    return out
