"""What a speed-bench engine is: the limits every engine shares (:class:`EngineConfig`) and the
scorer interface (:class:`Engine`), with the engine names.

The lowest layer of the engines: ``nakta_engine``, ``llama_engine`` and ``hf_engine``
implement it, ``engines`` builds them by name, ``run_measure`` times them; none of those import
the speed scripts (``nakta_speed.py`` ...) that run them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from nakta_model.fp8 import Precision
from nakta_model.scoring import score_with_forward
from speed_bench.workload import Request, Workload

NAKTA_KINDS = ("nakta", "nakta_cache", "nakta_ctx")
PEER_KINDS = ("llama_org", "hf")
# the names a user types and the tables show: ``*_fp8`` is the same Nakta engine on the model
# with quant="fp8" (nakta_model/fp8.py); read into an EngineSpec once, by engine_spec()
NAKTA_ENGINES = (*NAKTA_KINDS, *(f"{k}_fp8" for k in NAKTA_KINDS))
ALL_ENGINES = (*NAKTA_ENGINES, *PEER_KINDS)
DEFAULT_ENGINES = ("nakta", "nakta_cache", "llama_org", "hf")  # nakta_ctx: for --workload mmlu


@dataclass(frozen=True)
class EngineSpec:
    """One engine to build: its ``kind`` and the precision options of the model it scores
    (Nakta's engines only). Built once where the command reads ``--engines`` / ``--quant``
    (:func:`engine_spec`); everything below reads the fields, never the name."""

    kind: str
    precision: Precision = field(default_factory=Precision)

    def __post_init__(self) -> None:
        if self.kind not in (*NAKTA_KINDS, *PEER_KINDS):
            raise ValueError(f"unknown engine {self.kind!r}; choose from {ALL_ENGINES}")
        if self.precision.quant and self.kind not in NAKTA_KINDS:
            raise ValueError(f"engine {self.kind!r} has no quant={self.precision.quant!r}")

    @property
    def name(self) -> str:
        """What tables and results call it: ``nakta_cache``, ``nakta_cache_fp8``, ``hf``."""
        return self.kind + (f"_{self.precision.quant}" if self.precision.quant else "")

    @property
    def is_nakta(self) -> bool:
        return self.kind in NAKTA_KINDS


def engine_spec(name: str | EngineSpec, precision: Precision | None = None) -> EngineSpec:
    """The engine a user named (``--engines``), read once: ``nakta_cache_fp8`` is
    ``nakta_cache`` on the FP8 model. ``precision`` (``--quant fp8``) gives Nakta's engines
    that precision; the peers stay as they are."""
    if isinstance(name, EngineSpec):
        return name
    if name not in ALL_ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose from {ALL_ENGINES}")
    fp8 = name in NAKTA_ENGINES and name.endswith("_fp8")
    spec = EngineSpec(name.removesuffix("_fp8") if fp8 else name, Precision("fp8" if fp8 else None))
    if precision is not None and precision.quant and spec.is_nakta:
        spec = EngineSpec(spec.kind, precision)
    return spec


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
