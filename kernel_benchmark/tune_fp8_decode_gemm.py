"""Tune ``fp8_decode_gemm``'s launch configs at LLaMA-7B's decode linears, in minutes.

Why: the kernel's default config is derived from the shape (``fp8_decode_gemm._config``); the
best weight tile, K step, split count and pipeline depth per (N, K, rows) are measured. Per
point of the 7B linears (``wqkv`` 12288x4096, ``wo`` 4096x4096 + residual, ``w13`` 22016x4096,
``w2`` 4096x11008 + residual) at ``--rows`` (8, 16, 32, 64), a fixed candidate grid
(``candidates``) is timed beside the current config (``default``) and cuBLASLt's row-wise
scaled GEMM (``cublaslt``: ``fp8_matmul``, then the residual add as ``step_gemm`` does it):
CUDA-graph replays over input copies larger than L2, paths interleaved round by round
(``bench_common.timing.rotated_ms``, graphs on a side stream). Compilation dominates a sweep,
so the grid is first compiled by ``--jobs`` worker processes into Triton's on-disk cache.

    python -m kernel_benchmark.tune_fp8_decode_gemm [--rows 8,16,32,64] [--budget 170]

Writes ``results/<device>/fp8_decode_gemm_tune.{csv,md,json}`` (every timing; per point the
best, the default and cuBLASLt with % of copy bandwidth) and puts the winners, under this
device's family, into ``nakta_model/kernels/_fp8_decode_gemm_tuned.json``, which
``fp8_decode_gemm.py`` loads (commit it; ``--no-write-configs`` leaves it alone). GPU only.
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
from nakta_model.kernels import fp8_decode_gemm as fdg
from nakta_model.kernels.fp8_quant import FP8_DTYPE

KNOBS = fdg.KNOBS  # BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages
SHAPES = {  # kind: (N, K, residual epilogue), LLaMA-7B
    "wqkv": (12288, 4096, False),
    "wo": (4096, 4096, True),
    "w13": (22016, 4096, False),
    "w2": (4096, 11008, True),
}
ROWS = (8, 16, 32, 64)
ORDER = (32, 64, 16, 8)  # the target's rows first when the budget runs short
SMS = 132  # H100 SXM / H200: the grid's split counts are chosen for this many SMs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="decode rows (1..64)")
    p.add_argument("--kinds", default=",".join(SHAPES), help=f"subset of {tuple(SHAPES)}")
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
    if not a.kinds or set(a.kinds) - set(SHAPES):
        p.error(f"--kinds must be a subset of {','.join(SHAPES)}, got {a.kinds}")
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


def candidates(n: int, k: int, rows: int) -> list[dict[str, int]]:
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
            out.setdefault(tuning.config_key(cfg, KNOBS), cfg)
    return list(out.values())


def point_set(kind: str, rows: int, device, seed: int) -> dict:
    """One input set of a point: e4m3 x and weight with fp32 scales, a bf16 residual (``wo``,
    ``w2``) and the output buffer."""
    n, k, residual = SHAPES[kind]
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
    n, k, residual = SHAPES[kind]
    return n * k + 4 * n + rows * k + 4 * rows + 2 * rows * n * (2 if residual else 1)


# ------------------------------------------------------------------- parallel compilation

_WARM_SETS: dict = {}


def _warm(kind: str, rows: int, cfg_list: list[dict[str, int]]) -> int:
    """Worker: run each config once (compiles it into Triton's disk cache); the count run."""
    if (kind, rows) not in _WARM_SETS:
        _WARM_SETS.clear()  # one point's inputs at a time
        _WARM_SETS[(kind, rows)] = point_set(kind, rows, torch.device("cuda"), 0)
    t = _WARM_SETS[(kind, rows)]
    done = 0
    for cfg in cfg_list:
        try:
            kernel_call(t, cfg)()
            done += 1
        except Exception:  # noqa: BLE001 - a refused config is reported when timed
            pass
    torch.cuda.synchronize()
    return done


def precompile(points, jobs: int, deadline: float) -> None:
    """Compile every candidate of ``points`` in ``jobs`` spawned processes (Triton's disk
    cache then serves the timing process), until ``deadline``; what is left compiles later."""
    tasks = [(kind, rows, cands[i : i + 4]) for kind, rows, cands in points
             for i in range(0, len(cands), 4)]  # fmt: skip
    tuning.precompile(_warm, tasks, jobs, deadline)


# ------------------------------------------------------------------------------ timing


def time_point(kind: str, rows: int, cands, device, copy_gbps: float) -> list[dict]:
    """Every candidate, the current config and cuBLASLt at one point, interleaved."""
    from bench_common.timing import input_sets, rotated_ms

    n, k, _ = SHAPES[kind]
    sets = [point_set(kind, rows, device, i) for i in range(input_sets(device, n * k))]
    default = fdg._config(n, k, rows, device)
    paths = {"cublaslt": (None, [cublaslt_call(t) for t in sets])}
    paths["default"] = (default, [kernel_call(t, None) for t in sets])
    for c in cands:
        if tuning.config_key(c, KNOBS) != tuning.config_key(default, KNOBS):
            paths[tuning.config_label(c, KNOBS)] = (c, [kernel_call(t, c) for t in sets])
    with torch.no_grad():
        ms, errors = rotated_ms({p: calls for p, (_, calls) in paths.items()}, rounds=3,
                                budget_ms=3.0)  # fmt: skip
    nbytes = point_bytes(kind, rows)
    out = []
    for name, (cfg, _) in paths.items():
        us = ms.get(name, float("nan")) * 1e3
        out.append({"kind": kind, "N": n, "K": k, "rows": rows,
                    "path": name if name in ("cublaslt", "default") else "candidate",
                    **{key: (cfg or {}).get(key, -1) for key in KNOBS}, "us": us,
                    "pct_copy_bw": 100 * nbytes / us / 1e3 / copy_gbps,
                    "status": errors.get(name, "ok")})  # fmt: skip
    return out


# ------------------------------------------------------------------------------- results


def best_per_point(df: pd.DataFrame) -> list[dict]:
    """Per (kind, rows): the fastest kernel config (the current one included), with the
    current config's and cuBLASLt's numbers beside it."""
    out = []
    for (kind, rows), grp in df.groupby(["kind", "rows"], sort=False):
        ok = grp[(grp["path"] != "cublaslt") & (grp["status"] == "ok") & grp["us"].notna()]
        if ok.empty:
            continue
        best = ok.loc[ok["us"].idxmin()]
        default = grp[grp["path"] == "default"].iloc[0]
        lt = grp[grp["path"] == "cublaslt"].iloc[0]
        out.append({"kind": kind, "N": int(best["N"]), "K": int(best["K"]), "rows": int(rows),
                    "config": {key: int(best[key]) for key in KNOBS}, "us": float(best["us"]),
                    "pct_copy_bw": float(best["pct_copy_bw"]),
                    "default_pct_copy_bw": float(default["pct_copy_bw"]),
                    "cublaslt_pct_copy_bw": float(lt["pct_copy_bw"]),
                    "speedup_vs_cublaslt": float(lt["us"] / best["us"]),
                    "default_speedup_vs_cublaslt": float(lt["us"] / default["us"])})  # fmt: skip
    return out


def update_configs(path: Path, family: str, device_name: str, best: list[dict]) -> dict:
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
    about = ("fp8_decode_gemm launch configs per device family (keys N/K/rows bucket), "
             "written by kernel_benchmark/tune_fp8_decode_gemm.py; loaded by fp8_decode_gemm.py")  # fmt: skip
    return tuning.write_family(path, family, device_name, rows, about, fdg.load_tuned)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("tune_fp8_decode_gemm needs a GPU of compute capability >= 8.9: nothing tuned",
              file=sys.stderr)  # fmt: skip
        return 1
    from bench_common.ceilings import copy_bandwidth_gbps, device_slug
    from bench_common.report import results_dir
    from nakta_model.kernels._checks import device_family

    t0 = time.perf_counter()
    device = torch.device("cuda")
    slug, family = device_slug(device), device_family(device)
    order = [r for r in ORDER if r in a.rows] + [r for r in a.rows if r not in ORDER]
    points = [(kind, r, candidates(*SHAPES[kind][:2], r)) for r in order for kind in a.kinds]
    print(f"{len(points)} points, {sum(len(c) for *_, c in points)} candidates, budget "
          f"{a.budget:.0f}s, device {slug} (family {family!r})", flush=True)  # fmt: skip
    if a.jobs:
        precompile(points, a.jobs, t0 + 0.55 * a.budget)
    copy_gbps = copy_bandwidth_gbps()

    def describe(point: tuple, b: dict) -> str:
        return (f"{point[0]} rows {point[1]}: {b['us']:.1f} us, {b['pct_copy_bw']:.1f}% of copy "
                f"bw (default {b['default_pct_copy_bw']:.1f}%, cuBLASLt "
                f"{b['cublaslt_pct_copy_bw']:.1f}%), x{b['speedup_vs_cublaslt']:.2f} vs cuBLASLt "
                f"{tuning.config_label(b['config'], KNOBS)}")  # fmt: skip

    rows = tuning.time_points(
        points, lambda pt: time_point(*pt, device, copy_gbps), best_per_point, describe, t0,
        t0 + a.budget,
    )  # fmt: skip
    notes = (f"{slug}, torch {torch.__version__}, copy bandwidth {copy_gbps:.0f} GB/s. "
             "CUDA-graph replays over input copies > 3x L2, paths interleaved (rotated_ms); "
             "bytes: e4m3 weight + scales, e4m3 x, bf16 out (+ residual).")  # fmt: skip
    tuning.write_results(
        rows, best_per_point, out=a.out or results_dir(__file__, slug),
        stem="fp8_decode_gemm_tune", title="fp8_decode_gemm tuning: every timing", notes=notes,
        summary={"device": slug, "copy_gbps": copy_gbps}, family=family,
        device_name=torch.cuda.get_device_name(), configs=a.configs,
        write_configs=not a.no_write_configs, update=update_configs, t0=t0,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
