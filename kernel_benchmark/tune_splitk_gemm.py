"""Tune ``splitk_gemm``'s launch configs at LLaMA-7B's narrow decode linears, in a minute or two.

Why: the kernel's default (``splitk_gemm._config``: 128 x 128 x 64 tiles, splits until the
tiles cover the SMs) is derived from the shape, not measured; cuBLAS runs ``wo`` / ``w2`` at
54-62% of the bf16 matmul rate at 256-384 rows on an H100 (``decode_gemm_blocks.md``), where a
better-spread GEMM would save ~1 ms of an ~18 ms step. Per point (``wo`` 4096x4096, ``w2``
4096x11008, at ``--rows`` 128, 256, 384, 512), a fixed candidate grid (``candidates``) is timed
beside the current config (``default``) and the step's path without the kernel (``cublas``:
``F.linear``, or for ``--quants fp8`` cuBLASLt's row-wise scaled GEMM): CUDA-graph replays over
input copies larger than L2, paths interleaved round by round (``bench_common.timing.rotated_ms``).
Compilation dominates, so the grid is first compiled by ``--jobs`` worker processes.

    python -m kernel_benchmark.tune_splitk_gemm [--rows 128,256,384,512] [--quants bf16,fp8]

Writes ``results/<device>/splitk_gemm_tune.{csv,md,json}`` (every timing; per point the best,
the default and cuBLAS with TFLOP/s and % of the matmul rate) and puts the winners that beat
the default, under this device's family, into ``nakta_model/kernels/_splitk_gemm_tuned.json``,
which ``splitk_gemm.py`` loads (commit it; ``--no-write-configs`` leaves it alone). GPU only.
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
from nakta_model.kernels import splitk_gemm as skg
from nakta_model.kernels.fp8_quant import FP8_DTYPE

KNOBS = skg.KNOBS  # BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages
SHAPES = {"wo": (4096, 4096), "w2": (4096, 11008)}  # kind: (N, K), LLaMA-7B
ROWS = (256, 384, 128, 512)  # the throughput target's rows first
SMS = 132  # H100 SXM / H200: the grid's split counts are chosen for this many SMs
# (BLOCK_M, BLOCK_N, BLOCK_K at bf16, num_warps, num_stages); FP8 doubles BLOCK_K (same bytes)
TILES = (
    (64, 128, 64, 4, 4),
    (64, 128, 128, 4, 3),
    (64, 256, 64, 8, 3),
    (128, 64, 64, 4, 4),
    (128, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 128, 128, 8, 3),
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
)
SPLITS = (1, 2, 3, 4, 6, 8)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="decode rows (64..512)")
    p.add_argument("--kinds", default=",".join(SHAPES), help=f"subset of {tuple(SHAPES)}")
    p.add_argument("--quants", default="bf16", help="bf16, fp8 or both")
    p.add_argument("--budget", type=float, default=120.0, help="seconds for the whole sweep")
    p.add_argument("--jobs", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 2)),
                   help="processes compiling the grid up front (0: compile while timing)")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="results folder")
    p.add_argument("--configs", type=Path, default=skg.TUNED_JSON,
                   help="tuned-config JSON to update (read by splitk_gemm.py)")  # fmt: skip
    p.add_argument("--no-write-configs", action="store_true")
    a = p.parse_args(argv)
    try:
        a.rows = [int(t) for t in a.rows.split(",") if t.strip()]
    except ValueError:
        p.error(f"--rows must be comma-separated ints, got {a.rows!r}")
    if not a.rows or min(a.rows) < 64 or max(a.rows) > 512:
        p.error(f"--rows needs ints in [64, 512], got {a.rows}")
    a.kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    if not a.kinds or set(a.kinds) - set(SHAPES):
        p.error(f"--kinds must be a subset of {','.join(SHAPES)}, got {a.kinds}")
    a.quants = [q.strip() for q in a.quants.split(",") if q.strip()]
    if not a.quants or set(a.quants) - {"bf16", "fp8"}:
        p.error(f"--quants must be a subset of bf16,fp8, got {a.quants}")
    if a.budget <= 0 or a.jobs < 0:
        p.error("--budget must be > 0 and --jobs >= 0")
    return a


def candidates(n: int, k: int, rows: int, fp8: bool) -> list[dict[str, int]]:
    """The grid of one point: each of ``TILES`` (``BLOCK_M`` no taller than the rows need)
    with the split counts of ``SPLITS`` that keep at most ~4 programs per SM and at least 4 K
    steps a split."""
    out: dict[tuple, dict[str, int]] = {}
    for bm, bn, bk, warps, stages in TILES:
        if bm > max(64, 1 << (rows - 1).bit_length()):
            continue
        bk = 2 * bk if fp8 else bk
        tiles, steps = -(-rows // bm) * -(-n // bn), k // bk
        for split in [s for s in SPLITS if tiles * s <= 4 * SMS and steps // s >= 4] or [1]:
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps,
                       num_stages=stages)  # fmt: skip
            out.setdefault(tuning.config_key(cfg, KNOBS), cfg)
    return list(out.values())


def point_set(kind: str, rows: int, fp8: bool, device, seed: int) -> dict:
    """One input set of a point: x and weight (bf16, or e4m3 with fp32 scales)."""
    n, k = SHAPES[kind]
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = FP8_DTYPE if fp8 else torch.bfloat16
    t = {
        "x": torch.randn(rows, k, device=device, generator=g).to(dtype),
        "w": (torch.randn(n, k, device=device, generator=g) * 0.02).to(dtype),
        "xs": torch.rand(rows, device=device, generator=g) * 1e-2 if fp8 else None,
        "ws": torch.rand(n, device=device, generator=g) * 1e-2 if fp8 else None,
    }
    return t


def kernel_call(t: dict, cfg: dict[str, int] | None):
    """``splitk_linear`` on one set under ``cfg`` as its ``_TUNE`` (None: its own config)."""
    from kernel_benchmark.common import tuned

    def run():
        with tuned(skg, **(cfg or {})):
            return skg.splitk_linear(t["x"], t["w"], t["xs"], t["ws"])

    return run


def cublas_call(t: dict):
    """The step's GEMM without the kernel: ``F.linear`` (bf16) or cuBLASLt W8A8 (fp8)."""
    from nakta_model.kernels.fp8_gemm import fp8_matmul

    if t["xs"] is None:
        return lambda: torch.nn.functional.linear(t["x"], t["w"])
    return lambda: fp8_matmul(t["x"], t["xs"], t["w"], t["ws"], torch.bfloat16)


