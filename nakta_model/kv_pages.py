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
captured CUDA graphs) when it changed; users that hold such things register a callback
(:meth:`KVPool.on_rebuild`) so they let go of the old cache before the new one is allocated.

A cap while scoring. On CUDA the engine sizes the pool to ~80% of the free memory; the scorer's
forwards need activation memory that such a pool would leave them short of (an lm-eval run mixes
``loglikelihood`` and ``generate_until`` tasks in one process). So whenever scoring starts
(:meth:`KVPool.trim_for_scoring`, at the start of every ``score`` call, with or without a
prefix cache), the pool may hold at most ``cap`` pages (:meth:`KVPool.scoring_cap_pages`: the
``scoring_cap`` attribute when set, else on CUDA the pages that fit in
:data:`SCORING_FRACTION` of the memory available to the pool, none on the CPU). A pool larger
than the cap (grown for generation) is freed: a new epoch, every user's pages dropped, the
memory given back to the driver (``torch.cuda.empty_cache()``); a prefix cache then makes it
again at its own need (:meth:`KVPool.room_for_scoring`: its budget, at most ``cap - 1``
pages, plus the scratch page). The scorer never grows the pool past the cap either: its
budget is clipped to ``cap - 1`` pages. The engine grows the pool again (a new epoch) when it
next generates. Trimming when scoring starts, not when ``generate()`` returns, keeps a run of
``generate()`` calls (a console, a stream) from reallocating the pool and recapturing its
graphs every call; a switch pays it once, and the pages it would keep die at the engine's next
growth anyway.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "PAGE_SIZE",
    "SCORING_FRACTION",
    "SCRATCH_PAGE",
    "KVPool",
    "PagePool",
    "kv_bytes_available",
    "kv_pool",
    "page_bytes",
    "pages_for",
    "pool_pages",
]

PAGE_SIZE = 64  # a multiple of every decode / packed attention tile
SCRATCH_PAGE = 0
# While scoring the pool holds at most this share of the memory available to it (the scorer's
# default prefix budget is at most a quarter of the free memory too): the rest is the forwards'.
SCORING_FRACTION = 0.25


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
    (no pages, ``epoch`` 0) until a user asks for room (module docstring). ``scoring_cap``:
    the most pages the pool keeps while scoring (None: :data:`SCORING_FRACTION` of the memory
    available on CUDA, no cap on the CPU)."""

    def __init__(self, model):
        self.model, self.epoch = model, 0
        self.n_pages, self._free, self._refs = 0, [], []
        self._cache_ptr: int | None = None
        self.scoring_cap: int | None = None
        self._watchers: list[weakref.WeakMethod] = []

    def on_rebuild(self, method: Callable[[], None]) -> None:
        """Call the bound ``method`` before the cache is replaced or freed (held weakly: a
        user that is gone is not kept alive), so that whatever holds the old cache's addresses
        (captured graphs) lets go of it before the new one is allocated."""
        if not any(w() == method for w in self._watchers):
            self._watchers.append(weakref.WeakMethod(method))

    def _notify(self) -> None:
        alive = [w for w in self._watchers if w() is not None]
        self._watchers = alive
        for w in alive:
            fn = w()
            if fn is not None:
                fn()

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

    def scoring_cap_pages(self) -> int | None:
        """The most pages the pool holds while scoring (class docstring), None for no cap."""
        if self.scoring_cap is not None:
            return self.scoring_cap
        if self.model.device.type != "cuda":
            return None
        pages = int(SCORING_FRACTION * kv_bytes_available(self.model) // page_bytes(self.model))
        return _agreed_over_tp(self.model, pages)  # a replica's ranks trim alike

    def trim_for_scoring(self) -> int | None:
        """Scoring starts: a pool larger than the cap (grown for generation) is freed (a new
        epoch, the memory given back; users that need pages ask again); the cap, None for
        none."""
        cap = self.scoring_cap_pages()
        if cap is None:
            return None
        if isinstance(cap, bool) or not isinstance(cap, int):
            raise ValueError(f"scoring_cap must be an int >= 2 or None, got {cap!r}")
        cap = max(2, cap)
        if self.n_pages > cap:
            self.release()
        return cap

    def room_for_scoring(self, pages: int, held: int = 0) -> int:
        """The pages the scorer may hold now (``pages``, its budget, at most the cap's
        ``cap - 1``), with room for them made in a pool of at most the cap's size (module
        docstring; :meth:`trim_for_scoring` first); ``held``: the scorer's pages of this
        epoch."""
        if isinstance(pages, bool) or not isinstance(pages, int) or pages < 1:
            raise ValueError(f"pages must be a positive int, got {pages!r}")
        cap = self.trim_for_scoring()
        if cap is None:
            self.make_room(pages, held)
            return pages
        want = min(pages, cap - 1)
        current = self._is_current()
        others = self.used_pages - held if current else 0
        if not current:  # none yet (or trimmed), or replaced: the scorer's need
            self._rebuild(1 + want)
        elif self.capacity - others < want:  # room within the cap, the others' pages dropped
            self._rebuild(min(cap, max(self.n_pages, 1 + want + others)))
        return want

    def copy_positions(self, copies: Sequence[tuple[int, int, int]]) -> None:
        """K/V of positions ``src .. src + n - 1`` into ``dst ..`` (positions of the pool's
        flat cache) for each ``(src, dst, n)``, every layer: one gather and one scatter per
        cache tensor for all of them (a copy per row and layer was 64 launches a row for a 7B;
        GSM8K-full admits 1,319 rows)."""
        src = [a + i for a, _, n in copies for i in range(n)]
        dst = [b + i for _, b, n in copies for i in range(n)]
        if not src:
            return
        dev = self.model.device
        src_t = torch.tensor(src, dtype=torch.long, device=dev)
        dst_t = torch.tensor(dst, dtype=torch.long, device=dev)
        for layer in self.model.layers:
            att = layer.attention
            for cache in (att.k_cache, att.v_cache, att.k_scale, att.v_scale):
                if cache is not None:  # the scales: kv_cache="fp8" only
                    cache.index_copy_(0, dst_t, cache.index_select(0, src_t))

    def _rebuild(self, n_pages: int) -> None:
        m = self.model
        self._drop_storage()
        with torch.inference_mode(False):  # normal tensors: users in and out of inference mode
            m.setup_cache(n_pages, PAGE_SIZE)
        self._cache_ptr = m.layers[0].attention.k_cache.data_ptr()
        PagePool.__init__(self, n_pages)
        self.epoch += 1

    def release(self) -> None:
        """Give the cache's memory back (the model's cache is cleared); a new epoch begins,
        with no pages until someone asks for room again."""
        self._drop_storage(clear=self._is_current())  # someone else's cache stays theirs
        self.n_pages, self._free, self._refs, self._cache_ptr = 0, [], [], None
        self.epoch += 1

    def _drop_storage(self, clear: bool = True) -> None:
        """The users let go of the cache, the model drops it (``clear``), and on CUDA the
        memory goes back to the driver: the next pool is sized on it, and the scorer's
        forwards or another process get what the pool gave back."""
        self._notify()
        if clear:
            self.model.clear_cache()
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()


def kv_pool(model) -> KVPool:
    """The model's one KV pool (``model.kv_pool``), made (empty) on first use."""
    pool = getattr(model, "kv_pool", None)
    if pool is None:
        pool = model.kv_pool = KVPool(model)
    return pool


