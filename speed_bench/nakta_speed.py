"""Nakta engines: ``nakta`` (one row per request) and ``nakta_cache`` (shared-context rows).

Both run ``nakta_model.scoring.score`` on the same model: ``nakta_cache`` packs the four
endings of a task behind one copy of its context under a tree mask, so the context is computed
once; ``nakta`` feeds every request on its own, exactly the work lm-eval asks for.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nakta_model.checkpoint import from_meta_state_dict
from nakta_model.model import Transformer
from nakta_model.scoring import score

from .engine import Engine, EngineConfig
from .weights import WeightSource
from .workload import Request, Workload


def build_model(weights: WeightSource, cfg: EngineConfig) -> Transformer:
    """The Nakta model from the shared Meta weights, fused on the device (no host copy)."""
    meta = weights.state_dict(cfg.device, cfg.dtype)
    state = from_meta_state_dict(meta, weights.args)
    del meta
    with torch.device("meta"):
        model = Transformer(weights.args)
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    return model.eval()


class NaktaEngine(Engine):
    def __init__(self, model: Transformer, cfg: EngineConfig, use_cache: bool):
        self.model, self.cfg, self.use_cache = model, cfg, use_cache
        self.name = "nakta_cache" if use_cache else "nakta"

    def score(self, requests: Sequence[Request]) -> list[tuple[float, bool]]:
        return score(
            self.model,
            requests,
            use_cache=self.use_cache,
            token_budget=self.cfg.token_budget,
            max_length=self.cfg.max_length,
            max_rows=self.cfg.max_rows,
            progress=self.cfg.progress,
        )

    def computed_tokens(self, workload: Workload) -> int:
        return workload.unique_tokens() if self.use_cache else workload.request_tokens()

    def close(self) -> None:
        self.model = None
