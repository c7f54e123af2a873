"""How the scoring engine lays requests out: rows (a context and its continuation branches),
batches of rows under a token budget, and the host tensors of one batch.

A packed row is a token tree: the context, then the trie of its continuations' input tokens
(``cont[:-1]``; the last token of a continuation is only ever a target) in depth-first order,
so continuations that begin alike ("the man ...", "the woman ...") compute their shared tokens
once. On HellaSwag that is 12.5% of the tokens of a row that repeats them per ending.

Packed batches (``pack``) put rows back to back in one token stream for the packed engine;
padded batches (``pad_rows``) are right-padded ``[B, L]`` token matrices for peers whose forward
takes one. Both orders are canonical (a function of the tokens only), so the same requests give
the same batches in any input order. Host-only work: nothing here touches a device.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from nakta_model.kernels.packed_attention import PREFIX_ALIGN


@dataclass
class Trie:
    """Token sequences as a trie in depth-first order: node n holds ``tokens[n]`` at depth
    ``depth[n]`` (its index in every sequence through it), its subtree is nodes
    ``[n, end[n])``, and ``paths[k]`` lists the nodes of sequence k, one per token."""

    tokens: list[int]
    depth: list[int]
    end: list[int]
    paths: list[list[int]]


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (slice comparisons, which run in C: the
    contexts compared here share hundreds of tokens)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def sequence_trie(seqs: Sequence[Sequence[int]]) -> Trie:
    """The trie of ``seqs``; ``paths`` in the order of ``seqs``. The sequences are walked in
    sorted order, which makes insertion a depth-first walk: each one's new nodes follow the
    nodes it shares with the one before (sorted neighbours share the most). The beginning all
    of them share (a row's context: the first and last in sorted order share exactly that) is
    laid down in one piece."""
    order = sorted(range(len(seqs)), key=lambda k: seqs[k])
    chain = common_prefix_len(seqs[order[0]], seqs[order[-1]]) if seqs else 0
    tokens: list[int] = list(seqs[order[0]][:chain]) if seqs else []
    depth: list[int] = list(range(chain))
    end: list[int] = [-1] * chain  # the chain's ends: the whole trie's, set last
    root = list(range(chain))
    paths: list[list[int]] = [[] for _ in seqs]
    path: list[int] = []  # the nodes of the previous sequence below the chain
    prev: Sequence[int] = ()
    for k in order:
        u = seqs[k][chain:]
        shared = common_prefix_len(prev, u)
        while len(path) > shared:  # the previous sequence's deeper nodes are complete
            end[path.pop()] = len(tokens)
        first = len(tokens)
        tokens += u[shared:]
        depth += range(chain + shared, chain + len(u))
        end += [-1] * (len(u) - shared)
        path += range(first, len(tokens))
        paths[k] = root + path
        prev = u
    for n in path + root:
        end[n] = len(tokens)
    return Trie(tokens, depth, end, paths)


@dataclass
class Row:
    """One tree of the packed stream: a context followed by its continuation branches, and the
    rows ``merged`` into it (contexts that begin alike: :func:`merge_rows`); every token of the
    trie of their ``ctx + cont[:-1]`` sequences is computed once (:func:`sequence_trie`). The
    first ``prefix`` context tokens come from the prefix cache instead of the stream (rows
    with a prefix are never merged)."""

    ctx: list[int]
    branches: list[tuple[int, list[int]]] = field(default_factory=list)  # (request idx, cont)
    prefix: int = 0
    merged: list[Row] = field(default_factory=list)
    _trie: Trie | None = field(default=None, repr=False, compare=False)

    def requests(self) -> list[tuple[list[int], int, list[int]]]:
        """``(ctx, request idx, cont)`` of every branch of this row and the merged ones."""
        return [(r.ctx, i, cont) for r in (self, *self.merged) for i, cont in r.branches]

    @property
    def trie(self) -> Trie:
        """The trie of its sequences (built once: rows are final once they are batched)."""
        if self._trie is None:
            self._trie = sequence_trie([ctx + cont[:-1] for ctx, _, cont in self.requests()])
        return self._trie

    def __len__(self) -> int:
        if self.merged:
            return len(self.trie.tokens)
        # one context: it, then the trie of the continuations; counted without building the
        # trie (batching sorts every row by length before the first forward; pack builds it)
        conts = sorted(cont[:-1] for _, cont in self.branches)
        return len(self.ctx) + sum(
            len(u) - common_prefix_len(prev, u) for prev, u in zip([[], *conts], conts)
        )

    @property
    def stream_len(self) -> int:
        """Tokens this row puts in the packed stream."""
        return len(self) - self.prefix


# Merging rows brings HellaSwag's stream tokens close to the unique tokens (about 10% fewer
# than unmerged), while the key blocks the packed kernel scans (from a query block's tree
# start) grow: attention is a few % of a batch's time, the tokens all of it.
MERGE_MIN_SHARED = 4  # contexts sharing fewer leading tokens stay in rows of their own
MERGE_MAX_TOKENS = 1024  # a merged row's tokens at most (keys a query block may scan)


def merge_rows(
    rows: list[Row],
    max_tokens: int = MERGE_MAX_TOKENS,
    min_shared: int = MERGE_MIN_SHARED,
    max_contexts: int | None = None,
) -> list[Row]:
    """Rows whose contexts share at least ``min_shared`` leading tokens become one tree (their
    shared tokens computed once: HellaSwag tasks of one video repeat its first sentence), up to
    ``max_tokens`` tokens and ``max_contexts`` contexts a tree; rows with a cached prefix stay
    as they are. Canonical: the trees depend on the rows' tokens only."""
    out = [r for r in rows if r.prefix]
    group: list[Row] = []
    size = 0
    prev: list[int] = []
    for r in sorted((r for r in rows if not r.prefix), key=lambda r: r.ctx):
        shared = common_prefix_len(prev, r.ctx) if group else 0
        grow = len(r) - shared  # at most: its branches may share more with the tree
        fits = max_contexts is None or len(group) < max_contexts
        if group and shared >= min_shared and size + grow <= max_tokens and fits:
            group.append(r)
            size += grow
        else:
            if group:
                out.append(_tree_of(group))
            group, size = [r], len(r)
        prev = r.ctx
    if group:
        out.append(_tree_of(group))
    return out


def _tree_of(group: list[Row]) -> Row:
    if len(group) == 1:
        return group[0]
    head, *rest = group
    return Row(head.ctx, head.branches, 0, [*head.merged, *rest])


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
    into several rows only if the packed row could grow past ``max_length`` tokens, counting
    every branch's tokens in full); identical (context, continuation) pairs are computed once.
    """
    if not use_cache:
        return [Row(ctx, [(i, cont)]) for i, (ctx, cont) in enumerate(reqs)], {}
    groups: dict[tuple[int, ...], list[Row]] = {}
    last_size: dict[tuple[int, ...], int] = {}  # a context's last row, every branch in full
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
        if not rows or last_size[key] + len(cont) - 1 > max_length:
            rows.append(Row(ctx))  # a packed row stays within the model's length
            last_size[key] = len(ctx)
        rows[-1].branches.append((i, cont))
        last_size[key] += len(cont) - 1
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
    between rows) and ``max_rows`` contexts (a merged row counts each of its contexts), best
    fit decreasing: each row, longest first, joins the batch with the least room that still
    fits it, so batches come out nearly full and their token counts (the forward's only shape)
    nearly equal. A row longer than the budget gets a batch of its own. Canonical row order,
    as in :func:`padded_batches`.
    """
    rows = sorted(rows, key=_row_key)
    batches: list[list[Row]] = []
    contexts: list[int] = []
    room: list[tuple[int, int]] = []  # sorted (free tokens, batch id) of batches still open
    for row in rows:
        n, w = row.stream_len, 1 + len(row.merged)
        at = bisect.bisect_left(room, (n, -1))
        while at < len(room) and max_rows is not None and contexts[room[at][1]] + w > max_rows:
            at += 1
        if at < len(room):
            free, b = room.pop(at)
        else:
            b = len(batches)
            batches.append([])
            contexts.append(0)
            free = max(token_budget, n)
        batches[b].append(row)
        contexts[b] += w
        free -= n
        if free > 0 and (max_rows is None or contexts[b] < max_rows):
            bisect.insort(room, (free, b))
    return batches


@dataclass
class Packed:
    """Host-side tensors of one packed batch (built before the device work starts)."""

    tokens: torch.Tensor  # [T] long: every row's tokens back to back, then padding
    positions: torch.Tensor  # [T] long
    seq_start: torch.Tensor  # [T] int32: first token of each token's row
    span_end: torch.Tensor  # [T] int32: one past the token's subtree (kernels/packed_attention)
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
    """Lay out a batch as one token stream: each row is the trie of its ``ctx + cont[:-1]``
    sequences (the last token of a continuation is a target, never an input) depth first, a
    node's position its depth. Scored positions: each context's last node (predicts its
    branches' first targets) and every continuation node (predicts the next token of each
    branch through it).

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
    span: list[int] = []
    entry: list[int] = []
    flat: list[int] = []
    src: list[int] = []
    target: list[int] = []
    req: list[int] = []

    def pad(to: int, e: int) -> None:
        n = -len(toks) % to
        start.extend(range(len(toks), len(toks) + n))
        span.extend(range(len(toks) + 1, len(toks) + n + 1))
        toks.extend([0] * n)
        pos.extend([0] * n)
        entry.extend([e] * n)

    current = -1
    for row in batch:
        e = entries[tuple(row.ctx[: row.prefix])] if row.prefix else -1
        if entries is not None and e != current:  # a new prefix segment
            pad(PREFIX_ALIGN, current)
            current = e
        s0 = len(toks)
        p, trie = row.prefix, row.trie
        base = s0 - p  # stream index of trie node n (the first p nodes: the cached prefix)
        toks += trie.tokens[p:]
        pos += trie.depth[p:]
        span += [base + x for x in trie.end[p:]]
        reqs = row.requests()
        # node path[len(ctx) - 1 + j] predicts cont[j]: the last context node, then the
        # continuation's own nodes
        scored = sorted(
            {n for (ctx, _, _), path in zip(reqs, trie.paths) for n in path[len(ctx) - 1 :]}
        )
        flat_of = {n: len(flat) + k for k, n in enumerate(scored)}
        flat += [base + n for n in scored]
        for (ctx, i, cont), path in zip(reqs, trie.paths):
            src += [flat_of[n] for n in path[len(ctx) - 1 :]]
            target += cont
            req += [i] * len(cont)
        start += [s0] * (len(toks) - s0)
        entry += [e] * (len(toks) - s0)
    n_real = len(toks)
    pad(PREFIX_ALIGN if entries is not None else PAD_MULTIPLE, current)
    out = Packed(
        tokens=torch.tensor(toks, dtype=torch.long),
        positions=torch.tensor(pos, dtype=torch.long),
        seq_start=torch.tensor(start, dtype=torch.int32),
        span_end=torch.tensor(span, dtype=torch.int32),
        flat_index=torch.tensor(flat, dtype=torch.long),
        src=torch.tensor(src, dtype=torch.long),
        target=torch.tensor(target, dtype=torch.long),
        req=torch.tensor(req, dtype=torch.long),
        n_real=n_real,
        token_entry=torch.tensor(entry, dtype=torch.int32) if entries is not None else None,
    )
    if pin:
        for name in ("tokens", "positions", "seq_start", "span_end", "flat_index", "src"):
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
