"""The packed tree/varlen attention kernel against plain fp64 attention over the same mask.

CPU: the Triton kernel in interpreter mode on small odd shapes; GPU: 7B-like heads in bf16/fp16.

Its cached prefixes read from e4m3 pools (``kv_cache="fp8"``) are checked here too.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from tiers import slow_beyond

from nakta_model.kernels.fp8_quant import FP8_DTYPE, quantize_rows_reference
from nakta_model.kernels.packed_attention import (
    packed_attention,
    packed_attention_mask,
    packed_attention_reference,
)


def row_spans(at: int, ctx: int, branches: list[int]) -> list[int]:
    """``span_end`` of one row at stream index ``at``: a context, then branches of the given
    lengths, each a chain below the context (the two-level trees of a HellaSwag row)."""
    end = at + ctx + sum(branches)
    spans = [end] * ctx
    b0 = at + ctx
    for b in branches:
        spans += [b0 + b] * b
        b0 += b
    return spans


def layout(rows: list[tuple[int, list[int]]], pad: int = 0, device="cpu"):
    """seq_start / span_end of rows (context length, branch lengths), then ``pad`` pad tokens."""
    start, span = [], []
    for ctx, branches in rows:
        s = len(start)
        start += [s] * (ctx + sum(branches))
        span += row_spans(s, ctx, branches)
    n = len(start)
    start += range(n, n + pad)
    span += range(n + 1, n + pad + 1)
    i32 = dict(dtype=torch.int32, device=device)
    return torch.tensor(start, **i32), torch.tensor(span, **i32)


def random_trees(rng: random.Random, sizes: list[int], pad: int = 0):
    """seq_start / span_end of random token trees in depth-first order (each node's parent a
    random node on the path to the one before), one per size, then pad tokens."""
    start, span = [], []
    for n in sizes:
        s = len(start)
        end: list[int] = [0] * n
        path: list[int] = []
        for t in range(n):
            keep = rng.randint(1, len(path)) if path else 0  # the new node's depth
            while len(path) > keep:
                end[path.pop()] = s + t
            path.append(t)
        while path:
            end[path.pop()] = s + n
        start += [s] * n
        span += end
    n = len(start)
    start += range(n, n + pad)
    span += range(n + 1, n + pad + 1)
    i32 = dict(dtype=torch.int32)
    return torch.tensor(start, **i32), torch.tensor(span, **i32)


def naive(qkv, seq_start, span_end, hq, hkv, hd):
    """fp64 softmax attention with the packed mask, GQA by repeating KV heads."""
    t = qkv.shape[0]
    heads = qkv.double().view(t, hq + 2 * hkv, hd)
    q = heads[:, :hq].transpose(0, 1)
    k = heads[:, hq : hq + hkv].repeat_interleave(hq // hkv, 1).transpose(0, 1)
    v = heads[:, hq + hkv :].repeat_interleave(hq // hkv, 1).transpose(0, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(hd)
    s = s.masked_fill(~packed_attention_mask(seq_start, span_end)[None], float("-inf"))
    return (s.softmax(-1) @ v).transpose(0, 1).reshape(t, hq * hd)


def random_rows(rng: random.Random, n: int) -> list[tuple[int, list[int]]]:
    return [
        (rng.randint(1, 23), [rng.randint(1, 9) for _ in range(rng.randint(0, 4))])
        for _ in range(n)
    ]


TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "hq, hkv, hd",
    [(4, 2, 16), (2, 2, 8), (3, 1, 24), (2, 1, 40)],
    ids=["gqa", "mha8", "mqa", "hd40"],
)
def test_matches_fp64_attention_on_random_trees(dtype, hq, hkv, hd):
    rng = random.Random(hq * 100 + hd)
    seq_start, span_end = layout(random_rows(rng, 4), pad=3)
    t = seq_start.shape[0]
    qkv = torch.randn(t, (hq + 2 * hkv) * hd).to(dtype)
    out = torch.full((t, hq * hd), float("nan"), dtype=dtype)  # poisoned: every element written
    got = packed_attention(qkv, seq_start, span_end, hq, hkv, hd, out=out)
    assert got is out and torch.isfinite(got).all()
    want = naive(qkv, seq_start, span_end, hq, hkv, hd)
    err = (got.double() - want).norm() / want.norm()
    assert err < TOL[dtype], err
    ref = packed_attention_reference(qkv, seq_start, span_end, hq, hkv, hd)
    assert (ref.double() - want).norm() / want.norm() < TOL[dtype]


def test_strided_qkv_rows_and_custom_scale():
    seq_start, span_end = layout([(5, [3, 4]), (7, [])])
    t, hq, hkv, hd = seq_start.shape[0], 2, 1, 16
    big = torch.randn(t, (hq + 2 * hkv) * hd + 9)  # row stride > width: a column slice
    qkv = big[:, 3 : 3 + (hq + 2 * hkv) * hd]
    assert not qkv.is_contiguous()
    got = packed_attention(qkv, seq_start, span_end, hq, hkv, hd, scale=0.3)
    want = packed_attention(qkv.contiguous(), seq_start, span_end, hq, hkv, hd, scale=0.3)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    ref = packed_attention_reference(qkv, seq_start, span_end, hq, hkv, hd, scale=0.3)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)


def test_rows_and_branches_do_not_see_each_other():
    """Changing one row's (or span_end's) keys leaves every other row's output untouched."""
    seq_start, span_end = layout([(4, [3, 5]), (6, [2])])
    t, hq, hkv, hd = seq_start.shape[0], 2, 2, 16
    qkv = torch.randn(t, (hq + 2 * hkv) * hd)
    base = packed_attention(qkv, seq_start, span_end, hq, hkv, hd)
    changed = qkv.clone()
    changed[4:7, hq * hd :] += 5.0  # K/V of row 0's first span_end (tokens 4..6)
    out = packed_attention(changed, seq_start, span_end, hq, hkv, hd)
    same = [i for i in range(t) if not 4 <= i < 7]
    torch.testing.assert_close(out[same], base[same], rtol=0, atol=0)
    assert not torch.equal(out[4:7], base[4:7])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deep_random_trees_match_fp64_attention(dtype):
    """Tries deeper than context + branches (continuations sharing their first tokens): a token
    sees exactly itself and its ancestors."""
    rng = random.Random(11)
    seq_start, span_end = random_trees(rng, [1, 9, 23, 40, 6], pad=5)
    hq, hkv, hd = 4, 2, 16
    t = seq_start.shape[0]
    qkv = torch.randn(t, (hq + 2 * hkv) * hd).to(dtype)
    got = packed_attention(qkv, seq_start, span_end, hq, hkv, hd)
    want = naive(qkv, seq_start, span_end, hq, hkv, hd)
    assert (got.double() - want).norm() / want.norm() < TOL[dtype]
    ref = packed_attention_reference(qkv, seq_start, span_end, hq, hkv, hd)
    assert (ref.double() - want).norm() / want.norm() < TOL[dtype]
    # the mask is the ancestor relation of the trees
    mask = packed_attention_mask(seq_start, span_end)
    for i in range(t):
        for j in range(t):
            inside = seq_start[i] == seq_start[j] and j <= i < span_end[j]
            assert bool(mask[i, j]) == bool(inside)


