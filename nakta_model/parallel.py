"""Tensor parallelism: who am I in the TP group, and the two collectives the model needs.

The model is Megatron-style: heads and FFN columns are split across ranks, ``wo`` and ``w2``
are row-split and end in one all-reduce each, the LM head is split over the vocabulary and
gathered only at the positions that are scored. With ``tp_size == 1`` every helper is a no-op,
so single-process code never touches ``torch.distributed``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

__all__ = ["ParallelContext", "all_reduce", "gather_last_dim", "shard_range"]


@dataclasses.dataclass(frozen=True)
class ParallelContext:
    """This process's place in the tensor-parallel group (defaults: one process)."""

    tp_rank: int = 0
    tp_size: int = 1
    tp_group: object | None = None  # a torch.distributed ProcessGroup; None = the default group

    def __post_init__(self) -> None:
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size must be a positive int, got {self.tp_size!r}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, {self.tp_size}), got {self.tp_rank!r}")

    @classmethod
    def from_distributed(cls, group: object | None = None) -> ParallelContext:
        """The whole (or the given) initialized process group as one TP group."""
        if not dist.is_available() or not dist.is_initialized():
            return cls()
        return cls(tp_rank=dist.get_rank(group), tp_size=dist.get_world_size(group), tp_group=group)


def shard_range(total: int, ctx: ParallelContext) -> slice:
    """This rank's contiguous slice of ``total`` items (``total`` must divide evenly)."""
    if total % ctx.tp_size:
        raise ValueError(f"{total} items cannot be split evenly over tp_size={ctx.tp_size}")
    n = total // ctx.tp_size
    return slice(ctx.tp_rank * n, (ctx.tp_rank + 1) * n)


def all_reduce(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Sum ``x`` over the TP group in place (row-parallel ``wo`` / ``w2`` outputs)."""
    if ctx.tp_size == 1:
        return x
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=ctx.tp_group)
    return x


def gather_last_dim(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dim (vocab-split LM head logits)."""
    if ctx.tp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(ctx.tp_size)]
    dist.all_gather(parts, x, group=ctx.tp_group)
    return torch.cat(parts, dim=-1)
