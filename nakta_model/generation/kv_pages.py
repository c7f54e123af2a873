"""The generation engine's KV pool: the model's KV cache as pages, handed out and counted.

Why pages: rows that reserve ``max_seq_len`` positions up front hold memory they never use
(a 128-token prompt with 128 new tokens in a 2,048-position row uses 1/8 of it), which caps the
rows in flight long before the GPU's bandwidth does. Here the cache is ``n_pages`` pages of
``PAGE_SIZE`` positions (``model.setup_cache(n_pages, PAGE_SIZE)``: the same flat ``[n_pages *
page, n_kv, hd]`` tensors the decode and prefill kernels address by slot), a row holds a block
table of the pages it has written so far, and a page shared by several rows (a held few-shot
prefix) carries a reference count. Page 0 is the scratch page: idle batch entries and the
prefill stream's padding write there, nobody reads it.
"""

from __future__ import annotations

import torch

__all__ = ["PAGE_SIZE", "PagePool", "pool_pages"]

PAGE_SIZE = 64  # = prefix_cache.PAGE_SIZE; a multiple of every decode / packed attention tile
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
    pages = max(2, min(cap, int(fraction * free // (per_position * PAGE_SIZE))))
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
