"""The parallel grid over ``torch.distributed``, launched by ``torchrun``: this rank's place
(:class:`ParallelContext`), the process groups, the tensor-parallel collectives, :func:`launch`.

A run is a grid of ``world = tp x dp`` processes. Ranks ``[d*tp, (d+1)*tp)`` form tensor-parallel
group ``d`` (neighbouring ranks: the same host, NVLink); the ranks with the same ``tp_rank``
form a data-parallel group. Every TP group is one model replica, Megatron-style: heads and FFN
columns split across its ranks, ``wo`` and ``w2`` row-split and ending in one all-reduce each,
the embedding replicated, the LM head split over the vocabulary and gathered only at the rows
that are scored. Sharding requests over the replicas: ``data_parallel.py``; loading this rank's
shard of a model: ``loading.py``.

Backends: NCCL for CUDA tensors and gloo for host objects (one process group serving both,
``cpu:gloo,cuda:nccl``); gloo alone on the CPU. With ``tp == dp == 1`` nothing here touches
``torch.distributed``: single-process code needs neither ``torchrun`` nor a process group.

Bad configurations (world size not ``tp x dp``, heads / KV heads / FFN / vocab not divisible by
``tp``, a checkpoint sharded for another ``tp``) are found from values every rank shares (the
launcher's environment, the arguments, ``params.json``) BEFORE any collective, so every rank
raises the same :class:`ParallelConfigError` and none waits for a rank that already left.
Failures that only some ranks can see (a missing shard file) go through :func:`collective_call`,
which turns them into the same error on every rank. :func:`launch` prints such an error once
(rank 0) and exits every rank with status 2.

    torchrun --nproc_per_node 2 -m speed_bench.run_all --preset 13B --tp 2
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from nakta_model.process_exit import exit_without_teardown

__all__ = [
    "ParallelConfigError",
    "ParallelContext",
    "all_reduce",
    "barrier",
    "collective_call",
    "gather_last_dim",
    "gather_objects",
    "grid_groups",
    "grid_position",
    "init_parallel",
    "is_distributed",
    "launch",
    "shutdown",
    "validate_grid",
]

T = TypeVar("T")
R = TypeVar("R")


class ParallelConfigError(ValueError):
    """A tensor/data-parallel set-up that cannot work; raised identically on every rank."""


@dataclasses.dataclass(frozen=True)
class ParallelContext:
    """This process's place in the ``tp x dp`` grid (defaults: one process, nothing split).

    ``tp_group`` / ``dp_group`` are ``torch.distributed`` process groups (``None`` = the default
    group, used when a group spans the whole world; never used when its size is 1). ``device``
    is this rank's device when :func:`init_parallel` chose it.
    """

    tp_rank: int = 0
    tp_size: int = 1
    tp_group: object | None = None
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: object | None = None
    device: torch.device | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "dp"):
            size, rank = getattr(self, f"{name}_size"), getattr(self, f"{name}_rank")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"{name}_size must be a positive int, got {size!r}")
            if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < size:
                raise ValueError(f"{name}_rank must be in [0, {size}), got {rank!r}")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.dp_size

    @property
    def rank(self) -> int:
        """Global rank: replicas are blocks of ``tp_size`` consecutive ranks."""
        return self.dp_rank * self.tp_size + self.tp_rank

    @property
    def is_leader(self) -> bool:
        """Global rank 0: the one process that prints and writes files."""
        return self.rank == 0

    def describe(self) -> str:
        where = f", {self.device}" if self.device is not None else ""
        return (
            f"rank {self.rank}/{self.world_size}: tp {self.tp_rank}/{self.tp_size}, "
            f"dp {self.dp_rank}/{self.dp_size}{where}"
        )


# ------------------------------------------------------------------------------ TP collectives
def all_reduce(x: torch.Tensor, parallel: ParallelContext) -> torch.Tensor:
    """Sum ``x`` over the TP group in place (row-parallel ``wo`` / ``w2`` outputs)."""
    if parallel.tp_size == 1:
        return x
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=parallel.tp_group)
    return x


def gather_last_dim(x: torch.Tensor, parallel: ParallelContext) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dim (vocab-split LM head logits, Meta's
    dim-split embedding)."""
    if parallel.tp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(parallel.tp_size)]
    dist.all_gather(parts, x, group=parallel.tp_group)
    return torch.cat(parts, dim=-1)


# --------------------------------------------------------------------------------- the grid
def grid_position(rank: int, tp: int, dp: int) -> tuple[int, int]:
    """``(tp_rank, dp_rank)`` of global ``rank``: TP groups are blocks of consecutive ranks, so
    a replica's all-reduces stay on one host (NVLink) whenever ``tp`` divides GPUs per host."""
    if not 0 <= rank < tp * dp:
        raise ValueError(f"rank must be in [0, {tp * dp}), got {rank}")
    return rank % tp, rank // tp


