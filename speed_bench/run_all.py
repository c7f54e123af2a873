"""Scoring speed (HellaSwag; MMLU-shaped with --workload mmlu): Nakta vs Meta's LLaMA code vs HF transformers, in ONE process.

Every engine scores the same lm-eval requests from the same weights with the same batching
limits (``--token-budget`` padded tokens per forward call), one engine at a time (each built,
warmed up on a spread sample of the tasks, timed between ``cuda.synchronize`` calls, freed).
Reported per engine: wall time, tasks/s, tokens/s, MFU, peak GPU memory, acc and acc_norm, and
whether its predictions agree with ``llama_org``'s.

Counting (the README's speed-benchmark section says more):
* ``tokens_per_s``: lm-eval's tokens (``len(context + continuation) - 1`` per request) per
  second -- the same work for every engine, so its ratios equal the tasks/s ratios;
* ``mfu``: model FLOPs the engine computed / time / peak, where model FLOPs =
  ``2 x block matmul params x computed tokens + 2 x LM-head params x scored tokens`` (the head
  is only needed where a log-prob is read) and the peak is a bf16 ``8192^3`` matmul measured
  in this run; ``computed tokens`` excludes padding (plain engines: lm-eval's tokens; Nakta's
  engines: what ``scoring.score`` reports it ran, shared contexts and prefixes once);
* ``mfu_unique``: the same with every engine credited only the unique tokens (the trie of all
  requests: shared contexts and prefixes counted once): the fraction of the chip spent on work
  no engine can skip.

    python -m speed_bench.run_all                     # tiny model + embedded workload on the CPU
    python speed_bench/run_all.py                     # the same, by path (also from speed_bench/)
    python -m speed_bench.run_all --preset 7B \\
        --data ../shared/data/hellaswag_val_full.jsonl --tokenizer ../shared/data/llama_tokenizer.model \\
        --limit 1000 --select spread
    torchrun --nproc_per_node 2 -m speed_bench.run_all --preset 30B ...   # 2 GPUs, tp = 2

``nakta_speed.py``, ``llama_speed.py`` and ``hf_speed.py`` are this command with their engines
only (same options, results in ``results/<device>/<engines>/``).

Multi-GPU (``torchrun``, world = tp x dp; tp defaults to the world size, ``--dp N`` makes it
world / N): each rank builds its tensor-parallel shard of the same weights, requests are
sharded over the data-parallel replicas; ``llama_org`` runs Meta's fairscale model parallel
over the whole world when tp = world (dp 1), ``hf`` is skipped (one GPU). The clock runs
between barriers on all ranks, MFU divides by the sum of every GPU's measured peak, peak memory
is the largest rank's, and rank 0 alone prints and writes (default folder
``results/<device>/<model>-tp<N>-dp<M>/``).

A run never silently replaces an earlier run in a folder of one's own: when the results folder
(the git-ignored ``results/cpu/``, any ``--out``) holds result files, the run is refused before
anything is timed unless ``--overwrite`` (or pick another ``--out``). A catalogue folder
(``results/<device>/`` with its ``README.md`` index, and what is under it) is replaced: that is
what re-measuring it means, and git keeps what was committed. A run of the
tiny model (the CPU default) says in one line under its table why ``nakta_cache`` is not faster
there.

This file is the command line, the run, engine after engine, and the report (the table, the
plot, the files); ``run_measure.py`` times one engine and makes its row.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if not __package__:  # run by path: import from the repo root, not from this script's folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import pandas as pd
import torch
import torch.distributed as dist

from bench_common.ceilings import device_slug, matmul_tflops, matmul_tflops_sustained
from bench_common.report import results_dir, save_figure, write_json, write_table
from nakta_model.cli import (
    InputError,
    checked_on_every_rank,
    checkpoint_errors,
    checkpoint_tokenizer_path,
    exit_on_input_error,
    require_checkpoint,
    require_file,
)
from nakta_model.config import preset
from nakta_model.fp8 import Precision
from nakta_model.parallel import (
    ParallelContext,
    gather_objects,
    launch,
    validate_grid,
)
from speed_bench.engines import (
    ALL_ENGINES,
    DEFAULT_ENGINES,
    EngineConfig,
    EngineSpec,
    engine_spec,
    make_engine,
    skip_reason,
)
from speed_bench.run_measure import agreement, engine_row, free_memory, run_engine, sync
from speed_bench.weights import WeightSource, matmul_params, weight_source
from speed_bench.workload import (
    Workload,
    mmlu_shaped_workload,
    real_workload,
    synthetic_workload,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class EngineSet:
    """What one speed command times: ``run_all`` all engines, ``nakta_speed.py`` and the other
    engine scripts theirs, with the same options and results format. ``results_subdir`` keeps
    their default results apart (``results/<device>/<subdir>/``; None: ``results/<device>/``)."""

    engines: tuple[str, ...]
    results_subdir: str | None
    description: str
    defaults: tuple[str, ...] | None = None  # what runs without --engines (None: all)

    @property
    def default_engines(self) -> tuple[str, ...]:
        return self.defaults or self.engines


RUN_ALL = EngineSet(ALL_ENGINES, None, __doc__.split("\n\n")[0], DEFAULT_ENGINES)


# ----------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None, engine_set: EngineSet = RUN_ALL) -> argparse.Namespace:
    """The one command line of run_all and of the engine scripts (``engine_set`` limits
    ``--engines``); ``args.engines`` comes back as a tuple of :class:`EngineSpec` (the names
    and ``--quant`` read once, here)."""
    p = argparse.ArgumentParser(description=engine_set.description)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help="random weights of this shape: 7B 13B 30B 65B tiny ...")
    src.add_argument("--checkpoint", type=Path, help="Nakta, Meta or HF checkpoint folder")
    p.add_argument("--data", type=Path, help="HellaSwag jsonl (default: embedded workload)")
    p.add_argument("--workload", choices=("hellaswag", "mmlu"), default="hellaswag",
                   help="embedded workload: HellaSwag lengths, or MMLU-shaped (57 subjects, a "
                        "5-shot prefix shared by each subject's questions)")  # fmt: skip
    p.add_argument("--shots", type=int, default=0,
                   help="embedded HellaSwag workload: few-shot examples before each task's "
                        "context, drawn per task as lm-eval does (10: ~1,000-token rows)")  # fmt: skip
    p.add_argument("--tokenizer", type=Path,
                   help="sentencepiece model for --data (default: the checkpoint's own)")  # fmt: skip
    p.add_argument("--limit", type=int, help="tasks (default 1000 on GPU, 16 on CPU)")
    p.add_argument("--select", choices=("first", "spread"), default="first",
                   help="with --data and --limit: first N tasks, or N spread over the file")  # fmt: skip
    p.add_argument("--engines", default=",".join(engine_set.default_engines),
                   help=f"comma-separated, from {','.join(engine_set.engines)} (default: "
                        f"{','.join(engine_set.default_engines)})")  # fmt: skip
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="default bf16 on GPU, fp32 on CPU")
    p.add_argument("--quant", choices=["fp8"],
                   help="fp8: Nakta's engines on the FP8 model (their *_fp8 names; needs a GPU "
                        "of compute capability >= 8.9); bf16 beside it: --engines "
                        "nakta_cache,nakta_cache_fp8")  # fmt: skip
    p.add_argument("--token-budget", type=int, help="padded tokens per forward (16384 / 2048)")
    p.add_argument("--max-rows", type=int, help="rows per forward, on top of the budget")
    p.add_argument("--warmup", type=int,
                   help="warm-up tasks per engine, not timed (default: GPU 20%% of the tasks, "
                        "at least 64; CPU 2)")  # fmt: skip
    p.add_argument("--passes", type=int, default=1,
                   help="timed passes over the workload per engine; the tables report the last, "
                        "and with 2+ also first_pass_s and first_over_last (with --warmup 0: what "
                        "a new process's first pass costs against a warm one)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="random weights and embedded workload")
    p.add_argument("--device", help="default cuda when present")
    p.add_argument("--out", type=Path, help="results folder (default results/<device>/...)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier run's results in a folder of your own (the CPU "
                        "folder, an --out); a catalogue folder's are always replaced")  # fmt: skip
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--tp", type=int,
                   help="tensor-parallel GPUs per replica (torchrun; default world size / --dp)")  # fmt: skip
    p.add_argument("--dp", type=int,
                   help="data-parallel replicas (torchrun; default 1, or world size / --tp)")  # fmt: skip
    args = p.parse_args(argv)
    if args.data is not None and args.tokenizer is None and args.checkpoint is None:
        p.error("--data needs --tokenizer (the LLaMA sentencepiece model) or a --checkpoint")
    if args.data is not None and args.workload != "hellaswag":
        p.error("--data is HellaSwag; --workload mmlu is embedded (no --data)")
    if args.shots < 0:
        p.error("--shots must be >= 0")
    if args.shots and (args.data is not None or args.workload != "hellaswag"):
        p.error("--shots goes with the embedded HellaSwag workload (no --data, no --workload mmlu)")
    if args.tokenizer is not None and args.data is None:
        p.error("--tokenizer goes with --data (the embedded workload needs no tokenizer)")
    if args.limit is not None and args.limit < 1:
        p.error("--limit must be >= 1")
    if args.warmup is not None and args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.passes < 1:
        p.error("--passes must be >= 1")
    names = tuple(e.strip() for e in args.engines.split(",") if e.strip())
    unknown = [e for e in names if e not in engine_set.engines]
    if unknown or not names:
        p.error(f"--engines: choose from {','.join(engine_set.engines)}, got {unknown or 'none'}")
    args.precision = Precision.parse(args.quant)
    specs = dict.fromkeys(engine_spec(e, args.precision) for e in names)
    unknown = [s.name for s in specs if s.name not in engine_set.engines]
    if unknown:  # --quant fp8 made a twin this command does not time
        p.error(f"--engines: choose from {','.join(engine_set.engines)}, got {unknown}")
    args.engines = tuple(specs)
    return args


def resolve_grid(tp: int | None, dp: int | None, world: int) -> tuple[int, int]:
    """``(tp, dp)`` for a world of ``world`` processes: by default one replica over the whole
    world (the seed's ``torchrun --nproc_per_node 4 nakta_speed.py``); ``--dp N`` alone gives
    tp = world / N, ``--tp N`` alone dp = world / N. A pair that does not make ``world`` is left
    for :func:`validate_grid` to refuse with its message."""
    if tp is None and dp is None:
        return world, 1
    if tp is None:
        return (world // dp if 0 < dp <= world else 1), dp
    if dp is None:
        return tp, (world // tp if 0 < tp <= world else 1)
    return tp, dp


def _world_size() -> int:
    """The live process group's size, else torchrun's ``WORLD_SIZE``, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    raw = os.environ.get("WORLD_SIZE", "1")
    return int(raw) if raw.isdigit() else 1


def _default_preset(device: torch.device, tp: int = 1) -> str:
    """7B on a GPU that holds it comfortably (per GPU: its tp shard), else the tiny model whose
    heads split over ``tp`` (so the default, the seed's 4-process run included, runs anywhere)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if free * tp > 40e9:
            return "7B"
    for name in ("tiny", "tiny-mha"):
        if preset(name).n_kv_heads % tp == 0:
            return name
    return "tiny"


def main(argv: list[str] | None = None, engine_set: EngineSet = RUN_ALL) -> dict | None:
    """One process (plain ``python``) or one rank of a ``torchrun`` grid; returns the summary
    (``None`` on ranks other than 0 of a grid). Bad input exits 2 with one ``error:`` line."""
    args = parse_args(argv, engine_set)
    world = _world_size()
    tp, dp = resolve_grid(args.tp, args.dp, world)
    if tp * dp == 1 and world == 1:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda":
            if device.index is None:  # set_device needs an index; "cuda" means the current one
                device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
        return exit_on_input_error(_run, args, engine_set, ParallelContext(device=device))
    return launch(lambda parallel: _run(args, engine_set, parallel), tp, dp, device=args.device)


def tiny_model_note(rows: dict[str, dict], margs, device: torch.device) -> str | None:
    """One line under the table when the model is tiny (the embedded CPU default): its times
    measure per-call overhead, not the caches' worth, so ``nakta_cache`` may well be slower
    than plain ``nakta`` there, and the table must not be read as their verdict."""
    cache, plain = rows.get("nakta_cache"), rows.get("nakta")
    params = sum(matmul_params(margs))
    if cache is None or plain is None or params > 1e8:  # a real model: the numbers stand
        return None
    return (
        f"note: nakta_cache {cache['tasks_per_s'] / plain['tasks_per_s']:.2f}x nakta on a tiny "
        f"model ({params / 1e6:.2g}M matmul params, {device.type}): a forward costs about the same "
        "whatever its tokens, so the caches' packing and prefix bookkeeping cost about as much as "
        "the tokens they save, and nakta_cache can be the slower; what they buy shows on a real "
        "model (--checkpoint, or --preset 7B on a GPU)"
    )


# ----------------------------------------------------------------------------- inputs
def check_paths(args: argparse.Namespace) -> None:
    """Every path given exists and is what it should be: before anything is loaded."""
    if args.checkpoint is not None:
        require_checkpoint(args.checkpoint)
    if args.data is not None:
        require_file(args.data, "--data", "a HellaSwag .jsonl file")
        args.tokenizer = checkpoint_tokenizer_path(args.checkpoint, args.tokenizer)


def load_weights(args: argparse.Namespace, preset_name: str | None) -> WeightSource:
    """The checkpoint (read once) or the preset's random weights; a file that does not load
    is an :class:`InputError` naming the checkpoint."""
    if args.checkpoint is None:
        try:
            return weight_source(preset_name, None, seed=args.seed)
        except ValueError as e:
            raise InputError(f"--preset {preset_name}: {e}") from e
    with checkpoint_errors(args.checkpoint):
        return weight_source(None, args.checkpoint)


def load_real_workload(args: argparse.Namespace, limit: int) -> Workload:
    """lm-eval's requests from ``--data`` and ``--tokenizer``; a file that does not read as
    what it should be is an :class:`InputError` naming it."""
    from nakta_model.tasks.hellaswag import sentencepiece_encoder
    from nakta_model.tokenizer import TokenizerError

    try:
        sentencepiece_encoder(args.tokenizer)
    except TokenizerError as e:
        raise InputError(f"--tokenizer {args.tokenizer}: {e.reason}") from e
    try:
        return real_workload(args.data, args.tokenizer, limit, args.select)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise InputError(
            f"--data {args.data}: cannot read HellaSwag tasks from it ({type(e).__name__}: {e})"
        ) from e


def load_inputs(
    args: argparse.Namespace, preset_name: str | None, limit: int
) -> tuple[WeightSource, Workload]:
    """Weights and workload, every input checked: paths first (cheap), then the task file and
    tokenizer (seconds), then the weights; a workload the model cannot read is refused."""
    check_paths(args)
    workload = load_real_workload(args, limit) if args.data is not None else None
    weights = load_weights(args, preset_name)
    margs = weights.args
    if workload is None:
        if args.workload == "mmlu":
            workload = mmlu_shaped_workload(limit, margs.vocab_size, args.seed, margs.max_seq_len)
        else:
            workload = synthetic_workload(
                limit, margs.vocab_size, args.seed, margs.max_seq_len, shots=args.shots
            )
    if workload.max_token_id() >= margs.vocab_size:
        raise InputError(
            f"the workload uses token ids up to {workload.max_token_id()} but the model's "
            f"vocabulary has {margs.vocab_size}: use a 32000-word preset (7B..65B) or checkpoint"
        )
    return weights, workload


def plan_engines(
    engines: tuple[EngineSpec | str, ...], parallel: ParallelContext
) -> dict[str, str]:
    """The requested engines that will be skipped here (by name), with why; refuses a run where
    none can run (e.g. ``hf_speed.py`` under torchrun)."""
    specs = [engine_spec(e) for e in engines]
    skipped = {s.name: reason for s in specs if (reason := skip_reason(s, parallel))}
    if len(skipped) == len(engines):
        raise InputError(
            "no requested engine can run here: "
            + "; ".join(f"{k}: {v}" for k, v in skipped.items())
        )
    return skipped


def _check_precision(engines: tuple[EngineSpec, ...], device: torch.device) -> None:
    """Every engine's precision on this device (FP8's compute capability) as one ``error:``
    line, before any weights are drawn or read (not a traceback after the warm-ups)."""
    for spec in engines:
        try:
            spec.precision.check_device(device)
        except ValueError as e:
            raise InputError(f"--quant {spec.precision.quant} / {spec.name}: {e}") from None


RESULT_FILES = ("summary.json", "speed.md", "speed.csv", "speed.png")  # what write_results writes
CATALOGUE_INDEX = "README.md"  # results/<device>/README.md: the catalogue's index


def check_replaceable(out: Path, overwrite: bool) -> None:
    """Refuse, before anything is timed, to replace an earlier run's results in a folder of
    one's own (the git-ignored ``results/cpu/``, any ``--out``) without ``--overwrite``. A
    catalogue folder (``results/<device>/`` with its index, and the folders under it) is
    replaced: re-measuring it is what its commands are for, and git keeps what was committed."""
    present = [f for f in RESULT_FILES if (out / f).exists()]
    if overwrite or not present or in_catalogue(out):
        return
    import datetime

    when = datetime.datetime.fromtimestamp((out / present[0]).stat().st_mtime)
    raise InputError(
        f"results folder {out} holds an earlier run's results ({present[0]}, "
        f"{when:%Y-%m-%d %H:%M}): pass --overwrite to replace them, or --out DIR for another "
        "folder"
    )


def in_catalogue(out: Path) -> bool:
    """Whether ``out`` is a device folder of a results catalogue (``.../results/<device>/``
    holding its index ``README.md``) or inside one."""
    out = out.resolve()
    chain = (out, *out.parents)
    for depth, folder in enumerate(chain):
        if folder.parent.name == "results":  # the device folder: the index is here or below
            return any((f / CATALOGUE_INDEX).is_file() for f in chain[: depth + 1])
    return False


def default_out(engine_set: EngineSet, slug: str, model: str, parallel: ParallelContext) -> Path:
    """``results/<device>/[<engine set>/][<model>-tp<N>-dp<M>/]`` beside this file."""
    out = results_dir(__file__, slug)
    if engine_set.results_subdir:
        out = out / engine_set.results_subdir
    if parallel.world_size > 1:
        out = out / f"{model}-tp{parallel.tp_size}-dp{parallel.dp_size}"
    return out


def _run(args: argparse.Namespace, engine_set: EngineSet, parallel: ParallelContext) -> dict | None:
    device = parallel.device
    on_gpu = device.type == "cuda"
    world = parallel.world_size
    say = print if parallel.is_leader else (lambda *a, **k: None)
    dtype = _DTYPES[args.dtype or ("bf16" if on_gpu else "fp32")]
    engines = args.engines
    checked_on_every_rank(_check_precision, engines, device)  # before any weights are read
    skipped = checked_on_every_rank(plan_engines, engines, parallel)
    preset_name = (
        None if args.checkpoint else (args.preset or _default_preset(device, parallel.tp_size))
    )
    preset_name = gather_objects(preset_name)[0]  # a grid runs rank 0's choice (free memory)
    limit = args.limit or (1000 if on_gpu else 16)
    weights, workload = checked_on_every_rank(load_inputs, args, preset_name, limit)
    margs = weights.args
    validate_grid(parallel.tp_size, parallel.dp_size, world, args=margs)  # every rank: same verdict
    slug = device_slug(device)
    out = args.out or default_out(engine_set, slug, weights.name, parallel)
    checked_on_every_rank(check_replaceable, out, args.overwrite)  # before hours are spent

    cfg = EngineConfig(
        device=device,
        dtype=dtype,
        token_budget=args.token_budget or (16384 if on_gpu else 2048),
        max_length=margs.max_seq_len,
        max_rows=args.max_rows,
        progress=not args.no_progress and parallel.is_leader,
    )
    # Warm-up meets many batch shapes (Triton specialises kernels on size divisibility, so one
    # batch is not enough to keep compilation out of the timed pass): 20% of tasks, >= 64. A CPU
    # run (no Triton compilation) warms up on 2 tasks.
    n_warm = args.warmup if args.warmup is not None else (max(64, limit // 5) if on_gpu else 2)
    warmup = workload.spread(n_warm) if n_warm > 0 else None

    say(
        f"device {device_slug(device)} x {world} (tp {parallel.tp_size}, dp {parallel.dp_size}) | model {weights.name} ({sum(matmul_params(margs)) / 1e9:.2f}B "
        f"matmul params) {str(dtype).removeprefix('torch.')} | workload {workload.name}: "
        f"{workload.n_tasks} tasks, {workload.request_tokens()} tokens "
        f"({workload.unique_tokens()} unique) | token budget {cfg.token_budget}"
    )
    peak_tflops = (
        matmul_tflops(8192, dtype=torch.bfloat16, device=str(device))
        if on_gpu
        else matmul_tflops(1024, dtype=dtype, device="cpu")  # a CPU run measures overhead
    )
    gpu_peaks = gather_objects(peak_tflops)  # every GPU measured at once, each its own
    peak_tflops = sum(gpu_peaks)  # the grid's peak: MFU is per GPU, averaged over the grid
    say(f"measured matmul peak: {peak_tflops:.4g} TFLOP/s ({world} x ~{peak_tflops / world:.4g})")
    sustained_tflops = None  # the same matmul kept up for 3 s (power-limited clocks): GPU only
    if on_gpu:
        sustained_tflops = sum(gather_objects(matmul_tflops_sustained(device=str(device))))
        say(f"sustained: {sustained_tflops:.4g} TFLOP/s")

    rows: dict[str, dict] = {}
    shared: dict = {}
    for i, spec in enumerate(engines):
        name = spec.name
        if name in skipped:
            say(f"[{name}] skipped: {skipped[name]}")
            continue
        t0 = time.perf_counter()
        engine = make_engine(spec, weights, cfg, shared, parallel)
        sync(device)
        build_s = max(gather_objects(time.perf_counter() - t0))
        results, passes, peak = run_engine(engine, workload, warmup, cfg, parallel, args.passes)
        seconds = passes[-1]
        rows[name] = engine_row(
            name, engine, workload, weights, results, seconds, peak, peak_tflops, build_s
        )
        if len(passes) > 1:  # the first pass against the last (steady) one
            rows[name] |= {"first_pass_s": passes[0], "first_over_last": passes[0] / seconds}
        say(
            f"[{name}] {seconds:.2f} s, {rows[name]['tasks_per_s']:.1f} tasks/s, "
            f"acc {rows[name]['acc']:.4f}"
        )
        engine.close()
        del engine
        if shared and not any(s.is_nakta for s in engines[i + 1 :]):
            shared.clear()
        free_memory(device)
    reference = "llama_org" if "llama_org" in rows else next(iter(rows))
    agreement(rows, reference)

    df = pd.DataFrame(
        [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows.values()]
    )
    if sustained_tflops:  # the same work against what the GPU keeps up: context, not the MFU
        df["mfu_unique_sustained"] = df["mfu_unique"] * peak_tflops / sustained_tflops
    ratios = {}
    if "nakta_cache" in rows:
        for peer in rows:
            if peer != "nakta_cache":
                ratios[f"nakta_cache_vs_{peer}"] = (
                    rows["nakta_cache"]["tasks_per_s"] / rows[peer]["tasks_per_s"]
                )
    summary = {
        "device": slug,
        "gpus": world,
        "tp": parallel.tp_size,
        "dp": parallel.dp_size,
        "host": platform.node(),
        "torch": torch.__version__,
        "model": weights.name,
        "model_args": margs.to_params(),
        "matmul_params": {"blocks": matmul_params(margs)[0], "lm_head": matmul_params(margs)[1]},
        "dtype": str(dtype).removeprefix("torch."),
        "peak_matmul_tflops": peak_tflops,
        "peak_matmul_tflops_per_gpu": gpu_peaks,
        "sustained_matmul_tflops": sustained_tflops,
        "token_budget": cfg.token_budget,
        "max_rows": cfg.max_rows,
        "warmup_tasks": 0 if warmup is None else warmup.n_tasks,
        "workload": {
            "name": workload.name,
            "tasks": workload.n_tasks,
            "request_tokens": workload.request_tokens(),
            "unique_tokens": workload.unique_tokens(),
            "scored_tokens": workload.scored_tokens(),
        },
        "reference_engine": reference,
        "engines": {
            r["engine"]: {k: json_num(v) for k, v in r.items() if k != "engine"}
            for r in df.to_dict("records")
        },
        "skipped": skipped,
        "ratios_tasks_per_s": ratios,
        # per task, as digits: lets runs on other grids (tp/dp) be checked prediction by prediction
        "predictions": {
            name: {
                "acc": "".join(str(p) for p, _ in r["_preds"]),
                "acc_norm": "".join(str(p) for _, p in r["_preds"]),
            }
            for name, r in rows.items()
        },
    }
    if not parallel.is_leader:
        return None
    notes = (
        f"{workload.name}: {workload.n_tasks} tasks, {workload.request_tokens()} lm-eval tokens "
        f"({workload.unique_tokens()} unique: shared contexts and prefixes counted once); model {weights.name}, "
        f"{summary['dtype']}, token budget {cfg.token_budget}; {world} x {slug} (tp "
        f"{parallel.tp_size}, dp {parallel.dp_size}), measured matmul peak {peak_tflops:.0f} TFLOP/s. tokens_per_s counts lm-eval's tokens for every engine; "
        "mfu counts the tokens the engine computed (no padding), mfu_unique only unique tokens; "
        "FLOPs = 2 x block matmul params x tokens + 2 x LM-head params x scored tokens. "
        + (
            f"mfu_unique_sustained: the same against the matmul's sustained rate "
            f"({sustained_tflops:.0f} TFLOP/s, 3 s back to back: the clocks a run meets). "
            if sustained_tflops
            else ""
        )
        + f"pred_agree_vs_ref: share of tasks with the same acc and acc_norm predictions as "
        f"{reference}. Skipped: {skipped or 'none'}. Ratios (tasks/s): "
        + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
    )
    write_results(out, summary, df, notes)

    print()
    print(format_table(df))
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    if note := tiny_model_note(rows, margs, device):
        print(note)
    for k, v in skipped.items():
        print(f"skipped {k}: {v}")
    print(f"results -> {out}")
    return summary


# ----------------------------------------------------------------------------- report
# How the results show: the console table, the plot and the files written (what is measured is
# run_measure.py's).


# the console table's columns (the markdown table and summary.json keep every column)
TABLE_COLUMNS = [
    "engine",
    "wall_s",
    "tasks_per_s",
    "tokens_per_s",
    "mfu",
    "mfu_unique",
    "peak_mem_gb",
    "acc",
    "acc_norm",
    "pred_agree_vs_ref",
]


def plot(df: pd.DataFrame, title: str) -> Figure:
    """tasks/s and both MFUs per engine, side by side (matplotlib is imported only here: the
    headless Agg backend, so a run without a display still writes its plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].bar(df["engine"], df["tasks_per_s"], color="tab:blue")
    axes[0].set_ylabel("HellaSwag tasks / s")
    for i, v in enumerate(df["tasks_per_s"]):
        axes[0].text(i, v, f"{v:.3g}", ha="center", va="bottom")
    x = range(len(df))
    axes[1].bar([i - 0.2 for i in x], 100 * df["mfu"], width=0.4, label="MFU (computed tokens)")
    axes[1].bar(
        [i + 0.2 for i in x], 100 * df["mfu_unique"], width=0.4, label="MFU (unique tokens)"
    )
    axes[1].set_xticks(list(x), df["engine"])
    axes[1].set_ylabel("% of matmul peak measured in this run")
    axes[1].legend()
    for ax in axes:
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def write_results(out: Path, summary: dict, df: pd.DataFrame, notes: str) -> None:
    """``summary.json``, ``speed.md`` / ``speed.csv`` (with ``notes``) and ``speed.png`` in ``out``."""
    write_json(summary, out / "summary.json")
    write_table(df, out, "speed", f"Scoring speed: {summary['workload']['name']}", notes)
    import matplotlib.pyplot as plt

    fig = plot(df, f"{summary['workload']['name']} on {summary['device']}, {summary['model']}")
    save_figure(fig, out / "speed.png")
    plt.close(fig)


def format_table(df: pd.DataFrame) -> str:
    """The console table: shares as percentages, the rest to 4 significant digits."""
    show = df[TABLE_COLUMNS].copy()
    for c in ("mfu", "mfu_unique", "acc", "acc_norm", "pred_agree_vs_ref"):
        show[c] = (100 * show[c]).map(lambda v: f"{v:.1f}%")
    return show.to_string(index=False, float_format=lambda v: f"{v:.4g}")


def json_num(v: object) -> object:
    """NaN and inf become null (JSON has neither; a CPU run's peak memory is NaN)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


if __name__ == "__main__":
    main()
