"""Tune ``decode_linear``'s FP8-weight launch configs at LLaMA-7B's decode GEMVs, in minutes.

Why: the FP8 rows of ``decode_linear.py`` were derived from bf16 ones, and FP8 moves
half the weight bytes per K step while the bf16 x tile stays as large: the best tiles differ
(H100: batch 32 ran at 0.44-0.93x bf16 on the derived rows). Per (shape, batch) of wqkv
(NORM+ROPE), wo (RESIDUAL), w13 (NORM+SWIGLU) and w2 (RESIDUAL) at ``--batches`` (the
generator's buckets), a fixed candidate grid chosen from the kernel's structure
(``candidates``) is timed beside the current FP8 default and the bf16 default: CUDA-graph
replays over input copies larger than L2, candidates interleaved round by round
(``bench_common.timing.rotated_ms``, graphs on a side stream). Compilation dominates a sweep,
so the grid is first compiled by ``--jobs`` worker processes into Triton's on-disk cache.

    python -m kernel_benchmark.tune_fp8_decode [--batches 1,2,4,8,16,32,64] [--budget 230]

Writes ``results/<device>/fp8_decode_tune.{csv,json}`` (every timing; per point the best, the
default and bf16 with % of copy bandwidth) and puts the winners, under this device's family,
into ``nakta_model/kernels/_decode_linear_fp8_tuned.json``, which ``decode_linear.py``
loads (commit it; ``--no-write-configs`` leaves it alone). GPU only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if not __package__:  # run by path: import from the repo root, not from this script's folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import pandas as pd
import torch

from kernel_benchmark import tuning
from nakta_model.kernels import decode_linear as cfgs

KNOBS = cfgs.FP8_KNOBS  # USE_DOT, BLOCK_N, BLOCK_K, num_warps, num_stages, DOT_F16, PREFETCH
KINDS = ("wqkv", "wo", "w13", "w2")  # the LM head stays bf16 (not FP8): not tuned here
BATCHES = (1, 2, 4, 8, 16, 32, 64)
ORDER = (1, 32, 64, 16, 8, 4, 2)  # the targets' batches first when the budget runs short
SMEM_BUDGET = 110 * 1024  # pipelined tile bytes a tl.dot candidate may take (2 CTAs per SM)
FMA_ACC_MAX = 16384  # fp32 accumulator elements (TILE_N x BLOCK_K) of a batch-1 candidate


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    tuning.precompile(_warm, tasks, jobs, deadline)


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
        if tuning.config_key(c, KNOBS) != tuning.config_key(default, KNOBS):
            paths[tuning.config_label(c, KNOBS)] = (c, [_with(c, s["fp8"]) for s in sets])
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


def best_per_point(df: pd.DataFrame) -> list[dict]:
    """Per (kind, batch): the fastest FP8 config (the default included), with the default's
    and bf16's numbers beside it."""
    out = []
    for (kind, batch), grp in df.groupby(["kind", "batch"], sort=False):
        fp8 = grp[(grp["path"] != "bf16") & (grp["status"] == "ok") & grp["us"].notna()]
        if fp8.empty:
            continue
        best = fp8.loc[fp8["us"].idxmin()]
        default = grp[grp["path"] == "default"].iloc[0]
        bf16 = grp[grp["path"] == "bf16"].iloc[0]
        out.append({"kind": kind, "variant": best["variant"], "N": int(best["N"]),
                    "K": int(best["K"]), "batch": int(batch),
                    "config": {k: int(best[k]) for k in KNOBS}, "us": float(best["us"]),
                    "pct_copy_bw": float(best["pct_copy_bw"]),
                    "default_pct_copy_bw": float(default["pct_copy_bw"]),
                    "bf16_pct_copy_bw": float(bf16["pct_copy_bw"]),
                    "speedup_vs_bf16": float(bf16["us"] / best["us"]),
                    "default_speedup_vs_bf16": float(bf16["us"] / default["us"])})  # fmt: skip
    return out


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
    return tuning.write_family(path, family, device_name, rows, about, cfgs.load_fp8_tuned)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("tune_fp8_decode needs a GPU of compute capability >= 8.9: nothing tuned",
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
                f"{tuning.config_label(b['config'], KNOBS)}")  # fmt: skip

    rows = tuning.time_points(
        points, lambda pt: time_point(*pt, device, copy_gbps), best_per_point, describe, t0,
        deadline,
    )  # fmt: skip
    notes = (f"{slug}, torch {torch.__version__}, copy bandwidth {copy_gbps:.0f} GB/s. "
             "CUDA-graph replays over input copies > 3x L2, candidates interleaved (rotated_ms); "
             "bytes as bench_fp8's decode section.")  # fmt: skip
    tuning.write_results(
        rows, best_per_point, out=args.out or results_dir(__file__, slug), stem="fp8_decode_tune",
        title="FP8 decode GEMV tuning: every timing", notes=notes,
        summary={"device": slug, "copy_gbps": copy_gbps}, family=family,
        device_name=torch.cuda.get_device_name(), configs=args.configs,
        write_configs=not args.no_write_configs, update=update_configs, t0=t0,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