_WARM_SETS: dict = {}


def _warm(kind: str, rows: int, fp8: bool, cfg_list: list[dict[str, int]]) -> int:
    """Worker: run each config once (compiles it into Triton's disk cache); the count run."""
    if (kind, rows, fp8) not in _WARM_SETS:
        _WARM_SETS.clear()
        _WARM_SETS[(kind, rows, fp8)] = point_set(kind, rows, fp8, torch.device("cuda"), 0)
    t = _WARM_SETS[(kind, rows, fp8)]
    done = 0
    for cfg in cfg_list:
        try:
            kernel_call(t, cfg)()
            done += 1
        except Exception:  # noqa: BLE001 - a refused config is reported when timed
            pass
    torch.cuda.synchronize()
    return done


def time_point(kind: str, rows: int, fp8: bool, cands, device, matmul_tflops: float) -> list[dict]:
    """Every candidate, the current config and cuBLAS at one point, interleaved."""
    from bench_common.timing import input_sets, rotated_ms

    n, k = SHAPES[kind]
    sets = [point_set(kind, rows, fp8, device, i) for i in range(input_sets(device, n * k * 2))]
    default = skg._config(rows, n, k, skg.sm_count(device, SMS), fp8, skg.device_family(device))
    paths = {"cublas": (None, [cublas_call(t) for t in sets])}
    paths["default"] = (default, [kernel_call(t, None) for t in sets])
    for c in cands:
        if tuning.config_key(c, KNOBS) != tuning.config_key(default, KNOBS):
            paths[tuning.config_label(c, KNOBS)] = (c, [kernel_call(t, c) for t in sets])
    with torch.no_grad():
        ms, errors = rotated_ms({p: calls for p, (_, calls) in paths.items()}, rounds=3,
                                budget_ms=3.0)  # fmt: skip
    flop = 2 * rows * n * k
    return [{"kind": kind, "N": n, "K": k, "rows": rows, "quant": "fp8" if fp8 else "bf16",
             "path": name if name in ("cublas", "default") else "candidate",
             **{key: (cfg or {}).get(key, -1) for key in KNOBS},
             "us": ms.get(name, float("nan")) * 1e3,
             "TFLOP_s": flop / ms.get(name, float("nan")) / 1e9,
             "pct_matmul": 100 * flop / ms.get(name, float("nan")) / 1e9 / matmul_tflops,
             "status": errors.get(name, "ok")}
            for name, (cfg, _) in paths.items()]  # fmt: skip