def grid_groups(tp: int, dp: int) -> tuple[list[list[int]], list[list[int]]]:
    """The ranks of every TP group (one per replica) and every DP group (one per TP rank)."""
    tp_groups = [[d * tp + t for t in range(tp)] for d in range(dp)]
    dp_groups = [[d * tp + t for d in range(dp)] for t in range(tp)]
    return tp_groups, dp_groups


def _positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ParallelConfigError(f"--{name} must be a positive integer, got {value!r}")
    return value


def _checkpoint_tp(checkpoint: str | Path) -> tuple[Any, int | None]:
    """``(ModelArgs, stored tp_size)`` of a Nakta checkpoint, from its ``params.json`` only."""
    from nakta_model.checkpoint import read_args

    try:
        args, params = read_args(checkpoint)
    except (OSError, ValueError) as e:
        raise ParallelConfigError(f"cannot read checkpoint {checkpoint}: {e}") from e
    return args, params.get("tp_size")


def validate_grid(
    tp: int,
    dp: int,
    world_size: int,
    *,
    args: Any | None = None,
    checkpoint: str | Path | None = None,
) -> None:
    """Raise :class:`ParallelConfigError` for any grid that cannot run.

    Uses only values every rank shares, so all ranks agree without talking to each other.
    ``args`` (a ``ModelArgs``) adds the divisibility checks; ``checkpoint`` (a Nakta checkpoint
    directory) adds them from its ``params.json`` and refuses one sharded for another ``tp``.
    """
    tp, dp = _positive("tp", tp), _positive("dp", dp)
    if world_size != tp * dp:
        if world_size == 1:
            hint = f"launch it with: torchrun --nproc_per_node {tp * dp} ..."
        else:
            hint = f"launch {tp * dp} processes, or pick --tp/--dp with tp x dp = {world_size}"
        raise ParallelConfigError(
            f"world size {world_size} != tp {tp} x dp {dp} = {tp * dp}: {hint}"
        )
    stored_tp = None
    if checkpoint is not None:
        ckpt_args, stored_tp = _checkpoint_tp(checkpoint)
        args = args if args is not None else ckpt_args
    if args is not None:
        try:
            args.check_tp(tp)
        except ValueError as e:
            raise ParallelConfigError(f"--tp {tp} cannot split this model: {e}") from e
    if checkpoint is not None and stored_tp != tp:
        raise ParallelConfigError(
            f"checkpoint {checkpoint} is sharded for tp={stored_tp}, but this run has --tp {tp}; "
            f"reshard it with: python convert.py <meta-or-hf-dir> <out-dir> --tp {tp}"
        )


# --------------------------------------------------------------------------- process groups
_STATE: dict[str, Any] = {"started": False, "groups": {}}
_QUIET_RANK_EXIT_DELAY_S = 2.0


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ParallelConfigError(
            f"environment variable {name}={raw!r} is not an integer"
        ) from None


def _world_from_env() -> tuple[int, int]:
    """``(world_size, rank)``: the live process group's, else torchrun's variables, else 1 x 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return _env_int("WORLD_SIZE", 1), _env_int("RANK", 0)


def _resolve_device(device: torch.device | str | None) -> torch.device:
    """``None``: this rank's GPU (``LOCAL_RANK``) when CUDA is present, else the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ParallelConfigError("device cuda was requested but CUDA is not available")
    local_world = _env_int("LOCAL_WORLD_SIZE", 1)
    n_gpus = torch.cuda.device_count()
    if device.index is None:
        if local_world > n_gpus:  # every rank on this host sees the same two numbers
            raise ParallelConfigError(
                f"{local_world} processes per host but only {n_gpus} GPU(s) visible: "
                f"use torchrun --nproc_per_node <= {n_gpus}"
            )
        device = torch.device("cuda", _env_int("LOCAL_RANK", 0))
    torch.cuda.set_device(device)
    return device


def _new_group(ranks: list[int], world: int) -> object | None:
    """A process group over ``ranks`` (every rank must call this, in the same order)."""
    if len(ranks) == 1 or len(ranks) == world:
        return None  # never used (size 1) / the default group
    group = dist.new_group(ranks)
    return group if dist.get_rank() in ranks else None