@pytest.mark.parametrize("skip", [0, 1, 2], ids=["no-skip", "branch", "masked-loads"])
def test_every_block_skip_mode_computes_the_same_attention(skip):
    """Merged trees (several contexts in one row: whole subtrees between a query and its
    ancestors, whose key blocks the kernel may skip) give the fp64 result with the skip off,
    by a branch and by the loads' mask."""
    from kernel_benchmark.common import tuned
    from nakta_model.kernels import packed_attention as packed

    rng = random.Random(23 + skip)
    seq_start, span_end = random_trees(rng, [70, 3, 55], pad=4)
    hq, hkv, hd = 2, 1, 16
    qkv = torch.randn(seq_start.shape[0], (hq + 2 * hkv) * hd)
    with tuned(packed, SKIP=skip):
        got = packed_attention(qkv, seq_start, span_end, hq, hkv, hd)
    want = naive(qkv, seq_start, span_end, hq, hkv, hd)
    assert (got.double() - want).norm() / want.norm() < TOL[torch.float32]


def test_one_branch_per_row_is_causal_varlen_attention():
    lengths = [5, 1, 17, 9]
    seq_start, span_end = layout([(n, []) for n in lengths])
    hq, hd = 2, 16
    qkv = torch.randn(seq_start.shape[0], 3 * hq * hd)
    got = packed_attention(qkv, seq_start, span_end, hq, hq, hd)
    causal = packed_attention(qkv, seq_start, None, hq, hq, hd)  # None: a chain per sequence
    torch.testing.assert_close(causal, got, rtol=0, atol=0)
    at = 0
    for n in lengths:
        h = qkv[at : at + n].view(n, 3, hq, hd).permute(1, 2, 0, 3)
        o = torch.nn.functional.scaled_dot_product_attention(h[0], h[1], h[2], is_causal=True)
        torch.testing.assert_close(
            got[at : at + n], o.transpose(0, 1).reshape(n, hq * hd), rtol=2e-5, atol=2e-5
        )
        at += n