def best_per_point(df: pd.DataFrame) -> list[dict]:
    """Per (kind, rows, quant): the fastest kernel config (the current one included), with the
    current config's and cuBLAS's numbers beside it."""
    out = []
    for (kind, rows, quant), grp in df.groupby(["kind", "rows", "quant"], sort=False):
        ok = grp[(grp["path"] != "cublas") & (grp["status"] == "ok") & grp["us"].notna()]
        if ok.empty:
            continue
        best = ok.loc[ok["us"].idxmin()]
        default = grp[grp["path"] == "default"].iloc[0]
        cb = grp[grp["path"] == "cublas"].iloc[0]
        out.append({"kind": kind, "N": int(best["N"]), "K": int(best["K"]), "rows": int(rows),
                    "quant": quant, "config": {key: int(best[key]) for key in KNOBS},
                    "us": float(best["us"]), "pct_matmul": float(best["pct_matmul"]),
                    "default_us": float(default["us"]), "cublas_us": float(cb["us"]),
                    "cublas_pct_matmul": float(cb["pct_matmul"]),
                    "speedup_vs_cublas": float(cb["us"] / best["us"])})  # fmt: skip
    return out


def update_configs(path: Path, family: str, device_name: str, best: list[dict]) -> dict:
    """Put ``best`` under ``family`` in the tuned-config JSON (other rows kept); returns the
    document written."""
    figures = ("us", "pct_matmul", "cublas_us", "speedup_vs_cublas")
    rows = {skg.tuned_key(b["N"], b["K"], skg.rows_bucket(b["rows"]), b["quant"] == "fp8"):
            (b["config"], {k: round(b[k], 3) for k in figures}) for b in best}  # fmt: skip
    about = ("splitk_gemm launch configs per device family (keys N/K/rows bucket/float|fp8), "
             "written by kernel_benchmark/tune_splitk_gemm.py; loaded by splitk_gemm.py")  # fmt: skip
    return tuning.write_family(path, family, device_name, rows, about, skg.load_tuned)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_splitk_gemm needs a GPU: nothing tuned", file=sys.stderr)
        return 1
    from bench_common.ceilings import device_slug, matmul_tflops
    from bench_common.report import results_dir

    t0 = time.perf_counter()
    device = torch.device("cuda")
    slug, family = device_slug(device), skg.device_family(device)
    quants = [q == "fp8" for q in a.quants]
    points = [(kind, r, fp8, candidates(*SHAPES[kind], r, fp8))
              for fp8 in quants for r in a.rows for kind in a.kinds]  # fmt: skip
    print(f"{len(points)} points, {sum(len(c) for *_, c in points)} candidates, budget "
          f"{a.budget:.0f}s, device {slug} (family {family!r})", flush=True)  # fmt: skip
    if a.jobs:
        tasks = [(kind, r, fp8, c[i : i + 6]) for kind, r, fp8, c in points
                 for i in range(0, len(c), 6)]  # fmt: skip
        tuning.precompile(_warm, tasks, a.jobs, t0 + 0.45 * a.budget)
    peak = matmul_tflops()

    def describe(point: tuple, b: dict) -> str:
        return (f"{point[0]} {b['quant']} rows {point[1]}: {b['us']:.1f} us ({b['pct_matmul']:.0f}% "
                f"of matmul; default {b['default_us']:.1f}, cuBLAS {b['cublas_us']:.1f} us), "
                f"x{b['speedup_vs_cublas']:.2f} vs cuBLAS {tuning.config_label(b['config'], KNOBS)}")  # fmt: skip

    rows = tuning.time_points(
        points, lambda pt: time_point(*pt, device, peak), best_per_point, describe, t0,
        t0 + a.budget,
    )  # fmt: skip
    notes = (f"{slug}, torch {torch.__version__}, bf16 matmul {peak:.0f} TFLOP/s measured in "
             "this run. CUDA-graph replays over input copies > 3x L2, paths interleaved "
             "(rotated_ms).")  # fmt: skip
    tuning.write_results(
        rows, best_per_point, out=a.out or results_dir(__file__, slug), stem="splitk_gemm_tune",
        title="splitk_gemm tuning: every timing", notes=notes,
        summary={"device": slug, "matmul_tflops": peak}, family=family,
        device_name=torch.cuda.get_device_name(), configs=a.configs,
        write_configs=not a.no_write_configs, update=update_configs, t0=t0,
        keep=lambda b: b["us"] < b["default_us"],  # only rows that beat the shape's default
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
