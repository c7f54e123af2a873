"""How the scoring engine lays requests out: rows (a context and its continuation branches),
batches of rows under a token budget, and the host tensors of one batch.

Packed batches (``pack``) put rows back to back in one token stream for the packed engine;
padded batches (``pad_rows``) are right-padded ``[B, L]`` token matrices for peers whose forward
takes one. Both orders are canonical (a function of the tokens only), so the same requests give
the same batches in any input order. Host-only work: nothing here touches a device.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from nakta_model.kernels.packed_attention import PREFIX_ALIGN


@dataclass
class Row:
    """One model input row: a context followed by one or more continuation branches; the
    first ``prefix`` context tokens come from the prefix cache instead of the stream."""

    ctx: list[int]
    branches: list[tuple[int, list[int]]] = field(default_factory=list)  # (request idx, cont)
    prefix: int = 0

    def __len__(self) -> int:
        return len(self.ctx) + sum(len(c) - 1 for _, c in self.branches)

    @property
    def stream_len(self) -> int:
        """Tokens this row puts in the packed stream."""
        return len(self) - self.prefix


def check_budget(token_budget: int, max_rows: int | None) -> None:
    if not isinstance(token_budget, int) or token_budget < 1:
        raise ValueError(f"token_budget must be a positive int, got {token_budget!r}")
    if max_rows is not None and (not isinstance(max_rows, int) or max_rows < 1):
        raise ValueError(f"max_rows/batch_size must be a positive int or None, got {max_rows!r}")


def build_rows(
    reqs: list[tuple[list[int], list[int]]], use_cache: bool, max_length: int
) -> tuple[list[Row], dict[int, int]]:
    """Group requests into rows. Returns rows and ``duplicate -> original`` request indices.

    With the cache, requests whose (truncated) context tokens are equal share a row (split
    into several rows only if the packed row would grow past ``max_length`` tokens); identical
    (context, continuation) pairs are computed once.
    """
    if not use_cache:
        return [Row(ctx, [(i, cont)]) for i, (ctx, cont) in enumerate(reqs)], {}
    groups: dict[tuple[int, ...], list[Row]] = {}
    seen: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    dup: dict[int, int] = {}
    for i, (ctx, cont) in enumerate(reqs):
        key = tuple(ctx)
        pair = (key, tuple(cont))
        if pair in seen:
            dup[i] = seen[pair]
            continue
        seen[pair] = i
        rows = groups.setdefault(key, [])
        if not rows or len(rows[-1]) + len(cont) - 1 > max_length:
            rows.append(Row(ctx))  # a packed row stays within the model's length
        rows[-1].branches.append((i, cont))
    for rows in groups.values():
        for r in rows:
            r.branches.sort(key=lambda b: b[1])
    return [r for rows in groups.values() for r in rows], dup


def _row_key(row: Row) -> tuple:
    return (-len(row), row.ctx, [c for _, c in row.branches])


def padded_batches(rows: list[Row], token_budget: int, max_rows: int | None) -> list[list[Row]]:
    """For row-padded peers: longest rows first; a batch holds rows while rows x longest
    length <= token_budget (and at most ``max_rows`` rows).

    Rows (and branches within a row) are put in a canonical order that depends on their tokens
    only, so the same set of requests gives the same batches, and the same rounding, in any
    input order (parity.py and lm-eval's call order differ).
    """
    rows = sorted(rows, key=_row_key)
    out: list[list[Row]] = []
    cur: list[Row] = []
    for row in rows:
        width = len(cur[0]) if cur else len(row)
        full = (len(cur) + 1) * width > token_budget or (
            max_rows is not None and len(cur) >= max_rows
        )
        if cur and full:
            out.append(cur)
            cur = []
        cur.append(row)
    if cur:
        out.append(cur)
    return out


def packed_batches(rows: list[Row], token_budget: int, max_rows: int | None) -> list[list[Row]]:
    """For the packed engine: rows go into batches of at most ``token_budget`` tokens (no padding
    between rows) and ``max_rows`` rows, best fit decreasing: each row, longest first, joins the
    batch with the least room that still fits it, so batches come out nearly full and their
    token counts (the forward's only shape) nearly equal. A row longer than the budget gets a
    batch of its own. Canonical row order, as in :func:`padded_batches`.
    """
    rows = sorted(rows, key=_row_key)
    batches: list[list[Row]] = []
    sizes: list[int] = []
    room: list[tuple[int, int]] = []  # sorted (free tokens, batch id) of batches still open
    for row in rows:
        n = row.stream_len
        at = bisect.bisect_left(room, (n, -1))
        if at < len(room):
            free, b = room.pop(at)
        else:
            b = len(batches)
            batches.append([])
            sizes.append(0)
            free = max(token_budget, n)
        batches[b].append(row)
        sizes[b] += n
        free -= n
        if free > 0 and (max_rows is None or len(batches[b]) < max_rows):
            bisect.insort(room, (free, b))
    return batches


@dataclass
class Packed:
    """Host-side tensors of one packed batch (built before the device work starts)."""

    tokens: torch.Tensor  # [T] long: every row's tokens back to back, then padding
    positions: torch.Tensor  # [T] long
    seq_start: torch.Tensor  # [T] int32: first token of each token's row
    branch: torch.Tensor  # [T] int32: 0 context, k > 0 branch k
    flat_index: torch.Tensor  # [N] long: scored token indices
    src: torch.Tensor  # [S] long: row of the [N, V] logits that predicts each target
    target: torch.Tensor  # [S] long: target token ids
    req: torch.Tensor  # [S] long: request index of each target
    n_real: int  # tokens before the padding
    token_entry: torch.Tensor | None = None  # [T] int32: prefix-cache entry (-1 none)


PAD_MULTIPLE = 128  # token counts are rounded up to this: few distinct forward shapes


def pack(
    batch: list[Row], pin: bool = False, entries: dict[tuple[int, ...], int] | None = None
) -> Packed:
    """Lay out a batch as one token stream: each row is its context, then every branch's
    tokens but the last (the last token of a continuation is a target, never an input), with
    positions restarting at ``len(ctx)`` for every branch. Scored positions: the last context
    token (predicts every branch's first target), then every branch token.

    A row with a cached prefix puts only ``ctx[prefix:]`` in the stream (positions from
    ``prefix`` on) and attends to the prefix's cached K/V; ``entries`` maps each prefix to its
    page-table row. Rows of one prefix form a segment that starts on a ``PREFIX_ALIGN``
    boundary (pad tokens before it), so a query block of the kernel sees one prefix.

    The stream is padded to a multiple of ``PAD_MULTIPLE``; a pad token is a sequence of its
    own (it attends to itself only) and is never scored.

    ``pin``: page-locked host tensors, so their copies to the GPU are truly asynchronous (a
    copy from pageable memory waits for the stream to drain and would idle the GPU while the
    host packs the next batch).
    """
    toks: list[int] = []
    pos: list[int] = []
    start: list[int] = []
    branch: list[int] = []
    entry: list[int] = []
    flat: list[int] = []
    src: list[int] = []
    target: list[int] = []
    req: list[int] = []

    def pad(to: int, e: int) -> None:
        n = -len(toks) % to
        start.extend(range(len(toks), len(toks) + n))
        toks.extend([0] * n)
        pos.extend([0] * n)
        branch.extend([0] * n)
        entry.extend([e] * n)

    current = -1
    for row in batch:
        e = entries[tuple(row.ctx[: row.prefix])] if row.prefix else -1
        if entries is not None and e != current:  # a new prefix segment
            pad(PREFIX_ALIGN, current)
            current = e
        s0 = len(toks)
        c, p = len(row.ctx), row.prefix
        toks += row.ctx[p:]
        pos += range(p, c)
        branch += [0] * (c - p)
        first_scored = len(flat)
        flat.append(s0 + c - p - 1)  # predicts the first token of every branch
        for k, (i, cont) in enumerate(row.branches, start=1):
            m = len(cont)
            b0 = len(toks)
            toks += cont[:-1]
            pos += range(c, c + m - 1)
            branch += [k] * (m - 1)
            src.append(first_scored)
            src += range(len(flat), len(flat) + m - 1)
            flat += range(b0, b0 + m - 1)
            target += cont
            req += [i] * m
        start += [s0] * (len(toks) - s0)
        entry += [e] * (len(toks) - s0)
    n_real = len(toks)
    pad(PREFIX_ALIGN if entries is not None else PAD_MULTIPLE, current)
    out = Packed(
        tokens=torch.tensor(toks, dtype=torch.long),
        positions=torch.tensor(pos, dtype=torch.long),
        seq_start=torch.tensor(start, dtype=torch.int32),
        branch=torch.tensor(branch, dtype=torch.int32),
        flat_index=torch.tensor(flat, dtype=torch.long),
        src=torch.tensor(src, dtype=torch.long),
        target=torch.tensor(target, dtype=torch.long),
        req=torch.tensor(req, dtype=torch.long),
        n_real=n_real,
        token_entry=torch.tensor(entry, dtype=torch.int32) if entries is not None else None,
    )
    if pin:
        for name in ("tokens", "positions", "seq_start", "branch", "flat_index", "src"):
            setattr(out, name, getattr(out, name).pin_memory())
        out.target, out.req = out.target.pin_memory(), out.req.pin_memory()
        if out.token_entry is not None:
            out.token_entry = out.token_entry.pin_memory()
    return out


def prefix_batches(
    rows: list[Row], token_budget: int, max_rows: int | None, pool_pages: int, page_size: int
) -> list[list[Row]]:
    """Rows with cached prefixes, one prefix after another (longest rows first within one),
    into batches of at most ``token_budget`` stream tokens counting each segment's alignment
    padding, ``max_rows`` rows, and prefixes that fit the pool together."""
    rows = sorted(rows, key=lambda r: (r.ctx[: r.prefix], *_row_key(r)))
    batches: list[list[Row]] = []
    cur: list[Row] = []
    used = pages = 0
    key = None
    for row in rows:
        k = tuple(row.ctx[: row.prefix])
        new_seg = k != key
        need = row.stream_len + ((-used % PREFIX_ALIGN) if new_seg and cur else 0)
        row_pages = -(-row.prefix // page_size) if new_seg else 0
        full = cur and (
            used + need > token_budget
            or (max_rows is not None and len(cur) >= max_rows)
            or pages + row_pages > pool_pages
        )
        if full:
            batches.append(cur)
            cur, used, pages, new_seg = [], 0, 0, True
            need, row_pages = row.stream_len, -(-row.prefix // page_size)
        cur.append(row)
        used += need
        pages += row_pages
        key = k
    if cur:
        batches.append(cur)
    return batches


@dataclass
class PaddedBatch:
    """Host-side tensors of one row-padded batch (the plain scorer's layout)."""

    tokens: torch.Tensor  # [B, L] long
    flat_index: torch.Tensor  # [N] long: scored positions, flattened b * L + t
    src: torch.Tensor  # [T] long: row of the [N, V] logits that predicts each target
    target: torch.Tensor  # [T] long: target token ids
    req: torch.Tensor  # [T] long: request index of each target


def pad_rows(batch: list[Row], pin: bool = False) -> PaddedBatch:
    """Right-padded ``[B, L]`` rows of single-branch rows (``ctx + cont[:-1]``) for peers whose
    forward takes a token matrix; scored positions as in :func:`pack`."""
    width = max(len(r) for r in batch)
    tokens = torch.zeros(len(batch), width, dtype=torch.long)
    flat, src, target, req = [], [], [], []
    for b, row in enumerate(batch):
        ((i, cont),) = row.branches
        toks = row.ctx + cont[:-1]
        tokens[b, : len(toks)] = torch.tensor(toks)
        c = len(row.ctx)
        src += range(len(flat), len(flat) + len(cont))
        flat += range(b * width + c - 1, b * width + len(toks))
        target += cont
        req += [i] * len(cont)
    out = PaddedBatch(
        tokens=tokens,
        flat_index=torch.tensor(flat, dtype=torch.long),
        src=torch.tensor(src, dtype=torch.long),
        target=torch.tensor(target, dtype=torch.long),
        req=torch.tensor(req, dtype=torch.long),
    )
    if pin:
        for name in ("tokens", "flat_index", "src", "target", "req"):
            setattr(out, name, getattr(out, name).pin_memory())
    return out
