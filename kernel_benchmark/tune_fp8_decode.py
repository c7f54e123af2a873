"""Tune the FP8 decode linears' launch configs at LLaMA-7B's shapes, in minutes: ``decode_linear``'s
FP8-weight GEMVs (``--kernel gemv``, the default) or ``fp8_decode_gemm`` (``--kernel gemm``).

Why: the FP8 rows of ``decode_linear.py`` were derived from bf16 ones, and FP8 moves half the
weight bytes per K step while the bf16 x tile stays as large: the best tiles differ (H100: batch
32 ran at 0.44-0.93x bf16 on the derived rows); ``fp8_decode_gemm``'s default config is derived
from the shape (``fp8_decode_gemm._config``), and the best weight tile, K step, split count and
pipeline depth per (N, K, rows) are measured. Per point of the 7B linears (``wqkv`` NORM+ROPE
12288x4096, ``wo`` 4096x4096 + residual, ``w13`` NORM+SWIGLU 22016x4096, ``w2`` 4096x11008 +
residual) a fixed candidate grid chosen from the kernel's structure (``candidates`` /
``gemm_candidates``) is timed beside the current default and a peer: the bf16 GEMV (gemv) or
cuBLASLt's row-wise scaled GEMM (gemm: ``fp8_matmul``, then the residual add as ``step_gemm``
does it). CUDA-graph replays over input copies larger than L2, paths interleaved round by round
(``bench_common.timing.rotated_ms``, graphs on a side stream). Compilation dominates a sweep, so
the grid is first compiled by ``--jobs`` worker processes into Triton's on-disk cache.

    python -m kernel_benchmark.tune_fp8_decode [--batches 1,2,4,8,16,32,64] [--budget 230]
    python -m kernel_benchmark.tune_fp8_decode --kernel gemm [--rows 8,16,32,64] [--budget 170]

Writes ``results/<device>/fp8_decode_tune.{csv,json}`` (gemv) or
``fp8_decode_gemm_tune.{csv,md,json}`` (gemm): every timing, and per point the best, the default
and the peer with % of copy bandwidth; and puts the winners, under this device's family, into
the kernel's tuned table (``nakta_model/kernels/_decode_linear_fp8_tuned.json``, which
``decode_linear.py`` loads, or ``_fp8_decode_gemm_tuned.json``, which ``fp8_decode_gemm.py``
loads; commit it; ``--no-write-configs`` leaves it alone). GPU only.

The file reads: the sweep driver and the table writer both kernels share, then the GEMV tuner,
then the GEMM tuner, then the command that picks one.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from pathlib import Path

if not __package__:  # run by path: import from the repo root, not from this script's folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import pandas as pd
import torch

from nakta_model.kernels import decode_linear as cfgs
from nakta_model.kernels import fp8_decode_gemm as fdg
from nakta_model.kernels.fp8_quant import FP8_DTYPE

# ==============================================================================================
# Shared: compiling a candidate grid in spawned workers, the sweep, its results and the tuned table
# ==============================================================================================


def config_key(cfg: dict[str, int], knobs: Sequence[str]) -> tuple[int, ...]:
    """A launch config's identity over a tuner's ``knobs`` (candidates deduplicated by it)."""
    return tuple(int(cfg[k]) for k in knobs)


def config_label(cfg: dict[str, int], knobs: Sequence[str]) -> str:
    """``"KNOB=value ..."`` over ``knobs``: the tuners' log lines and timing paths."""
    return " ".join(f"{k}={cfg[k]}" for k in knobs)


def compile_in_workers(
    warm: Callable[..., int], tasks: Sequence[tuple], jobs: int, deadline: float
) -> None:
    """``warm(*task)`` for every task in ``jobs`` spawned processes until ``deadline`` (each
    returns how many configs it ran); what is left compiles later, while timing, as does
    everything when the pool itself fails."""
    try:
        _compile_in_workers(warm, tasks, jobs, deadline)
    except Exception as ex:  # noqa: BLE001 - the timing loop compiles what is missing
        print(f"precompile failed ({type(ex).__name__}: {ex}); compiling while timing")


def _compile_in_workers(
    warm: Callable[..., int], tasks: Sequence[tuple], jobs: int, deadline: float
):
    t0 = time.perf_counter()
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))
    try:
        futures = [pool.submit(warm, *t) for t in tasks]
        done, pending = wait(futures, timeout=max(1.0, deadline - time.perf_counter()),
                             return_when=FIRST_EXCEPTION)  # fmt: skip
        n = sum(f.result() for f in done if f.exception() is None)
        failed = [f.exception() for f in done if f.exception() is not None]
        print(f"precompile: {n} configs in {time.perf_counter() - t0:.0f}s with {jobs} jobs"
              f"{f', {len(pending)} tasks left' if pending else ''}"
              f"{f', worker error: {failed[0]}' if failed else ''}", flush=True)  # fmt: skip
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # no worker left on the GPU while timing


