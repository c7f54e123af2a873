"""Nakta engines: ``nakta`` (one row per request), ``nakta_cache`` (every cache) and
``nakta_ctx`` (the per-task shared context only).

All run ``nakta_model.scoring.score`` on the same model: ``nakta_cache`` packs the four
endings of a task behind one copy of its context under a tree mask, so the context is computed
once, and computes a prefix shared by many tasks (a few-shot prompt) once into the prefix
cache; ``nakta_ctx`` is the same without the prefix cache (what it buys, on ``--workload
mmlu``); ``nakta`` feeds every request on its own, exactly the work lm-eval asks for.

Under ``torchrun`` (``--tp/--dp``) each rank builds its tensor-parallel shard of the same
weights, tensor by tensor (``nakta_model.load`` of ``WeightSource.source``: a rank never holds
more than its shard plus one unsplit tensor, so a 30B model splits over two GPUs without first
materialising all 65 GB on each), and the engine shards the requests over the data-parallel
replicas (a task's endings stay together) and gathers the results back in request order.

The engine only; ``nakta_speed.py`` is the command that times it (``run_all`` with these
engines).
"""

from __future__ import annotations

from collections.abc import Sequence

from nakta_model.data_parallel import map_requests
from nakta_model.model import Transformer
from nakta_model.parallel import ParallelContext, gather_objects
from nakta_model.scoring import ScoreStats, score
from speed_bench.engine_api import Engine, EngineConfig
from speed_bench.workload import Request, Workload


class NaktaEngine(Engine):
    def __init__(
        self,
        model: Transformer,
        cfg: EngineConfig,
        use_cache: bool,
        parallel: ParallelContext | None = None,
        prefix_cache: bool = True,
    ):
        self.model, self.cfg, self.use_cache = model, cfg, use_cache
        self.prefix_cache = None if prefix_cache else False  # None: score() finds prefixes
        self.parallel = parallel or ParallelContext()
        self.name = ("nakta_cache" if prefix_cache else "nakta_ctx") if use_cache else "nakta"
        self.stats = ScoreStats(count_unique=False)  # the workload knows its unique tokens

    def score(self, requests: Sequence[Request]) -> list[tuple[float, bool]]:
        self.stats = ScoreStats(count_unique=False)  # of the last call: the timed pass
        if self.parallel.dp_size == 1:
            return self._score_local(requests)
        return map_requests(self._score_local, requests, self.parallel)

    def _score_local(self, requests: Sequence[Request]) -> list[tuple[float, bool]]:
        return score(
            self.model,
            requests,
            use_cache=self.use_cache,
            token_budget=self.cfg.token_budget,
            max_length=self.cfg.max_length,
            max_rows=self.cfg.max_rows,
            progress=self.cfg.progress,
            prefix_cache=self.prefix_cache,
            stats=self.stats,
        )

    def computed_tokens(self, workload: Workload) -> int:
        """Tokens the last ``score`` call ran through the model (scoring's own count), summed
        over the data-parallel replicas (every rank of a replica ran the same)."""
        if self.parallel.world_size == 1:
            return self.stats.computed_tokens
        return sum(gather_objects(self.stats.computed_tokens)) // self.parallel.tp_size

    def close(self) -> None:
        self.model = None
