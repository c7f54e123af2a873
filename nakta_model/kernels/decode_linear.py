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

Kernel (section 1 below): each program owns ``BLOCK_N`` output columns
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

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

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
from nakta_model.kernels._triton_math import rotate, round_to, rsqrt, silu
from nakta_model.kernels._tuned_tables import read_tuned
from nakta_model.kernels.fp8_quant import FP8_DTYPE
from nakta_model.kernels.rmsnorm import rms_norm_reference
from nakta_model.kernels.rope import apply_rope_qkv_reference
from nakta_model.kernels.swiglu import FAST_IS_EXACT_DTYPES, swiglu_reference

# ------------------------------------------------------------------------------------------------
# 1. Triton kernels
# ------------------------------------------------------------------------------------------------


@triton.jit
def _row_rstd(
    X, rows, row_ok, K, stride_xm, eps, inv_k,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ACCURATE: tl.constexpr,
):  # fmt: skip
    """1 / rms of each batch row, fp32 ``[BLOCK_M]`` (``mean`` as ``sum * (1 / K)``, as
    PyTorch's CUDA mean and ``rmsnorm.py`` compute it)."""
    ks = tl.arange(0, BLOCK_K)
    ss = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        mask = row_ok[:, None] & (k < K)[None, :]
        x = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        ss += x * x
    # fp32 scalars: torch.compile's inductor passes Python floats to Triton as fp64
    inv_k, eps = tl.cast(inv_k, tl.float32), tl.cast(eps, tl.float32)
    return rsqrt(tl.sum(ss, axis=1) * inv_k + eps, ACCURATE)


@triton.jit
def _x_tile(
    X, NW, rows, row_ok, k, k_ok, stride_xm, stride_nw, rstd,
    NORM: tl.constexpr, EVEN_K: tl.constexpr, EMULATE_RNE: tl.constexpr,
):  # fmt: skip
    """``[BLOCK_M, BLOCK_K]`` of the matmul's input in x's dtype: x, or with ``NORM`` Meta's
    RMSNorm of it (normalized row rounded, times the weight, rounded)."""
    if EVEN_K:
        mask = row_ok[:, None]
    else:
        mask = row_ok[:, None] & k_ok[None, :]
    x = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=mask, other=0.0)
    if NORM:
        dtype = X.dtype.element_ty
        w = tl.load(NW + k * stride_nw, mask=k_ok, other=0.0).to(tl.float32)
        n = round_to(x.to(tl.float32) * rstd[:, None], dtype, EMULATE_RNE).to(tl.float32)
        x = round_to(n * w[None, :], dtype, EMULATE_RNE)
    return x


@triton.jit
def _w_tile(W, w_rows, w_ok, k, k_ok, stride_wn, EVEN_K: tl.constexpr):
    """``[TILE_N, BLOCK_K]`` of the weight. Weights are read once per step: evict them first so
    the small activations stay in L2."""
    ptrs = W + w_rows.to(tl.int64)[:, None] * stride_wn + k[None, :]
    if EVEN_K:
        mask = w_ok[:, None]
    else:
        mask = w_ok[:, None] & k_ok[None, :]
    return tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")


@triton.jit
def _dot_loop(
    X, W, NW, rows, row_ok, w_rows, w_ok, K, stride_xm, stride_wn, stride_nw, rstd,
    NORM: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, EMULATE_RNE: tl.constexpr,
    W_FP8: tl.constexpr, DOT_F16: tl.constexpr,
):  # fmt: skip
    """``W_tile @ x^T`` over all of K with ``tl.dot``: fp32 ``[TILE_N, BLOCK_M]``.

    ``DOT_F16`` (FP8 weight, bf16 x): both operands go to fp16 and the MMA is fp16 x fp16 ->
    fp32. e4m3 -> fp16 is one ``cvt.rn.f16x2.e4m3x2`` per pair on sm89+, e4m3 -> bf16 adds two
    ``cvt.bf16.f16``; every e4m3 value is exact in fp16 and so is every bf16 x with
    ``6.1e-5 <= |x| <= 65504`` (8 significant bits fit in 11), so the products are the bf16
    path's. Outside: ``|x| > 65504`` becomes inf (the output inf/NaN), ``|x| < 6.1e-5`` an fp16
    subnormal (absolute error <= 2^-25 per element, below the fp32 sum's rounding for LLaMA's
    activations). ``_config`` sets it only where asked (``_TUNE["DOT_F16"] = 0`` allows none).
    ``UPCAST`` (interpreter, bf16) feeds fp32 copies of the operands: Triton 3.9's interpreter
    returns garbage for a bf16 ``tl.dot``; the copies are exact, so the sums are the same."""
    acc = tl.zeros([TILE_N, BLOCK_M], dtype=tl.float32)
    ks = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        x = _x_tile(X, NW, rows, row_ok, k, k_ok, stride_xm, stride_nw, rstd, NORM, EVEN_K,
                    EMULATE_RNE)  # fmt: skip
        w = _w_tile(W, w_rows, w_ok, k, k_ok, stride_wn, EVEN_K)
        if W_FP8 and DOT_F16:
            w = w.to(tl.float16)
            x = x.to(tl.float32).to(tl.float16)
        elif W_FP8:  # e4m3 values are exact in every x dtype
            w = w.to(x.dtype)
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PREC)
    return acc


