"""Timing one engine over the workload and turning its results into a report row.

Kept apart from ``run_all`` (which builds the engines, in order, and writes the results) so the
clock, the FLOP count and the agreement with the reference read in one place.
"""

from __future__ import annotations

import gc
import time

import torch

from nakta_model.parallel import ParallelContext, barrier, gather_objects
from nakta_model.tasks.hellaswag import evaluate
from speed_bench.engine_api import Engine, EngineConfig
from speed_bench.weights import WeightSource, matmul_params
from speed_bench.workload import Workload


# ----------------------------------------------------------------------------- running
def free_memory(device: torch.device) -> None:
    """Return the freed engine's memory before the next one is built (its peak starts clean)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    """Wait for the GPU, so a clock read after it counts the queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- measuring
def model_flops(weights: WeightSource, block_tokens: int, scored_tokens: int) -> float:
    """MFU's numerator: every block matmul over ``block_tokens``, the LM head only over the
    tokens whose log-prob is read."""
    blocks, head = matmul_params(weights.args)
    return 2.0 * (blocks * block_tokens + head * scored_tokens)


def run_engine(
    engine: Engine,
    workload: Workload,
    warmup: Workload | None,
    cfg: EngineConfig,
    parallel: ParallelContext | None = None,
    passes: int = 1,
) -> tuple[list[tuple[float, bool]], list[float], float]:
    """Warm up, then time ``passes`` full passes. Returns (the last pass's results, each
    pass's seconds, peak GB).

    With no warm-up and two passes, the first pass pays whatever a new process pays per shape
    (kernel compilation, attention plans) and the second does not: issue 13 asks for the first
    <= 1.15x the second. Under a grid the clock starts after a barrier and stops after the last
    rank is done (its GPU work synchronised), so each pass's seconds are the whole grid's wall
    time; peak memory is the largest rank's.
    """
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes!r}")
    parallel = parallel or ParallelContext(device=cfg.device)
    if warmup is not None:
        engine.score(warmup.requests)
    sync(cfg.device)
    if cfg.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(cfg.device)
    seconds = []
    for _ in range(passes):
        barrier(parallel)
        t0 = time.perf_counter()
        results = engine.score(workload.requests)
        sync(cfg.device)
        barrier(parallel)
        seconds.append(time.perf_counter() - t0)
    peak = (
        torch.cuda.max_memory_allocated(cfg.device) / 1e9
        if cfg.device.type == "cuda"
        else float("nan")
    )
    if parallel.world_size > 1:
        peak = max(gather_objects(peak))
    return results, seconds, peak


def engine_row(
    name: str,
    engine: Engine,
    workload: Workload,
    weights: WeightSource,
    results: list[tuple[float, bool]],
    seconds: float,
    peak_gb: float,
    peak_tflops: float,
    build_s: float,
) -> dict:
    """One engine's report row; ``_preds`` and ``_lls`` (dropped from the tables) feed
    :func:`agreement` and the summary's predictions."""
    metrics, per_doc = evaluate(workload.docs, [ll for ll, _ in results])
    computed = engine.computed_tokens(workload)
    scored = workload.scored_tokens()
    peak_flops = peak_tflops * 1e12
    return {
        "engine": name,
        "wall_s": seconds,
        "build_s": build_s,
        "tasks_per_s": workload.n_tasks / seconds,
        "tokens_per_s": workload.request_tokens() / seconds,
        "computed_tokens": computed,
        "computed_tokens_per_s": computed / seconds,
        "mfu": model_flops(weights, computed, scored) / seconds / peak_flops,
        "mfu_unique": model_flops(weights, workload.unique_tokens(), scored) / seconds / peak_flops,
        "peak_mem_gb": peak_gb,
        "acc": metrics["acc"],
        "acc_norm": metrics["acc_norm"],
        "_preds": [(r.pred, r.pred_norm) for r in per_doc],
        "_lls": [ll for ll, _ in results],
    }


def agreement(rows: dict[str, dict], reference: str) -> None:
    """Per engine: share of tasks whose acc / acc_norm predictions equal the reference's, and
    the largest log-likelihood difference (dtype rounding shows up here, bugs show up above)."""
    ref = rows[reference]
    for row in rows.values():
        n = max(1, len(ref["_preds"]))
        row["pred_agree_vs_ref"] = sum(a == b for a, b in zip(row["_preds"], ref["_preds"])) / n
        row["max_abs_ll_diff_vs_ref"] = max(
            (abs(a - b) for a, b in zip(row["_lls"], ref["_lls"])), default=0.0
        )
