"""The generation engine's side of the KV pool: which pages each row holds and may still take.

A row reserves at admission the pages its prompt and ``max_new_tokens`` can ever need (so an
admitted row never runs out: no preemption) and takes them as it grows. Shared few-shot
prefixes are prefilled once into pages of their own and held (LRU, ``prefix_rows`` at most);
a row holds their full pages by reference and a copy of the partial last page
(copy-on-write, queued and made in one gather/scatter per admission round). This is a mixin of
:class:`~nakta_model.generation.engine.Generator`: it reads the engine's ``model``, ``pool``,
``stats``, ``row_pages``, ``n_prefixes``, ``max_seq_len`` (annotated below); the scheduling
stays there.
"""

from __future__ import annotations

from collections import OrderedDict

from nakta_model.generation.prefill_stream import PrefillStream
from nakta_model.generation.requests import GenerationStats, _Held, _Row
from nakta_model.kv_pages import PAGE_SIZE, KVPool, kv_pool, pages_for

__all__ = ["RowPages"]


class RowPages:
    """Page keeping for the generation engine (module docstring)."""

    model: object
    pool: KVPool
    stats: GenerationStats
    row_pages: int
    n_prefixes: int
    max_seq_len: int
    _held: OrderedDict[tuple[int, ...], _Held]
    _copies: list[tuple[int, int, int]]
    _steps: dict  # the engine's captured steps (they hold the cache's addresses)
    _epoch: int | None  # the pool epoch those steps and held prefixes belong to
    _n_pages: int  # pages asked of the pool
    _room: int  # pages a row may ever take: the pool's but the other users'

    def _ensure_cache(self) -> None:
        """The model's KV pool, of at least ``_n_pages`` pages (a larger one is used as it is),
        with room for a full row (at most ``_n_pages - 1``) besides the others' pages
        (``KVPool.make_room``); rows wait for pages the others hold. When the pool was rebuilt
        since (a new epoch), the captured steps (they hold the old cache's addresses) and the
        held prefixes are dropped."""
        self.pool = kv_pool(self.model)
        self.pool.on_rebuild(self._forget_cache)
        held = self.held_pages if self._epoch == self.pool.epoch else 0
        self.pool.make_room(min(self.row_pages, self._n_pages - 1), held, size=self._n_pages)
        if self._epoch != self.pool.epoch:
            self._forget_cache()
            self._epoch = self.pool.epoch
        self.model._rope_tables(self.row_pages * PAGE_SIZE)  # rows may pass 2 x max_seq_len
        self._room = self.pool.capacity - (self.pool.used_pages - self.held_pages)

    def _forget_cache(self) -> None:
        """The pool's cache is being replaced or freed (the pool calls this first): drop what
        holds its addresses or pages (the captured steps, the held prefixes), so its memory
        can go before the next cache is allocated."""
        self._steps.clear()
        self._held.clear()

    @property
    def held_pages(self) -> int:
        """Pages the held shared prefixes hold (the pool's only pages in use between calls)."""
        return sum(len(h.pages) for h in self._held.values())

    def _positions(self, r: _Row) -> int:
        """Positions row r may write: its prompt and every decoded token but the last."""
        return min(r.total, self.max_seq_len) - 1

    def _available(self, running: list[_Row]) -> int:
        return self.pool.free_pages - sum(x.reserved for x in running)

    def _reserve(self, r: _Row, running: list[_Row]) -> bool:
        """Give row r its shared prefix's pages (computing the prefix when it is not held) and
        reserve the pages it will write; False (nothing changed) when the pool cannot cover it
        until running rows finish."""
        key = tuple(r.request.prompt[: r.shared])
        total = pages_for(self._positions(r))

        def fits() -> bool:
            if not r.shared:
                return total <= self._available(running)
            held = self._held.get(key)
            compute = 0 if held is not None else pages_for(r.shared)
            return compute + total - r.shared // PAGE_SIZE <= self._available(running)

        # held prefixes nobody else holds give their pages back when evicted (LRU first)
        while not fits():
            idle = [k for k, h in self._held.items() if k != key and self._unshared(h)]
            if not idle:
                break
            self._evict(idle[0])
        if not fits():
            if running:
                return False
            for k in list(self._held):  # nothing runs: the pool is all this row's
                self._evict(k)
            r.shared = 0
            key = ()
        if r.shared:
            held = self._held.get(key) or self._compute_prefix(key)
            self._held.move_to_end(key)  # most recently used
            n_full = r.shared // PAGE_SIZE
            self.pool.incref(held.pages[:n_full])
            r.pages, r.held, r.done = list(held.pages[:n_full]), held, r.shared
            if r.shared % PAGE_SIZE:  # copy-on-write: the partial page's keys into its own
                (own,) = self.pool.alloc(1)
                self._copy_page(held.pages[n_full], own, r.shared % PAGE_SIZE)
                r.pages.append(own)
        r.reserved = total - len(r.pages)
        self._note_peak()
        return True

    def _unshared(self, held: _Held) -> bool:
        return all(self.pool.refs(p) == 1 for p in held.pages)

    def _evict(self, key: tuple[int, ...]) -> None:
        """Drop a held prefix: its pages go back once no row holds them any more (copies
        pending from them are made first: a freed page may be handed out and rewritten)."""
        self._flush_copies()
        self.pool.free(self._held.pop(key).pages)

    def _compute_prefix(self, key: tuple[int, ...]) -> _Held:
        """Prefill ``key`` into pages of its own (one forward), evicting the least recently
        used held prefix first when ``prefix_rows`` are held."""
        if len(self._held) >= self.n_prefixes:
            self._evict(next(iter(self._held)))
        used = {h.slot for h in self._held.values()}
        slot = next(i for i in range(self.n_prefixes) if i not in used)
        pages = self.pool.alloc(pages_for(len(key)))
        try:
            stream = PrefillStream()
            stream.add(list(key), 0, len(key), pages)
            stream.run(self.model)
        except BaseException:
            self.pool.free(pages)
            raise
        held = self._held[key] = _Held(pages, len(key), slot)
        self.stats.prefilled_tokens += len(key)
        self._note_peak()
        return held

    def _copy_page(self, src: int, dst: int, n: int) -> None:
        """K/V of the first ``n`` positions of page ``src`` into page ``dst``, every layer: queued
        until ``_flush_copies`` (end of an admission round, or before an eviction)."""
        self._copies.append((src * PAGE_SIZE, dst * PAGE_SIZE, n))

    def _flush_copies(self) -> None:
        """Make the queued page copies: one gather and one scatter per cache tensor for all of
        them (a copy per row and layer was 64 launches a row for a 7B: GSM8K-full admits
        1,319 rows, ~84k launches the GPU waited for)."""
        if self._copies:
            self.pool.copy_positions(self._copies)
            self._copies.clear()

    def _grow(self, r: _Row, positions: int) -> None:
        """Pages for row r's first ``positions`` positions, from its reservation."""
        need = pages_for(positions) - len(r.pages)
        if need > 0:
            if need > r.reserved:
                raise RuntimeError(f"requests[{r.index}]: {need} pages past its reservation")
            r.pages += self.pool.alloc(need)
            r.reserved -= need
            self._note_peak()

    def _note_peak(self) -> None:
        self.stats.peak_pages = max(self.stats.peak_pages, self.pool.used_pages)

    def _free_row(self, r: _Row) -> None:
        self.pool.free(r.pages)
        r.pages, r.reserved = [], 0

    def _reads_held(self, r: _Row) -> bool:
        """Row r's shared prefix is still held (not evicted since it was admitted)."""
        return r.held is not None and self._held.get(tuple(r.request.prompt[: r.shared])) is r.held
