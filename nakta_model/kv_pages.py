"""The model's one KV pool: its KV cache as pages, handed out and counted, shared by the
generation engine and the scorer's prefix cache.

Why pages: rows that reserve ``max_seq_len`` positions up front hold memory they never use
(a 128-token prompt with 128 new tokens in a 2,048-position row uses 1/8 of it), which caps the
rows in flight long before the GPU's bandwidth does. Here the cache is ``n_pages`` pages of
``PAGE_SIZE`` positions (``model.setup_cache(n_pages, PAGE_SIZE)``: the same flat ``[n_pages *
page, n_kv, hd]`` tensors the decode and prefill kernels address by slot), a row holds a block
table of the pages it has written so far, and a page shared by several rows (a held few-shot
prefix) carries a reference count. Page 0 is the scratch page: idle batch entries and the
prefill stream's padding write there, nobody reads it.

One pool per model (:func:`kv_pool`, kept as ``model.kv_pool``): the engine's rows and held
prefixes and the scorer's cached prefixes all take pages from it and give back only their own,
so switching between scoring and generating recomputes nothing. A user asks for room
(:meth:`KVPool.make_room`); when the pool cannot give it besides what the others hold, or the
model's cache was replaced by someone else (``setup_cache`` / ``clear_cache``), the pool is
rebuilt, larger, never smaller, and its ``epoch`` goes up: every user compares the epoch it
last saw and drops its page lists (and anything that holds the old cache's addresses, such as
captured CUDA graphs) when it changed.
"""

from __future__ import annotations

import torch

__all__ = ["PAGE_SIZE", "SCRATCH_PAGE", "KVPool", "PagePool", "kv_pool", "pages_for", "pool_pages"]

PAGE_SIZE = 64  # a multiple of every decode / packed attention tile
SCRATCH_PAGE = 0


class PagePool:
    """Reference-counted pages ``1 .. n_pages - 1`` (page 0: scratch, never handed out).

    ``alloc(n)`` hands out ``n`` free pages with one reference each, ``incref`` adds a holder
    (a row sharing a held prefix's page), ``free`` drops one reference per page and returns a
    page to the free list when none is left. ``free_pages`` / ``used_pages`` count them."""

    def __init__(self, n_pages: int):
        if isinstance(n_pages, bool) or not isinstance(n_pages, int) or n_pages < 2:
            raise ValueError(f"n_pages must be an int >= 2 (page 0 is scratch), got {n_pages!r}")
        self.n_pages = n_pages
        self._free = list(range(n_pages - 1, 0, -1))  # pop() hands out low pages first
        self._refs = [0] * n_pages

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.n_pages - 1 - len(self._free)

    @property
    def capacity(self) -> int:
        """Pages a request may ever hold (all but the scratch page)."""
        return self.n_pages - 1

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV pool: {n} pages asked, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] < 1:
                raise RuntimeError(f"KV pool: page {p} is not held")
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] < 1:
                raise RuntimeError(f"KV pool: page {p} freed more often than held")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def refs(self, page: int) -> int:
        return self._refs[page]


class KVPool(PagePool):
    """The model's KV cache (``setup_cache(n_pages, PAGE_SIZE)``) and its page allocator; empty
    (no pages, ``epoch`` 0) until a user asks for room (module docstring)."""

    def __init__(self, model):
        self.model, self.epoch = model, 0
        self.n_pages, self._free, self._refs = 0, [], []
        self._cache_ptr: int | None = None

    def _is_current(self) -> bool:
        """The model's cache is still the one this pool set up."""
        m = self.model
        k0 = m.layers[0].attention.k_cache
        return (
            self.n_pages > 0
            and k0 is not None
            and k0.data_ptr() == self._cache_ptr
            and (m.max_batch_size, m.max_seq_len) == (self.n_pages, PAGE_SIZE)
        )

    def make_room(self, pages: int, held: int = 0, size: int = 0) -> None:
        """Make sure a user that holds ``held`` pages of this epoch may hold ``pages`` at once
        besides every other user's, in a pool of at least ``size`` pages: rebuild the pool
        larger (new epoch, every page free) when it is not, or when the model's cache is not
        this pool's any more. A pool already larger is kept as it is."""
        if isinstance(pages, bool) or not isinstance(pages, int) or pages < 1:
            raise ValueError(f"pages must be a positive int, got {pages!r}")
        if not self._is_current():
            self._rebuild(max(self.n_pages, size, 1 + pages))
            return
        others = self.used_pages - held
        if self.n_pages < size or self.capacity - others < pages:
            self._rebuild(max(size, 1 + pages + others))

    def _rebuild(self, n_pages: int) -> None:
        m = self.model
        m.clear_cache()
        with torch.inference_mode(False):  # normal tensors: users in and out of inference mode
            m.setup_cache(n_pages, PAGE_SIZE)
        self._cache_ptr = m.layers[0].attention.k_cache.data_ptr()
        PagePool.__init__(self, n_pages)
        self.epoch += 1

    def release(self) -> None:
        """Give the cache's memory back (the model's cache is cleared); a new epoch begins,
        with no pages until someone asks for room again."""
        if self._is_current():
            self.model.clear_cache()
        self.n_pages, self._free, self._refs, self._cache_ptr = 0, [], [], None
        self.epoch += 1


def kv_pool(model) -> KVPool:
    """The model's one KV pool (``model.kv_pool``), made (empty) on first use."""
    pool = getattr(model, "kv_pool", None)
    if pool is None:
        pool = model.kv_pool = KVPool(model)
    return pool


def pages_for(positions: int) -> int:
    """Pages that hold ``positions`` positions."""
    return -(-positions // PAGE_SIZE)


def pool_pages(model, *, cap: int, fraction: float = 0.8) -> int:
    """Pages of the KV pool: ``cap`` on the CPU; on CUDA the most that fit in ``fraction`` of
    the device memory free once the model's current cache is dropped, at most ``cap``."""
    if model.device.type != "cuda":
        return cap
    per_position = (
        sum(2 * layer.attention.n_kv_heads * layer.attention.head_dim for layer in model.layers)
        * torch.empty((), dtype=model.dtype).element_size()
    )
    held = 0
    k0 = model.layers[0].attention.k_cache
    if k0 is not None:  # the current cache is given back before the pool is made
        held = 2 * len(model.layers) * k0.numel() * k0.element_size()
    free = torch.cuda.mem_get_info(model.device)[0] + held
    return max(2, min(cap, int(fraction * free // (per_position * PAGE_SIZE))))
