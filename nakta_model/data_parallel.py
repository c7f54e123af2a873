"""Data parallel: requests sharded over the model replicas, results gathered back in order.

Each replica (one tensor-parallel group, ``parallel.py``) scores its share; every rank ends up
with the full answer in request order. Sharding keeps items with the same key together (the
endings of one HellaSwag context: the shared-context engine still sees a whole task) and
balances the cost (tokens) greedily. It depends only on the inputs and ``dp_size``, so the
ranks of one replica agree on their share without talking.

A group of contexts sharing a long prefix (MMLU's 5 shots of one subject) stays on one replica,
which computes the prefix once, unless it alone holds more than ``1 / (2 dp)`` of the work:
then its contexts are spread like any others (each replica computes the prefix once), so no
replica waits on one giant group.

(lm-eval's requests are not sharded here: lm-eval's own data parallelism hands each replica its
documents, ``accuracy_test/lm_eval_adapter.py``.)
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from time import perf_counter
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
    costs, keys = _request_costs_and_keys(requests, parallel.dp_size)
    return data_parallel_map(fn, requests, parallel, costs=costs, keys=keys)


def _request_costs_and_keys(requests, dp_size: int = 1) -> tuple[list[int], list[Hashable]]:
    """Tokens per request, and what keeps requests together on one replica: a prefix that
    contexts share (``prefix_cache.shared_prefixes``: computed once per replica that holds
    it), else the context itself (its continuations share it)."""
    from nakta_model.prefix_cache import shared_prefixes

    contexts = [tuple(c) for c, _ in requests]
    shared = shared_prefixes(contexts)
    keys = [c[:n] if n else c for c, n in zip(contexts, shared)]
    costs = [len(c) + len(t) for c, t in requests]
    return costs, _spread_heavy_groups(keys, list(contexts), costs, dp_size)


def _spread_heavy_groups(
    keys: list[Hashable], fallback: list[Hashable], costs: Sequence[float], dp_size: int
) -> list[Hashable]:
    """A group worth more than ``1 / (2 dp_size)`` of all the work falls back to its members'
    own keys (their contexts): kept whole it would hold one replica back."""
    if dp_size <= 1:
        return keys
    cap = sum(costs) / (2 * dp_size)
    group_cost: dict[Hashable, float] = {}
    for k, c in zip(keys, costs):
        group_cost[k] = group_cost.get(k, 0.0) + c
    return [f if group_cost[k] > cap else k for k, f in zip(keys, fallback)]


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
    timings: dict[str, float] | None = None,
) -> list[R]:
    """``fn(items)`` computed with the items sharded over the replicas, results in item order.

    ``fn`` maps a list of items to one result per item; it runs on this replica's share only
    (not at all when the share is empty: then it has no collectives to join either, and the
    whole replica skips it together). Every rank returns the full list. ``timings`` (a dict)
    accumulates ``shard_s`` (choosing the share), ``local_s`` (``fn``) and ``gather_s`` (the
    gather, which includes waiting for the slowest replica) and ``items`` (this share's size).
    """
    costs = costs if costs is not None else [1.0] * len(items)
    if len(costs) != len(items):
        raise ValueError(f"costs has {len(costs)} entries, items has {len(items)}")
    t0 = perf_counter()
    idx = shard_indices(costs, parallel, keys)
    t1 = perf_counter()
    local = list(fn([items[i] for i in idx])) if idx else []
    t2 = perf_counter()
    out = gather_in_order(local, idx, len(items), parallel)
    if timings is not None:
        for key, value in (
            ("shard_s", t1 - t0),
            ("local_s", t2 - t1),
            ("gather_s", perf_counter() - t2),
        ):
            timings[key] = timings.get(key, 0.0) + value
        timings["items"] = timings.get("items", 0) + len(idx)
    return out
