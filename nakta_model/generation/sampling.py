"""Next-token choice on the device, per row, with no host synchronisation (CUDA-graph safe).

Each row has its own settings (continuous batching mixes requests): ``temperature`` 0 means
greedy (argmax of the logits); otherwise the logits are divided by the temperature, cut to the
``top_k`` most likely tokens (0: no cut) and to the nucleus ``top_p`` (Meta's ``sample_top_p``
rule: a sorted token stays while the mass *before* it is <= p), and a token is drawn in
proportion to what is left. The draw is an exponential race (``argmax p_i / E_i`` with
``E_i ~ Exp(1)``), which samples exactly ``p_i / sum p`` without normalising and without
``torch.multinomial``'s host-side checks, so the whole step can be captured in a CUDA graph
(the default CUDA generator advances its offset on every replay).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["SamplingParams", "sample_next"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. ``temperature == 0``: greedy (top_k/top_p unused)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        t, k, p = self.temperature, self.top_k, self.top_p
        if (
            isinstance(t, bool)
            or not isinstance(t, (int, float))
            or not (t >= 0 and math.isfinite(t))
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = no cut), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample_next(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    any_sampling: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token per row of ``logits [B, V]`` (any float dtype; math in fp32): int64 ``[B]``.

    ``temperature`` fp32 ``[B]`` (0 = greedy), ``top_k`` int ``[B]`` (0 = all), ``top_p`` fp32
    ``[B]``. ``any_sampling=False`` skips the sort and the draw when every row is greedy (a
    separate CUDA graph can be captured for that case).
    """
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    if not any_sampling:
        return greedy
    vocab = logits.shape[-1]
    scaled = logits / temperature.clamp_min(1e-6)[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
    rank = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab)
    keep = (rank[None, :] < k[:, None]) & (before <= top_p[:, None])
    keep[:, 0] = True  # the most likely token always stays
    race = torch.empty_like(probs).exponential_(generator=generator)
    choice = (probs * keep / race).argmax(dim=-1, keepdim=True)
    drawn = order.gather(-1, choice).squeeze(-1)
    return torch.where(temperature > 0, drawn, greedy)