def test_bad_inputs_raise_naming_the_argument():
    seq_start, span_end = layout([(3, [2])])
    t = seq_start.shape[0]
    qkv = torch.randn(t, 4 * 16)
    with pytest.raises(ValueError, match="qkv must have"):
        packed_attention(qkv, seq_start, span_end, 2, 2, 16)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        packed_attention(torch.randn(t, 7 * 16), seq_start, span_end, 3, 2, 16)
    with pytest.raises(TypeError, match="seq_start must have dtype"):
        packed_attention(qkv, seq_start.float(), span_end, 2, 1, 16)
    with pytest.raises(ValueError, match="span_end must have 5 entries"):
        packed_attention(qkv, seq_start, span_end[:-1], 2, 1, 16)
    with pytest.raises(ValueError, match="n_q_heads must be a positive int"):
        packed_attention(qkv, seq_start, span_end, 0, 1, 16)
    with pytest.raises(TypeError, match="qkv must have dtype"):
        packed_attention(qkv.double(), seq_start, span_end, 2, 1, 16)
    with pytest.raises(ValueError, match="seq_start must point at the first token"):
        packed_attention(qkv, torch.tensor([0, 0, 1, 1, 1], dtype=torch.int32), span_end, 2, 1, 16)
    for bad in ([1, 2, 5, 3, 5], [5, 2, 3, 4, 6], [0, 2, 3, 4, 5]):  # own token / sequence
        with pytest.raises(ValueError, match="span_end.t. must lie in"):
            packed_attention(qkv, seq_start, torch.tensor(bad, dtype=torch.int32), 2, 1, 16)
    with pytest.raises(ValueError, match="out must be"):
        packed_attention(qkv, seq_start, span_end, 2, 1, 16, out=torch.empty(t, 16))
    empty = packed_attention(torch.randn(0, 64), seq_start[:0], span_end[:0], 2, 1, 16)
    assert empty.shape == (0, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq, hkv", [(32, 32), (32, 8), (40, 40)])
def test_gpu_hellaswag_shaped_stream(dtype, hq, hkv):
    """A full 16K-token stream of HellaSwag-like trees (context + 4 endings) at 7B/13B heads."""
    rng = random.Random(0)
    rows, n = [], 0
    while n < 16000:
        ctx, ends = rng.randint(20, 120), [rng.randint(5, 40) for _ in range(4)]
        rows.append((ctx, ends))
        n += ctx + sum(ends)
    seq_start, span_end = layout(rows, pad=-n % 128, device="cuda")
    t, hd = seq_start.shape[0], 128
    qkv = torch.randn(t, (hq + 2 * hkv) * hd, device="cuda", dtype=dtype)
    got = packed_attention(qkv, seq_start, span_end, hq, hkv, hd)
    want = packed_attention_reference(qkv.float(), seq_start, span_end, hq, hkv, hd)
    err = (got.float() - want).norm() / want.norm()
    assert torch.isfinite(got).all() and err < 1e-2, err


def prefix_case(hq=2, hkv=1, hd=16, dtype=torch.float32, page=32, seed=0):
    """Three PREFIX_ALIGN-aligned segments: rows after prefix 0 (40 tokens, 2 pages), rows with
    no prefix, rows after prefix 1 (70 tokens, 3 pages, stored in scattered pages)."""
    from nakta_model.kernels.packed_attention import PREFIX_ALIGN, PrefixKV

    rng = random.Random(seed)
    starts, spans, entries = [], [], []

    def segment(entry, rows):
        s0 = len(starts)
        for ctx, brs in rows:
            st = len(starts)
            n = ctx + sum(brs)
            starts.extend([st] * n)
            spans.extend(row_spans(st, ctx, brs))
            entries.extend([entry] * n)
        pad = -(len(starts) - s0) % PREFIX_ALIGN
        starts.extend(range(len(starts), len(starts) + pad))
        spans.extend(range(len(spans) + 1, len(spans) + pad + 1))
        entries.extend([entry] * pad)

    segment(0, [(rng.randint(2, 9), [rng.randint(1, 4) for _ in range(3)]) for _ in range(6)])
    segment(-1, [(rng.randint(2, 9), [rng.randint(1, 4)]) for _ in range(5)])
    segment(1, [(rng.randint(2, 9), [rng.randint(1, 4) for _ in range(2)]) for _ in range(4)])
    t = len(starts)
    i32 = dict(dtype=torch.int32)
    n_pages = 8
    k_pool = torch.randn(n_pages * page, hkv, hd).to(dtype)
    v_pool = torch.randn(n_pages * page, hkv, hd).to(dtype)
    table = torch.tensor([[5, 2, 0], [7, 1, 4]], **i32)
    prefix = PrefixKV(
        k_pool, v_pool, table, torch.tensor([40, 70], **i32), torch.tensor(entries, **i32), page
    )
    qkv = torch.randn(t, (hq + 2 * hkv) * hd).to(dtype)
    return qkv, torch.tensor(starts, **i32), torch.tensor(spans, **i32), prefix


def naive_with_prefix(qkv, seq_start, span_end, prefix, hq, hkv, hd):
    from nakta_model.kernels.packed_attention import _gather_prefix

    t = qkv.shape[0]
    heads = qkv.double().view(t, hq + 2 * hkv, hd)
    mask = packed_attention_mask(seq_start, span_end)
    out = torch.empty(t, hq, hd, dtype=torch.float64)
    for i in range(t):
        e = int(prefix.token_entry[i])
        keys = heads[mask[i], hq : hq + hkv]
        vals = heads[mask[i], hq + hkv :]
        if e >= 0:
            pk, pv = _gather_prefix(prefix, e)
            keys, vals = torch.cat([pk.double(), keys]), torch.cat([pv.double(), vals])
        for h in range(hq):
            g = h // (hq // hkv)
            p = torch.softmax(keys[:, g] @ heads[i, h] / math.sqrt(hd), 0)
            out[i, h] = p @ vals[:, g]
    return out.reshape(t, hq * hd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_prefixes_are_attended_before_each_sequence(dtype):
    hq, hkv, hd = 2, 1, 16
    qkv, seq_start, span_end, prefix = prefix_case(hq, hkv, hd, dtype)
    got = packed_attention(qkv, seq_start, span_end, hq, hkv, hd, prefix=prefix)
    want = naive_with_prefix(qkv, seq_start, span_end, prefix, hq, hkv, hd)
    assert (got.double() - want).norm() / want.norm() < TOL[dtype]
    ref = packed_attention_reference(qkv, seq_start, span_end, hq, hkv, hd, prefix=prefix)
    assert (ref.double() - want).norm() / want.norm() < TOL[dtype]
    # the segment without a prefix is exactly the plain kernel's
    plain = packed_attention(qkv, seq_start, span_end, hq, hkv, hd)
    none = prefix.token_entry == -1
    torch.testing.assert_close(got[none], plain[none], rtol=0, atol=0)
    assert not torch.allclose(got[~none], plain[~none])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq, hkv", [(32, 32), (32, 8)])
def test_gpu_cached_prefixes_at_llama_heads(dtype, hq, hkv):
    """The prefix path as the scorer runs it on the GPU: 128-dim heads, 64-token pages (the
    prefix cache's), the tuned launch config; against the reference in fp32 (itself checked
    against the fp64 loop on the CPU above)."""
    from nakta_model.kernels.packed_attention import PrefixKV

    hd = 128
    qkv, seq_start, span_end, p = prefix_case(hq, hkv, hd, dtype, page=64, seed=3)
    qkv, seq_start, span_end = qkv.cuda(), seq_start.cuda(), span_end.cuda()
    pools = [p.k_pool.cuda(), p.v_pool.cuda()]
    index = [p.page_table.cuda(), p.lengths.cuda(), p.token_entry.cuda()]
    got = packed_attention(
        qkv, seq_start, span_end, hq, hkv, hd, prefix=PrefixKV(*pools, *index, 64)
    )
    ref_prefix = PrefixKV(*[t.float() for t in pools], *index, 64)
    want = packed_attention_reference(
        qkv.float(), seq_start, span_end, hq, hkv, hd, prefix=ref_prefix
    )
    err = (got.float() - want).norm() / want.norm()
    assert torch.isfinite(got).all() and err < {torch.float32: 1e-5}.get(dtype, 1e-2), err


def test_prefix_layout_and_argument_errors():
    from nakta_model.kernels.packed_attention import PrefixKV

    hq, hkv, hd = 2, 1, 16
    qkv, seq_start, span_end, p = prefix_case(hq, hkv, hd)
    mixed = p.token_entry.clone()
    mixed[5] = 1  # a block holding tokens of two prefixes
    with pytest.raises(ValueError, match="changes inside a block"):
        packed_attention(qkv, seq_start, span_end, hq, hkv, hd,
                         prefix=PrefixKV(p.k_pool, p.v_pool, p.page_table, p.lengths, mixed, 32))  # fmt: skip
    with pytest.raises(ValueError, match="page_size must be a positive multiple"):
        packed_attention(qkv, seq_start, span_end, hq, hkv, hd,
                         prefix=PrefixKV(p.k_pool, p.v_pool, p.page_table, p.lengths, p.token_entry, 20))  # fmt: skip
    with pytest.raises(ValueError, match="fit in the page table"):
        packed_attention(qkv, seq_start, span_end, hq, hkv, hd,
                         prefix=PrefixKV(p.k_pool, p.v_pool, p.page_table, p.lengths * 3, p.token_entry, 32))  # fmt: skip
    with pytest.raises(TypeError, match="prefix.k_pool must have qkv's dtype"):
        packed_attention(qkv, seq_start, span_end, hq, hkv, hd,
                         prefix=PrefixKV(p.k_pool.double(), p.v_pool, p.page_table, p.lengths, p.token_entry, 32))  # fmt: skip
    with pytest.raises(TypeError, match="prefix must be a PrefixKV"):
        packed_attention(qkv, seq_start, span_end, hq, hkv, hd, prefix=(p.k_pool,))


# ------------------------------------------------------------------------------------------------
# ``packed_attention``'s cached prefixes read from e4m3 pools (``kv_cache="fp8"``: prefill
# continuing from cached pages): codes with one fp32 scale per (slot, KV head), dequantized in
# registers. Against the fp64 loop over the dequantized prefix (``naive_with_prefix``) and the
# module's reference; fp32 / bf16 / fp16, GQA, with a window; bad scales refused.
# ------------------------------------------------------------------------------------------------


def fp8_prefix(prefix):
    """The same prefix with its pools quantized per (slot, KV head)."""
    qk, qv = quantize_rows_reference(prefix.k_pool), quantize_rows_reference(prefix.v_pool)
    shape, rows = prefix.k_pool.shape, prefix.k_pool.shape[:2]
    return dataclasses.replace(
        prefix, k_pool=qk.q.view(shape), v_pool=qv.q.view(shape), k_scale=qk.scale.view(rows),
        v_scale=qv.scale.view(rows),
    )  # fmt: skip


# the wider heads in bf16 / fp16 take the interpreter ~3x their fp32 time: slow tier
@pytest.mark.parametrize(
    ("hq", "hkv", "hd", "dtype"),
    slow_beyond(
        {"2-1-16": (2, 1, 16), "6-2-24": (6, 2, 24)},
        {"dtype0": torch.float32, "dtype1": torch.bfloat16, "dtype2": torch.float16},
        fast=[
            ("2-1-16", "dtype0"),
            ("2-1-16", "dtype1"),
            ("2-1-16", "dtype2"),
            ("6-2-24", "dtype0"),
        ],
    ),
)
def test_fp8_prefix_pages(hq, hkv, hd, dtype):
    qkv, seq_start, span_end, prefix = prefix_case(hq, hkv, hd, dtype, seed=2)
    p8 = fp8_prefix(prefix)
    got = packed_attention(qkv, seq_start, span_end, hq, hkv, hd, prefix=p8)
    want = naive_with_prefix(qkv, seq_start, span_end, p8, hq, hkv, hd)  # dequantized prefix
    assert (got.double() - want).norm() / want.norm() < TOL[dtype]
    ref = packed_attention_reference(qkv, seq_start, span_end, hq, hkv, hd, prefix=p8)
    assert (ref.double() - want).norm() / want.norm() < TOL[dtype]
    # quantization error against the unquantized prefix: small, but there
    full = naive_with_prefix(qkv, seq_start, span_end, prefix, hq, hkv, hd)
    rel = ((got.double() - full).norm() / full.norm()).item()
    assert rel < 0.05, rel
    none = prefix.token_entry == -1  # rows without a prefix: the plain kernel's bits
    plain = packed_attention(qkv, seq_start, span_end, hq, hkv, hd)
    torch.testing.assert_close(got[none], plain[none], rtol=0, atol=0)


def test_fp8_prefix_with_window():
    hq, hkv, hd = 4, 2, 16
    qkv, seq_start, span_end, prefix = prefix_case(hq, hkv, hd, torch.bfloat16, seed=4)
    p8 = fp8_prefix(prefix)
    # positions: the prefix's length plus the depth in the sequence (span_end None: causal)
    entry = p8.token_entry.long()
    plen = torch.where(entry >= 0, p8.lengths.long()[entry.clamp(min=0)], 0)
    pos = (plen + torch.arange(qkv.shape[0]) - seq_start.long()).to(torch.int32)
    kw = dict(prefix=p8, window=30, positions=pos)
    got = packed_attention(qkv, seq_start, None, hq, hkv, hd, **kw)
    ref = packed_attention_reference(qkv, seq_start, None, hq, hkv, hd, **kw)
    assert (got.float() - ref.float()).norm() / ref.float().norm() < TOL[torch.bfloat16]


def test_fp8_prefix_scales_are_checked():
    qkv, seq_start, span_end, prefix = prefix_case()
    p8 = fp8_prefix(prefix)
    assert p8.k_pool.dtype == FP8_DTYPE
    args = (qkv, seq_start, span_end, 2, 1, 16)
    for fn in (packed_attention, packed_attention_reference):
        with pytest.raises(ValueError, match="e4m3 pools need prefix.k_scale"):
            fn(*args, prefix=dataclasses.replace(p8, k_scale=None))
        with pytest.raises(ValueError, match=r"prefix.v_scale must be fp32 \[slots=256, 1\]"):
            fn(*args, prefix=dataclasses.replace(p8, v_scale=p8.v_scale[:3]))
        with pytest.raises(ValueError, match="go with e4m3 pools"):
            fn(*args, prefix=dataclasses.replace(prefix, k_scale=p8.k_scale))
        with pytest.raises(TypeError, match="must have one dtype"):
            fn(*args, prefix=dataclasses.replace(p8, v_pool=prefix.v_pool))