def time_points(
    points: Sequence[tuple],
    time_point: Callable[[tuple], list[dict]],
    best_per_point: Callable[[pd.DataFrame], list[dict]],
    describe: Callable[[tuple, dict], str],
    t0: float,
    deadline: float,
) -> list[dict]:
    """Every timing row of ``time_point(point)`` for the points in order, until ``deadline``
    (the points left are named); after each point its best (``best_per_point``) is printed
    as ``describe(point, best)``."""
    rows: list[dict] = []
    for i, point in enumerate(points):
        if time.perf_counter() > deadline:
            print(f"budget spent: {len(points) - i} points not tuned", flush=True)
            break
        new = time_point(point)
        rows += new
        best = best_per_point(pd.DataFrame(new))
        if best:
            print(f"[{i + 1}/{len(points)} {time.perf_counter() - t0:.0f}s] "
                  f"{describe(point, best[0])}", flush=True)  # fmt: skip
        torch.cuda.empty_cache()
    return rows


def write_results(
    rows: list[dict],
    best_per_point: Callable[[pd.DataFrame], list[dict]],
    *,
    out: Path,
    stem: str,
    title: str,
    notes: str,
    summary: dict,
    family: str,
    device_name: str,
    configs: Path,
    write_configs: bool,
    update: Callable[[Path, str, str, list[dict]], object],
    t0: float,
    keep: Callable[[dict], bool] = lambda best: True,
) -> list[dict]:
    """``out/<stem>.csv`` / ``.md`` (every timing), ``out/<stem>.json`` (``summary`` and the
    best per point) and, with ``write_configs``, the best points that ``keep`` takes into the
    kernel's table (``update``: the tuner's ``update_configs``) under this device ``family``
    (``device_name`` recorded beside it).
    Returns the best per point."""
    from bench_common.report import write_json, write_table

    df = pd.DataFrame(rows)
    best = best_per_point(df) if len(df) else []
    if len(df):
        write_table(df, out, stem, title, notes)
    write_json({**summary, "family": family, "best": best}, out / f"{stem}.json")
    chosen = [b for b in best if keep(b)]
    if chosen and write_configs:
        if not family:
            print("no device family for this GPU: tuned configs not written", flush=True)
        else:
            update(configs, family, device_name, chosen)
            print(f"tuned configs ({len(chosen)} points, family {family}) -> {configs}")
    print(f"done in {time.perf_counter() - t0:.0f}s; results -> {out}", flush=True)
    return best


def write_family(
    path: Path, family: str, device_name: str, rows: dict[str, tuple[dict, dict]], about: str,
    load: Callable[[Path], object],
) -> dict:  # fmt: skip
    """Put ``rows`` (table key -> (config, measured figures)) under ``family`` in the
    tuned-config JSON at ``path`` (other families kept, this family's rows of these keys
    replaced), atomically; ``load`` (the kernel's reader) checks the file before (a malformed
    one stops here, not overwritten) and after. Returns the document written."""
    from nakta_model.io_utils import atomic_write_text

    doc: dict = {"devices": {}}
    if path.is_file():
        load(path)
        doc = json.loads(path.read_text())
    block = doc["devices"].setdefault(family, {"entries": {}})
    entries, measured = block.setdefault("entries", {}), block.setdefault("measured", {})
    for key, (config, figures) in rows.items():
        entries[key] = config
        measured[key] = figures
    block["device_name"] = device_name
    block["versions"] = f"torch {torch.__version__}"
    doc["about"] = about
    doc["devices"] = dict(sorted(doc["devices"].items()))
    block["entries"] = dict(sorted(entries.items()))
    atomic_write_text(path, json.dumps(doc, indent=2, sort_keys=True) + "\n")
    load(path)  # what was written loads
    return doc


# ==============================================================================================
# decode_linear's FP8-weight GEMVs (--kernel gemv)
# ==============================================================================================


