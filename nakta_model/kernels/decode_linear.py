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

import torch
import torch.nn.functional as F
import triton

from nakta_model.kernels import _decode_linear_configs as _knobs
from nakta_model.kernels._checks import (
    dependent_launch,
    device_family,
    interpreter_enabled,
    sm_count,
)
from nakta_model.kernels._decode_linear_checks import (  # noqa: F401  (re-exported)
    MAX_BATCH,
    RopeArgs,
    _check_args,
    _check_matrix,
    _check_no_aliasing,
    _check_rope,
    _check_weight_scale,
)
from nakta_model.kernels._decode_linear_configs import _CONFIGS, _DEVICE_CONFIGS
from nakta_model.kernels._decode_linear_kernels import _decode_linear_kernel
from nakta_model.kernels.fp8_quant import FP8_DTYPE
from nakta_model.kernels.rmsnorm import rms_norm_reference
from nakta_model.kernels.rope import apply_rope_qkv_reference
from nakta_model.kernels.swiglu import FAST_IS_EXACT_DTYPES, swiglu_reference

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
    ``USE_DOT``, where a table row or ``_TUNE`` asks (``_TUNE["DOT_F16"] = 0`` is the escape
    hatch for activations beyond fp16's 65504: the e4m3 codes converted to bf16 instead);
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
    f16 = use_dot and x_dtype == torch.bfloat16 and dtype == FP8_DTYPE
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
        # batch 1 on the CUDA cores: the first weight tile is loaded before the dependent
        # launch's wait (the weights are no kernel's output, so that load overlaps the previous
        # kernel's tail; asking L2 for the whole slice instead thrashed it)
        EARLY_W=cfg["BLOCK_M"] == 1 and not cfg["USE_DOT"],
        PDL=pdl, DOT_F16=bool(cfg["DOT_F16"]), PREFETCH=words is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------
# 2. Public function
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