def pages_for(positions: int) -> int:
    """Pages that hold ``positions`` positions."""
    return -(-positions // PAGE_SIZE)


def page_bytes(model) -> int:
    """Bytes of one page: K and V of ``PAGE_SIZE`` positions in every layer; with
    ``kv_cache="fp8"`` one byte an element plus an fp32 scale per position and KV head (a
    128-dim bf16 head: 256 bytes, e4m3: 132, so ~1.94x the positions in the same memory)."""
    per_position = 0
    fp8 = getattr(model, "kv_cache", "bf16") == "fp8"
    elem = 1 if fp8 else torch.empty((), dtype=model.dtype).element_size()
    for layer in model.layers:
        a = layer.attention
        per_position += 2 * a.n_kv_heads * (a.head_dim * elem + (4 if fp8 else 0))
    return per_position * PAGE_SIZE


def kv_bytes_available(model) -> int:
    """CUDA: bytes a KV pool could take if the model's current cache were dropped: the
    driver's free memory, what PyTorch's allocator caches unused (freed activations), and the
    current cache's own bytes. Stable between scoring calls (unlike the driver's free memory,
    which drops as the allocator caches a forward's activations)."""
    dev = model.device
    free = torch.cuda.mem_get_info(dev)[0]
    cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    return free + max(0, cached) + _cache_bytes(model)


def _cache_bytes(model) -> int:
    """Bytes of the model's current KV cache (0: none)."""
    a0 = model.layers[0].attention
    k0, s0 = a0.k_cache, a0.k_scale
    if k0 is None:
        return 0
    per_layer = k0.numel() * k0.element_size() + (0 if s0 is None else s0.numel() * 4)
    return 2 * len(model.layers) * per_layer


def pool_pages(model, *, cap: int, fraction: float = 0.8) -> int:
    """Pages of the KV pool: ``cap`` on the CPU; on CUDA the most that fit in ``fraction`` of
    the device memory free once the model's current cache is dropped, at most ``cap``."""
    if model.device.type != "cuda":
        return cap
    # the current cache is given back before the pool is made
    free = torch.cuda.mem_get_info(model.device)[0] + _cache_bytes(model)
    pages = max(2, min(cap, int(fraction * free // page_bytes(model))))
    return _agreed_over_tp(model, pages)


def _agreed_over_tp(model, pages: int) -> int:
    """The smallest pool of the model's tensor-parallel group: every rank of a replica must
    admit the same rows at the same steps (free memory differs a little between GPUs)."""
    parallel = getattr(model, "parallel", None)
    if parallel is None or parallel.tp_size == 1:
        return pages
    import torch.distributed as dist

    t = torch.tensor([pages], dtype=torch.int64, device=model.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=parallel.tp_group)
    return int(t.item())