KNOBS = cfgs.FP8_KNOBS  # USE_DOT, BLOCK_N, BLOCK_K, num_warps, num_stages, DOT_F16, PREFETCH
KINDS = ("wqkv", "wo", "w13", "w2")  # the LM head stays bf16 (not FP8): not tuned here
BATCHES = (1, 2, 4, 8, 16, 32, 64)
ORDER = (1, 32, 64, 16, 8, 4, 2)  # the targets' batches first when the budget runs short
SMEM_BUDGET = 110 * 1024  # pipelined tile bytes a tl.dot candidate may take (2 CTAs per SM)
FMA_ACC_MAX = 16384  # fp32 accumulator elements (TILE_N x BLOCK_K) of a batch-1 candidate


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="--kernel gemv (the default): tune decode_linear's FP8 GEMV launch configs"
    )
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="decode batches")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"subset of {KINDS}")
    p.add_argument("--budget", type=float, default=230.0, help="seconds for the whole sweep")
    p.add_argument("--jobs", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 2)),
                   help="processes compiling the grid up front (0: compile while timing)")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="results folder")
    p.add_argument("--configs", type=Path, default=cfgs.FP8_TUNED_JSON,
                   help="tuned-config JSON to update (read by decode_linear.py)")  # fmt: skip
    p.add_argument("--no-write-configs", action="store_true")
    args = p.parse_args(argv)
    try:
        args.batches = sorted({int(t) for t in args.batches.split(",") if t.strip()})
    except ValueError:
        p.error(f"--batches must be comma-separated ints, got {args.batches!r}")
    if not args.batches or min(args.batches) < 1 or max(args.batches) > 64:
        p.error(f"--batches needs ints in [1, 64], got {args.batches}")
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not args.kinds or set(args.kinds) - set(KINDS):
        p.error(f"--kinds must be a subset of {','.join(KINDS)}, got {args.kinds}")
    if args.budget <= 0 or args.jobs < 0:
        p.error("--budget must be > 0 and --jobs >= 0")
    return args


# ------------------------------------------------------------------------------- the grid


