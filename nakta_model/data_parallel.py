"""Data parallel: requests sharded over the model replicas, results gathered back in order.

Each replica (one tensor-parallel group, ``parallel.py``) scores its share; every rank ends up
with the full answer in request order. Sharding keeps items with the same key together (the
endings of one HellaSwag context: the shared-context engine still sees a whole task) and
balances the cost (tokens) greedily. It depends only on the inputs and ``dp_size``, so the
ranks of one replica agree on their share without talking.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

from nakta_model.parallel import ParallelContext, gather_objects

__all__ = [
    "data_parallel_map",
    "gather_in_order",
    "map_requests",
    "shard_indices",
    "shard_requests",
]

T = TypeVar("T")
R = TypeVar("R")


def shard_indices(
    costs: Sequence[float], parallel: ParallelContext, keys: Sequence[Hashable] | None = None
) -> list[int]:
    """The item indices this rank's replica handles, ascending.

    Items with the same key (e.g. the endings of one HellaSwag context) stay together, so the
    shared-context engine still sees every continuation of a context at once. Groups go,
    costliest first, to the replica with the least cost so far (ties: lowest replica), which
    balances the work to within one group. Depends only on the inputs and ``dp_size``, so the
    TP ranks of one replica get the same items without communicating.
    """
    n = len(costs)
    if keys is not None and len(keys) != n:
        raise ValueError(f"keys has {len(keys)} entries, costs has {n}")
    if parallel.dp_size == 1:
        return list(range(n))
    groups: dict[Hashable, list[int]] = {}
    for i in range(n):
        groups.setdefault(keys[i] if keys is not None else i, []).append(i)
    members = list(groups.values())
    cost = [sum(float(costs[i]) for i in m) for m in members]
    order = sorted(range(len(members)), key=lambda g: (-cost[g], members[g][0]))
    load = [0.0] * parallel.dp_size
    mine: list[int] = []
    for g in order:
        replica = min(range(parallel.dp_size), key=lambda r: (load[r], r))
        load[replica] += cost[g]
        if replica == parallel.dp_rank:
            mine.extend(members[g])
    return sorted(mine)


def shard_requests(
    requests: Sequence[tuple[Sequence[int], Sequence[int]]], parallel: ParallelContext
) -> list[int]:
    """:func:`shard_indices` for ``(context_tokens, continuation_tokens)`` requests: grouped
    by context, cost = tokens."""
    costs, keys = _request_costs_and_keys(requests)
    return shard_indices(costs, parallel, keys)


def map_requests(
    fn: Callable[[list[T]], Sequence[R]],
    requests: Sequence[T],
    parallel: ParallelContext,
) -> list[R]:
    """:func:`data_parallel_map` over ``(context_tokens, continuation_tokens)`` requests,
    sharded as :func:`shard_requests` shards them: every scorer of the house (the speed
    bench's engine, parity.py, the lm-eval adapter) splits requests the same way."""
    costs, keys = _request_costs_and_keys(requests)
    return data_parallel_map(fn, requests, parallel, costs=costs, keys=keys)


def _request_costs_and_keys(requests) -> tuple[list[int], list[tuple[int, ...]]]:
    """Tokens per request, and what keeps requests together on one replica: a prefix that
    contexts share (``prefix_cache.shared_prefixes``: computed once per replica that holds
    it), else the context itself (its continuations share it)."""
    from nakta_model.prefix_cache import shared_prefixes

    contexts = [list(c) for c, _ in requests]
    shared = shared_prefixes(contexts)
    keys = [tuple(c[:n]) if n else tuple(c) for c, n in zip(contexts, shared)]
    return [len(c) + len(t) for c, t in requests], keys


def gather_in_order(
    local_results: Sequence[T], local_indices: Sequence[int], total: int, parallel: ParallelContext
) -> list[T]:
    """Every replica's results put back at their item index; the full list on every rank.

    Results travel as pickled host objects over the DP group (gloo), so move tensors to the
    CPU first. Raises if the shards do not cover ``range(total)`` exactly once.
    """
    if len(local_results) != len(local_indices):
        raise ValueError(
            f"{len(local_results)} results for {len(local_indices)} indices on {parallel.describe()}"
        )
    if parallel.dp_size == 1:
        parts = [(list(local_indices), list(local_results))]
    else:
        parts = gather_objects((list(local_indices), list(local_results)), parallel.dp_group)
    out: list[Any] = [None] * total
    seen = [False] * total
    for indices, results in parts:
        for i, r in zip(indices, results):
            if not 0 <= i < total or seen[i]:
                raise RuntimeError(f"data-parallel shards overlap or overflow at item {i}")
            seen[i] = True
            out[i] = r
    if not all(seen):
        raise RuntimeError(f"data-parallel shards miss item {seen.index(False)} of {total}")
    return out


def data_parallel_map(
    fn: Callable[[list[T]], Sequence[R]],
    items: Sequence[T],
    parallel: ParallelContext,
    *,
    costs: Sequence[float] | None = None,
    keys: Sequence[Hashable] | None = None,
) -> list[R]:
    """``fn(items)`` computed with the items sharded over the replicas, results in item order.

    ``fn`` maps a list of items to one result per item; it runs on this replica's share only
    (not at all when the share is empty: then it has no collectives to join either, and the
    whole replica skips it together). Every rank returns the full list.
    """
    costs = costs if costs is not None else [1.0] * len(items)
    if len(costs) != len(items):
        raise ValueError(f"costs has {len(costs)} entries, items has {len(items)}")
    idx = shard_indices(costs, parallel, keys)
    local = list(fn([items[i] for i in idx])) if idx else []
    return gather_in_order(local, idx, len(items), parallel)