def init_parallel(
    tp: int = 1,
    dp: int = 1,
    *,
    args: Any | None = None,
    checkpoint: str | Path | None = None,
    device: torch.device | str | None = None,
    timeout_s: float | None = None,
) -> ParallelContext:
    """Join the ``tp x dp`` grid ``torchrun`` launched and return this rank's context.

    Validates first (:func:`validate_grid`), then creates the default process group (once per
    process; ``cpu:gloo,cuda:nccl`` on GPUs, ``gloo`` on the CPU) and the TP / DP groups. Each
    rank uses the GPU ``LOCAL_RANK`` unless ``device`` says otherwise. A plain ``python`` run is
    a world of one: with ``tp == dp == 1`` no process group is created at all.
    """
    world, rank = _world_from_env()
    validate_grid(tp, dp, world, args=args, checkpoint=checkpoint)
    dev = _resolve_device(device)
    if world == 1 and not dist.is_initialized():
        return ParallelContext(device=dev)
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo"
        kw = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
        dist.init_process_group(backend, **kw)
        _STATE["started"] = True
        _STATE["groups"] = {}
    key = (tp, dp)
    if key not in _STATE["groups"]:
        tp_ranks, dp_ranks = grid_groups(tp, dp)
        tp_groups = [_new_group(r, world) for r in tp_ranks]
        dp_groups = [_new_group(r, world) for r in dp_ranks]
        _STATE["groups"][key] = (tp_groups, dp_groups)
    tp_groups, dp_groups = _STATE["groups"][key]
    tp_rank, dp_rank = grid_position(rank, tp, dp)
    return ParallelContext(
        tp_rank=tp_rank,
        tp_size=tp,
        tp_group=tp_groups[dp_rank],
        dp_rank=dp_rank,
        dp_size=dp,
        dp_group=dp_groups[tp_rank],
        device=dev,
    )


def shutdown() -> None:
    """Destroy the process group :func:`init_parallel` created (no-op otherwise)."""
    if _STATE["started"] and dist.is_initialized():
        dist.destroy_process_group()
    _STATE["started"] = False
    _STATE["groups"] = {}


def is_distributed() -> bool:
    """A process group of more than one process is up (else every collective is a no-op)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier(parallel: ParallelContext | None = None) -> None:
    """Wait for every rank (after finishing this rank's queued GPU work): for timing."""
    if parallel is not None and parallel.device is not None and parallel.device.type == "cuda":
        torch.cuda.synchronize(parallel.device)
    if is_distributed():
        dist.barrier()


def gather_objects(obj: T, group: object | None = None) -> list[T]:
    """Every rank's ``obj`` (picklable, on the host), in rank order, on every rank."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def collective_call(fn: Callable[..., R], *a: Any, **kw: Any) -> R:
    """``fn(*a, **kw)`` on every rank; if it raises on ANY rank, every rank raises.

    For steps whose failure only some ranks can see (a missing or corrupt shard file): without
    this, the healthy ranks would go on to the next collective and wait for a rank that is gone.
    Every rank raises :class:`ParallelConfigError` with the same message (the failing ranks and
    their errors); the failing rank chains its original exception.
    """
    error: BaseException | None = None
    result: Any = None
    try:
        result = fn(*a, **kw)
    except Exception as e:  # noqa: BLE001 -- re-raised below on every rank
        error = e
    mine = None if error is None else f"{type(error).__name__}: {error}"
    failed = [(r, m) for r, m in enumerate(gather_objects(mine)) if m is not None]
    if failed:
        where = getattr(fn, "__qualname__", repr(fn))
        detail = "; ".join(f"rank {r}: {m}" for r, m in failed)
        raise ParallelConfigError(f"{where} failed on {len(failed)} rank(s): {detail}") from error
    return result


def launch(main: Callable[[ParallelContext], R], tp: int = 1, dp: int = 1, **init_kw: Any) -> R:
    """Run ``main(parallel)`` on this rank of the ``tp x dp`` grid, then tear the grid down.

    The entry point for CLIs under ``torchrun``: a :class:`ParallelConfigError` (from the set-up
    or from ``main``) is printed once, by rank 0, and every rank exits with status 2 -- one
    clear message instead of a traceback per rank, and no rank left waiting. When this call
    started the process group, that exit is :func:`~nakta_model.process_exit.exit_without_teardown`
    (flushed, ``os._exit``): a group still pinned by a library (fairscale) would otherwise abort
    the interpreter's teardown at random. A group the caller started is the caller's to end.
    """
    already_up = dist.is_available() and dist.is_initialized()
    if already_up:
        rank = dist.get_rank()
    else:
        rank = int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else 0
    owned = False  # whether this call started the process group (then it also ends the process)
    try:
        parallel = init_parallel(tp, dp, **init_kw)
        owned = bool(_STATE["started"]) and not already_up
        try:
            return main(parallel)
        finally:
            shutdown()
    except ParallelConfigError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:  # torchrun stops all ranks when the first exits: let rank 0 print first
            time.sleep(_QUIET_RANK_EXIT_DELAY_S)
        if owned:  # a group a library still pins must not meet the interpreter's teardown
            exit_without_teardown(2)
        raise SystemExit(2) from None
