"""The Triton kernels of ``decode_attention.py``: the split-K pass, the cascade's prefix pass and
the combining pass, each reading keys through a page table (the row form: one page a row).

Kept apart from the launcher, its checks and the reference so that neither file grows past a
readable size (the house's ``_<op>_kernels.py`` convention); what they compute and how they
round is in ``decode_attention.py``'s docstring, which chooses every constexpr (``_config``)
and launches them.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from nakta_model.kernels._triton_math import round_to


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