def candidates(variant: str, batch: int) -> list[dict[str, int]]:
    """The grid of one (variant, batch), from the kernel's structure (``TILE_N`` = weight rows
    per program, twice ``BLOCK_N`` with SwiGLU; ROPE needs ``BLOCK_N >= 2``).

    Batch 1, CUDA cores: ``TILE_N x BLOCK_K`` fp32 accumulators up to ``FMA_ACC_MAX`` (more
    spills), every thread owning at least one 16-byte load (16 e4m3 codes), each with and
    without ``PREFETCH`` (the next K tile loaded ahead as int32 words, ``_fma_prefetch_loop``);
    plus a few ``tl.dot`` tiles with fp16 operands (the MMA does the FMAs; e4m3 -> fp16 is
    one cvt per pair). Batches >= 2, ``tl.dot``: tiles of 16..128 weight rows, ``BLOCK_K`` 64..256 so the
    pipelined weight + bf16 x tiles (``BLOCK_K x (TILE_N + 2 BLOCK_M)`` bytes a stage) leave
    room for two programs per SM, both operand conversions (``DOT_F16``), warps by tile."""
    r = 2 if variant == "swiglu" else 1
    out: list[dict[str, int]] = []

    def add(use_dot, tile_rows, bk, warps, stages, f16, prefetch=0):
        bn = max(2, tile_rows // r)
        out.append(dict(USE_DOT=use_dot, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                        num_stages=stages, DOT_F16=f16, PREFETCH=prefetch))  # fmt: skip

    if batch == 1:
        for tile_rows in (8, 16, 32, 64):
            for bk in (256, 512, 1024):
                elems = max(tile_rows, 2 * r) * bk
                if elems > FMA_ACC_MAX:
                    continue
                for warps in (2, 4, 8):
                    if warps * 32 * 16 <= elems:
                        for prefetch in (0, 1):
                            add(0, tile_rows, bk, warps, 3, 0, prefetch)
        for tile_rows, bk in ((16, 256), (32, 256), (64, 128)):
            add(1, tile_rows, bk, 4, 3, 1)
        return out
    block_m = max(16, 1 << (batch - 1).bit_length())
    for tile_rows in (16, 32, 64, 128):
        for bk in (64, 128, 256):
            stages = 3
            if stages * bk * (tile_rows + 2 * block_m) > SMEM_BUDGET:
                continue
            if bk == 64 and tile_rows < 64:  # short K steps only pay with wide tiles
                continue
            warps = 2 if tile_rows == 16 else 4 if tile_rows <= 64 else 8
            for f16 in (1, 0):
                add(1, tile_rows, bk, warps, stages, f16)
    return out


def _shapes(kinds: list[str]):
    from kernel_benchmark.decode_shapes import MODELS, linear_shapes

    return [s for s in linear_shapes("7B", MODELS["7B"]) if s.kind in kinds]


# ------------------------------------------------------------------- parallel compilation

_WARM_INPUTS: dict = {}


def _warm(kind: str, batch: int, cfg_list: list[dict[str, int]]) -> int:
    """Worker: run each config once (compiles it into Triton's disk cache); the count run."""
    from kernel_benchmark.common import tuned
    from nakta_model.kernels import decode_linear as dl

    device = torch.device("cuda")
    if (kind, batch) not in _WARM_INPUTS:
        _WARM_INPUTS.clear()  # one point's inputs at a time
        shape = next(s for s in _shapes(list(KINDS)) if s.kind == kind)
        _WARM_INPUTS[(kind, batch)] = _fp8_set(shape, batch, device, 0)
    call = _WARM_INPUTS[(kind, batch)]["fp8"]
    done = 0
    for cfg in cfg_list:
        try:
            with torch.no_grad(), tuned(dl, **cfg):
                call()
            done += 1
        except Exception:  # noqa: BLE001 - a refused config is reported when timed
            pass
    torch.cuda.synchronize()
    return done


def precompile(points, jobs: int, deadline: float) -> None:
    """Compile every candidate of ``points`` in ``jobs`` spawned processes (Triton's disk
    cache then serves the timing process), until ``deadline``; what is left compiles later."""
    tasks, seen = [], set()
    for shape, batch, cands in points:
        # Triton specializes an int on == 1 and on divisibility by 16 only: batches 2, 4 and
        # 8 (one BLOCK_M) share their kernels, so one of them compiles the grid for all
        compile_class = (shape.kind, batch if batch == 1 or batch % 16 == 0 else "small")
        if compile_class in seen:
            continue
        seen.add(compile_class)
        for i in range(0, len(cands), 4):
            tasks.append((shape.kind, batch, cands[i : i + 4]))
    compile_in_workers(_warm, tasks, jobs, deadline)


# ------------------------------------------------------------------------------ timing


def _fp8_set(shape, batch: int, device, seed: int) -> dict:
    """One input set and its two calls: ``fp8`` (e4m3 weight + row scales), ``bf16``."""
    from kernel_benchmark.decode_shapes import linear_kwargs, make_linear_set
    from nakta_model.kernels.decode_linear import decode_linear
    from nakta_model.kernels.fp8_quant import quantize_weight

    t = make_linear_set(shape, batch, torch.bfloat16, device, seed)
    kw = linear_kwargs(shape, t)
    wq, ws = quantize_weight(t["w"])
    return {
        "fp8": lambda: decode_linear(t["x"], wq, weight_scale=ws, **kw, out=t["out"]),
        "bf16": lambda: decode_linear(t["x"], t["w"], **kw, out=t["out"]),
    }


def _with(cfg: dict[str, int] | None, call):
    """``call`` run under ``cfg`` as ``decode_linear``'s ``_TUNE`` (None: the tables)."""
    from kernel_benchmark.common import tuned
    from nakta_model.kernels import decode_linear as dl

    def run():
        with tuned(dl, **(cfg or {})):
            return call()

    return run


def time_point(shape, batch: int, cands, device, copy_gbps: float) -> list[dict]:
    """Every candidate, the FP8 default and the bf16 default of one point, interleaved."""
    from bench_common.timing import input_sets, rotated_ms
    from kernel_benchmark.decode_shapes import linear_bytes
    from nakta_model.kernels import decode_linear as dl
    from nakta_model.kernels.fp8_quant import FP8_DTYPE

    sets = [_fp8_set(shape, batch, device, i) for i in range(input_sets(device, shape.n * shape.k))]
    default = dl._config(torch.bfloat16, batch, shape.n_cols, shape.k, shape.variant, device,
                         FP8_DTYPE)  # fmt: skip
    default = {k: default[k] for k in KNOBS}
    paths = {"bf16": (None, [_with({}, s["bf16"]) for s in sets])}
    paths["default"] = (default, [_with({}, s["fp8"]) for s in sets])
    for c in cands:
        if config_key(c, KNOBS) != config_key(default, KNOBS):
            paths[config_label(c, KNOBS)] = (c, [_with(c, s["fp8"]) for s in sets])
    with torch.no_grad():
        ms, errors = rotated_ms({n: calls for n, (_, calls) in paths.items()}, rounds=3,
                                budget_ms=3.0)  # fmt: skip
    full = linear_bytes(shape, batch, 2)
    rows = []
    for name, (cfg, _) in paths.items():
        nbytes = full if name == "bf16" else full - shape.n * shape.k + 4 * shape.n
        us = ms.get(name, float("nan")) * 1e3
        rows.append({"kind": shape.kind, "variant": shape.variant, "N": shape.n, "K": shape.k,
                     "batch": batch, "path": name if name in ("bf16", "default") else "candidate",
                     **{k: (cfg or {}).get(k, -1) for k in KNOBS}, "us": us,
                     "pct_copy_bw": 100 * nbytes / us / 1e3 / copy_gbps,
                     "status": errors.get(name, "ok")})  # fmt: skip
    return rows


# ------------------------------------------------------------------------------- results


def _best_per_point(
    df: pd.DataFrame, point: str, peer: str, knobs: Sequence[str], carry: Sequence[str] = ()
) -> list[dict]:
    """Per (kind, ``point``): the fastest kernel config (the default included), with the
    default's and the ``peer`` path's numbers beside it (both tuners' result rows)."""
    out = []
    for (kind, at), grp in df.groupby(["kind", point], sort=False):
        ok = grp[(grp["path"] != peer) & (grp["status"] == "ok") & grp["us"].notna()]
        if ok.empty:
            continue
        best = ok.loc[ok["us"].idxmin()]
        default = grp[grp["path"] == "default"].iloc[0]
        ref = grp[grp["path"] == peer].iloc[0]
        out.append({"kind": kind, **{c: best[c] for c in carry}, "N": int(best["N"]),
                    "K": int(best["K"]), point: int(at),
                    "config": {k: int(best[k]) for k in knobs}, "us": float(best["us"]),
                    "pct_copy_bw": float(best["pct_copy_bw"]),
                    "default_pct_copy_bw": float(default["pct_copy_bw"]),
                    f"{peer}_pct_copy_bw": float(ref["pct_copy_bw"]),
                    f"speedup_vs_{peer}": float(ref["us"] / best["us"]),
                    f"default_speedup_vs_{peer}": float(ref["us"] / default["us"])})  # fmt: skip
    return out


def best_per_point(df: pd.DataFrame) -> list[dict]:
    """Per (kind, batch): the fastest FP8 config (the default included), with the default's
    and bf16's numbers beside it."""
    return _best_per_point(df, "batch", "bf16", KNOBS, carry=("variant",))


def update_configs(path: Path, family: str, device_name: str, best: list[dict]) -> dict:
    """Put ``best`` under ``family`` in the tuned-config JSON (other families kept, this
    family's rows of the tuned points replaced); returns the document written."""
    rows = {}
    for b in best:
        n_cols = b["N"] // 2 if b["variant"] == "swiglu" else b["N"]
        bucket = 1 << (b["batch"] - 1).bit_length()
        figures = ("pct_copy_bw", "default_pct_copy_bw", "bf16_pct_copy_bw", "speedup_vs_bf16")
        rows[cfgs.fp8_tuned_key(bucket, b["variant"], n_cols, b["K"])] = (
            b["config"],
            {k: round(b[k], 3) for k in figures},
        )
    about = ("decode_linear FP8-weight launch configs per device family, written by "
             "kernel_benchmark/tune_fp8_decode.py; loaded by decode_linear.py")  # fmt: skip
    return write_family(path, family, device_name, rows, about, cfgs.load_fp8_tuned)


def gemv_main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("tune_fp8_decode --kernel gemv needs a GPU of compute capability >= 8.9: nothing tuned",
              file=sys.stderr)  # fmt: skip
        return 1
    from bench_common.ceilings import copy_bandwidth_gbps, device_slug
    from bench_common.report import results_dir
    from nakta_model.kernels._checks import device_family

    t0 = time.perf_counter()
    deadline = t0 + args.budget
    device = torch.device("cuda")
    slug, family = device_slug(device), device_family(device)
    shapes = _shapes(args.kinds)
    order = [b for b in ORDER if b in args.batches] + [b for b in args.batches if b not in ORDER]
    points = [(s, b, candidates(s.variant, b)) for b in order for s in shapes]
    print(f"{len(points)} points, {sum(len(c) for *_, c in points)} candidates, "
          f"budget {args.budget:.0f}s, device {slug} (family {family!r})", flush=True)  # fmt: skip
    if args.jobs:
        precompile(points, args.jobs, t0 + 0.6 * args.budget)
    copy_gbps = copy_bandwidth_gbps()

    def describe(point: tuple, b: dict) -> str:
        return (f"{point[0].kind} b{point[1]}: {b['pct_copy_bw']:.1f}% of copy bw (default "
                f"{b['default_pct_copy_bw']:.1f}%, bf16 {b['bf16_pct_copy_bw']:.1f}%), "
                f"x{b['speedup_vs_bf16']:.2f} vs bf16 (default x{b['default_speedup_vs_bf16']:.2f}) "
                f"{config_label(b['config'], KNOBS)}")  # fmt: skip

    rows = time_points(
        points, lambda pt: time_point(*pt, device, copy_gbps), best_per_point, describe, t0,
        deadline,
    )  # fmt: skip
    notes = (f"{slug}, torch {torch.__version__}, copy bandwidth {copy_gbps:.0f} GB/s. "
             "CUDA-graph replays over input copies > 3x L2, candidates interleaved (rotated_ms); "
             "bytes as bench_fp8's decode section.")  # fmt: skip
    write_results(
        rows, best_per_point, out=args.out or results_dir(__file__, slug), stem="fp8_decode_tune",
        title="FP8 decode GEMV tuning: every timing", notes=notes,
        summary={"device": slug, "copy_gbps": copy_gbps}, family=family,
        device_name=torch.cuda.get_device_name(), configs=args.configs,
        write_configs=not args.no_write_configs, update=update_configs, t0=t0,
    )  # fmt: skip
    return 0


# ==============================================================================================
# fp8_decode_gemm (--kernel gemm)
# ==============================================================================================


GEMM_KNOBS = fdg.KNOBS  # BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages
GEMM_SHAPES = {  # kind: (N, K, residual epilogue), LLaMA-7B
    "wqkv": (12288, 4096, False),
    "wo": (4096, 4096, True),
    "w13": (22016, 4096, False),
    "w2": (4096, 11008, True),
}
GEMM_ROWS = (8, 16, 32, 64)
GEMM_ORDER = (32, 64, 16, 8)  # the target's rows first when the budget runs short
SMS = 132  # H100 SXM / H200: the grid's split counts are chosen for this many SMs


def gemm_parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="--kernel gemm: tune fp8_decode_gemm's launch configs")
    p.add_argument("--rows", default=",".join(map(str, GEMM_ROWS)), help="decode rows (1..64)")
    p.add_argument("--kinds", default=",".join(GEMM_SHAPES), help=f"subset of {tuple(GEMM_SHAPES)}")
    p.add_argument("--budget", type=float, default=170.0, help="seconds for the whole sweep")
    p.add_argument("--jobs", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 2)),
                   help="processes compiling the grid up front (0: compile while timing)")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="results folder")
    p.add_argument("--configs", type=Path, default=fdg.TUNED_JSON,
                   help="tuned-config JSON to update (read by fp8_decode_gemm.py)")  # fmt: skip
    p.add_argument("--no-write-configs", action="store_true")
    a = p.parse_args(argv)
    try:
        a.rows = sorted({int(t) for t in a.rows.split(",") if t.strip()})
    except ValueError:
        p.error(f"--rows must be comma-separated ints, got {a.rows!r}")
    if not a.rows or min(a.rows) < 1 or max(a.rows) > fdg.MAX_ROWS:
        p.error(f"--rows needs ints in [1, {fdg.MAX_ROWS}], got {a.rows}")
    a.kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    if not a.kinds or set(a.kinds) - set(GEMM_SHAPES):
        p.error(f"--kinds must be a subset of {','.join(GEMM_SHAPES)}, got {a.kinds}")
    if a.budget <= 0 or a.jobs < 0:
        p.error("--budget must be > 0 and --jobs >= 0")
    return a


