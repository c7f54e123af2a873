"""Decode attention: one new query per batch row over its KV cache (split-K flash-decoding).

Why: at decode time attention reads the whole K/V cache for one query per row; with few rows
and heads, one program per (row, head) cannot keep the GPU's memory system busy. The sequence
is split into ``n_splits`` chunks, each program streams one chunk of one KV head for all its
query heads (GQA: K/V loaded once per group) and writes a partial result (running max, sum of
exponentials, unnormalised output: fp32 workspace); a second small kernel combines the splits.
With one split the first kernel writes the output directly (one launch).

Shared prefixes: with ``prefix_rows``/``prefix_lens`` a row reads its first keys from another
cache row, where a prompt prefix many rows share (a few-shot prompt) is held once. The rows'
programs for one KV head run side by side (the batch is the grid's fastest axis), so that
prefix is fetched from HBM about once per step and served from L2 to the other rows, instead
of every row streaming its own copy.

Cascade (``prefix_slots``): when the shared prefixes live in a few known cache rows (the
generation engine's prefix rows), one more kernel computes the prefix part for every row at
once: per slot and KV head, the queries of all the rows that read that prefix form one
tensor-core tile against the prefix keys, which are then read once per step instead of once
per row, and the split kernel covers only each row's own keys (``[prefix_lens[b],
cache_lens[b])``). Both write partials that the combining kernel merges (a row's prefix part is
one more split to it). Few-shot generation (GSM8K, BBH) spends most of a step's attention on
the shared prefix: batch 64 with a 768-token shared prompt read it 64 times per layer.

Paged KV cache (``block_table``): the caches are a pool of pages (``[n_pages, page, n_kv,
hd]``) and each row's keys are the pages its block table lists; every key tile (``BLOCK_S``
keys, a divisor of the page) lies in one page, so the paged read costs one table load per tile.
The row form (``rows``: row b reads cache row ``rows[b]``) is the table with one page a row.
Shared prefixes are then pages several tables hold (read once from HBM, served from L2 to the
other rows), and the cascade's slots are page tables too.

Sliding window (``window``, Mistral): a row attends to its last ``window`` keys only. The split
kernel's chunks and the cascade's prefix splits are laid over the keys inside the window, so a
long row's keys below it are never read (the pages stay in the pool; nothing is evicted).

CUDA-graph capturable: the grid ``(B, n_kv_heads, n_splits)`` depends on shapes only
(``n_splits`` from the batch, KV heads and cache length, never from ``cache_lens``' values);
each program derives its chunk from ``cache_lens[b]`` on the device (the valid keys are spread
over all splits), and a split past the end writes a neutral partial (max -inf, sum 0). Pass
``workspace`` (``attention_workspace``) and ``out`` to allocate nothing.

Numerics: scores and softmax in fp32 with ``exp2`` (scale folded with log2 e); output in q's
dtype. Every head layout uses ``tl.dot`` with the query group (1 for MHA) padded to 16 rows,
the probabilities rounded to the cache dtype for the P @ V product as flash attention does
(fp32 inputs: ``input_precision="ieee"``). The padding wastes tensor-core work nobody waits
for: this way an MHA cache streams at about copy bandwidth at batch 32-64, about twice the
CUDA-core path (one query head, fp32 throughout; still there with ``_TUNE`` ``USE_DOT=0``;
``kernel_benchmark/bench_decode.py --attention-only`` compares them, docs/kernels.md).
``cache_lens[b] == 0`` gives a zero output row (an idle slot of a static batch); a length
outside ``[0, S_max]`` gives NaN (no host sync on CUDA) or, on the CPU or with
``NAKTA_DEBUG=1``, a ValueError.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from nakta_model import knobs
from nakta_model.kernels._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_dtype,
    check_index,
    check_ndim,
    check_no_overlap,
    check_positive_int,
    check_same_device,
    check_tensor,
    check_triton_device,
    debug_checks,
    dependent_launch,
    interpreter_enabled,
    sm_count,
    tracing,
)
from nakta_model.kernels._triton_math import round_to
from nakta_model.kernels.fp8_quant import FP8_DTYPE

# ------------------------------------------------------------------------------------------------
# 1. The @triton.jit kernels: the split-K pass, the cascade's prefix pass, the combining pass
# ------------------------------------------------------------------------------------------------


@triton.jit
def _scores(q, k, USE_DOT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``q [BLOCK_G, D] . k [BLOCK_S, D]^T`` in fp32: ``[BLOCK_G, BLOCK_S]``."""
    if USE_DOT:
        if UPCAST:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PREC)
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PREC)
    else:  # one query head: [1, D] against [BLOCK_S, D]
        s = tl.sum(k.to(tl.float32) * q.to(tl.float32), axis=1)[None, :]
    return s