@triton.jit
def _x_raw(X, NW, rows, row_ok, k, k_ok, stride_xm, stride_nw, NORM: tl.constexpr,
           EVEN_K: tl.constexpr):  # fmt: skip
    """``_x_tile``'s loads alone (x and, with ``NORM``, the norm weight, same masks), for
    ``_x_norm`` to finish an iteration later."""
    if EVEN_K:
        mask = row_ok[:, None]
    else:
        mask = row_ok[:, None] & k_ok[None, :]
    x = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=mask, other=0.0)
    if NORM:
        nw = tl.load(NW + k * stride_nw, mask=k_ok, other=0.0)
    else:
        nw = x
    return x, nw


@triton.jit
def _x_norm(x, nw, rstd, dtype: tl.constexpr, NORM: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """``_x_tile``'s arithmetic on loaded tiles: the same roundings in the same order."""
    if NORM:
        n = round_to(x.to(tl.float32) * rstd[:, None], dtype, EMULATE_RNE).to(tl.float32)
        x = round_to(n * nw.to(tl.float32)[None, :], dtype, EMULATE_RNE)
    return x


# One int32 word of four e4m3 codes (code j in byte j) -> four fp32, as Triton converts an
# e4m3 pair: one cvt.rn.f16x2.e4m3x2 per 16-bit half (sm_89+: F2FP.F16.E4M3.UNPACK_B), one
# cvt.f32.f16 per code (HADD2.F32); no byte extraction or re-pairing around them.
E4M3X4_ASM = tl.constexpr("""{
.reg .b16 lo, hi, f0, f1, f2, f3;
.reg .b32 h01, h23;
mov.b32 {lo, hi}, $4;
cvt.rn.f16x2.e4m3x2 h01, lo;
cvt.rn.f16x2.e4m3x2 h23, hi;
mov.b32 {f0, f1}, h01;
mov.b32 {f2, f3}, h23;
cvt.f32.f16 $0, f0;
cvt.f32.f16 $1, f1;
cvt.f32.f16 $2, f2;
cvt.f32.f16 $3, f3;
}""")


@triton.jit
def _e4m3_code(words, SHIFT: tl.constexpr):
    """Byte ``SHIFT / 8`` of each int32 word read as an e4m3 code, as fp32 (exact)."""
    code = ((words >> SHIFT) & 0xFF).to(tl.uint8)
    return code.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3x4(words, EMULATE: tl.constexpr):
    """Each int32 word's four e4m3 codes as fp32 (exact): ``E4M3X4_ASM`` compiled;
    ``EMULATE`` (the interpreter, which runs no PTX) by Triton bit ops and casts."""
    if EMULATE:
        return (_e4m3_code(words, 0), _e4m3_code(words, 8), _e4m3_code(words, 16),
                _e4m3_code(words, 24))  # fmt: skip
    return tl.inline_asm_elementwise(
        E4M3X4_ASM, "=r,=r,=r,=r,r", [words], dtype=(tl.float32,) * 4, is_pure=True, pack=1
    )


@triton.jit
def _split4(x, KW: tl.constexpr):
    """``[1, 4 KW]`` -> four ``[1, KW]``: columns ``4 i + j`` for ``j`` = 0..3 (the order of an
    int32 word's codes)."""
    even, odd = tl.split(tl.reshape(x, (1, KW, 2, 2)))  # [.., i, q, p]: column 4 i + 2 q + p
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return x0, x1, x2, x3


@triton.jit
def _join4(a0, a1, a2, a3, TILE_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``_split4`` undone: four ``[TILE_N, KW]`` -> ``[TILE_N, 4 KW]``, ``a_j[:, i]`` at column
    ``4 i + j`` (``[.., i, q, p]`` holds ``a(2 q + p)``)."""
    return tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), (TILE_N, BLOCK_K))


@triton.jit
def _w_words(W, w_rows, w_ok, kw, kw_ok, stride_wn, EVEN_K: tl.constexpr):
    """``[TILE_N, BLOCK_K / 4]`` int32 words of the weight (``W`` its int32 view, ``stride_wn``
    in words): ``_w_tile`` four codes a word."""
    ptrs = W + w_rows.to(tl.int64)[:, None] * stride_wn + kw[None, :]
    if EVEN_K:
        mask = w_ok[:, None]
    else:
        mask = w_ok[:, None] & kw_ok[None, :]
    return tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_first")


@triton.jit
def _fma_prefetch_loop(
    X, W, NW, rows, row_ok, w_rows, w_ok, K, stride_xm, stride_wn, stride_nw, rstd,
    NORM: tl.constexpr, EVEN_K: tl.constexpr, TILE_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EMULATE_RNE: tl.constexpr, w_first, HAS_FIRST: tl.constexpr = 0,
):  # fmt: skip
    """``_fma_loop`` at batch 1 for an e4m3 weight read as int32 words (``PREFETCH``), the next
    K tile's loads (weight words, x, norm weight) issued before the current tile's FMAs: a
    hand-written two-stage pipeline (Triton pipelines ``tl.dot`` loops only), so each warp
    has its next tile in flight while it computes. Words carry four codes a register across
    the iteration (an e4m3 tile carried so takes one a register). The last tile is peeled off
    the loop, so the loads keep ``_fma_loop``'s masks. Same products, same order per K lane,
    same final reduction: ``_fma_loop``'s sums bit for bit. fp32 ``[TILE_N, 1]``."""
    KW: tl.constexpr = BLOCK_K // 4
    dtype = X.dtype.element_ty
    ks = tl.arange(0, BLOCK_K)
    kws = tl.arange(0, KW)
    k_words = K // 4
    # x before the weight, here and in the loop: Triton's layout propagation takes the layout
    # of the last load in program order where two meet, and the products must keep the
    # weight's (else every weight tile is moved through shared memory instead of x's)
    x_next, nw_next = _x_raw(X, NW, rows, row_ok, ks, ks < K, stride_xm, stride_nw, NORM, EVEN_K)
    if HAS_FIRST:  # the first tile's words, loaded by the caller (``EARLY_W``)
        w_next = w_first
    else:
        w_next = _w_words(W, w_rows, w_ok, kws, kws < k_words, stride_wn, EVEN_K)
    acc0 = tl.zeros([TILE_N, KW], dtype=tl.float32)
    acc1 = tl.zeros([TILE_N, KW], dtype=tl.float32)
    acc2 = tl.zeros([TILE_N, KW], dtype=tl.float32)
    acc3 = tl.zeros([TILE_N, KW], dtype=tl.float32)
    for k1 in range(BLOCK_K, K, BLOCK_K):  # k1: the tile loaded ahead
        w, x_cur, nw_cur = w_next, x_next, nw_next
        k = k1 + ks
        x_next, nw_next = _x_raw(X, NW, rows, row_ok, k, k < K, stride_xm, stride_nw, NORM,
                                 EVEN_K)  # fmt: skip
        kw = k1 // 4 + kws
        w_next = _w_words(W, w_rows, w_ok, kw, kw < k_words, stride_wn, EVEN_K)
        x0, x1, x2, x3 = _split4(_x_norm(x_cur, nw_cur, rstd, dtype, NORM, EMULATE_RNE), KW)
        c0, c1, c2, c3 = _e4m3x4(w, EMULATE_RNE)
        acc0 += c0 * x0.to(tl.float32)
        acc1 += c1 * x1.to(tl.float32)
        acc2 += c2 * x2.to(tl.float32)
        acc3 += c3 * x3.to(tl.float32)
    x0, x1, x2, x3 = _split4(_x_norm(x_next, nw_next, rstd, dtype, NORM, EMULATE_RNE), KW)
    c0, c1, c2, c3 = _e4m3x4(w_next, EMULATE_RNE)
    acc0 += c0 * x0.to(tl.float32)
    acc1 += c1 * x1.to(tl.float32)
    acc2 += c2 * x2.to(tl.float32)
    acc3 += c3 * x3.to(tl.float32)
    return tl.sum(_join4(acc0, acc1, acc2, acc3, TILE_N, BLOCK_K), axis=1)[:, None]


@triton.jit
def _fma_loop(
    X, W, NW, rows, row_ok, w_rows, w_ok, K, stride_xm, stride_wn, stride_nw, rstd,
    NORM: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EMULATE_RNE: tl.constexpr, PREFETCH: tl.constexpr = 0,
    w_first=None, HAS_FIRST: tl.constexpr = 0,
):  # fmt: skip
    """``W_tile @ x^T`` on the CUDA cores: fp32 products accumulated per K lane, reduced over
    K once at the end (no cross-thread reduction inside the loop). fp32 ``[TILE_N, BLOCK_M]``.
    ``PREFETCH`` (batch 1, ``W`` the e4m3 weight's int32 view): ``_fma_prefetch_loop``.
    ``HAS_FIRST`` (batch 1): ``w_first`` is the first K tile (words with ``PREFETCH``), loaded
    by the caller; the same products in the same order per K lane."""
    ks = tl.arange(0, BLOCK_K)
    if BLOCK_M == 1 and PREFETCH:
        acc = _fma_prefetch_loop(X, W, NW, rows, row_ok, w_rows, w_ok, K, stride_xm, stride_wn,
                                 stride_nw, rstd, NORM, EVEN_K, TILE_N, BLOCK_K, EMULATE_RNE,
                                 w_first, HAS_FIRST)  # fmt: skip
    elif BLOCK_M == 1:
        acc2 = tl.zeros([TILE_N, BLOCK_K], dtype=tl.float32)
        start = 0
        if HAS_FIRST:
            x = _x_tile(X, NW, rows, row_ok, ks, ks < K, stride_xm, stride_nw, rstd, NORM,
                        EVEN_K, EMULATE_RNE)  # fmt: skip
            acc2 += w_first.to(tl.float32) * x.to(tl.float32)
            start = BLOCK_K
        for k0 in range(start, K, BLOCK_K):
            k = k0 + ks
            k_ok = k < K
            x = _x_tile(X, NW, rows, row_ok, k, k_ok, stride_xm, stride_nw, rstd, NORM, EVEN_K,
                        EMULATE_RNE)  # fmt: skip
            w = _w_tile(W, w_rows, w_ok, k, k_ok, stride_wn, EVEN_K)
            acc2 += w.to(tl.float32) * x.to(tl.float32)
        acc = tl.sum(acc2, axis=1)[:, None]
    else:
        acc3 = tl.zeros([TILE_N, BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            k_ok = k < K
            x = _x_tile(X, NW, rows, row_ok, k, k_ok, stride_xm, stride_nw, rstd, NORM, EVEN_K,
                        EMULATE_RNE)  # fmt: skip
            w = _w_tile(W, w_rows, w_ok, k, k_ok, stride_wn, EVEN_K)
            acc3 += w.to(tl.float32)[:, None, :] * x.to(tl.float32)[None, :, :]
        acc = tl.sum(acc3, axis=2)
    return acc


@triton.jit
def _store_cols(OUT, y, cols, col_ok, rows, row_ok, stride_om):
    """Store a ``[columns, batch rows]`` tile into ``OUT[row, col]``."""
    ptrs = OUT + rows[None, :] * stride_om + cols[:, None]
    tl.store(ptrs, y, mask=col_ok[:, None] & row_ok[None, :])


@triton.jit
def _rope_epilogue(
    acc, OUT, POS, COS, SIN, KC, VC, SLOT, n0, rows, row_ok, n_w_rows, q_cols, qk_cols, n_pos,
    n_slots, stride_om, stride_cp, stride_cc, stride_sp, stride_sc, stride_kcs, stride_kch,
    stride_vcs, stride_vch,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE_RNE: tl.constexpr,
):  # fmt: skip
    """Round the qkv tile, rotate its Q/K pairs, store Q to OUT and K/V into the caches."""
    dtype = OUT.dtype.element_ty
    HALF_N: tl.constexpr = BLOCK_N // 2
    v = round_to(acc, dtype, EMULATE_RNE).to(tl.float32)
    pairs = tl.permute(tl.reshape(v, (HALF_N, 2, BLOCK_M)), (0, 2, 1))
    a, b = tl.split(pairs)  # rows 2i and 2i + 1 of the tile: [HALF_N, BLOCK_M]
    pair_cols = n0 + 2 * tl.arange(0, HALF_N)
    freq = (pair_cols % HEAD_DIM) // 2

    pos = tl.load(POS + rows, mask=row_ok, other=0).to(tl.int64)
    slot = tl.load(SLOT + rows, mask=row_ok, other=0).to(tl.int64)
    ok = (pos >= 0) & (pos < n_pos) & (slot >= 0) & (slot < n_slots)
    pos = tl.where(ok, pos, 0)
    slot = tl.where(ok, slot, 0)
    fmask = (pair_cols < qk_cols)[:, None] & row_ok[None, :]
    cos = tl.load(COS + pos[None, :] * stride_cp + freq[:, None] * stride_cc, mask=fmask, other=1.0)
    sin = tl.load(SIN + pos[None, :] * stride_sp + freq[:, None] * stride_sc, mask=fmask, other=0.0)
    nan = float("nan")
    cos = tl.where(ok[None, :], cos, nan)
    sin = tl.where(ok[None, :], sin, nan)
    ya, yb = rotate(a, b, cos, sin, cos, sin, False)
    rot = (pair_cols < qk_cols)[:, None]
    ya = tl.where(rot, ya, a)
    yb = tl.where(rot, yb, b)
    y = tl.reshape(tl.permute(tl.join(ya, yb), (0, 2, 1)), (BLOCK_N, BLOCK_M))
    y = round_to(y, dtype, EMULATE_RNE)

    cols = n0 + tl.arange(0, BLOCK_N)
    _store_cols(OUT, y, cols, cols < q_cols, rows, row_ok, stride_om)
    store_ok = row_ok & ok
    is_k = (cols >= q_cols) & (cols < qk_cols)
    kcol = tl.where(is_k, cols - q_cols, 0)
    k_ptrs = (
        KC
        + slot[None, :] * stride_kcs
        + (kcol // HEAD_DIM).to(tl.int64)[:, None] * stride_kch
        + (kcol % HEAD_DIM)[:, None]
    )
    tl.store(k_ptrs, y, mask=is_k[:, None] & store_ok[None, :])
    is_v = (cols >= qk_cols) & (cols < n_w_rows)
    vcol = tl.where(is_v, cols - qk_cols, 0)
    v_ptrs = (
        VC
        + slot[None, :] * stride_vcs
        + (vcol // HEAD_DIM).to(tl.int64)[:, None] * stride_vch
        + (vcol % HEAD_DIM)[:, None]
    )
    tl.store(v_ptrs, y, mask=is_v[:, None] & store_ok[None, :])


@triton.jit
def _decode_linear_kernel(
    X, W, WS, NW, R, OUT, POS, COS, SIN, KC, VC, SLOT,
    n_rows, K, n_w_rows, n_out_cols, stride_xm, stride_wn, stride_ws, stride_nw, stride_rm,
    stride_om,
    eps, inv_k, q_cols, qk_cols, n_pos, n_slots,
    stride_cp, stride_cc, stride_sp, stride_sc, stride_kcs, stride_kch, stride_vcs, stride_vch,
    HEAD_DIM: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr,
    ROPE: tl.constexpr, W_FP8: tl.constexpr, USE_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr, FAST_SILU: tl.constexpr, ACCURATE: tl.constexpr,
    EMULATE_RNE: tl.constexpr, PDL: tl.constexpr, DOT_F16: tl.constexpr = False,
    PREFETCH: tl.constexpr = 0, NORM_BLOCK: tl.constexpr = 0, EARLY_W: tl.constexpr = 0,
):  # fmt: skip
    """One program: output columns ``[n0, n0 + BLOCK_N)`` for every batch row.

    Switches (constexpr): ``W_FP8`` e4m3 weight with fp32 row scales ``WS`` (codes converted in
    registers, the sums scaled before the epilogue; ``DOT_F16``: fp16 MMA operands, see
    ``_dot_loop``); ``NORM`` RMSNorm prologue; at most one of
    ``RESIDUAL`` / ``SWIGLU``
    (the tile holds ``TILE_N = 2 * BLOCK_N`` rows: gate rows, then the matching up rows) /
    ``ROPE``; ``USE_DOT`` tensor cores vs CUDA-core products; ``EVEN_K`` drops the K mask;
    ``PREFETCH`` (FP8, batch 1, CUDA cores: ``W`` is the weight's int32 view, ``stride_wn`` in
    words) loads each K tile an iteration ahead (``_fma_prefetch_loop``);
    ``NORM_BLOCK``: x elements per step of the RMSNorm prologue (0: ``BLOCK_K``).
    ``PDL`` (launched as a programmatic dependent): let the next kernel's blocks launch now,
    and wait for the previous kernel's results before the first load or store of them.
    ``EARLY_W`` (batch 1, CUDA cores): the first K tile of the weight (no kernel's output) is
    loaded before that wait, so its memory latency overlaps the previous kernel's tail.
    The accumulator is ``[TILE_N, BLOCK_M]``: output columns down, batch rows across.
    """
    if PDL:
        gdc_launch_dependents()
        if not EARLY_W:
            gdc_wait()  # x, residual, positions and slots are the previous kernels' outputs
    n0 = tl.program_id(0) * BLOCK_N
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    if SWIGLU:
        j = tl.arange(0, TILE_N)
        col = n0 + j % BLOCK_N
        w_rows = tl.where(j < BLOCK_N, col, col + n_out_cols)
        w_ok = col < n_out_cols
    else:
        w_rows = n0 + tl.arange(0, TILE_N)
        w_ok = w_rows < n_w_rows
    if EARLY_W:
        if PREFETCH:
            kw0 = tl.arange(0, BLOCK_K // 4)
            w_first = _w_words(W, w_rows, w_ok, kw0, kw0 < K // 4, stride_wn, EVEN_K)
        else:
            k0s = tl.arange(0, BLOCK_K)
            w_first = _w_tile(W, w_rows, w_ok, k0s, k0s < K, stride_wn, EVEN_K)
        if PDL:
            gdc_wait()  # now the inputs: the first weight tile is on its way
    else:
        w_first = tl.zeros([1], dtype=tl.float32)  # unused
    if NORM:
        rstd = _row_rstd(X, rows, row_ok, K, stride_xm, eps, inv_k, BLOCK_M,
                         NORM_BLOCK if NORM_BLOCK > 0 else BLOCK_K, ACCURATE)  # fmt: skip
    else:
        rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_DOT:
        acc = _dot_loop(X, W, NW, rows, row_ok, w_rows, w_ok, K, stride_xm, stride_wn, stride_nw,
                        rstd, NORM, EVEN_K, BLOCK_M, TILE_N, BLOCK_K, PREC, UPCAST, EMULATE_RNE,
                        W_FP8, DOT_F16)  # fmt: skip
    else:
        acc = _fma_loop(X, W, NW, rows, row_ok, w_rows, w_ok, K, stride_xm, stride_wn, stride_nw,
                        rstd, NORM, EVEN_K, BLOCK_M, TILE_N, BLOCK_K, EMULATE_RNE, PREFETCH,
                        w_first, EARLY_W)  # fmt: skip
    if W_FP8:  # dequantize the sums: each weight row's scale, before any rounding
        ws = tl.load(WS + w_rows.to(tl.int64) * stride_ws, mask=w_ok, other=0.0)
        acc = acc * ws[:, None]

    dtype = OUT.dtype.element_ty
    cols = n0 + tl.arange(0, BLOCK_N)
    if ROPE:
        _rope_epilogue(acc, OUT, POS, COS, SIN, KC, VC, SLOT, n0, rows, row_ok, n_w_rows, q_cols,
                       qk_cols, n_pos, n_slots, stride_om, stride_cp, stride_cc, stride_sp,
                       stride_sc, stride_kcs, stride_kch, stride_vcs, stride_vch, HEAD_DIM,
                       BLOCK_M, BLOCK_N, EMULATE_RNE)  # fmt: skip
    elif SWIGLU:
        gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
        gate = round_to(gate, dtype, EMULATE_RNE).to(tl.float32)
        up = round_to(up, dtype, EMULATE_RNE).to(tl.float32)
        s = round_to(silu(gate, FAST_SILU, ACCURATE), dtype, EMULATE_RNE).to(tl.float32)
        y = round_to(s * up, dtype, EMULATE_RNE)
        _store_cols(OUT, y, cols, cols < n_out_cols, rows, row_ok, stride_om)
    elif RESIDUAL:
        col_ok = cols < n_out_cols
        r_ptrs = R + rows[None, :] * stride_rm + cols[:, None]
        r = tl.load(r_ptrs, mask=col_ok[:, None] & row_ok[None, :], other=0.0).to(tl.float32)
        y = round_to(r + round_to(acc, dtype, EMULATE_RNE).to(tl.float32), dtype, EMULATE_RNE)
        _store_cols(OUT, y, cols, col_ok, rows, row_ok, stride_om)
    else:
        y = round_to(acc, dtype, EMULATE_RNE)
        _store_cols(OUT, y, cols, cols < n_out_cols, rows, row_ok, stride_om)


# ------------------------------------------------------------------------------------------------
# 2. Launch configuration: the tables (data: what measured them beside each) and _config
# ------------------------------------------------------------------------------------------------

# Keys: ``(dtype name, batch bucket)`` and per shape ``(dtype name, bucket, variant, N, K)``,
# where the dtype is the weight's when it is FP8 (``"float8_e4m3fn"``: the weight dtype sets
# the bytes per K step, so its best ``BLOCK_K`` differs) and x's otherwise.

# Configurations per (dtype, batch bucket = next power of two of B), and per-shape entries
# keyed (dtype, bucket, variant, N, K) from ``bench_decode.py --tune`` (LLaMA-7B's five decode
# GEMVs at batch 1, 8 and 32 on an H100),
# applied over the bucket's; variant is "plain", "residual", "swiglu" or "rope" (``_variant``).
# ``BLOCK_N`` is left to ``_block_n`` (fill the GPU) and ``BLOCK_K`` to ``_block_k`` (registers)
# unless given. ``_TUNE`` overrides every key (set by the benchmark and the tests).
_HALF: dict[int, dict[str, int]] = {
    1: dict(USE_DOT=0, num_warps=4, num_stages=4),
    2: dict(USE_DOT=1, BLOCK_K=256, num_warps=4, num_stages=4),
    4: dict(USE_DOT=1, BLOCK_K=256, num_warps=4, num_stages=4),
    8: dict(USE_DOT=1, BLOCK_K=256, num_warps=4, num_stages=4),
    16: dict(USE_DOT=1, BLOCK_K=256, num_warps=4, num_stages=4),
    32: dict(USE_DOT=1, BLOCK_K=128, num_warps=4, num_stages=4),
    64: dict(USE_DOT=1, BLOCK_K=128, num_warps=4, num_stages=3),
}
_CONFIGS: dict[tuple, dict[str, int]] = {
    **{("bfloat16", b): c for b, c in _HALF.items()},
    **{("float16", b): c for b, c in _HALF.items()},
    **{  # fp32: half the K tile (same bytes per weight row)
        ("float32", b): {**c, "BLOCK_K": c["BLOCK_K"] // 2} if "BLOCK_K" in c else dict(c)
        for b, c in _HALF.items()
    },
    # H100 --tune winners (their gains over the defaults: docs/experiments.md); batch 1 head
    # and w13 keep the defaults.
    ("bfloat16", 1, "plain", 32000, 4096): dict(
        USE_DOT=0, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4
    ),
    ("bfloat16", 1, "residual", 4096, 11008): dict(
        USE_DOT=0, BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=3
    ),
    ("bfloat16", 1, "residual", 4096, 4096): dict(
        USE_DOT=0, BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=4
    ),
    ("bfloat16", 1, "rope", 12288, 4096): dict(
        USE_DOT=0, BLOCK_N=16, BLOCK_K=256, num_warps=2, num_stages=5
    ),
    ("bfloat16", 1, "swiglu", 11008, 4096): dict(
        USE_DOT=0, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4
    ),
    ("bfloat16", 8, "plain", 32000, 4096): dict(
        USE_DOT=1, BLOCK_N=128, BLOCK_K=256, num_warps=4, num_stages=3
    ),
    ("bfloat16", 8, "residual", 4096, 11008): dict(
        USE_DOT=1, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=5
    ),
    ("bfloat16", 8, "residual", 4096, 4096): dict(
        USE_DOT=1, BLOCK_N=32, BLOCK_K=256, num_warps=2, num_stages=5
    ),
    ("bfloat16", 8, "rope", 12288, 4096): dict(
        USE_DOT=1, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=5
    ),
    ("bfloat16", 8, "swiglu", 11008, 4096): dict(
        USE_DOT=1, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=4
    ),
    ("bfloat16", 32, "plain", 32000, 4096): dict(
        USE_DOT=1, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4
    ),
    ("bfloat16", 32, "residual", 4096, 11008): dict(
        USE_DOT=1, BLOCK_N=16, BLOCK_K=256, num_warps=2, num_stages=5
    ),
    ("bfloat16", 32, "residual", 4096, 4096): dict(
        USE_DOT=1, BLOCK_N=16, BLOCK_K=256, num_warps=2, num_stages=4
    ),
    ("bfloat16", 32, "rope", 12288, 4096): dict(
        USE_DOT=1, BLOCK_N=32, BLOCK_K=128, num_warps=2, num_stages=3
    ),
    ("bfloat16", 32, "swiglu", 11008, 4096): dict(
        USE_DOT=1, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=4
    ),
}
# Per-device overrides of the entries above, by a word of the device name: the H200's batch-1
# --tune winners where they beat the H100 entry (wqkv, w2; head, w13 and wo keep theirs).
_DEVICE_CONFIGS: dict[str, dict[tuple, dict[str, int]]] = {
    "h200": {
        ("bfloat16", 1, "rope", 12288, 4096): dict(
            USE_DOT=0, BLOCK_N=8, BLOCK_K=256, num_warps=2, num_stages=4
        ),
        ("bfloat16", 1, "residual", 4096, 11008): dict(
            USE_DOT=0, BLOCK_N=4, BLOCK_K=512, num_warps=4, num_stages=2
        ),
    },
}

_FP8 = "float8_e4m3fn"
_FMA_ACC_MAX = 16384  # fp32 accumulator elements per program an FP8 entry may grow to


def _fp8_entry(cfg: dict[str, int], rows_per_col: int, bucket: int) -> dict[str, int]:
    """An FP8-weight row derived from a bf16 one, where no tuned row exists: the same bytes of
    each weight row per K step (``BLOCK_K`` doubled) unless the CUDA-core accumulator
    (``TILE_N x BLOCK_M x BLOCK_K``) would pass ``_FMA_ACC_MAX``; ``tl.dot`` rows of batch
    >= 16 keep bf16's ``BLOCK_K``: their bf16 x tile (``BLOCK_M x BLOCK_K``) is as large as
    before and outweighs the weight tile, and doubling it cost shared memory and occupancy."""
    out = dict(cfg)
    if "BLOCK_K" in cfg:
        acc = rows_per_col * cfg.get("BLOCK_N", 16) * bucket * 2 * cfg["BLOCK_K"]
        if (cfg["USE_DOT"] and bucket < 16) or (not cfg["USE_DOT"] and acc <= _FMA_ACC_MAX):
            out["BLOCK_K"] = 2 * cfg["BLOCK_K"]
    return out


_CONFIGS.update(
    {
        (_FP8, *key[1:]): _fp8_entry(cfg, 2 if len(key) == 5 and key[2] == "swiglu" else 1, key[1])
        for key, cfg in list(_CONFIGS.items())
        if key[0] == "bfloat16"
    }
)
for _table in _DEVICE_CONFIGS.values():
    _table.update(
        {
            (_FP8, *key[1:]): _fp8_entry(cfg, 2 if key[2] == "swiglu" else 1, key[1])
            for key, cfg in list(_table.items())
            if key[0] == "bfloat16"
        }
    )


# ------------------------------------------------------------------ tuned FP8 rows (a file)
# ``kernel_benchmark/tune_fp8_decode.py`` writes its winners, per device family, to this file
# beside the module; when present its rows go over the derived FP8 rows above (committing the
# file is the whole step). Format: {"devices": {family: {"entries": {"dtype/bucket/variant/N/K":
# {knob: int}}, ...}}}; a row written before a knob existed takes its FP8_KNOB_DEFAULTS value
# (a row without PREFETCH: 0); anything else raises here, naming the file.
FP8_TUNED_JSON = Path(__file__).with_name("_decode_linear_fp8_tuned.json")
FP8_KNOBS = ("USE_DOT", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "DOT_F16", "PREFETCH")
FP8_KNOB_DEFAULTS = {"PREFETCH": 0}  # knobs added after rows were written: a row without one


def fp8_tuned_key(bucket: int, variant: str, n_cols: int, k: int) -> str:
    """The file's key of one per-shape FP8 row (``_config``'s table key, joined by "/")."""
    return f"{_FP8}/{bucket}/{variant}/{n_cols}/{k}"


def load_fp8_tuned(path: Path) -> dict[str, dict[tuple, dict[str, int]]]:
    """``{family: {table key: config}}`` of a tuned-FP8 JSON; {} when the file is absent."""

    def key(text: str) -> tuple:
        dtype, bucket, variant, n, k = text.split("/")
        if dtype != _FP8:
            raise ValueError(f"entry {text!r}: expected {_FP8} rows")
        return dtype, int(bucket), variant, int(n), int(k)

    return read_tuned(path, "tuned-FP8 decode", key, FP8_KNOBS, FP8_KNOB_DEFAULTS)


for _family, _rows in load_fp8_tuned(FP8_TUNED_JSON).items():
    _DEVICE_CONFIGS.setdefault(_family, {}).update(_rows)


# ------------------------------------------------------------------ the RMSNorm prologue

# The RMSNorm prologue's pass over x (``_row_rstd``) runs before any weight load, one L2 round
# trip per ``NORM_BLOCK`` elements: with ``BLOCK_K`` (256-512 at batch 1) that was 8-16 trips
# in a row, the few microseconds by which the normed GEMVs (wqkv, w13, the LM head) trailed
# the others at batch 1. ``NORM_BLOCK`` takes the whole row in one or two loads instead, up to
# ``NORM_ELEMS_PER_THREAD`` fp32 squares a thread (never fewer than ``BLOCK_K``).
NORM_ELEMS_PER_THREAD = 32


def norm_block(k: int, block_m: int, block_k: int, num_warps: int) -> int:
    """Elements of x a program reads per step of the RMSNorm prologue (a power of two)."""
    widest = NORM_ELEMS_PER_THREAD * 32 * num_warps // block_m
    return max(block_k, min(triton.next_power_of_2(k), widest))


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
    an FP8 ``weight_dtype`` looks up the FP8 rows instead (section 2's tables).
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
# Triton refuses at launch (the 7B LM head at 2, 4 and 16 rows); the tuned rows take at most
# 200 KiB.
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


# ------------------------------------------------------------------------------------------------
# 3. Argument checks and the launcher
# ------------------------------------------------------------------------------------------------

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
    # e4m3 caches' scales [slots, n_kv_heads]: the GEMM path's epilogues only (step_gemm)
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


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
    if r.k_scale is not None or r.v_scale is not None:
        raise ValueError("rope.k_scale / v_scale (an e4m3 cache) are the GEMM path's, not here")
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


# Programmatic dependent launch pays at batch 1 and costs at 32 (early blocks land unevenly;
# the A/B: docs/experiments.md).
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
        NORM_BLOCK=norm_block(k, cfg["BLOCK_M"], cfg["BLOCK_K"], cfg["num_warps"]),
        # batch 1 on the CUDA cores: the first weight tile is loaded before the dependent
        # launch's wait (the weights are no kernel's output, so that load overlaps the previous
        # kernel's tail; asking L2 for the whole slice instead thrashed it)
        EARLY_W=cfg["BLOCK_M"] == 1 and not cfg["USE_DOT"],
        PDL=pdl, DOT_F16=bool(cfg["DOT_F16"]), PREFETCH=words is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------
# 4. Public function
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
# 5. Reference
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
