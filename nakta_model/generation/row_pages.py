"""The generation engine's side of the KV pool: which pages each row holds and may still take.

A row reserves at admission the pages its prompt and ``max_new_tokens`` can ever need (so an
admitted row never runs out: no preemption) and takes them as it grows. Shared few-shot
prefixes are prefilled once into pages of their own and held (LRU, ``prefix_rows`` at most);
a row holds their full pages by reference and a copy of the partial last page
(copy-on-write, queued and made in one gather/scatter per admission round).

:class:`RowPages` is one object the engine owns (``Generator.pages``): the engine decides
when rows are admitted, grow and finish; this class says whether the pool covers them and
which pages they get. It touches the model only to prefill a held prefix and to size the pool.
"""

from __future__ import annotations

from collections import OrderedDict

from nakta_model.generation.prefill_stream import PrefillStream
from nakta_model.generation.requests import GenerationStats, _Held, _Row
from nakta_model.kv_pages import PAGE_SIZE, KVPool, kv_pool, pages_for

__all__ = ["RowPages"]


class RowPages:
    """Page keeping for the generation engine (module docstring).

    ``row_pages``: a row's block-table width (pages of its longest row); ``n_pages``: pages
    asked of the model's pool; ``prefix_rows``: shared prefixes held at most; ``max_seq_len``:
    the positions a row may hold. ``held``: the held prefixes by their tokens, least recently
    used first (the decode step's cascade reads them)."""

    def __init__(
        self, model, *, row_pages: int, n_pages: int, prefix_rows: int, max_seq_len: int
    ) -> None:
        self.model, self.row_pages, self.n_pages = model, row_pages, n_pages
        self.prefix_rows, self.max_seq_len = prefix_rows, max_seq_len
        self.held: OrderedDict[tuple[int, ...], _Held] = OrderedDict()
        self.pool: KVPool = kv_pool(model)
        self.room = 0  # pages one row may ever take: the pool's but the other users'
        self.stats = GenerationStats()  # where peak pages and prefix tokens are counted
        self._copies: list[tuple[int, int, int]] = []  # (src, dst, n) positions, not yet made
        self._epoch: int | None = None  # the pool epoch the held prefixes belong to

    def begin(self, stats: GenerationStats) -> bool:
        """Ready the model's pool for a ``generate`` call that counts into ``stats``: at least
        ``n_pages`` pages (a larger pool is used as it is), with room for a full row (at most
        ``n_pages - 1``) besides the other users' pages (``KVPool.make_room``); rows wait for
        pages the others hold. True when the pool was rebuilt since the last call (a new
        epoch): the held prefixes are gone and so must be whatever the caller captured on the
        old cache's addresses."""
        self.stats = stats
        self.pool = kv_pool(self.model)
        self.pool.on_rebuild(self.forget)
        held = self.held_pages if self._epoch == self.pool.epoch else 0
        self.pool.make_room(min(self.row_pages, self.n_pages - 1), held, size=self.n_pages)
        rebuilt = self._epoch != self.pool.epoch
        if rebuilt:
            self.forget()
            self._epoch = self.pool.epoch
        self.model._rope_tables(self.row_pages * PAGE_SIZE)  # rows may pass 2 x max_seq_len
        self.room = self.pool.capacity - (self.pool.used_pages - self.held_pages)
        return rebuilt

    def forget(self) -> None:
        """The pool's cache is being replaced or freed (the pool calls this first): drop the
        held prefixes, so their memory can go before the next cache is allocated."""
        self.held.clear()

    @property
    def held_pages(self) -> int:
        """Pages the held shared prefixes hold (the pool's only pages in use between calls)."""
        return sum(len(h.pages) for h in self.held.values())

    def positions(self, r: _Row) -> int:
        """Positions row r may write: its prompt and every decoded token but the last."""
        return min(r.total, self.max_seq_len) - 1

    def reserve(self, r: _Row, running: list[_Row]) -> bool:
        """Give row r its shared prefix's pages (computing the prefix when it is not held) and
        reserve the pages it will write; False (nothing changed) when the pool cannot cover it
        until running rows finish. Copy-on-write copies wait for :meth:`flush_copies`."""
        key = tuple(r.request.prompt[: r.shared])
        total = pages_for(self.positions(r))

        def fits() -> bool:
            if not r.shared:
                return total <= self._available(running)
            held = self.held.get(key)
            compute = 0 if held is not None else pages_for(r.shared)
            return compute + total - r.shared // PAGE_SIZE <= self._available(running)

        # held prefixes nobody else holds give their pages back when evicted (LRU first)
        while not fits():
            idle = [k for k, h in self.held.items() if k != key and self._unshared(h)]
            if not idle:
                break
            self._evict(idle[0])
        if not fits():
            if running:
                return False
            for k in list(self.held):  # nothing runs: the pool is all this row's
                self._evict(k)
            r.shared = 0
            key = ()
        if r.shared:
            held = self.held.get(key) or self._compute_prefix(key)
            self.held.move_to_end(key)  # most recently used
            n_full = r.shared // PAGE_SIZE
            self.pool.incref(held.pages[:n_full])
            r.pages, r.held, r.done = list(held.pages[:n_full]), held, r.shared
            if r.shared % PAGE_SIZE:  # copy-on-write: the partial page's keys into its own
                (own,) = self.pool.alloc(1)
                self._copies.append((held.pages[n_full] * PAGE_SIZE, own * PAGE_SIZE,
                                     r.shared % PAGE_SIZE))  # fmt: skip
                r.pages.append(own)
        r.reserved = total - len(r.pages)
        self._note_peak()
        return True

    def flush_copies(self) -> None:
        """Make the queued copy-on-write page copies: one gather and one scatter per cache
        tensor for all of them (not a copy per row and layer: thousands of small launches)."""
        if self._copies:
            self.pool.copy_positions(self._copies)
            self._copies.clear()

    def grow(self, r: _Row, positions: int) -> None:
        """Pages for row r's first ``positions`` positions, from its reservation."""
        need = pages_for(positions) - len(r.pages)
        if need > 0:
            if need > r.reserved:
                raise RuntimeError(f"requests[{r.index}]: {need} pages past its reservation")
            r.pages += self.pool.alloc(need)
            r.reserved -= need
            self._note_peak()

    def free_row(self, r: _Row) -> None:
        """Row r's pages back to the pool (held prefix pages: its reference only)."""
        self.pool.free(r.pages)
        r.pages, r.reserved = [], 0

    def reads_held(self, r: _Row) -> bool:
        """Row r's shared prefix is still held (not evicted since it was admitted)."""
        return r.held is not None and self.held.get(tuple(r.request.prompt[: r.shared])) is r.held

    # ---------------------------------------------------------------------------- inside
    def _available(self, running: list[_Row]) -> int:
        return self.pool.free_pages - sum(x.reserved for x in running)

    def _unshared(self, held: _Held) -> bool:
        return all(self.pool.refs(p) == 1 for p in held.pages)

    def _evict(self, key: tuple[int, ...]) -> None:
        """Drop a held prefix: its pages go back once no row holds them any more (copies
        pending from them are made first: a freed page may be handed out and rewritten)."""
        self.flush_copies()
        self.pool.free(self.held.pop(key).pages)

    def _compute_prefix(self, key: tuple[int, ...]) -> _Held:
        """Prefill ``key`` into pages of its own (one forward), evicting the least recently
        used held prefix first when ``prefix_rows`` are held."""
        if len(self.held) >= self.prefix_rows:
            self._evict(next(iter(self.held)))
        used = {h.slot for h in self.held.values()}
        slot = next(i for i in range(self.prefix_rows) if i not in used)
        pages = self.pool.alloc(pages_for(len(key)))
        try:
            stream = PrefillStream()
            stream.add(list(key), 0, len(key), pages)
            stream.run(self.model)
        except BaseException:
            self.pool.free(pages)
            raise
        held = self.held[key] = _Held(pages, len(key), slot)
        self.stats.prefilled_tokens += len(key)
        self._note_peak()
        return held

    def _note_peak(self) -> None:
        self.stats.peak_pages = max(self.stats.peak_pages, self.pool.used_pages)
