"""The speed-bench engines: what every engine is, which exist, how to build one.

An engine is a scorer of token requests plus an honest token count. Engines are built one at a
time from a :class:`~speed_bench.weights.WeightSource` and freed before the next, so each one's
peak memory is its own. A multi-GPU engine (tensor / data parallel) fits the same shape: build
it from the same weights, score the same requests.

``nakta`` / ``nakta_cache`` / ``nakta_ctx`` (``nakta_speed.py``, one shared model built by ``nakta_model.load``
from the weights), ``llama_org`` (``llama_speed.py``) and ``hf`` (``hf_speed.py``).
This module, ``weights.py`` and ``workload.py`` are speed_bench's public API: ``run_all`` and
``model_profile`` both build and time engines through them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nakta_model.parallel import ParallelContext
from nakta_model.scoring import score_with_forward
from speed_bench.weights import WeightSource
from speed_bench.workload import Request, Workload

ALL_ENGINES = ("nakta", "nakta_cache", "nakta_ctx", "llama_org", "hf")
DEFAULT_ENGINES = ("nakta", "nakta_cache", "llama_org", "hf")  # nakta_ctx: for --workload mmlu
NAKTA_ENGINES = ("nakta", "nakta_cache", "nakta_ctx")


@dataclass(frozen=True)
class EngineConfig:
    """The limits every engine shares, so the comparison is like for like."""

    device: torch.device
    dtype: torch.dtype
    token_budget: int  # padded tokens (rows x longest row) per forward call
    max_length: int  # model input length limit (lm-eval's left truncation)
    max_rows: int | None = None  # rows per forward call, on top of the token budget
    progress: bool = True


class Engine:
    """Scores lm-eval requests: ``[(sum of continuation log-probs, is_greedy)]``."""

    name: str = "engine"

    def score(self, requests: Sequence[Request]) -> list[tuple[float, bool]]:
        raise NotImplementedError

    def score_plain(
        self, forward, requests: Sequence[Request], cfg: EngineConfig, vocab_size: int
    ) -> list[tuple[float, bool]]:
        """The peers' scoring: one padded row per request through ``forward`` (tokens ->
        logits), under the same limits as Nakta's engines."""
        return score_with_forward(
            forward,
            requests,
            max_length=cfg.max_length,
            batch_size=cfg.max_rows,
            token_budget=cfg.token_budget,
            vocab_size=vocab_size,
            device=cfg.device,
            progress=cfg.progress,
        )

    def computed_tokens(self, workload: Workload) -> int:
        """Non-padding tokens this engine pushes through the blocks for ``workload``."""
        return workload.request_tokens()

    def close(self) -> None:
        """Drop device memory (the runner builds the next engine only after this)."""


# ----------------------------------------------------------------------------- building
def make_engine(
    name: str,
    weights: WeightSource,
    cfg: EngineConfig,
    shared: dict,
    parallel: ParallelContext | None = None,
) -> Engine:
    """Build ``name``; ``nakta`` and ``nakta_cache`` share one model (kept in ``shared``): this
    rank's shard, built by ``nakta_model.load`` from the weights one Meta tensor at a time."""
    parallel = parallel or ParallelContext()
    if name in NAKTA_ENGINES:
        from nakta_model.loading import load
        from speed_bench.nakta_speed import NaktaEngine

        if "nakta" not in shared:
            source = weights.source(cfg.device, cfg.dtype)
            shared["nakta"] = load(source, cfg.device, cfg.dtype, parallel)
        return NaktaEngine(
            shared["nakta"],
            cfg,
            use_cache=name != "nakta",
            parallel=parallel,
            prefix_cache=name != "nakta_ctx",
        )
    if name not in ALL_ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose from {ALL_ENGINES}")
    reason = _grid_reason(name, parallel)
    if reason:
        raise ValueError(f"engine {name!r} cannot run on {parallel.describe()}: {reason}")
    if name == "llama_org":
        from speed_bench.llama_speed import LlamaOrgEngine

        return LlamaOrgEngine(weights, cfg)
    from speed_bench.hf_speed import HFEngine

    return HFEngine(weights, cfg)


def _grid_reason(name: str, parallel: ParallelContext) -> str | None:
    """Why ``name`` cannot run on this grid: llama_org splits over the whole world only
    (Meta's model parallel, MP = world size), hf runs in one process."""
    if parallel.world_size == 1 or name in NAKTA_ENGINES:
        return None
    if name == "hf":
        return "single-GPU engine: it runs only in a plain `python` process (world size 1)"
    if parallel.tp_size != parallel.world_size:
        return (
            f"llama_org runs Meta's model parallel over the whole world "
            f"(MP = {parallel.world_size}), not over dp {parallel.dp_size} replicas: time it "
            "with --dp 1"
        )
    return None


def skip_reason(name: str, parallel: ParallelContext | None = None) -> str | None:
    """Why ``name`` is not timed here (this grid, or a package missing), or None."""
    reason = _grid_reason(name, parallel or ParallelContext())
    if reason:
        return reason
    if name == "hf":
        from speed_bench.hf_speed import unavailable_reason

        return unavailable_reason()
    if name == "llama_org":
        try:
            import fairscale  # noqa: F401
        except ImportError:
            return "fairscale is not installed (llama_org needs it)"
    return None
