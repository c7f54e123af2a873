"""``decode_attention``'s paged form (``block_table``): keys read through per-row page tables
of one page pool, against a plain fp32 softmax over the keys gathered page by page (written
here, independent of the module's reference) and against the module's reference.

Pages are random and non-contiguous (rows share some, as a shared prefix's pages), lengths odd
(a row ending inside a page, one page exactly, a full table); GQA and MHA; fp32 / fp16 / bf16;
one split and several; with and without the cascade over prefix slots given as page tables.
Tolerances as in ``test_decode_attention.py``.
"""

from __future__ import annotations

import pytest
import torch
from test_decode_attention import assert_matches_reference
from tiers import slow_beyond

from nakta_model.kernels.decode_attention import (
    attention_workspace,
    cascade_splits,
    decode_attention,
    decode_attention_reference,
    decode_splits,
)

PAGE = 64  # the kernels' BLOCK_S (64) divides it
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def pool(n_pages, n_kv, hd, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n_pages * PAGE, n_kv, hd, generator=g).to(dtype)
    v = torch.randn(n_pages * PAGE, n_kv, hd, generator=g).to(dtype)
    return k.view(n_pages, PAGE, n_kv, hd), v.view(n_pages, PAGE, n_kv, hd)


def gathered_attention(q, k_pages, v_pages, table, lens):
    """fp32 softmax over row b's first ``lens[b]`` keys, gathered through ``table`` key by key."""
    batch, n_q, hd = q.shape
    n_kv = k_pages.shape[2]
    out = torch.zeros(batch, n_q, hd)
    for b in range(batch):
        n = int(lens[b])
        if n == 0:
            continue
        idx = [(int(table[b, s // PAGE]), s % PAGE) for s in range(n)]
        k = torch.stack([k_pages[p, i] for p, i in idx]).float()  # [n, n_kv, hd]
        v = torch.stack([v_pages[p, i] for p, i in idx]).float()
        for h in range(n_q):
            kv = h // (n_q // n_kv)
            p = torch.softmax(k[:, kv] @ q[b, h].float() / hd**0.5, dim=0)
            out[b, h] = p @ v[:, kv]
    return out


def paged_case(batch, n_q, n_kv, dtype, width=3, n_pages=11, hd=24, seed=1):
    """Random non-contiguous tables (entries past a row's keys point anywhere, even out of the
    pool: never read); rows 0 and 1 share their first page; odd lengths."""
    g = torch.Generator().manual_seed(seed)
    k, v = pool(n_pages, n_kv, hd, dtype, seed)
    table = torch.stack([torch.randperm(n_pages, generator=g)[:width] for _ in range(batch)])
    lens = torch.randint(1, width * PAGE + 1, (batch,), generator=g)
    lens[0] = 1
    if batch > 1:
        table[1, 0] = table[0, 0]
        lens[1] = width * PAGE  # a full table
    if batch > 2:
        lens[2] = PAGE  # exactly one page
    for b in range(batch):  # columns past the row's pages: garbage
        used = -(-int(lens[b]) // PAGE)
        table[b, used:] = 10_000
    qbuf = torch.randn(batch, n_q + 2, hd + 8, generator=g).to(dtype)
    q = qbuf[:, 1 : n_q + 1, 4 : hd + 4]  # a strided view
    return q, k, v, table.to(torch.int32), lens


@pytest.mark.parametrize(
    "dtype, heads, batch, n_splits",
    slow_beyond(
        {str(dt).removeprefix("torch."): dt for dt in DTYPES},
        {"mha": ((4, 4),), "gqa": ((8, 2),)},
        {"b1": 1, "b5": 5},
        {"s1": 1, "s3": 3},
        # each dtype, head layout, batch and split count at least once
        fast={
            ("float32", "mha", "b5", "s3"),
            ("float16", "gqa", "b1", "s3"),
            ("bfloat16", "gqa", "b5", "s1"),
            ("bfloat16", "mha", "b1", "s1"),
        },
    ),
)
def test_paged_matches_gathered_reference(dtype, heads, batch, n_splits):
    n_q, n_kv = heads
    q, k, v, table, lens = paged_case(batch, n_q, n_kv, dtype)
    got = decode_attention(q, k, v, lens, block_table=table, n_splits=n_splits)
    want = gathered_attention(q, k, v, table, lens).to(dtype)
    ref = decode_attention_reference(q, k, v, lens, block_table=table)
    assert_matches_reference(got, ref, v)
    assert_matches_reference(ref, want, v, rounded_p=False)
    assert_matches_reference(got, want, v)


def test_the_row_form_is_the_one_page_table():
    """``rows`` and ``block_table = rows[:, None]`` over ``[B_max, S_max]`` rows (S_max = 37: a
    page need not be a tile multiple when rows hold one page) give the same bits."""
    g = torch.Generator().manual_seed(3)
    k = torch.randn(5, 37, 2, 16, generator=g)
    v = torch.randn(5, 37, 2, 16, generator=g)
    q = torch.randn(3, 4, 16, generator=g)
    lens = torch.tensor([37, 1, 20])
    rows = torch.tensor([4, 0, 4], dtype=torch.int32)
    a = decode_attention(q, k, v, lens, rows=rows, n_splits=2)
    b = decode_attention(q, k, v, lens, block_table=rows[:, None].contiguous(), n_splits=2)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def _cascade_case(batch, n_q, n_kv, dtype):
    """Two held prefixes as page tables (150 keys: 2 full pages + 22; 64 keys: one page); rows
    share the full pages and own a copy of the partial one, then their own pages; some rows read
    no slot, one row's prefix is shorter than its slot's, one row ends inside its prefix."""
    n_pages, width, hd = 48, 4, 16
    k, v = pool(n_pages, n_kv, hd, dtype, seed=5)
    slot_table = torch.tensor([[3, 7, 11, 0], [5, 0, 0, 0]], dtype=torch.int32)
    slot_lens = torch.tensor([150, 64], dtype=torch.int32)
    free = iter([p for p in range(n_pages) if p not in (3, 7, 11, 5)])
    table = torch.zeros(batch, width, dtype=torch.int32)
    pre_rows = torch.zeros(batch, dtype=torch.int32)
    pre_lens = torch.zeros(batch, dtype=torch.int32)
    lens = torch.zeros(batch, dtype=torch.long)
    g = torch.Generator().manual_seed(6)
    for b in range(batch):
        kind = b % 4
        if kind == 0:  # reads slot 0, 150 keys: pages 3, 7 shared, page 11's keys copied
            own = next(free)
            k[own, :22], v[own, :22] = k[11, :22], v[11, :22]
            table[b, :3] = torch.tensor([3, 7, own])
            table[b, 3] = next(free)
            pre_rows[b], pre_lens[b] = 3, 150
            lens[b] = int(torch.randint(151, width * PAGE + 1, (1,), generator=g))
        elif kind == 1:  # reads slot 1 (one full page), then its own pages
            table[b] = torch.tensor([5, next(free), next(free), 9999])
            pre_rows[b], pre_lens[b] = 5, 64
            lens[b] = int(torch.randint(65, 3 * PAGE + 1, (1,), generator=g))
        elif kind == 2:  # no shared prefix
            table[b] = torch.tensor([next(free), next(free), 9999, 9999])
            lens[b] = int(torch.randint(1, 2 * PAGE + 1, (1,), generator=g))
        else:  # a 100-key prefix of slot 0 (shorter than the slot), the row ends at key 90
            table[b, :2] = torch.tensor([3, 7])
            table[b, 2:] = 9999
            pre_rows[b], pre_lens[b] = 3, 100
            lens[b] = 90
    q = torch.randn(batch, n_q, hd, generator=g).to(dtype)
    kw = dict(block_table=table, prefix_rows=pre_rows, prefix_lens=pre_lens)
    return q, k, v, lens, (slot_table, slot_lens), kw


@pytest.mark.parametrize(
    "n_q, n_kv, batch, n_splits, dtype",
    slow_beyond(
        {"mha": (4, 4, 5), "gqa": (8, 2, 7), "gqa-two-query-tiles": (8, 2, 21)},
        {"1": 1, "3": 3},
        {"fp32": torch.float32, "bf16": torch.bfloat16},
        fast={("mha", "3", "bf16"), ("gqa", "1", "fp32"), ("gqa-two-query-tiles", "1", "bf16")},
    ),
)
def test_paged_cascade_reads_each_slots_pages_once(n_q, n_kv, batch, n_splits, dtype):
    """The cascade over slot page tables equals the plain paged read (the rows' tables hold
    the same keys) and the gathered reference; a row's own keys start mid-tile (150)."""
    q, k, v, lens, slots, kw = _cascade_case(batch, n_q, n_kv, dtype)
    got = decode_attention(q, k, v, lens, n_splits=n_splits, prefix_slots=slots, **kw)
    plain = decode_attention(q, k, v, lens, n_splits=n_splits, block_table=kw["block_table"])
    want = gathered_attention(q, k, v, kw["block_table"], lens).to(dtype)
    ref = decode_attention_reference(q, k, v, lens, prefix_slots=slots, **kw)
    assert_matches_reference(ref, want, v, rounded_p=False)
    assert_matches_reference(got, want, v)
    assert_matches_reference(plain, want, v)


def test_paged_cascade_workspace_and_slot_reads():
    """A caller workspace sized for splits + slot splits; a row's keys past the prefix really
    come from its own pages (poisoning the slot's page past its length changes nothing, while
    poisoning a shared page inside the prefix does)."""
    q, k, v, lens, slots, kw = _cascade_case(6, 4, 2, torch.float32)
    ps = cascade_splits(6, 4, 2, 2, 4 * PAGE, "cpu")
    ws = attention_workspace(6, 4, 16, 2 + 2 * ps, "cpu").fill_(float("nan"))
    got = decode_attention(q, k, v, lens, n_splits=2, workspace=ws, prefix_slots=slots, **kw)
    assert_matches_reference(got, decode_attention_reference(q, k, v, lens, **{
        "block_table": kw["block_table"]}), v)  # fmt: skip
    k2 = k.clone()
    k2[11, 22:] = 1e4  # slot 0's last page past its 150 keys
    again = decode_attention(q, k2, v, lens, n_splits=2, prefix_slots=slots, **kw)
    torch.testing.assert_close(again, got, rtol=0, atol=0)
    k3 = k.clone()
    k3[3, :5] = 3.0  # a shared page inside the prefix
    changed = decode_attention(q, k3, v, lens, n_splits=2, prefix_slots=slots, **kw)
    assert not torch.allclose(changed, got)


def test_paged_arguments_are_checked():
    q, k, v, table, lens = paged_case(3, 4, 2, torch.float32)
    with pytest.raises(ValueError, match="rows or block_table, not both"):
        decode_attention(q, k, v, lens, block_table=table, rows=table[:, 0])
    with pytest.raises(ValueError, match=r"block_table must have shape \[B=3"):
        decode_attention(q, k, v, lens, block_table=table[:2])
    with pytest.raises(TypeError, match="block_table"):
        decode_attention(q, k, v, lens, block_table=table.float())
    with pytest.raises(ValueError, match=r"cache_lens must lie in \[0, S_max=192\]"):
        decode_attention(q, k, v, lens + 200, block_table=table)
    bad = table.clone()
    bad[0, 0] = 11
    with pytest.raises(ValueError, match=r"block_table must hold pages in \[0, 11\)"):
        decode_attention(q, k, v, lens, block_table=bad)
    with pytest.raises(ValueError, match="only go with prefix_slots"):
        decode_attention(
            q, k, v, lens, block_table=table, prefix_rows=table[:, 0], prefix_lens=lens
        )
    k40, v40 = (
        k.reshape(-1, 2, 24)[: 11 * 40].view(11, 40, 2, 24),
        v.reshape(-1, 2, 24)[: 11 * 40].view(11, 40, 2, 24),
    )
    with pytest.raises(ValueError, match="page size .* multiple of the dot kernel's BLOCK_S"):
        decode_attention(q, k40, v40, lens.clamp(max=40), block_table=table)
    q2, k2, v2, lens2, slots, kw = _cascade_case(5, 4, 4, torch.float32)
    with pytest.raises(ValueError, match=r"prefix_slots\[0\] must be 2-D"):
        decode_attention(q2, k2, v2, lens2, prefix_slots=(slots[0][:, 0], slots[1]), **kw)
    with pytest.raises(ValueError, match="every prefix must be read from a slot"):
        decode_attention(q2, k2, v2, lens2, prefix_slots=(slots[0][:1], slots[1][:1]), **kw)


def test_splits_follow_the_tables_width():
    """The split rule sees W * page keys a row (a shape: graph capture keeps its grid)."""
    assert decode_splits(1, 8, 4 * PAGE, "cpu") == decode_splits(1, 8, 256, "cpu")