@triton.jit
def _weighted_values(
    p, v, USE_DOT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    EMULATE_RNE: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """``p [BLOCK_G, BLOCK_S] @ v [BLOCK_S, D]`` in fp32 (``tl.dot``: p in v's dtype)."""
    if USE_DOT:
        p_low = round_to(p, v.dtype, EMULATE_RNE)
        if UPCAST:
            pv = tl.dot(p_low.to(tl.float32), v.to(tl.float32), input_precision=PREC)
        else:
            pv = tl.dot(p_low, v, input_precision=PREC)
    else:
        pv = tl.sum(tl.reshape(p, (BLOCK_S, 1)) * v.to(tl.float32), axis=0)[None, :]
    return pv


@triton.jit
def _online_step(
    m, l, acc, s, v, SAFE: tl.constexpr, USE_DOT: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr, EMULATE_RNE: tl.constexpr, BLOCK_S: tl.constexpr, vs=None,
    KV_FP8: tl.constexpr = False,
):  # fmt: skip
    """One tile of online softmax: fold scores ``s`` (masked keys -inf) and values ``v`` into
    the running ``(max, sum, acc)``. ``SAFE``: a query may have no valid key in the tile yet
    (its max stays -inf; -inf - -inf would be NaN), else every query sees one. ``KV_FP8``:
    ``v`` holds e4m3 codes (exact in q's dtype) and ``vs [BLOCK_S]`` their per-key scales,
    folded into the probabilities of the P @ V product (not into the sum)."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    if SAFE:
        m_new_or_0 = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new_or_0 = m_new
    alpha = tl.exp2(m - m_new_or_0)
    p = tl.exp2(s - m_new_or_0[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    if KV_FP8:
        pw = p * vs[None, :]
    else:
        pw = p
    acc = acc * alpha[:, None] + _weighted_values(pw, v, USE_DOT, PREC, UPCAST, EMULATE_RNE,
                                                  BLOCK_S)  # fmt: skip
    return m_new, l, acc


@triton.jit
def _chunk(lens_ptr, b, s_max, n_splits, split, base, BLOCK_S: tl.constexpr):
    """This split's key range ``[start, end)`` of row b's keys ``[base, length)``, spread
    evenly over the splits in whole ``BLOCK_S`` tiles that start on a ``BLOCK_S`` boundary (so
    a tile never straddles two pages: the first tile starts at ``base`` rounded down, and keys
    below ``lo`` are masked), ``lo`` and whether the length is out of range."""
    length = tl.load(lens_ptr + b).to(tl.int32)
    bad = (length < 0) | (length > s_max)
    length = tl.where(bad, 0, length)
    lo = tl.minimum(base, length)
    aligned = (lo // BLOCK_S) * BLOCK_S
    chunk = tl.cdiv(tl.cdiv(length - aligned, n_splits), BLOCK_S) * BLOCK_S
    start = aligned + split * chunk
    end = tl.minimum(start + chunk, length)
    end = tl.where(lo < length, end, start)  # nothing past the prefix: an empty chunk
    return start, end, lo, bad


@triton.jit
def _attn_split_kernel(
    Q, K, V, LENS, TABLE, PRE_ROWS, PRE_LENS, OUT, WS, s_max, page, n_splits, stride_tb,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ob, stride_oh, stride_wb, stride_wh, stride_ws, qk_scale,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, USE_DOT: tl.constexpr, SINGLE: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr, EMULATE_RNE: tl.constexpr, HAS_TABLE: tl.constexpr,
    HAS_PREFIX: tl.constexpr, CASCADE: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr = False,
    WINDOW: tl.constexpr = 0, KS=None, VS=None, stride_ksb=0, stride_kss=0, stride_vsb=0,
    stride_vss=0, KV_FP8: tl.constexpr = False,
):  # fmt: skip
    """One program: the query heads of one KV head of row b over one chunk of its cache.

    ``SINGLE`` (one split): normalise and write the output; otherwise write the partial
    ``(acc, max, sum)`` to the workspace (neutral when the chunk is empty). ``HAS_TABLE``: key
    s of row b lies in page ``TABLE[b * stride_tb + s // page]`` of the cache (``[pages, page,
    n_kv, hd]``) at offset ``s % page``: one table load per key tile (a tile never straddles
    two pages); the row form (cache row ``rows[b]``) is the table ``rows`` with one page of
    ``S_max`` keys per row. Without a table row b reads cache row b.
    ``HAS_PREFIX`` (row form only): keys ``< PRE_LENS[b]`` come from cache row ``PRE_ROWS[b]``
    (a prompt prefix several rows share: they read one copy, which stays in L2 while the rows'
    programs run); with ``CASCADE`` they are not read here at all (``_attn_prefix_kernel`` does
    them) and the splits cover keys ``[PRE_LENS[b], length)`` of the row itself.
    ``LAUNCH_DEPENDENTS`` (the last attention launch at batch 1): the next kernel, a
    programmatic dependent (the ``wo`` GEMV), may launch now and load its first weight tile
    while this one runs (``decode_linear``'s ``EARLY_W``); it waits for this kernel's output.
    ``WINDOW`` (sliding window; 0: none): only the last ``WINDOW`` keys of the row count; the
    splits cover those alone (the keys below are never read).
    ``KV_FP8``: K and V hold e4m3 codes, key s's fp32 scales at ``KS``/``VS`` (``[pages,
    page, n_kv]`` strides, unit along the heads): codes are widened to q's dtype (exact) and
    the scales applied in fp32, K's to the scores, V's to the probabilities.
    """
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    heads = (kvh * GROUP + g).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    if CASCADE:
        base = tl.load(PRE_LENS + b).to(tl.int32)
    else:
        base = 0
    if WINDOW > 0:
        base = tl.maximum(base, tl.load(LENS + b).to(tl.int32) - WINDOW)
    start, end, lo, bad = _chunk(LENS, b, s_max, n_splits, split, base, BLOCK_S)
    qk_scale = tl.cast(qk_scale, tl.float32)  # torch.compile passes Python floats to Triton as fp64

    q_mask = g_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    if HAS_PREFIX and not CASCADE:  # the row form, a prefix read in place: row chosen per key
        if HAS_TABLE:
            row = tl.load(TABLE + b * stride_tb).to(tl.int64)
        else:
            row = b
        pre_row = tl.load(PRE_ROWS + b).to(tl.int64)
        pre_len = tl.load(PRE_LENS + b).to(tl.int32)
    k_base = K + kvh.to(tl.int64) * stride_kh + d[None, :]
    v_base = V + kvh.to(tl.int64) * stride_vh + d[None, :]
    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    offs_s = tl.arange(0, BLOCK_S)
    for s0 in range(start, end, BLOCK_S):
        keys = s0 + offs_s
        k_ok = (keys < end) & (keys >= lo)
        kv_mask = k_ok[:, None] & d_ok[None, :]
        if HAS_PREFIX and not CASCADE:
            row1 = tl.where(keys < pre_len, pre_row, row)
            within1 = keys.to(tl.int64)
        else:
            if HAS_TABLE:
                row1 = tl.load(TABLE + b * stride_tb + s0 // page).to(tl.int64)
            else:
                row1 = b
            within1 = (s0 % page + offs_s).to(tl.int64)
        if HAS_PREFIX and not CASCADE:
            from_row = row1[:, None]
        else:
            from_row = row1
        within = within1[:, None]
        k = tl.load(k_base + from_row * stride_kb + within * stride_ks, mask=kv_mask, other=0.0)
        v = tl.load(v_base + from_row * stride_vb + within * stride_vs, mask=kv_mask, other=0.0)
        if KV_FP8:
            ks = tl.load(KS + kvh + row1 * stride_ksb + within1 * stride_kss, mask=k_ok, other=0.0)
            vs = tl.load(VS + kvh + row1 * stride_vsb + within1 * stride_vss, mask=k_ok, other=0.0)
            k = k.to(Q.dtype.element_ty)
            v = v.to(Q.dtype.element_ty)
            s = _scores(q, k, USE_DOT, PREC, UPCAST) * ks[None, :] * qk_scale
        else:
            vs = l  # unused
            s = _scores(q, k, USE_DOT, PREC, UPCAST) * qk_scale
        s = tl.where(k_ok[None, :], s, float("-inf"))
        # the first tile of a non-empty chunk holds a valid key (``lo`` or ``start``), so the
        # max is finite
        m, l, acc = _online_step(m, l, acc, s, v, False, USE_DOT, PREC, UPCAST, EMULATE_RNE,
                                 BLOCK_S, vs, KV_FP8)  # fmt: skip

    if SINGLE:
        out = tl.where(l[:, None] > 0, acc / l[:, None], 0.0)
        out = tl.where(bad, float("nan"), out)
        o_ptrs = OUT + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, round_to(out, OUT.dtype.element_ty, EMULATE_RNE), mask=q_mask)
    else:
        w_base = WS + b * stride_wb + heads * stride_wh + split * stride_ws
        tl.store(w_base[:, None] + d[None, :], acc, mask=q_mask)
        tl.store(w_base + HEAD_DIM, m, mask=g_ok)
        tl.store(w_base + HEAD_DIM + 1, l, mask=g_ok)


@triton.jit
def _attn_prefix_kernel(
    Q, K, V, LENS, PRE_ROWS, PRE_LENS, SLOT_TABLE, SLOT_LENS, WS, batch, s_max, page, n_splits,
    n_psplits, stride_st, stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb,
    stride_vs, stride_vh, stride_wb, stride_wh, stride_ws, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_S: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, EMULATE_RNE: tl.constexpr,
    WINDOW: tl.constexpr = 0, KS=None, VS=None, stride_ksb=0, stride_kss=0, stride_vsb=0,
    stride_vss=0, KV_FP8: tl.constexpr = False,
):  # fmt: skip
    """One program: one chunk of slot p's prefix keys (KV head kvh) against the queries of
    every row that reads that prefix, ``BLOCK_Q`` (row, head) pairs at a time, as one
    tensor-core tile; writes those pairs' partials into split ``n_splits + p * n_psplits +
    psplit`` (neutral for the pairs of other rows). Slot p's key s lies in page
    ``SLOT_TABLE[p * stride_st + s // page]`` (the row form: its cache row, one page of
    ``S_max`` keys). Row b reads slot p when ``PRE_ROWS[b]`` is the slot's first page (its
    row) and ``PRE_LENS[b] > 0``; it sees the slot's keys ``< min(PRE_LENS[b], LENS[b])``
    (``WINDOW`` > 0: and ``>= LENS[b] - WINDOW``; the splits then cover the slot's keys from
    the lowest any of the tile's rows sees). ``KV_FP8``: e4m3 K/V with per-key scales, as in
    ``_attn_split_kernel``."""
    p = tl.program_id(0)
    kvh = tl.program_id(1)
    psplit = tl.program_id(2) % n_psplits
    qblock = tl.program_id(2) // n_psplits
    qk_scale = tl.cast(qk_scale, tl.float32)
    i = qblock * BLOCK_Q + tl.arange(0, BLOCK_Q)  # (row, query head of this KV head) pairs
    b = (i // GROUP).to(tl.int64)
    heads = (kvh * GROUP + i % GROUP).to(tl.int64)
    i_ok = b < batch
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    table = SLOT_TABLE + p.to(tl.int64) * stride_st
    slot_key = tl.load(table).to(tl.int64)
    slot_len = tl.load(SLOT_LENS + p).to(tl.int32)
    slot_len = tl.minimum(tl.maximum(slot_len, 0), s_max)
    length = tl.load(LENS + b, mask=i_ok, other=0).to(tl.int32)
    plen = tl.load(PRE_LENS + b, mask=i_ok, other=0).to(tl.int32)
    member = i_ok & (tl.load(PRE_ROWS + b, mask=i_ok, other=-1).to(tl.int64) == slot_key)
    plen = tl.where(member & (length >= 0) & (length <= s_max), tl.minimum(plen, length), 0)
    if WINDOW > 0:
        win_lo = length - WINDOW
        first = tl.min(tl.where(plen > 0, tl.maximum(win_lo, 0), slot_len), 0)
        first = (tl.minimum(first, slot_len) // BLOCK_S) * BLOCK_S
    else:
        first = 0
    chunk = tl.cdiv(tl.cdiv(slot_len - first, n_psplits), BLOCK_S) * BLOCK_S
    start = first + psplit * chunk
    end = tl.minimum(start + chunk, slot_len)

    q_mask = i_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b[:, None] * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=q_mask, other=0.0)  # fmt: skip
    k_base = K + kvh.to(tl.int64) * stride_kh + d[None, :]
    v_base = V + kvh.to(tl.int64) * stride_vh + d[None, :]
    m = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    offs_s = tl.arange(0, BLOCK_S)
    for s0 in range(start, end, BLOCK_S):
        keys = s0 + offs_s
        k_ok = keys < end
        kv_mask = k_ok[:, None] & d_ok[None, :]
        pg = tl.load(table + s0 // page).to(tl.int64)
        within = (s0 % page + offs_s).to(tl.int64)[:, None]
        k = tl.load(k_base + pg * stride_kb + within * stride_ks, mask=kv_mask, other=0.0)
        v = tl.load(v_base + pg * stride_vb + within * stride_vs, mask=kv_mask, other=0.0)
        if KV_FP8:
            within1 = (s0 % page + offs_s).to(tl.int64)
            ks = tl.load(KS + kvh + pg * stride_ksb + within1 * stride_kss, mask=k_ok, other=0.0)
            vs = tl.load(VS + kvh + pg * stride_vsb + within1 * stride_vss, mask=k_ok, other=0.0)
            k = k.to(Q.dtype.element_ty)
            v = v.to(Q.dtype.element_ty)
            s = _scores(q, k, True, PREC, UPCAST) * ks[None, :] * qk_scale
        else:
            vs = l  # unused
            s = _scores(q, k, True, PREC, UPCAST) * qk_scale
        seen = keys[None, :] < plen[:, None]
        if WINDOW > 0:
            seen = seen & (keys[None, :] >= win_lo[:, None])
        s = tl.where(seen, s, float("-inf"))
        # a pair may have no key here (another row's, or past its prefix): SAFE
        m, l, acc = _online_step(m, l, acc, s, v, True, True, PREC, UPCAST, EMULATE_RNE, BLOCK_S,
                                 vs, KV_FP8)  # fmt: skip
    w_base = (
        WS + b * stride_wb + heads * stride_wh + (n_splits + p * n_psplits + psplit) * stride_ws
    )
    tl.store(w_base[:, None] + d[None, :], acc, mask=q_mask)
    tl.store(w_base + HEAD_DIM, m, mask=i_ok)
    tl.store(w_base + HEAD_DIM + 1, l, mask=i_ok)


@triton.jit
def _attn_combine_kernel(
    WS, LENS, OUT, s_max, n_splits, stride_wb, stride_wh, stride_ws, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
    EMULATE_RNE: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr = False,
):  # fmt: skip
    """One program per (row, query head): rescale the splits' partials to their common max and
    normalise. Neutral partials (max -inf, sum 0) weigh nothing; a row with no keys gives 0.
    ``LAUNCH_DEPENDENTS``: as the split kernel's, when this is the last attention launch."""
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    sp = tl.arange(0, BLOCK_SPLITS)
    sp_ok = sp < n_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    base = WS + b * stride_wb + h * stride_wh + sp * stride_ws
    m = tl.load(base + HEAD_DIM, mask=sp_ok, other=float("-inf"))
    l = tl.load(base + HEAD_DIM + 1, mask=sp_ok, other=0.0)
    o = tl.load(base[:, None] + d[None, :], mask=sp_ok[:, None] & d_ok[None, :], other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    den = tl.sum(w * l, axis=0)
    num = tl.sum(w[:, None] * o, axis=0)
    out = tl.where(den > 0, num / den, 0.0)
    length = tl.load(LENS + b)
    out = tl.where((length < 0) | (length > s_max), float("nan"), out)
    o_ptrs = OUT + b * stride_ob + h * stride_oh + d
    tl.store(o_ptrs, round_to(out, OUT.dtype.element_ty, EMULATE_RNE), mask=d_ok)


# ------------------------------------------------------------------------------------------------
# 2. Launch configuration: the split rule, the kernels' launch values, the workspace shape
# ------------------------------------------------------------------------------------------------

# Defaults for an H100/H200, to be replaced by ``bench_decode.py`` results: the split rule
# ("splits") and the split kernel's launch values by path, "dot" (tl.dot, the default) or
# "fma" (MHA on the CUDA cores). ``_TUNE`` overrides any key, and USE_DOT=0/1 forces the
# path (set by the benchmark and the tests only).
_CONFIGS: dict[str, dict[str, int]] = {
    "splits": dict(
        PROGRAMS_PER_SM=2,  # split until B * n_kv * n_splits reaches this many programs per SM
        MIN_SPLIT_KEYS=256,  # ... but no split of the full cache shorter than this
        MAX_SPLITS=64,
    ),
    "fma": dict(BLOCK_S=32, num_warps=4, num_stages=3),  # BLOCK_S: keys per step
    "dot": dict(BLOCK_S=64, num_warps=4, num_stages=3),
    # the cascade's prefix kernel: BLOCK_Q (row, head) pairs per tile; its splits of a slot's
    # prefix follow the split rule's shape with their own floor (not measured on a GPU yet)
    "cascade": dict(
        BLOCK_Q=64,
        BLOCK_S=64,
        num_warps=8,
        num_stages=2,
        PROGRAMS_PER_SM=2,
        MIN_SPLIT_KEYS=128,
        MAX_SPLITS=32,
    ),  # fmt: skip
}
_TUNE: dict[str, int] = {}
_DEFAULT_SMS = 132  # H100 SXM / H200; used off the GPU
# A benchmark's override in a fresh process, e.g. "MIN_SPLIT_KEYS=64,BLOCK_S=32": read at each
# launch (a process's captured graphs keep what they were captured with), applied before _TUNE
ENV_TUNE = "NAKTA_DECODE_ATTENTION_TUNE"
_KEYS = frozenset(k for table in _CONFIGS.values() for k in table)


@functools.lru_cache(maxsize=8)
def _parse_env(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq or key not in _KEYS or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(
                f"{ENV_TUNE}: expected KEY=positive int pairs with KEY in {sorted(_KEYS)}, "
                f"got {part!r}"
            )
        out[key] = int(value)
    return out


def _config(kind: str) -> dict[str, int]:
    """The table entry ``kind`` ("splits", "fma", "dot" or "cascade"), then ``ENV_TUNE``'s
    keys, then ``_TUNE``."""
    return {**_CONFIGS[kind], **_parse_env(knobs.get_str(ENV_TUNE)), **_TUNE}


def decode_splits(batch: int, n_kv_heads: int, max_seq: int, device: torch.device | str) -> int:
    """The number of sequence splits ``decode_attention`` uses for these shapes: enough
    programs to fill the GPU, no split of the full cache under ``MIN_SPLIT_KEYS`` keys.
    Depends on shapes only, so a captured graph keeps its grid."""
    for name, v in (("batch", batch), ("n_kv_heads", n_kv_heads), ("max_seq", max_seq)):
        check_positive_int(name, v)
    cfg = _config("splits")
    target = cfg["PROGRAMS_PER_SM"] * sm_count(torch.device(device), _DEFAULT_SMS)
    wanted = triton.cdiv(target, batch * n_kv_heads)
    cap = min(cfg["MAX_SPLITS"], triton.cdiv(max_seq, cfg["MIN_SPLIT_KEYS"]))
    return max(1, min(wanted, cap))


def cascade_splits(
    batch: int, n_q_heads: int, n_kv_heads: int, n_slots: int, max_seq: int, device
) -> int:
    """Splits of each slot's prefix keys in the cascade (``prefix_slots``): enough programs
    (slots x KV heads x query tiles x splits) to fill the GPU, no split of a full-length
    prefix under ``MIN_SPLIT_KEYS`` keys. Shapes only (graph capture keeps its grid); the
    workspace then needs ``n_splits + n_slots * cascade_splits(...)`` partials."""
    for name, v in (("batch", batch), ("n_q_heads", n_q_heads), ("n_kv_heads", n_kv_heads),
                    ("n_slots", n_slots), ("max_seq", max_seq)):  # fmt: skip
        check_positive_int(name, v)
    cfg = _config("cascade")
    tiles = triton.cdiv(batch * (n_q_heads // n_kv_heads), cfg["BLOCK_Q"])
    target = cfg["PROGRAMS_PER_SM"] * sm_count(torch.device(device), _DEFAULT_SMS)
    wanted = triton.cdiv(target, n_slots * n_kv_heads * tiles)
    cap = min(cfg["MAX_SPLITS"], triton.cdiv(max_seq, cfg["MIN_SPLIT_KEYS"]))
    return max(1, min(wanted, cap))


def attention_workspace(
    batch: int, n_q_heads: int, head_dim: int, n_splits: int, device: torch.device | str
) -> torch.Tensor:
    """The fp32 partials buffer ``[batch, n_q_heads, n_splits, head_dim + 2]`` (output, max,
    sum per split): allocate once, pass as ``workspace`` on every step."""
    for name, v in (("batch", batch), ("n_q_heads", n_q_heads), ("head_dim", head_dim),
                    ("n_splits", n_splits)):  # fmt: skip
        check_positive_int(name, v)
    return torch.empty(batch, n_q_heads, n_splits, head_dim + 2, dtype=torch.float32, device=device)


LOG2E = 1.4426950408889634

# ------------------------------------------------------------------------------------------------
# 3. Checks and launcher
# ------------------------------------------------------------------------------------------------


def _check_cache(name: str, c: object, q: torch.Tensor) -> torch.Tensor:
    c = check_tensor(name, c)
    check_ndim(name, c, 4)
    if c.dtype not in (q.dtype, FP8_DTYPE):
        raise TypeError(f"{name} must have q's dtype {q.dtype} or {FP8_DTYPE}, got {c.dtype}")
    if c.shape[3] > 1 and c.stride(3) != 1:
        raise ValueError(f"{name} must be unit-stride in its last dimension, got {c.stride()}")
    return c


def _check_scales(k_cache, v_cache, k_scale, v_scale) -> None:
    """e4m3 caches (both or neither) come with fp32 scales of the caches' first three dims,
    unit-stride along the heads; caches in q's dtype take none."""
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(
            f"k_cache and v_cache must have one dtype, got {k_cache.dtype} and {v_cache.dtype}"
        )
    if k_cache.dtype != FP8_DTYPE:
        if k_scale is not None or v_scale is not None:
            raise ValueError("k_scale and v_scale go with e4m3 k_cache/v_cache")
        return
    for name, sc, c in (("k_scale", k_scale, k_cache), ("v_scale", v_scale, v_cache)):
        if sc is None:
            raise ValueError(f"e4m3 caches need {name} (fp32, the caches' first three dims)")
        check_tensor(name, sc)
        check_dtype(name, sc, (torch.float32,))
        if sc.shape != c.shape[:3] or (sc.shape[2] > 1 and sc.stride(2) != 1):
            raise ValueError(
                f"{name} must be fp32 of shape {tuple(c.shape[:3])} (the cache's [pages, page, "
                f"n_kv]), unit-stride along the heads, got shape {tuple(sc.shape)}, strides "
                f"{sc.stride()}"
            )
        if sc.device != c.device:
            raise ValueError(f"{name} is on {sc.device}, the caches on {c.device}")


def _check_args(
    q, k_cache, v_cache, cache_lens, scale, n_splits, out, workspace, *, for_kernel: bool,
    rows=None, prefix_rows=None, prefix_lens=None, prefix_slots=None, block_table=None,
    window=None, k_scale=None, v_scale=None,
) -> tuple[float, int, int]:  # fmt: skip
    """Validate a ``decode_attention`` call; returns ``(scale, n_splits, n_psplits)`` (the
    cascade's splits per slot, 0 without ``prefix_slots``)."""
    q = check_tensor("q", q)
    check_dtype("q", q, FLOAT_DTYPES)
    check_ndim("q", q, 3)
    if q.shape[2] > 1 and q.stride(2) != 1:
        raise ValueError(f"q must be unit-stride in its last dimension, got {q.stride()}")
    batch, n_q, head_dim = q.shape
    if batch < 1 or n_q < 1 or head_dim < 1:
        raise ValueError(f"q must have shape [B>0, n_q_heads>0, head_dim>0], got {tuple(q.shape)}")
    k_cache = _check_cache("k_cache", k_cache, q)
    v_cache = _check_cache("v_cache", v_cache, q)
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} "
            f"and {tuple(v_cache.shape)}"
        )
    _check_scales(k_cache, v_cache, k_scale, v_scale)
    b_max, s_max, n_kv, hd = k_cache.shape
    paged = block_table is not None
    need_rows = 1 if rows is not None or paged else batch
    if hd != head_dim or b_max < need_rows or s_max < 1 or n_kv < 1:
        raise ValueError(
            f"k_cache must have shape [B_max >= {need_rows}, S_max > 0, n_kv_heads, "
            f"head_dim={head_dim}], got {tuple(k_cache.shape)}"
        )
    if paged:
        block_table = _check_block_table(block_table, rows, prefix_rows, prefix_slots, q)
        s_max = block_table.shape[1] * k_cache.shape[1]  # the most keys a row can hold
    if rows is not None:
        rows = check_index("rows", rows, batch, per="row of q")
        if rows.device != q.device:
            raise ValueError(f"rows is on {rows.device} but q is on {q.device}")
    if (prefix_rows is None) != (prefix_lens is None):
        raise ValueError("prefix_rows and prefix_lens go together: give both or neither")
    if prefix_rows is not None:
        prefix_rows = check_index("prefix_rows", prefix_rows, batch, per="row of q")
        prefix_lens = check_index("prefix_lens", prefix_lens, batch, per="row of q")
        for name, t in (("prefix_rows", prefix_rows), ("prefix_lens", prefix_lens)):
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if n_q % n_kv:
        raise ValueError(f"the caches' n_kv_heads ({n_kv}) must divide q's heads ({n_q})")
    cache_lens = check_index("cache_lens", cache_lens, batch, per="row of q")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive float, got {scale!r}")
    if window is not None:
        check_positive_int("window", window)
    seen = s_max if window is None else min(s_max, window)  # the most keys a row attends to
    if n_splits is None:
        n_splits = decode_splits(batch, n_kv, seen, q.device)
    if isinstance(n_splits, bool) or not isinstance(n_splits, int) or not 1 <= n_splits <= 1024:
        raise ValueError(f"n_splits must be an int in [1, 1024], got {n_splits!r}")
    if out is not None:
        out = check_tensor("out", out)
        check_dtype("out", out, (q.dtype,))
        if out.shape != q.shape:
            raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
        if head_dim > 1 and out.stride(2) != 1:
            raise ValueError(f"out must be unit-stride in its last dimension, got {out.stride()}")
    n_psplits = 0
    if prefix_slots is not None:
        slot_rows, slot_lens = _check_slots(prefix_slots, prefix_rows, q, paged)
        n_psplits = cascade_splits(batch, n_q, n_kv, slot_rows.shape[0], seen, q.device)
    if paged and for_kernel and block_table.shape[1] > 1:
        page = k_cache.shape[1]
        kinds = ("dot" if _TUNE.get("USE_DOT", 1) else "fma",) + (
            ("cascade",) if prefix_slots is not None else ()
        )
        for kind in kinds:
            if page % _config(kind)["BLOCK_S"]:
                raise ValueError(
                    f"the page size (k_cache.shape[1] = {page}) must be a multiple of the "
                    f"{kind} kernel's BLOCK_S={_config(kind)['BLOCK_S']} (a key tile in one page)"
                )
    if workspace is not None:
        n_slots = 0 if prefix_slots is None else slot_rows.shape[0]
        _check_workspace(workspace, batch, n_q, head_dim, n_splits + n_slots * n_psplits)
    check_same_device(
        q=q, k_cache=k_cache, v_cache=v_cache, cache_lens=cache_lens, out=out, workspace=workspace
    )
    _check_no_aliasing(q, k_cache, v_cache, out, workspace)
    if for_kernel:
        check_triton_device("q", q)
    if not q.is_cuda or debug_checks() or not for_kernel:
        lo, hi = int(cache_lens.min()), int(cache_lens.max())
        if lo < 0 or hi > s_max:
            raise ValueError(f"cache_lens must lie in [0, S_max={s_max}], got [{lo}, {hi}]")
        if paged:
            _check_pages("block_table", block_table, cache_lens, k_cache.shape[1], b_max)
        for name, t in (("rows", rows), ("prefix_rows", None if paged else prefix_rows)):
            if t is not None and (int(t.min()) < 0 or int(t.max()) >= b_max):
                raise ValueError(
                    f"{name} must lie in [0, B_max={b_max}), got [{int(t.min())}, {int(t.max())}]"
                )
        if prefix_lens is not None and (
            int(prefix_lens.min()) < 0 or int(prefix_lens.max()) > s_max
        ):
            raise ValueError(
                f"prefix_lens must lie in [0, S_max={s_max}], got "
                f"[{int(prefix_lens.min())}, {int(prefix_lens.max())}]"
            )
        if prefix_slots is not None:
            _check_slot_values(
                slot_rows, slot_lens, prefix_rows, prefix_lens, b_max, s_max, k_cache.shape[1]
            )
    return float(scale), n_splits, n_psplits


def _check_block_table(block_table, rows, prefix_rows, prefix_slots, q) -> torch.Tensor:
    """The paged form's table: int ``[B, pages per row]``, unit-stride columns; shared
    prefixes are pages of it (``prefix_rows`` only names the cascade's slots)."""
    if rows is not None:
        raise ValueError("give rows or block_table, not both (rows is the one-page-a-row table)")
    if prefix_rows is not None and prefix_slots is None:
        raise ValueError(
            "with block_table, prefix_rows/prefix_lens only go with prefix_slots (a shared "
            "prefix is read through the rows' block tables, which hold its pages)"
        )
    t = check_tensor("block_table", block_table)
    check_dtype("block_table", t, INDEX_DTYPES)
    check_ndim("block_table", t, 2)
    if t.shape[0] != q.shape[0] or t.shape[1] < 1:
        raise ValueError(
            f"block_table must have shape [B={q.shape[0]}, pages >= 1], got {tuple(t.shape)}"
        )
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"block_table must be unit-stride along its columns, got {t.stride()}")
    if t.device != q.device:
        raise ValueError(f"block_table is on {t.device} but q is on {q.device}")
    return t


def _check_pages(name: str, table, lens, page: int, n_pages: int) -> None:
    """CPU/debug: the pages that hold each row's ``lens[b]`` keys lie in ``[0, n_pages)``."""
    need = (lens.long().cpu() + page - 1) // page
    cols = torch.arange(table.shape[1])[None, :]
    used = table.long().cpu()[cols < need[:, None]]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= n_pages):
        raise ValueError(
            f"{name} must hold pages in [0, {n_pages}) for every key it covers, got "
            f"[{int(used.min())}, {int(used.max())}]"
        )


def _check_slots(
    prefix_slots: object, prefix_rows, q, paged: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slot_rows [P], slot_lens [P])``; paged: ``(slot_table [P, pages], slot_lens [P])``
    (``prefix_rows`` names a slot by its first page)."""
    if not isinstance(prefix_slots, (tuple, list)) or len(prefix_slots) != 2:
        raise TypeError("prefix_slots must be a pair (slot_rows, slot_lens) of int tensors")
    if prefix_rows is None:
        raise ValueError("prefix_slots needs prefix_rows and prefix_lens")
    slot_rows = check_tensor("prefix_slots[0]", prefix_slots[0])
    ndim = 2 if paged else 1
    n = slot_rows.shape[0] if slot_rows.dim() == ndim else 0
    if n < 1:
        what = "2-D [slots >= 1, pages] (page tables)" if paged else "1-D with >= 1 slot"
        raise ValueError(f"prefix_slots[0] must be {what}, got {tuple(slot_rows.shape)}")
    if paged:
        check_dtype("prefix_slots[0]", slot_rows, INDEX_DTYPES)
        if slot_rows.shape[1] > 1 and slot_rows.stride(1) != 1:
            raise ValueError("prefix_slots[0] must be unit-stride along its columns")
    else:
        slot_rows = check_index("prefix_slots[0]", slot_rows, n, per="slot")
    slot_lens = check_index("prefix_slots[1]", prefix_slots[1], n, per="slot")
    for name, t in (("prefix_slots[0]", slot_rows), ("prefix_slots[1]", slot_lens)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    return slot_rows, slot_lens


def _check_slot_values(
    slot_rows, slot_lens, prefix_rows, prefix_lens, b_max, s_max, page: int = 0
) -> None:
    """CPU/debug: the slots' rows (paged: the pages of their keys) and lengths in range, and
    every row with a prefix reads one of them, no further than the slot holds."""
    lens = slot_lens.long().cpu()
    if int(lens.min()) < 0 or int(lens.max()) > s_max:
        raise ValueError(f"prefix_slots[1] must lie in [0, S_max={s_max}]")
    if slot_rows.dim() == 2:
        _check_pages("prefix_slots[0]", slot_rows, slot_lens, page, b_max)
        rows = slot_rows[:, 0].long().cpu()
    else:
        rows = slot_rows.long().cpu()
        if int(rows.min()) < 0 or int(rows.max()) >= b_max:
            raise ValueError(f"prefix_slots[0] must lie in [0, B_max={b_max})")
    held = dict(zip(rows.tolist(), lens.tolist()))
    for r, n in zip(prefix_rows.long().cpu().tolist(), prefix_lens.long().cpu().tolist()):
        if n > 0 and (r not in held or n > held[r]):
            raise ValueError(
                f"with prefix_slots every prefix must be read from a slot: prefix row {r} "
                f"({n} keys) is not a slot holding that many (slots {held})"
            )


def _check_workspace(ws: object, batch: int, n_q: int, head_dim: int, n_splits: int) -> None:
    ws = check_tensor("workspace", ws)
    check_dtype("workspace", ws, (torch.float32,))
    need = batch * n_q * n_splits * (head_dim + 2)
    if not ws.is_contiguous() or ws.numel() < need:
        raise ValueError(
            f"workspace must be a contiguous fp32 tensor of at least {need} elements "
            f"(attention_workspace({batch}, {n_q}, {head_dim}, {n_splits})), got shape "
            f"{tuple(ws.shape)} contiguous={ws.is_contiguous()}"
        )


def _check_no_aliasing(q, k_cache, v_cache, out, workspace) -> None:
    """``out`` may be ``q`` itself (a program reads its heads' queries before writing them);
    any other sharing with the inputs is a race."""
    if tracing():
        return
    if out is not None:
        same_as_q = out.data_ptr() == q.data_ptr() and out.stride() == q.stride()
        if not same_as_q:
            check_no_overlap("out", out, "q", q)
        check_no_overlap("out", out, "k_cache", k_cache)
        check_no_overlap("out", out, "v_cache", v_cache)
    if workspace is not None:
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
            if t is not None:
                check_no_overlap("workspace", workspace, name, t)


# At batch 1 the last attention launch lets the next kernel launch at once (``wo``, a
# programmatic dependent, whose blocks load their first weight tile while attention runs and
# then wait for its output: ``decode_linear``'s ``EARLY_W``). Attention itself stays an ordinary
# launch (as a dependent it ran slower: docs/experiments.md).
TRIGGER_MAX_BATCH = 1


def _launch(
    q, k_cache, v_cache, cache_lens, scale, n_splits, out, workspace, rows=None, prefix=None,
    slots=None, n_psplits=0, block_table=None, window=None, k_scale=None, v_scale=None,
) -> None:  # fmt: skip
    batch, n_q, head_dim = q.shape
    kv_fp8 = k_cache.dtype == FP8_DTYPE
    fp8_args = {}
    if kv_fp8:
        fp8_args = dict(
            KS=k_scale, VS=v_scale, stride_ksb=k_scale.stride(0), stride_kss=k_scale.stride(1),
            stride_vsb=v_scale.stride(0), stride_vss=v_scale.stride(1), KV_FP8=True,
        )  # fmt: skip
    page, n_kv = k_cache.shape[1], k_cache.shape[2]
    s_max = page  # the row form: one page of S_max keys a row
    table, stride_tb = cache_lens, 0  # unused without a table
    if block_table is not None:
        table, stride_tb = block_table, block_table.stride(0)
        s_max = block_table.shape[1] * page
    elif rows is not None:
        table, stride_tb = rows, rows.stride(0)
    group = n_q // n_kv
    use_dot = bool(_TUNE.get("USE_DOT", 1))
    cfg = _config("dot" if use_dot else "fma")
    block_g = max(16, triton.next_power_of_2(group)) if use_dot else 1
    if not use_dot and group > 1:
        raise ValueError("_TUNE USE_DOT=0 needs one query head per KV head (MHA)")
    block_d = max(16 if use_dot else 1, triton.next_power_of_2(head_dim))
    interp = interpreter_enabled()
    upcast = interp and q.dtype == torch.bfloat16
    prec = "ieee" if (q.dtype == torch.float32 or upcast) else None
    cascade = slots is not None
    total = n_splits + (slots[0].shape[0] * n_psplits if cascade else 0)  # partials per head
    single = total == 1
    trigger = batch <= TRIGGER_MAX_BATCH and dependent_launch(q.device)
    if single:
        ws = q  # unused
        ws_strides = (0, 0, 0)
    else:
        if workspace is None:
            workspace = attention_workspace(batch, n_q, head_dim, total, q.device)
        ws = workspace.view(-1)[: batch * n_q * total * (head_dim + 2)]
        ws = ws.view(batch, n_q, total, head_dim + 2)
        ws_strides = ws.stride()[:3]
    _attn_split_kernel[(batch, n_kv, n_splits)](
        q, k_cache, v_cache, cache_lens, table, *(prefix or (cache_lens, cache_lens)), out, ws,
        s_max, page, n_splits, stride_tb, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        *ws_strides, scale * LOG2E,
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=cfg["BLOCK_S"],
        USE_DOT=use_dot, SINGLE=single, PREC=prec, UPCAST=upcast, EMULATE_RNE=interp,
        HAS_TABLE=block_table is not None or rows is not None, HAS_PREFIX=prefix is not None, CASCADE=cascade,
        LAUNCH_DEPENDENTS=trigger and single, WINDOW=window or 0, **fp8_args,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if cascade:
        cc = _config("cascade")
        # fp32 operands take twice the registers: half the tile keeps them out of local memory
        widest = cc["BLOCK_Q"] // (2 if q.dtype == torch.float32 else 1)
        block_q = max(16, min(widest, triton.next_power_of_2(batch * group)))
        tiles = triton.cdiv(batch * group, block_q)
        _attn_prefix_kernel[(slots[0].shape[0], n_kv, n_psplits * tiles)](
            q, k_cache, v_cache, cache_lens, *prefix, *slots, ws, batch, s_max, page, n_splits,
            n_psplits, slots[0].stride(0), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            *ws_strides, scale * LOG2E,
            GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            BLOCK_Q=block_q, BLOCK_S=cc["BLOCK_S"], PREC=prec, UPCAST=upcast,
            EMULATE_RNE=interp, WINDOW=window or 0, **fp8_args,
            num_warps=cc["num_warps"], num_stages=cc["num_stages"],
        )  # fmt: skip
    if single:
        return
    _attn_combine_kernel[(batch, n_q)](
        ws, cache_lens, out, s_max, total, *ws_strides, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SPLITS=triton.next_power_of_2(total), EMULATE_RNE=interp,
        LAUNCH_DEPENDENTS=trigger, num_warps=1,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------
# 4. Public function
# ------------------------------------------------------------------------------------------------


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    *,
    scale: float | None = None,
    n_splits: int | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    prefix_rows: torch.Tensor | None = None,
    prefix_lens: torch.Tensor | None = None,
    prefix_slots: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_table: torch.Tensor | None = None,
    window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q [B, n_q, hd]`` (one query per row) over ``k_cache``/``v_cache``
    ``[B_max, S_max, n_kv, hd]`` rows ``0..B-1`` (or cache rows ``rows[b]``), keys
    ``0 .. cache_lens[b] - 1``; query head h reads KV head ``h // (n_q / n_kv)``. With
    ``prefix_rows``/``prefix_lens`` (int ``[B]``), keys ``< prefix_lens[b]`` are read from cache
    row ``prefix_rows[b]`` instead (a shared prompt prefix held once). ``prefix_slots``
    ``(slot_rows [P], slot_lens [P])``, the cache rows that hold shared prefixes and their
    lengths (every row with a prefix reads one of them): the cascade computes each slot's
    prefix once for all its rows (module docstring); same result.

    Paged form, ``block_table`` (int ``[B, W]``): the caches are ``[n_pages, page, n_kv, hd]``
    and key s of row b is ``k_cache[block_table[b, s // page], s % page]`` (rows hold up to
    ``W * page`` keys; ``page`` a multiple of the kernels' ``BLOCK_S`` unless ``W == 1``; the
    row form is the table ``rows[:, None]`` with one page of S_max keys). Shared prefixes are
    pages several block tables hold; with ``prefix_slots = (slot_table [P, W'], slot_lens)``
    the cascade reads slot p's keys through its page table for the rows whose
    ``prefix_rows[b]`` is that table's first page (their first ``prefix_lens[b]`` keys).
    ``window`` (sliding-window attention, Mistral): row b attends to its last ``window`` keys
    only, ``cache_lens[b] - window .. cache_lens[b] - 1`` (the query is the row's last
    position); the splits and the cascade cover just those, the keys below are never read
    (``None``: every key; the kernels compile without it).
    ``scale`` defaults to ``1 / sqrt(hd)``, ``n_splits`` to ``decode_splits(...)`` (of the
    keys a row attends to: at most ``window``). Returns ``out`` (allocated when None), shape
    and dtype of q. e4m3 caches (``kv_cache="fp8"``) come with ``k_scale``/``v_scale``, fp32
    ``[B_max or n_pages, S_max or page, n_kv]``: key s stands for ``codes * scale``, read
    dequantized in registers (the codes widened to q's dtype, the scales applied in fp32)."""
    scale, n_splits, n_psplits = _check_args(
        q, k_cache, v_cache, cache_lens, scale, n_splits, out, workspace, for_kernel=True,
        rows=rows, prefix_rows=prefix_rows, prefix_lens=prefix_lens, prefix_slots=prefix_slots,
        block_table=block_table, window=window, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    prefix = None if prefix_rows is None else (prefix_rows, prefix_lens)
    _launch(
        q, k_cache, v_cache, cache_lens, scale, n_splits, out, workspace, rows, prefix,
        prefix_slots, n_psplits, block_table, window, k_scale, v_scale,
    )  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------------
# 5. Reference
# ------------------------------------------------------------------------------------------------


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    *,
    scale: float | None = None,
    n_splits: int | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    prefix_rows: torch.Tensor | None = None,
    prefix_lens: torch.Tensor | None = None,
    prefix_slots: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_table: torch.Tensor | None = None,
    window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch (any device): fp32 scores and softmax over each row's valid keys, output
    in q's dtype (zeros for a row with no keys). ``n_splits``/``workspace`` are checked like
    the kernel's and otherwise unused; so is ``prefix_slots`` in the row form (a row's prefix
    is ``prefix_rows[b]``'s row either way). Paged: each row's keys gathered through its block
    table, the first ``prefix_lens[b]`` through its slot's page table. ``window``: only each
    row's last ``window`` keys. e4m3 caches: dequantized first (``codes * scale`` in fp32)."""
    args = (q, k_cache, v_cache, cache_lens, scale, n_splits, out, workspace)
    scale, _, _ = _check_args(
        *args, for_kernel=False, rows=rows, prefix_rows=prefix_rows, prefix_lens=prefix_lens,
        prefix_slots=prefix_slots, block_table=block_table, window=window, k_scale=k_scale,
        v_scale=v_scale,
    )  # fmt: skip
    if k_cache.dtype == FP8_DTYPE:
        k_cache = k_cache.float() * k_scale[..., None]
        v_cache = v_cache.float() * v_scale[..., None]
    batch, n_q, _ = q.shape
    n_kv = k_cache.shape[2]
    kv_head = torch.arange(n_q, device=q.device) // (n_q // n_kv)
    if block_table is not None:
        k, v = _gather_pages(k_cache, block_table), _gather_pages(v_cache, block_table)
        if prefix_rows is not None:  # with prefix_slots (checked): the slots' pages
            table, lens = prefix_slots
            pick = (prefix_rows.long()[:, None] == table[:, 0].long()[None, :]).long().argmax(1)
            pk, pv = _gather_pages(k_cache, table[pick]), _gather_pages(v_cache, table[pick])
            n = min(pk.shape[1], k.shape[1])
            shared = torch.arange(n, device=q.device)[None, :] < prefix_lens[:, None]
            k[:, :n] = torch.where(shared[:, :, None, None], pk[:, :n], k[:, :n])
            v[:, :n] = torch.where(shared[:, :, None, None], pv[:, :n], v[:, :n])
        k, v = k.float()[:, :, kv_head], v.float()[:, :, kv_head]
    else:
        picked = slice(0, batch) if rows is None else rows.long()
        k = k_cache[picked].float()[:, :, kv_head]  # [B, S, n_q, hd]
        v = v_cache[picked].float()[:, :, kv_head]
        if prefix_rows is not None:
            s_max = k_cache.shape[1]
            shared = torch.arange(s_max, device=q.device)[None, :] < prefix_lens[:, None]
            shared = shared[:, :, None, None]
            k = torch.where(shared, k_cache[prefix_rows.long()].float()[:, :, kv_head], k)
            v = torch.where(shared, v_cache[prefix_rows.long()].float()[:, :, kv_head], v)
    scores = torch.einsum("bhd,bshd->bhs", q.float(), k) * scale
    key = torch.arange(k.shape[1], device=q.device)[None, :]
    lens = cache_lens.to(q.device).long()[:, None]
    valid = key < lens
    if window is not None:
        valid &= key >= lens - window
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no keys: all -inf -> 0
    y = torch.einsum("bhs,bshd->bhd", p, v).to(q.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def _gather_pages(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``[B, W * page, n_kv, hd]``: each row's pages in order (pages past a row's keys may be
    anything in range; a table entry outside the pool reads page 0, never used)."""
    n_pages = cache.shape[0]
    t = table.long()
    t = torch.where((t >= 0) & (t < n_pages), t, 0)
    return cache[t].flatten(1, 2)