# ------------------------------------------------------------------------------- the grid


# (BLOCK_N, BLOCK_K, num_warps, num_stages) families: 64- and 128-row weight tiles, 128..512
# bytes of each weight row per K step, one or two warpgroups on the 128-row tile, 3-4 stages
TILES = (  # (BLOCK_N, BLOCK_K, num_warps, num_stages); stages lowered to what fits
    (64, 128, 4, 4),
    (64, 128, 4, 8),  # deeper pipelines: more weight bytes in flight per SM
    (64, 256, 4, 3),
    (64, 256, 4, 4),
    (64, 256, 4, 6),
    (64, 256, 8, 6),
    (64, 512, 4, 3),
    (128, 128, 4, 4),
    (128, 128, 8, 8),
    (128, 256, 4, 4),
    (128, 256, 8, 4),
    (128, 256, 8, 6),
)


def gemm_candidates(n: int, k: int, rows: int) -> list[dict[str, int]]:
    """The grid of one point, from the kernel's structure: each of ``TILES`` with the split-K
    counts (1, 2, 4, 8) that keep at most ~4 programs per SM (``SMS``) and at least 4 K steps
    a split; stages lowered to what fits ``fp8_decode_gemm.SMEM_BUDGET`` at these rows, and
    duplicates after that cap dropped."""
    block_r = max(16, 1 << (rows - 1).bit_length())
    out: dict[tuple, dict[str, int]] = {}
    for block_n, bk, warps, stages in TILES:
        tiles, steps = -(-n // block_n), -(-k // bk)
        splits = [s for s in (1, 2, 4, 8) if tiles * s <= 4 * SMS and steps // s >= 4]
        for split in splits or [1]:
            cfg = dict(BLOCK_N=block_n, BLOCK_K=bk, SPLIT_K=split, num_warps=warps,
                       num_stages=stages)  # fmt: skip
            cfg["num_stages"] = fdg.stages_that_fit(cfg, block_r)
            out.setdefault(config_key(cfg, GEMM_KNOBS), cfg)
    return list(out.values())


def point_set(kind: str, rows: int, device, seed: int) -> dict:
    """One input set of a point: e4m3 x and weight with fp32 scales, a bf16 residual (``wo``,
    ``w2``) and the output buffer."""
    n, k, residual = GEMM_SHAPES[kind]
    g = torch.Generator(device=device).manual_seed(seed)
    t = {
        "xq": torch.randn(rows, k, device=device, generator=g).to(FP8_DTYPE),
        "xs": torch.rand(rows, device=device, generator=g) * 1e-2,
        "wq": torch.randn(n, k, device=device, generator=g).to(FP8_DTYPE),
        "ws": torch.rand(n, device=device, generator=g) * 1e-2,
        "out": torch.empty(rows, n, device=device, dtype=torch.bfloat16),
    }
    t["res"] = torch.randn(rows, n, device=device, dtype=torch.bfloat16) if residual else None
    return t


def kernel_call(t: dict, cfg: dict[str, int] | None):
    """``fp8_decode_gemm`` on one set under ``cfg`` as its ``_TUNE`` (None: the tables)."""
    from kernel_benchmark.common import tuned

    def run():
        with tuned(fdg, **(cfg or {})):
            return fdg.fp8_decode_gemm(t["xq"], t["xs"], t["wq"], t["ws"], torch.bfloat16,
                                       residual=t["res"], out=t["out"])  # fmt: skip

    return run


def cublaslt_call(t: dict):
    """``step_gemm``'s FP8 GEMM without the kernel: cuBLASLt, then the residual add."""
    from nakta_model.kernels.fp8_gemm import fp8_matmul

    def run():
        y = fp8_matmul(t["xq"], t["xs"], t["wq"], t["ws"], torch.bfloat16)
        return y.add_(t["res"]) if t["res"] is not None else y

    return run


def point_bytes(kind: str, rows: int) -> int:
    """Bytes a perfect kernel moves: e4m3 weight + scales, e4m3 x + scales, bf16 out (and the
    residual read)."""
    n, k, residual = GEMM_SHAPES[kind]
    return n * k + 4 * n + rows * k + 4 * rows + 2 * rows * n * (2 if residual else 1)


# ------------------------------------------------------------------- parallel compilation

_GEMM_WARM_SETS: dict = {}


def _warm_gemm(kind: str, rows: int, cfg_list: list[dict[str, int]]) -> int:
    """Worker: run each config once (compiles it into Triton's disk cache); the count run."""
    if (kind, rows) not in _GEMM_WARM_SETS:
        _GEMM_WARM_SETS.clear()  # one point's inputs at a time
        _GEMM_WARM_SETS[(kind, rows)] = point_set(kind, rows, torch.device("cuda"), 0)
    t = _GEMM_WARM_SETS[(kind, rows)]
    done = 0
    for cfg in cfg_list:
        try:
            kernel_call(t, cfg)()
            done += 1
        except Exception:  # noqa: BLE001 - a refused config is reported when timed
            pass
    torch.cuda.synchronize()
    return done


def gemm_precompile(points, jobs: int, deadline: float) -> None:
    """Compile every candidate of ``points`` in ``jobs`` spawned processes (Triton's disk
    cache then serves the timing process), until ``deadline``; what is left compiles later."""
    tasks = [(kind, rows, cands[i : i + 4]) for kind, rows, cands in points
             for i in range(0, len(cands), 4)]  # fmt: skip
    compile_in_workers(_warm_gemm, tasks, jobs, deadline)


# ------------------------------------------------------------------------------ timing


def gemm_time_point(kind: str, rows: int, cands, device, copy_gbps: float) -> list[dict]:
    """Every candidate, the current config and cuBLASLt at one point, interleaved."""
    from bench_common.timing import input_sets, rotated_ms

    n, k, _ = GEMM_SHAPES[kind]
    sets = [point_set(kind, rows, device, i) for i in range(input_sets(device, n * k))]
    default = fdg._config(n, k, rows, device)
    paths = {"cublaslt": (None, [cublaslt_call(t) for t in sets])}
    paths["default"] = (default, [kernel_call(t, None) for t in sets])
    for c in cands:
        if config_key(c, GEMM_KNOBS) != config_key(default, GEMM_KNOBS):
            paths[config_label(c, GEMM_KNOBS)] = (c, [kernel_call(t, c) for t in sets])
    with torch.no_grad():
        ms, errors = rotated_ms({p: calls for p, (_, calls) in paths.items()}, rounds=3,
                                budget_ms=3.0)  # fmt: skip
    nbytes = point_bytes(kind, rows)
    out = []
    for name, (cfg, _) in paths.items():
        us = ms.get(name, float("nan")) * 1e3
        out.append({"kind": kind, "N": n, "K": k, "rows": rows,
                    "path": name if name in ("cublaslt", "default") else "candidate",
                    **{key: (cfg or {}).get(key, -1) for key in GEMM_KNOBS}, "us": us,
                    "pct_copy_bw": 100 * nbytes / us / 1e3 / copy_gbps,
                    "status": errors.get(name, "ok")})  # fmt: skip
    return out


# ------------------------------------------------------------------------------- results


def gemm_best_per_point(df: pd.DataFrame) -> list[dict]:
    """Per (kind, rows): the fastest kernel config (the current one included), with the
    current config's and cuBLASLt's numbers beside it."""
    return _best_per_point(df, "rows", "cublaslt", GEMM_KNOBS)


def gemm_update_configs(path: Path, family: str, device_name: str, best: list[dict]) -> dict:
    """Put ``best`` under ``family`` in the tuned-config JSON (other families kept, this
    family's rows of the tuned points replaced); returns the document written."""
    figures = ("pct_copy_bw", "default_pct_copy_bw", "cublaslt_pct_copy_bw", "speedup_vs_cublaslt")
    rows = {
        fdg.tuned_key(b["N"], b["K"], fdg.rows_bucket(b["rows"])): (
            b["config"],
            {k: round(b[k], 3) for k in figures},
        )
        for b in best
    }
    about = ("fp8_decode_gemm launch configs per device family (keys N/K/rows bucket), written "
             "by kernel_benchmark/tune_fp8_decode.py --kernel gemm; loaded by "
             "fp8_decode_gemm.py")  # fmt: skip
    return write_family(path, family, device_name, rows, about, fdg.load_tuned)


def gemm_main(argv: list[str] | None = None) -> int:
    a = gemm_parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("tune_fp8_decode --kernel gemm needs a GPU of compute capability >= 8.9: "
              "nothing tuned", file=sys.stderr)  # fmt: skip
        return 1
    from bench_common.ceilings import copy_bandwidth_gbps, device_slug
    from bench_common.report import results_dir
    from nakta_model.kernels._checks import device_family

    t0 = time.perf_counter()
    device = torch.device("cuda")
    slug, family = device_slug(device), device_family(device)
    order = [r for r in GEMM_ORDER if r in a.rows] + [r for r in a.rows if r not in GEMM_ORDER]
    points = [
        (kind, r, gemm_candidates(*GEMM_SHAPES[kind][:2], r)) for r in order for kind in a.kinds
    ]
    print(f"{len(points)} points, {sum(len(c) for *_, c in points)} candidates, budget "
          f"{a.budget:.0f}s, device {slug} (family {family!r})", flush=True)  # fmt: skip
    if a.jobs:
        gemm_precompile(points, a.jobs, t0 + 0.55 * a.budget)
    copy_gbps = copy_bandwidth_gbps()

    def describe(point: tuple, b: dict) -> str:
        return (f"{point[0]} rows {point[1]}: {b['us']:.1f} us, {b['pct_copy_bw']:.1f}% of copy "
                f"bw (default {b['default_pct_copy_bw']:.1f}%, cuBLASLt "
                f"{b['cublaslt_pct_copy_bw']:.1f}%), x{b['speedup_vs_cublaslt']:.2f} vs cuBLASLt "
                f"{config_label(b['config'], GEMM_KNOBS)}")  # fmt: skip

    rows = time_points(
        points, lambda pt: gemm_time_point(*pt, device, copy_gbps), gemm_best_per_point, describe,
        t0, t0 + a.budget,
    )  # fmt: skip
    notes = (f"{slug}, torch {torch.__version__}, copy bandwidth {copy_gbps:.0f} GB/s. "
             "CUDA-graph replays over input copies > 3x L2, paths interleaved (rotated_ms); "
             "bytes: e4m3 weight + scales, e4m3 x, bf16 out (+ residual).")  # fmt: skip
    write_results(
        rows, gemm_best_per_point, out=a.out or results_dir(__file__, slug),
        stem="fp8_decode_gemm_tune", title="fp8_decode_gemm tuning: every timing", notes=notes,
        summary={"device": slug, "copy_gbps": copy_gbps}, family=family,
        device_name=torch.cuda.get_device_name(), configs=a.configs,
        write_configs=not a.no_write_configs, update=gemm_update_configs, t0=t0,
    )  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    """``--kernel gemv`` (the default) or ``gemm``; the rest are that tuner's options."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--kernel", choices=("gemv", "gemm"), default="gemv")
    a, rest = p.parse_known_args(argv)
    return (gemm_main if a.kernel == "gemm" else gemv_main)(rest)


if __name__ == "__main__":
    sys.exit(main())
