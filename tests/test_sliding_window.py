"""Sliding-window attention (Mistral) in every attention path, against plain fp64 attention.

Convention (transformers' Mistral ``sliding_window``): the query at position i sees the key at
position j iff ``i - window < j <= i``. Checked here for the packed scoring kernel (chains,
token trees, cached prefix pages), the decode kernel (row form, in-place prefix rows, paged,
the cascade over held prefixes, the CUDA-core path) and the dense causal path, each against an
fp64 softmax written here from that rule, on sequences longer than tiny windows (1-7, so the
CPU interpreter runs stay small). A window past every sequence gives the no-window bits; key
tiles below every query's window are never read (their values poisoned with NaN leave the
output finite). ``gpu`` tests: Mistral-7B's heads (32 q, 8 kv, head_dim 128), window 4096,
sequences past it.

The same window through a whole tiny Mistral-shaped model, against transformers, is checked here too.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from test_decode_attention import PAGE, _paged_cascade_case, assert_matches_reference, paged_case
from test_packed_attention import TOL, layout, prefix_case, random_rows, random_trees

import nakta_model
from nakta_model import scoring
from nakta_model.attention import causal_attention
from nakta_model.kernels import decode_attention as da
from nakta_model.kernels import packed_attention as pa
from nakta_model.kernels.decode_attention import decode_attention, decode_attention_reference
from nakta_model.kernels.packed_attention import (
    packed_attention,
    packed_attention_mask,
    packed_attention_reference,
)
from nakta_model.model import Transformer

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# ------------------------------------------------------------------------------ packed


def depths(seq_start: torch.Tensor, span_end: torch.Tensor | None) -> torch.Tensor:
    """Each token's depth in its tree (its ancestors' count), as the scorer gives positions:
    in depth-first order the ancestors of t are the open subtrees when t comes."""
    starts = seq_start.tolist()
    ends = None if span_end is None else span_end.tolist()
    out, open_ends = [], []
    for t, s in enumerate(starts):
        if ends is None:
            out.append(t - s)
            continue
        if s == t:
            open_ends = []
        while open_ends and open_ends[-1] <= t:
            open_ends.pop()
        out.append(len(open_ends))
        open_ends.append(ends[t])
    return torch.tensor(out, dtype=torch.int32)


def windowed_fp64(qkv, seq_start, span_end, hq, hkv, hd, window, pos, prefix=None):
    """fp64 attention, token by token: the ancestors j (and cached prefix keys p, at position
    p) with ``pos[i] - pos[j] < window``."""
    t = qkv.shape[0]
    heads = qkv.double().view(t, hq + 2 * hkv, hd)
    tree = packed_attention_mask(seq_start, span_end)
    out = torch.empty(t, hq, hd, dtype=torch.float64)
    for i in range(t):
        near = tree[i] & (int(pos[i]) - pos.long() < window)
        keys, vals = heads[near, hq : hq + hkv], heads[near, hq + hkv :]
        e = -1 if prefix is None else int(prefix.token_entry[i])
        if e >= 0:
            pk, pv = pa._gather_prefix(prefix, e)
            seen = int(pos[i]) - torch.arange(pk.shape[0]) < window
            keys = torch.cat([pk[seen].double(), keys])
            vals = torch.cat([pv[seen].double(), vals])
        for h in range(hq):
            g = h // (hq // hkv)
            p = torch.softmax(keys[:, g] @ heads[i, h] / math.sqrt(hd), 0)
            out[i, h] = p @ vals[:, g]
    return out.reshape(t, hq * hd)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq, hkv, hd", [(4, 2, 16), (3, 1, 24)], ids=["gqa", "mqa-hd24"])
@pytest.mark.parametrize("tree", [True, False], ids=["trees", "chains"])
def test_packed_window_matches_fp64(dtype, hq, hkv, hd, tree):
    """Random token trees (or chains) of up to 40 tokens, windows 1, 3 and 7: the kernel and
    the reference against the fp64 rule; the reference in fp64 to fp64 rounding."""
    rng = random.Random(hq * 7 + hd + tree)
    seq_start, span_end = random_trees(rng, [1, 9, 23, 40, 6], pad=5)
    span_end = span_end if tree else None
    pos = depths(seq_start, span_end)
    qkv = torch.randn(seq_start.shape[0], (hq + 2 * hkv) * hd).to(dtype)
    for window in (1, 3, 7):
        kw = dict(window=window, positions=pos)
        want = windowed_fp64(qkv, seq_start, span_end, hq, hkv, hd, window, pos)
        got = packed_attention(qkv, seq_start, span_end, hq, hkv, hd, **kw)
        assert torch.isfinite(got).all() and rel_err(got, want) < TOL[dtype], window
        ref = packed_attention_reference(qkv, seq_start, span_end, hq, hkv, hd, **kw)
        assert rel_err(ref, want) < TOL[dtype], window
        if dtype == torch.float32:
            ref64 = packed_attention_reference(qkv.double(), seq_start, span_end, hq, hkv, hd, **kw)
            torch.testing.assert_close(ref64, want, rtol=1e-12, atol=1e-12)


def test_packed_window_on_hellaswag_rows_int64_positions_and_strided_qkv():
    """Contexts with branches (the scorer's rows), int64 positions, qkv a column slice of a
    wider buffer: the same bits as the contiguous copy, and the fp64 rule."""
    seq_start, span_end = layout(random_rows(random.Random(5), 5), pad=3)
    t, hq, hkv, hd = seq_start.shape[0], 2, 1, 16
    pos = depths(seq_start, span_end).long()
    big = torch.randn(t, (hq + 2 * hkv) * hd + 7)
    qkv = big[:, 5 : 5 + (hq + 2 * hkv) * hd]
    assert not qkv.is_contiguous()
    kw = dict(window=4, positions=pos)
    got = packed_attention(qkv, seq_start, span_end, hq, hkv, hd, **kw)
    same = packed_attention(qkv.contiguous(), seq_start, span_end, hq, hkv, hd, **kw)
    torch.testing.assert_close(got, same, rtol=0, atol=0)
    want = windowed_fp64(qkv, seq_start, span_end, hq, hkv, hd, 4, pos)
    assert rel_err(got, want) < TOL[torch.float32]


@pytest.mark.parametrize("tree", [True, False], ids=["trees", "chains"])
def test_packed_window_past_every_sequence_is_no_window(tree):
    """A window longer than any sequence masks nothing and skips nothing: the same bits."""
    seq_start, span_end = random_trees(random.Random(2), [30, 7, 44], pad=2)
    span_end = span_end if tree else None
    hq, hkv, hd = 2, 1, 16
    qkv = torch.randn(seq_start.shape[0], (hq + 2 * hkv) * hd)
    plain = packed_attention(qkv, seq_start, span_end, hq, hkv, hd)
    pos = depths(seq_start, span_end)
    wide = packed_attention(qkv, seq_start, span_end, hq, hkv, hd, window=45, positions=pos)
    torch.testing.assert_close(wide, plain, rtol=0, atol=0)
    narrow = packed_attention(qkv, seq_start, span_end, hq, hkv, hd, window=3, positions=pos)
    assert not torch.allclose(narrow, plain)


def prefix_positions(prefix, seq_start, span_end) -> torch.Tensor:
    """A token's position: its prefix's length plus its depth (pad tokens: 0, as the
    generation engine's prefill stream writes them)."""
    d = depths(seq_start, span_end)
    e = prefix.token_entry.long()
    plen = torch.where(e >= 0, prefix.lengths.long()[e.clamp(min=0)], 0)
    t = torch.arange(seq_start.shape[0])
    alone = (seq_start == t) & (torch.cat([seq_start[1:], torch.tensor([-1])]) != t)
    return torch.where(alone & (e >= 0), 0, plen + d).to(torch.int32)


@pytest.mark.parametrize("dtype, window", [(torch.float32, 3), (torch.bfloat16, 50)])
def test_packed_window_over_cached_prefix_pages(dtype, window):
    """Rows after cached prefixes of 40 and 70 keys (scattered pages): prefix key p is at
    position p, so a window of 3 sees none of the prefix for most tokens, 50 sees its end."""
    hq, hkv, hd = 2, 1, 16
    qkv, seq_start, span_end, prefix = prefix_case(hq, hkv, hd, dtype)
    pos = prefix_positions(prefix, seq_start, span_end)
    plain = packed_attention(qkv, seq_start, span_end, hq, hkv, hd, prefix=prefix)
    kw = dict(prefix=prefix, window=window, positions=pos)
    want = windowed_fp64(qkv, seq_start, span_end, hq, hkv, hd, window, pos, prefix)
    got = packed_attention(qkv, seq_start, span_end, hq, hkv, hd, **kw)
    assert torch.isfinite(got).all() and rel_err(got, want) < TOL[dtype], window
    ref = packed_attention_reference(qkv, seq_start, span_end, hq, hkv, hd, **kw)
    assert rel_err(ref, want) < TOL[dtype], window
    assert not torch.allclose(got.float(), plain.float())


def test_packed_window_skips_key_tiles_below_every_query():
    """Values poisoned with NaN in the first key tile of a long chain (and in the first pages
    of a cached prefix): the query blocks whose windows start past them never read them, so
    their outputs are finite and equal the clean run's, which matches the fp64 rule."""
    cfg = pa._config(16, pa.interpreter_enabled())
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    n, window, hq, hkv, hd = 6 * bm, 5, 2, 1, 16
    seq_start = torch.zeros(n, dtype=torch.int32)
    pos = torch.arange(n, dtype=torch.int32)
    qkv = torch.randn(n, (hq + 2 * hkv) * hd)
    clean = packed_attention(qkv, seq_start, None, hq, hkv, hd, window=window, positions=pos)
    poisoned = qkv.clone()
    poisoned[:bn, (hq + hkv) * hd :] = float("nan")  # V of keys [0, BLOCK_N)
    got = packed_attention(poisoned, seq_start, None, hq, hkv, hd, window=window, positions=pos)
    far = -(-(bn + window) // bm) * bm  # every query block from here on starts past the tile
    assert torch.isfinite(got[far:]).all()
    torch.testing.assert_close(got[far:], clean[far:], rtol=0, atol=0)
    want = windowed_fp64(qkv, seq_start, None, hq, hkv, hd, window, pos)
    assert rel_err(clean, want) < TOL[torch.float32]

    # a 3-page cached prefix of 150 keys read by one 128-token segment at positions 150..
    page, plen = 64, 150
    k_pool, v_pool = torch.randn(4 * page, hkv, hd), torch.randn(4 * page, hkv, hd)
    t = pa.PREFIX_ALIGN
    qkv = torch.randn(t, (hq + 2 * hkv) * hd)
    i32 = dict(dtype=torch.int32)
    table, lengths = torch.tensor([[2, 0, 3]], **i32), torch.tensor([plen], **i32)
    entry = torch.zeros(t, **i32)
    pos = plen + torch.arange(t, **i32)
    args = (torch.zeros(t, **i32), None, hq, hkv, hd)

    def run(vp):
        prefix = pa.PrefixKV(k_pool, vp, table, lengths, entry, page)
        return packed_attention(qkv, *args, prefix=prefix, window=window, positions=pos)

    clean = run(v_pool)
    bad = v_pool.clone()
    bad[2 * page : 3 * page] = float("nan")  # pages 2 and 0: prefix keys 0..127, below
    bad[:page] = float("nan")  # every window (150 - 5 + 1 = 146 and up)
    got = run(bad)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, clean, rtol=0, atol=0)
    prefix = pa.PrefixKV(k_pool, v_pool, table, lengths, entry, page)
    want = windowed_fp64(qkv, args[0], None, hq, hkv, hd, window, pos, prefix)
    assert rel_err(clean, want) < TOL[torch.float32]


def test_packed_window_arguments_are_checked():
    seq_start, span_end = layout([(6, [3, 2])])
    t, hq, hkv, hd = seq_start.shape[0], 2, 1, 16
    qkv = torch.randn(t, (hq + 2 * hkv) * hd)
    pos = depths(seq_start, span_end)
    args = (qkv, seq_start, span_end, hq, hkv, hd)
    with pytest.raises(ValueError, match="window needs positions"):
        packed_attention(*args, window=3)
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="window must be a positive int"):
            packed_attention(*args, window=bad, positions=pos)
    with pytest.raises(ValueError, match="positions must have 11 entries"):
        packed_attention(*args, window=3, positions=pos[:-1])
    with pytest.raises(TypeError, match="positions must have dtype"):
        packed_attention(*args, window=3, positions=pos.float())
    ahead = pos.clone()
    ahead[4] += 1  # past its depth: the loop bound would skip keys it sees
    with pytest.raises(ValueError, match=r"positions\[4\] = 5 is past its depth"):
        packed_attention(*args, window=3, positions=ahead)
    with pytest.raises(ValueError, match=r"positions\[4\] = 5 is past its depth"):
        packed_attention_reference(*args, window=3, positions=ahead)


# ------------------------------------------------------------------------------ decode


def decode_fp64(q, k_pages, v_pages, table, lens, window, scale=None):
    """fp64 softmax over row b's keys ``[lens[b] - window, lens[b])`` gathered key by key
    through ``table`` (page size ``k_pages.shape[1]``)."""
    batch, n_q, hd = q.shape
    page, n_kv = k_pages.shape[1], k_pages.shape[2]
    scale = scale or 1 / math.sqrt(hd)
    out = torch.zeros(batch, n_q, hd, dtype=torch.float64)
    for b in range(batch):
        n = int(lens[b])
        idx = [(int(table[b, s // page]), s % page) for s in range(max(0, n - window), n)]
        if not idx:
            continue
        k = torch.stack([k_pages[p, i] for p, i in idx]).double()
        v = torch.stack([v_pages[p, i] for p, i in idx]).double()
        for h in range(n_q):
            g = h // (n_q // n_kv)
            out[b, h] = torch.softmax(k[:, g] @ q[b, h].double() * scale, 0) @ v[:, g]
    return out


def assert_decode_close(got, want, dtype):
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err < {torch.float32: 1e-5, torch.float16: 2.0**-8, torch.bfloat16: 2.0**-6}[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("n_splits", [1, 3])
def test_decode_window_paged_matches_fp64(dtype, heads, n_splits):
    """Random non-contiguous page tables, odd lengths up to three pages, a strided q;
    windows 1, 5 (inside a page) and 70 (across a page boundary)."""
    q, k, v, table, lens = paged_case(5, *heads, dtype)
    for window in (1, 70) if n_splits == 1 else (5, 70):
        kw = dict(block_table=table, window=window)
        got = decode_attention(q, k, v, lens, n_splits=n_splits, **kw)
        want = decode_fp64(q, k, v, table, lens, window)
        assert_decode_close(got, want, dtype)
        ref = decode_attention_reference(q, k, v, lens, **kw)
        assert_matches_reference(got, ref, v)
        assert_decode_close(ref, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_splits", [1, 3])
def test_decode_window_row_form_with_prefix_rows(dtype, n_splits):
    """The row form with a prefix read in place from another cache row: the window counts
    positions whichever row holds them (the same bits as the prefix copied in)."""
    g = torch.Generator().manual_seed(4)
    hq, hkv, hd, s_max = 4, 2, 16, 45
    k = torch.randn(6, s_max, hkv, hd, generator=g).to(dtype)
    v = torch.randn(6, s_max, hkv, hd, generator=g).to(dtype)
    q = torch.randn(4, hq, hd, generator=g).to(dtype)
    lens = torch.tensor([1, 45, 20, 33])
    rows = torch.tensor([3, 0, 1, 2], dtype=torch.int32)
    pre_rows = torch.tensor([5, 5, 4, 5], dtype=torch.int32)
    pre_lens = torch.tensor([9, 43, 0, 31], dtype=torch.int32)
    copied_k, copied_v = k[rows.long()].clone(), v[rows.long()].clone()
    for b in range(4):
        n = int(pre_lens[b])
        copied_k[b, :n], copied_v[b, :n] = k[int(pre_rows[b]), :n], v[int(pre_rows[b]), :n]
    for window in (3, 7):
        kw = dict(n_splits=n_splits, window=window)
        got = decode_attention(q, k, v, lens, rows=rows, prefix_rows=pre_rows,
                               prefix_lens=pre_lens, **kw)  # fmt: skip
        same = decode_attention(q, copied_k, copied_v, lens, **kw)
        torch.testing.assert_close(got, same, rtol=0, atol=0)
        table = torch.arange(4, dtype=torch.int32)[:, None]
        assert_decode_close(got, decode_fp64(q, copied_k, copied_v, table, lens, window), dtype)


@pytest.mark.parametrize(
    "n_q, n_kv, batch, dtype",
    [
        pytest.param(4, 4, 5, torch.bfloat16, id="mha-bf16"),
        pytest.param(
            8, 2, 21, torch.float32, id="gqa-two-query-tiles-fp32", marks=pytest.mark.slow
        ),
    ],
)
def test_decode_window_cascade_matches_fp64(n_q, n_kv, batch, dtype):
    """The cascade over held prefixes (page tables of 150 and 64 keys; rows past, inside and
    without a prefix): windows that leave the prefix behind, straddle it, or hold it whole."""
    q, k, v, lens, slots, kw = _paged_cascade_case(batch, n_q, n_kv, dtype)
    for window, n_splits in ((5, 1), (70, 3), (170, 2)):
        got = decode_attention(q, k, v, lens, n_splits=n_splits, prefix_slots=slots,
                               window=window, **kw)  # fmt: skip
        want = decode_fp64(q, k, v, kw["block_table"], lens, window)
        assert_decode_close(got, want, dtype)
        ref = decode_attention_reference(q, k, v, lens, prefix_slots=slots, window=window, **kw)
        assert_matches_reference(got, ref, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_window_on_the_cuda_cores(dtype, monkeypatch):
    """The MHA CUDA-core path (``USE_DOT=0``) takes the window too."""
    monkeypatch.setattr(da, "_TUNE", {"USE_DOT": 0})
    q, k, v, table, lens = paged_case(4, 4, 4, dtype)
    for n_splits in (1, 2):
        got = decode_attention(q, k, v, lens, block_table=table, n_splits=n_splits, window=6)
        assert_decode_close(got, decode_fp64(q, k, v, table, lens, 6), dtype)


def test_decode_window_skips_pages_below_it():
    """NaN in every page below the rows' windows (of their own pages and of a held prefix's)
    leaves the output finite and unchanged: those keys are never read."""
    q, k, v, lens, slots, kw = _paged_cascade_case(8, 8, 2, torch.float32)
    table, window = kw["block_table"], 5
    used, touched = set(), set()  # pages the rows' keys lie in; those their windows touch
    for b, n in enumerate(lens.tolist()):
        used |= {int(table[b, c]) for c in range(-(-n // PAGE))}
        touched |= {int(table[b, c]) for c in range((n - window) // PAGE, -(-n // PAGE))}
    below = sorted(used - touched)
    assert 3 in below  # slot 0's first page, shared by half the rows
    bad_k, bad_v = k.clone(), v.clone()
    bad_k[below], bad_v[below] = float("nan"), float("nan")
    want = decode_fp64(q, k, v, table, lens, window)
    for n_splits in (1, 3):
        args = dict(n_splits=n_splits, window=window)
        clean = decode_attention(q, k, v, lens, prefix_slots=slots, **args, **kw)
        plain = decode_attention(q, k, v, lens, block_table=table, **args)
        got = decode_attention(q, bad_k, bad_v, lens, prefix_slots=slots, **args, **kw)
        got_plain = decode_attention(q, bad_k, bad_v, lens, block_table=table, **args)
        assert torch.isfinite(got).all() and torch.isfinite(got_plain).all()
        torch.testing.assert_close(got, clean, rtol=0, atol=0)
        torch.testing.assert_close(got_plain, plain, rtol=0, atol=0)
        assert_decode_close(clean, want, torch.float32)


def test_decode_window_past_every_row_is_no_window_and_args_checked():
    q, k, v, table, lens = paged_case(5, 8, 2, torch.float32)
    plain = decode_attention(q, k, v, lens, block_table=table)
    wide = decode_attention(q, k, v, lens, block_table=table, window=3 * PAGE)
    torch.testing.assert_close(wide, plain, rtol=0, atol=0)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="window must be a positive int"):
            decode_attention(q, k, v, lens, block_table=table, window=bad)
        with pytest.raises(ValueError, match="window must be a positive int"):
            decode_attention_reference(q, k, v, lens, block_table=table, window=bad)


def test_decode_splits_count_the_window_not_the_cache():
    """The default split count sees the keys a row attends to (at most ``window``)."""
    assert da.decode_splits(1, 8, 256, "cpu") < da.decode_splits(1, 8, 32768, "cpu")
    q = torch.randn(1, 8, 16)
    k = torch.randn(1, 4096, 2, 16)
    lens = torch.tensor([4000])
    _, n_splits, _ = da._check_args(q, k, k, lens, None, None, None, None, for_kernel=False,
                                    window=256)  # fmt: skip
    assert n_splits == da.decode_splits(1, 2, 256, "cpu")


# ------------------------------------------------------------------------------ dense


def dense_fp64(q, k, v, window):
    """fp64 attention where the s queries are the last s of the t keys, window applied."""
    s, t = q.shape[2], k.shape[2]
    rep = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(rep, 1)
    v = v.double().repeat_interleave(rep, 1)
    scores = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    i = torch.arange(s)[:, None] + (t - s)
    j = torch.arange(t)[None, :]
    visible = (j <= i) if window is None else (j <= i) & (i - j < window)
    return scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("s, t", [(13, 13), (5, 19), (1, 17)], ids=["prefill", "suffix", "one"])
@pytest.mark.parametrize("window", [1, 4, 7, None])
def test_dense_causal_attention_window(dtype, s, t, window):
    """Queries as the last s of t keys (prefill, a continuation of a cache, one decode
    query), GQA, q/k/v as the model's transposed views of one fused buffer."""
    hq, hkv, hd, b = 4, 2, 8, 2
    buf = torch.randn(b, t, hq + 2 * hkv, hd).to(dtype)
    q = buf[:, t - s :, :hq].transpose(1, 2)
    k = buf[:, :, hq : hq + hkv].transpose(1, 2)
    v = buf[:, :, hq + hkv :].transpose(1, 2)
    assert not q.is_contiguous()
    got = causal_attention(q, k, v, window)
    want = dense_fp64(q, k, v, window)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    if window is not None and t > window:
        assert not torch.allclose(got, causal_attention(q, k, v))


def test_dense_window_argument_is_checked():
    q = torch.randn(1, 2, 5, 8)
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="window must be a positive int"):
            causal_attention(q, q, q, bad)


# ------------------------------------------------------------------------------ GPU

MISTRAL = dict(hq=32, hkv=8, hd=128, window=4096)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_packed_window_at_mistral_heads(dtype):
    """Two 6,000-token chains and a HellaSwag-like tree of long contexts at Mistral-7B's heads,
    window 4096: against the reference in fp32."""
    hq, hkv, hd, w = MISTRAL.values()
    rows = [(6000, []), (5000, [50, 70, 30]), (6000, [])]
    seq_start, span_end = layout(rows, pad=-sum(c + sum(b) for c, b in rows) % 128)
    pos = depths(seq_start, span_end).cuda()
    seq_start, span_end = seq_start.cuda(), span_end.cuda()
    qkv = torch.randn(seq_start.shape[0], (hq + 2 * hkv) * hd, device="cuda", dtype=dtype)
    kw = dict(window=w, positions=pos)
    got = packed_attention(qkv, seq_start, span_end, hq, hkv, hd, **kw)
    want = packed_attention_reference(qkv.float(), seq_start, span_end, hq, hkv, hd, **kw)
    assert torch.isfinite(got).all() and rel_err(got, want.double()) < 1e-2
    full = packed_attention_reference(qkv.float(), seq_start, span_end, hq, hkv, hd)
    assert rel_err(full, want.double()) > 1e-2  # the window changes the answer


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_decode_window_at_mistral_heads(dtype):
    """Batch 8, rows of 100 to 9,000 keys in 64-key pages, window 4096, one shared prefix of
    5,000 keys read by the cascade: against the reference in fp32. (That keys below the window
    are never read is the CPU tests' NaN check; what it saves is a benchmark's job.)"""
    hq, hkv, hd, w = MISTRAL.values()
    g = torch.Generator(device="cuda").manual_seed(0)
    width, n_pages, batch = 160, 1400, 8
    k = torch.randn(n_pages, PAGE, hkv, hd, device="cuda", generator=g).to(dtype)
    v = torch.randn(n_pages, PAGE, hkv, hd, device="cuda", generator=g).to(dtype)
    table = torch.randperm(n_pages - 1, device="cuda", generator=g)[: batch * width] + 1
    table = table.view(batch, width).to(torch.int32)
    table[:4, :79] = table[0, :79]  # rows 0-3 share a 5,000-key prefix (78 full pages + 8)
    lens = torch.tensor([5001, 6000, 9000, 8100, 100, 4096, 4097, 9999], device="cuda")
    pre_rows = torch.zeros(batch, dtype=torch.int32, device="cuda")
    pre_lens = torch.zeros(batch, dtype=torch.int32, device="cuda")
    pre_rows[:4], pre_lens[:4] = table[0, 0], 4992  # the 78 shared full pages
    slots = (table[:1].clone(), torch.tensor([4992], dtype=torch.int32, device="cuda"))
    q = torch.randn(batch, hq, hd, device="cuda", generator=g).to(dtype)
    kw = dict(block_table=table, window=w)
    ref = decode_attention_reference(q.float(), k.float(), v.float(), lens, **kw)
    for extra in ({}, dict(prefix_rows=pre_rows, prefix_lens=pre_lens, prefix_slots=slots)):
        got = decode_attention(q, k, v, lens, **kw, **extra)
        assert torch.isfinite(got).all()
        err = (got.float() - ref).abs().max() / ref.abs().max()
        assert err < 2.0**-6, (extra.keys(), err)
    full = decode_attention_reference(q.float(), k.float(), v.float(), lens, block_table=table)
    assert (full - ref).abs().max() > 1e-2


# ------------------------------------------------------------------------------------------------
# A tiny Mistral-shaped model (sliding window 5, sequences of 30-90 tokens) against transformers'
# ``MistralForCausalLM`` with eager attention, in fp32, on the same random weights.
#
# Nakta reads the weights as an HF LLaMA folder (Mistral's tensors are LLaMA's) and runs with
# ``ModelArgs.sliding_window`` set. Checked: the dense forward with and without a KV cache; the
# packed scoring path (context trees, through the Triton kernels in interpreter mode) and the
# prefix-cache scoring path (a shared 70-token prefix, longer than the window, cached in pages)
# against HF's log-likelihoods; prefill + decode through the generation engine (chunked prefill, a
# held shared prefix read by the decode cascade) giving HF's greedy tokens (HF's own sliding-
# window KV cache) for generations that run well past the window. Each check also confirms that
# full attention gives a different answer, so the window is what is being compared.
# ------------------------------------------------------------------------------------------------


transformers = pytest.importorskip("transformers")

WINDOW = 5
SHAPE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
    rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False,
)  # fmt: skip
ATOL = 1e-4  # fp32 logits: the two implementations round differently (measured ~5e-6)


def write_hf_llama_folder(hf_model, out, shape: dict = SHAPE) -> None:
    """The Mistral model's tensors as an HF LLaMA folder (the same names and layout; Nakta's
    own reader for ``model_type: mistral`` comes with its config support)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {k: v for k, v in shape.items() if k != "head_dim"}
    config.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu")
    (out / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(hf, nakta with kernels='triton', the same without the window)`` (the last one, only
    there to show the window matters, through the PyTorch references)."""
    no_special = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)  # no EOS stops
    cfg = transformers.MistralConfig(
        sliding_window=WINDOW, initializer_range=0.2, **no_special, **SHAPE
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.MistralForCausalLM(cfg).float().eval()
    assert hf.config.sliding_window == WINDOW
    folder = tmp_path_factory.mktemp("mistral") / "hf"
    write_hf_llama_folder(hf, folder)
    full = nakta_model.load(folder, "cpu", torch.float32, kernels="reference")
    windowed = Transformer(full.args.replace(sliding_window=WINDOW), kernels="triton")
    windowed.load_state_dict(full.state_dict())
    return hf, windowed, full


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def hf_loglikelihood(hf, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    logits = hf_logits(hf, context + continuation)[len(context) - 1 : -1]
    logp = logits.log_softmax(-1)
    target = torch.tensor(continuation)
    ll = logp.gather(1, target[:, None]).sum().item()
    return ll, bool((logp.argmax(-1) == target).all())


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """HF's greedy ``generate``: prefill, then a token at a time through its sliding-window
    KV cache."""
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    assert out.shape == (1, len(prompt) + n)
    return out[0, len(prompt) :].tolist()


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, SHAPE["vocab_size"]) for _ in range(n)]


@pytest.mark.usefixtures("one_torch_thread")
def test_dense_forward_with_and_without_a_cache(pair):
    hf, model, full = pair
    model.kernels = "reference"  # the dense path is PyTorch either way
    try:
        toks = torch.randint(0, SHAPE["vocab_size"], (2, 37))
        with torch.no_grad():
            want = hf(toks).logits
        torch.testing.assert_close(model(toks), want, rtol=0, atol=ATOL)
        assert (full(toks) - want).abs().max() > 100 * ATOL
        model.setup_cache(2, 64)
        first = model(toks[:, :20], 0)
        rest = model(toks[:, 20:], 20)  # 17 queries over 37 cached keys
        torch.testing.assert_close(torch.cat([first, rest], 1), want, rtol=0, atol=ATOL)
        step = model(toks[:, 36:], 36)  # one query: the decode shape
        torch.testing.assert_close(step[:, 0], want[:, 36], rtol=0, atol=ATOL)
    finally:
        model.clear_cache()
        model.kernels = "triton"


@pytest.mark.usefixtures("one_torch_thread")
def test_packed_scoring_matches_hf_loglikelihoods(pair):
    """Contexts of 12-40 tokens with 1-4 continuations each (token trees in one stream)."""
    hf, model, full = pair
    rng = random.Random(1)
    requests = []
    for _ in range(4):
        ctx = tokens(rng, rng.randint(12, 40))
        for _ in range(rng.randint(1, 4)):
            requests.append((ctx, tokens(rng, rng.randint(1, 6))))
    got = scoring.score(model, requests, prefix_cache=False)
    for (ll, greedy), (c, x) in zip(got, requests):
        want_ll, want_greedy = hf_loglikelihood(hf, c, x)
        assert abs(ll - want_ll) < 1e-3 * max(1.0, abs(want_ll)), (ll, want_ll)
        assert greedy == want_greedy
    plain = scoring.score(full, requests, prefix_cache=False)
    assert max(abs(a[0] - b[0]) for a, b in zip(plain, got)) > 0.1


@pytest.mark.usefixtures("one_torch_thread")
def test_prefix_cache_scoring_past_the_window(pair):
    """Six contexts sharing a 70-token prefix (longer than the window): the prefix is computed
    once into KV pages and the contexts' tokens read it by position; HF's log-likelihoods."""
    from nakta_model.prefix_cache import PrefixCache

    hf, model, _ = pair
    rng = random.Random(2)
    shared = tokens(rng, 70)
    requests = [(shared + tokens(rng, rng.randint(2, 9)), tokens(rng, rng.randint(1, 4)))
                for _ in range(6)]  # fmt: skip
    cache = PrefixCache(model, budget_tokens=256)
    stats = scoring.ScoreStats()
    got = scoring.score(model, requests, prefix_cache=cache, stats=stats)
    assert stats.prefixes == 1 and stats.prefix_tokens >= 64  # the cached-prefix path ran
    for (ll, greedy), (c, x) in zip(got, requests):
        want_ll, want_greedy = hf_loglikelihood(hf, c, x)
        assert abs(ll - want_ll) < 1e-3 * max(1.0, abs(want_ll)), (ll, want_ll)
        assert greedy == want_greedy
    cache.clear()


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.slow  # the whole engine through the Triton interpreter: about a minute of CPU
def test_generation_greedy_tokens_equal_hf_past_the_window(pair):
    """Prompts of 6 and 90 tokens and two sharing a 70-token prefix (held once, read by the
    decode cascade), prefilled in 32-token pieces, 14 greedy tokens each: HF's tokens."""
    from nakta_model.generation.engine import Generator
    from nakta_model.generation.requests import greedy_requests

    hf, model, full = pair
    rng = random.Random(3)
    shared = tokens(rng, 70)
    prompts = [tokens(rng, 6), tokens(rng, 90), shared + tokens(rng, 3), shared + tokens(rng, 5)]
    n = 14
    want = [hf_greedy(hf, p, n) for p in prompts]
    gen = Generator(model, max_batch=4, chunk=4, graph_mode="eager", prefill_chunk=32)
    got = [r.tokens for r in gen.generate(greedy_requests(prompts, n, None))]
    assert gen.stats.prefilled_tokens < gen.stats.prompt_tokens  # the shared prefix: once
    assert got == want
    plain = Generator(full, max_batch=4, chunk=4, graph_mode="eager", prefill_chunk=32)
    assert [r.tokens for r in plain.generate(greedy_requests(prompts, n, None))] != want


@pytest.mark.usefixtures("one_torch_thread")
def test_model_args_sliding_window_field():
    """``sliding_window``: None (full attention) or a positive int, kept in params.json."""
    from nakta_model.config import ModelArgs

    args = ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=32)
    assert args.sliding_window is None
    windowed = args.replace(sliding_window=4096)
    assert ModelArgs.from_meta_params(windowed.to_params()).sliding_window == 4096
    for bad in (0, -1, 2.5, True, "4096"):
        with pytest.raises(ValueError, match="sliding_window must be a positive int"):
            args.replace(sliding_window=bad)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.gpu
def test_gpu_mistral_heads_past_a_4096_window(tmp_path):
    """Two layers at Mistral-7B's attention shape (dim 4096, 32 q / 8 kv heads of 128, window
    4096) in fp32 on the GPU: a 5,000-token sequence scored through the packed kernel gives
    HF's log-likelihoods, and a 4,200-token prompt prefilled in 1,000-token pieces (each
    reading the earlier ones through its pages) and decoded through the engine (CUDA graphs,
    split-K decode attention over 64-key pages) gives HF's 24 greedy tokens."""
    from nakta_model.generation.engine import Generator
    from nakta_model.generation.requests import greedy_requests

    shape = dict(SHAPE, hidden_size=4096, intermediate_size=1024, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, vocab_size=1000,
                 max_position_embeddings=8192)  # fmt: skip
    cfg = transformers.MistralConfig(
        sliding_window=4096, initializer_range=0.05, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, **shape,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.MistralForCausalLM(cfg).float().eval()
    write_hf_llama_folder(hf, tmp_path / "hf", shape)
    hf = hf.cuda()
    base = nakta_model.load(tmp_path / "hf", "cuda", torch.float32)
    model = Transformer(base.args.replace(sliding_window=4096)).cuda()
    model.load_state_dict(base.state_dict())
    del base
    rng = random.Random(0)
    ctx, cont = tokens(rng, 4990), tokens(rng, 10)
    with torch.no_grad():
        logp = hf(torch.tensor([ctx + cont], device="cuda")).logits[0, 4989:-1].log_softmax(-1)
    want = logp.gather(1, torch.tensor(cont, device="cuda")[:, None]).sum().item()
    ((ll, _),) = scoring.score(model, [(ctx, cont)], prefix_cache=False)
    assert abs(ll - want) < 1e-3 * max(1.0, abs(want)), (ll, want)

    prompt = tokens(rng, 4200)
    out = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=24, do_sample=False)
    gen = Generator(model, max_batch=1, max_seq_len=4300, chunk=8, prefill_chunk=1000)
    got = gen.generate(greedy_requests([prompt], 24, None))[0].tokens
    assert got == out[0, len(prompt) :].tolist()
