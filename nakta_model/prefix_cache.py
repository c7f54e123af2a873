"""Prompt prefixes shared across requests: found once, their K/V computed once and kept.

Many evaluations repeat a long prefix: lm-eval's MMLU gives every question of a subject the
same 5 shots (``sampler: first_n``), ~500 tokens before a ~100-token question; BBH and GSM8K
prompts share a fixed few-shot prefix too. Recomputing it per question multiplies the tokens by
~6. Here:

* :func:`shared_prefixes` finds the prefixes: distinct contexts sorted as token sequences, cut
  into groups wherever neighbours share fewer than ``min_tokens`` tokens; a group of two or more
  contexts shares its common prefix (capped one token short of its shortest context, whose last
  token must still run in the stream: it predicts the continuation);
* :class:`PrefixCache` keeps their K/V in pages of the model's one KV pool (``kv_pages``,
  shared with the generation engine): a prefix is computed once (a packed prefill writes its
  K/V into pages it takes from the pool), kept under a token budget (a cap on the pages it
  holds) and evicted least-recently-used into the pool; packed tokens then attend to it
  through a page table (``kernels/packed_attention.PrefixKV``), with no copies.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nakta_model.kv_pages import PAGE_SIZE, kv_pool
from nakta_model.score_batches import common_prefix_len

__all__ = ["MIN_PREFIX_TOKENS", "PrefixCache", "shared_prefixes"]

MIN_PREFIX_TOKENS = 64  # shorter shared beginnings are not worth a cache entry


def shared_prefixes(
    contexts: Sequence[Sequence[int]], min_tokens: int = MIN_PREFIX_TOKENS
) -> list[int]:
    """The shared prefix length of every context (0: none), as described in the module doc.

    Contexts with equal tokens count once (the scorer already shares a whole context between
    its continuations). Deterministic: depends on the set of contexts only.
    """
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 1:
        raise ValueError(f"min_tokens must be a positive int, got {min_tokens!r}")
    distinct = sorted({tuple(c) for c in contexts})
    length: dict[tuple[int, ...], int] = {}
    start = 0
    for i in range(1, len(distinct) + 1):
        if i < len(distinct) and common_prefix_len(distinct[i - 1], distinct[i]) >= min_tokens:
            continue
        group = distinct[start:i]  # one run of neighbours sharing >= min_tokens
        if len(group) >= 2:
            common = min(common_prefix_len(group[0], g) for g in group[1:])
            common = min(common, min(len(g) for g in group) - 1)
            for g in group:
                length[g] = common if common >= min_tokens else 0
        start = i
    return [length.get(tuple(c), 0) for c in contexts]


@dataclass
class _Entry:
    pages: list[int]
    length: int


class PrefixCache:
    """K/V of shared prefixes in pages of the model's KV pool (module docstring).

    ``budget_tokens`` caps the pages held (rounded up to whole pages); a prefix longer than
    that is not cached (the caller computes it in the stream instead). Entries are evicted least
    recently used, never while the current batch holds them (:meth:`acquire` pins them until
    the next call). They stay valid while the pool's epoch is the one they were made in; other
    users of the pool (the generation engine) never touch their pages. :meth:`prepare` (the
    scorer calls it at the start of every ``score`` call) applies the pool's cap while scoring
    (``KVPool.room_for_scoring``): ``limit``, the pages it may hold this call, is the budget
    clipped to the cap, and a pool grown past the cap for generation is trimmed.
    """

    def __init__(self, model, budget_tokens: int, page_size: int = PAGE_SIZE):
        if (
            isinstance(budget_tokens, bool)
            or not isinstance(budget_tokens, int)
            or budget_tokens < 1
        ):
            raise ValueError(f"budget_tokens must be a positive int, got {budget_tokens!r}")
        if page_size != PAGE_SIZE:
            raise ValueError(f"page_size must be the KV pool's {PAGE_SIZE}, got {page_size!r}")
        self.model, self.page_size = model, page_size
        self.n_pages = -(-budget_tokens // page_size)
        self.limit = self.n_pages  # pages it may hold now: the budget clipped to the pool's cap
        self.entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self.pool = kv_pool(model)
        self._epoch: int | None = None
        self.computed_tokens = 0  # prefix tokens run through the model (stats)

    @property
    def held_pages(self) -> int:
        """Pages this cache's entries hold in the pool."""
        return sum(len(e.pages) for e in self.entries.values())

    def prepare(self) -> None:
        """Scoring starts: room for the budget in the model's pool under its cap while scoring
        (``limit``: the pages this cache may hold until the next ``prepare``; entries beyond
        it are evicted, least recently used first)."""
        self.pool = kv_pool(self.model)
        held = self.held_pages if self._epoch == self.pool.epoch else 0
        self.limit = self.pool.room_for_scoring(self.n_pages, held)
        self._check_epoch()
        self._make_room(0, keep=set())

    def _ensure_pool(self) -> None:
        """Room for ``limit`` in the model's pool besides the other users' pages (there is,
        since :meth:`prepare`, unless the cache was replaced); when the pool was rebuilt
        since (a new epoch) every entry is gone."""
        self.pool = kv_pool(self.model)
        current = self._epoch == self.pool.epoch
        self.pool.make_room(self.limit, self.held_pages if current else 0)
        self._check_epoch()

    def _check_epoch(self) -> None:
        if self._epoch != self.pool.epoch:
            self.entries.clear()
            self._epoch = self.pool.epoch

    def clear(self) -> None:
        """Give every entry's pages back to the pool."""
        if self._epoch == self.pool.epoch:
            for e in self.entries.values():
                self.pool.free(e.pages)
        self.entries.clear()

    def fits(self, length: int) -> bool:
        return -(-length // self.page_size) <= self.limit

    def acquire(self, prefixes: Sequence[tuple[int, ...]]) -> list[_Entry]:
        """Entries for ``prefixes`` (each fits the budget, all together too): the missing ones
        computed now, in one packed prefill per budget-full of tokens."""
        self._ensure_pool()
        need = sum(-(-len(p) // self.page_size) for p in dict.fromkeys(prefixes))
        if need > self.limit:
            raise ValueError(f"{need} pages of prefixes for one batch; the limit is {self.limit}")
        wanted = set(prefixes)
        missing = [p for p in dict.fromkeys(prefixes) if p not in self.entries]
        for p in missing:
            n = -(-len(p) // self.page_size)
            self._make_room(n, keep=wanted)
            self.entries[p] = _Entry(self.pool.alloc(n), len(p))
        if missing:
            try:
                self._compute(missing)
            except BaseException:  # half-written pages are no entries
                for p in missing:
                    self.pool.free(self.entries.pop(p).pages)
                raise
        for p in prefixes:
            self.entries.move_to_end(p)  # most recently used
        return [self.entries[p] for p in prefixes]

    def _make_room(self, pages: int, keep: set) -> None:
        """Evict (into the pool) until ``pages`` more stay within the limit."""
        while self.held_pages + pages > self.limit:
            victim = next((k for k in self.entries if k not in keep), None)
            if victim is None:  # only this batch's prefixes left: cannot happen (checked)
                raise RuntimeError("prefix cache: no evictable entry")
            self.pool.free(self.entries.pop(victim).pages)

    def _compute(self, prefixes: list[tuple[int, ...]]) -> None:
        """K/V of new prefixes into their pages: causal packed prefills (the logits are not
        needed; the last token's are computed as the forward's one scored row)."""
        m = self.model
        dev = m.device
        budget = max(self.page_size, 16384)
        batch: list[tuple[int, ...]] = []
        for p in prefixes + [None]:
            if p is not None and (not batch or sum(map(len, batch)) + len(p) <= budget):
                batch.append(p)
                continue
            toks, pos, start, slots = [], [], [], []
            for q in batch:
                e = self.entries[q]
                s0 = len(toks)
                toks += q
                pos += range(len(q))
                start += [s0] * len(q)
                slots += [
                    e.pages[i // self.page_size] * self.page_size + i % self.page_size
                    for i in range(len(q))
                ]
            m.forward_prefill(
                *(_on_device(x, torch.int64, dev) for x in (toks, pos, start, slots)),
                _on_device([len(toks) - 1], torch.int64, dev),
            )
            self.computed_tokens += len(toks)
            batch = [p] if p is not None else []

    def page_table(self, entries: list[_Entry]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(page_table [n, max_pages], lengths [n])`` int32 on the model's device."""
        width = max((len(e.pages) for e in entries), default=1)
        table = [e.pages + [0] * (width - len(e.pages)) for e in entries] or [[0]]
        dev = self.model.device
        return (
            _on_device(table, torch.int32, dev),
            _on_device([e.length for e in entries] or [0], torch.int32, dev),
        )


def _on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` on ``device`` without a host sync: a copy from pageable memory waits for
    every kernel already queued, so the host could not build the next batch while the GPU runs
    this one; from page-locked memory it is queued like a kernel."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
