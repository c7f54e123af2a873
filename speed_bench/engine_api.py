"""What a speed-bench engine is: the limits every engine shares (:class:`EngineConfig`) and the
scorer interface (:class:`Engine`), with the engine names.

The lowest layer of the engines: ``nakta_engine``, ``llama_engine`` and ``hf_engine``
implement it, ``engines`` builds them by name, ``run_measure`` times them; none of those import
the speed scripts (``nakta_speed.py`` ...) that run them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nakta_model.scoring import score_with_forward
from speed_bench.workload import Request, Workload

# ``*_fp8``: the same Nakta engine on the model with quant="fp8" (nakta_model/fp8.py)
NAKTA_ENGINES = (
    "nakta", "nakta_cache", "nakta_ctx", "nakta_fp8", "nakta_cache_fp8", "nakta_ctx_fp8",
)  # fmt: skip
ALL_ENGINES = (*NAKTA_ENGINES, "llama_org", "hf")
DEFAULT_ENGINES = ("nakta", "nakta_cache", "llama_org", "hf")  # nakta_ctx: for --workload mmlu
FP8_SUFFIX = "_fp8"


def quantized_name(name: str, quant: str | None) -> str:
    """The engine that runs ``name`` with ``quant`` (``--quant fp8``: Nakta's engines get their
    ``_fp8`` twin; the peers stay as they are)."""
    if quant and name in NAKTA_ENGINES and not name.endswith(FP8_SUFFIX):
        return name + FP8_SUFFIX
    return name


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
