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

    python speed_bench/nakta_speed.py [run_all options]           # results/<device>/nakta/
    cd speed_bench && torchrun --nproc_per_node 4 nakta_speed.py  # tp = 4 (the world size)
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

if not __package__:  # run by path: import from the repo root, not from this script's folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from nakta_model.data_parallel import map_requests
from nakta_model.model import Transformer
from nakta_model.parallel import ParallelContext, gather_objects
from nakta_model.scoring import ScoreStats, score
from speed_bench.engines import NAKTA_ENGINES, Engine, EngineConfig
from speed_bench.workload import Request, Workload

ENGINES = NAKTA_ENGINES
DESCRIPTION = (
    "Scoring speed of Nakta's engines (nakta, nakta_cache; nakta_ctx on request), measured as "
    "speed_bench.run_all measures it (same options). Under torchrun the model is split over the "
    "whole world (tp = world size) unless --dp/--tp say otherwise."
)


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


def main(argv: list[str] | None = None) -> dict | None:
    """``run_all`` with the Nakta engines only."""
    from speed_bench.run_all import EngineSet
    from speed_bench.run_all import main as run_all_main

    return run_all_main(argv, EngineSet(ENGINES, "nakta", DESCRIPTION, ("nakta", "nakta_cache")))


if __name__ == "__main__":
    main()
