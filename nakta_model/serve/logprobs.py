"""Per-token log-probabilities of a token sequence, from one packed forward (the scoring path's
``forward_packed``): what ``echo`` + ``logprobs`` return for the prompt, and ``logprobs`` for
generated tokens (scored again after they are decoded, with the prompt in front).

``log_softmax`` in fp32 over the logits at every position; a token's logprob and the top
alternatives come from the same row, so a greedy token's logprob equals the largest of its
row's (lm-eval's ``is_greedy`` test compares them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["SequenceLogprobs", "sequence_logprobs"]


@dataclass
class SequenceLogprobs:
    """For positions 1..N-1 of the sequence: the token's logprob, and the ``top`` alternatives
    (ids, logprobs; most likely first). ``next_top`` / ``next_ids``: the same after the last
    token (what comes next), for a greedy token chosen from this forward."""

    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    next_ids: list[int]
    next_logprobs: list[float]


@torch.no_grad()
def sequence_logprobs(model, tokens: Sequence[int], top: int) -> SequenceLogprobs:
    """Logprobs of ``tokens[1:]`` given what precedes each, and ``max(top, 1)`` alternatives at
    every position (the last included: its row predicts the token after the sequence)."""
    n = len(tokens)
    if n == 0:
        raise ValueError("tokens must hold at least one token")
    dev = model.device
    t = torch.tensor(list(tokens), dtype=torch.int64, device=dev)
    positions = torch.arange(n, dtype=torch.int64, device=dev)
    seq_start = torch.zeros(n, dtype=torch.int64, device=dev)
    logits = model.forward_packed(t, positions, seq_start, None, positions)
    lp = torch.log_softmax(logits.float(), dim=-1)
    k = max(top, 1)
    vals, ids = lp.topk(k, dim=-1)
    own = lp[:-1].gather(1, t[1:, None]).squeeze(1) if n > 1 else lp.new_zeros(0)
    vals, ids, own = vals.cpu().tolist(), ids.cpu().tolist(), own.cpu().tolist()
    return SequenceLogprobs(own, ids[:-1], vals[:-1], ids[-1], vals[-1])
