"""``bench_decode.py --tune``: coordinate descent over ``decode_linear``'s launch config.

Per (shape, batch bucket) of the first model, batch 1 first: from the current default config
(``decode_linear._config``), ``BLOCK_N`` / ``BLOCK_K`` / ``num_stages`` / ``num_warps`` /
``USE_DOT`` are moved one at a time to their neighbours, keeping whatever is faster, within
``--tune-budget`` seconds. Every measurement goes to ``<stem>_linear_tune.csv``, the best config
per point to ``<stem>_linear_tune_best.json``, whose ``shapes`` are per-shape entries of
``decode_linear._CONFIGS`` (paste them there, or pass the file back with ``--shapes-config``).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import itertools
import json
import math
import time
from pathlib import Path

import pandas as pd
import torch

from bench_common.report import write_json
from bench_common.timing import graph_ms, input_sets
from kernel_benchmark.common import tuned
from kernel_benchmark.decode_shapes import (
    LinearShape,
    cpu_us,
    linear_bytes,
    make_linear_set,
    nakta_call,
)
from nakta_model.io_utils import atomic_write_text
from nakta_model.kernels import decode_linear as dl


def tune_candidates(knob: str, cfg: dict[str, int], bucket: int, rows_per_col: int) -> list[int]:
    """Values of one knob to try next to the current ``cfg`` (coordinate descent)."""
    v = cfg[knob]
    if knob == "BLOCK_N":
        lo = 2 if not cfg["USE_DOT"] else 16 // rows_per_col
        return [x for x in (v // 2, v * 2) if lo <= x <= 256]
    if knob == "BLOCK_K":
        return [x for x in (v // 2, v * 2) if 16 <= x <= 2048]
    if knob == "num_warps":
        return [x for x in (v // 2, v * 2) if 1 <= x <= 16]
    if knob == "num_stages":
        return [x for x in (v - 1, v + 1) if 1 <= x <= 6]
    if knob == "USE_DOT":
        return [1 - v] if bucket <= 4 else []
    raise ValueError(f"unknown knob {knob!r}")


TUNE_KNOBS = ("BLOCK_N", "BLOCK_K", "num_stages", "num_warps", "USE_DOT")


def _cfg_knobs(cfg: dict[str, int]) -> dict[str, int]:
    return {k: cfg[k] for k in ("USE_DOT", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")}


def tune_point(shape, batch, dtype, device, copy_gbps, deadline: float) -> list[dict]:
    """Coordinate descent over ``TUNE_KNOBS`` from the current default config of one (shape,
    batch): each knob's neighbours are timed with the others at the best so far."""
    e = dtype.itemsize
    n_sets = input_sets(device, shape.n * shape.k * e)
    sets = [make_linear_set(shape, batch, dtype, device, seed=i) for i in range(n_sets)]
    calls = [nakta_call(shape, t) for t in sets]
    nbytes = linear_bytes(shape, batch, e)
    bucket = 1 << (batch - 1).bit_length()
    rows_per_col = 2 if shape.variant == "swiglu" else 1
    rows, seen = [], {}

    def resolved(knobs: dict[str, int]) -> dict[str, int]:
        """The config as ``_config`` resolves it under ``knobs`` (BLOCK_K <= K)."""
        with tuned(dl, **knobs):
            return _cfg_knobs(dl._config(dtype, batch, shape.n_cols, shape.k, shape.variant,
                                         device))  # fmt: skip

    def measure(knobs: dict[str, int], default: bool = False) -> tuple[float, dict[str, int]]:
        """us of one config, and the config as ``_config`` resolves it."""
        with contextlib.suppress(ValueError):  # a refused config is measured below as failed
            knobs = resolved(knobs)
        key = tuple(sorted(knobs.items()))
        if key in seen:
            return seen[key], knobs
        try:
            with torch.no_grad(), tuned(dl, **knobs):
                if device.type == "cuda":
                    us = graph_ms(calls, torch.cuda.current_stream(), budget_ms=5.0) * 1e3
                else:
                    us = cpu_us(calls[0])
            status = "ok"
        except Exception as ex:  # a config the compiler or the checks refuse
            us, status = float("nan"), f"failed: {str(ex).splitlines()[0][:80]}"
        seen[key] = us
        rows.append(
            {"model": shape.model, "kind": shape.kind, "N": shape.n, "K": shape.k}
            | {"batch": batch, "bucket": bucket, **knobs, "us": us, "status": status}
            | {"pct_copy_bw": 100 * nbytes / us / 1e3 / copy_gbps, "default": default}
        )
        return us, knobs

    best_us, best = measure(resolved({}), default=True)
    for knob in TUNE_KNOBS:
        for value in tune_candidates(knob, best, bucket, rows_per_col):
            if time.perf_counter() > deadline:
                return rows
            trial = {**best, knob: value}
            if trial["USE_DOT"]:  # tl.dot needs tiles of 16 weight rows
                trial["BLOCK_N"] = max(trial["BLOCK_N"], 16 // rows_per_col)
            us, trial = measure(trial)
            if us < best_us:
                best, best_us = trial, us
    return rows


def tune(
    shapes: list[LinearShape], batches, dtype, device, copy_gbps: float, budget_s: float
) -> pd.DataFrame:
    """``tune_point`` over (batch, shape), batch 1 first, until ``budget_s`` is spent."""
    from tqdm import tqdm

    deadline = time.perf_counter() + budget_s
    rows = []
    points = list(itertools.product(batches, shapes))
    for batch, shape in tqdm(points, desc="tune"):
        if time.perf_counter() > deadline:
            print(f"tune budget spent: stopped before {shape.label()} batch {batch}")
            break
        rows += tune_point(shape, batch, dtype, device, copy_gbps, deadline)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return pd.DataFrame(rows)


def best_configs(tdf: pd.DataFrame, shapes: list[LinearShape], dtype) -> dict:
    """Per (shape, bucket): the fastest config and its gain over the default, plus the
    per-shape ``_CONFIGS`` entries to paste (keys as ``decode_linear._config`` looks them up)."""
    by_label = {(s.model, s.kind): s for s in shapes}
    per_point, table = {}, {}
    ok = tdf[tdf["status"] == "ok"]
    for (model, kind, batch), grp in ok.groupby(["model", "kind", "batch"]):
        shape = by_label[(model, kind)]
        best = grp.loc[grp["us"].idxmin()]
        default = grp[grp["default"]]
        knobs = {k: int(best[k]) for k in ("USE_DOT", "BLOCK_N", "BLOCK_K", "num_warps",
                                           "num_stages")}  # fmt: skip
        bucket = int(best["bucket"])
        per_point[f"{shape.label()} batch {batch}"] = {
            "config": knobs,
            "us": _finite(best["us"], 2),
            "pct_copy_bw": _finite(best["pct_copy_bw"], 1),
            "default_pct_copy_bw": _finite(default["pct_copy_bw"].iloc[0], 1)
            if len(default)
            else None,
            "tried": int(len(grp)),
        }
        key = (str(dtype).removeprefix("torch."), bucket, shape.variant, shape.n_cols, shape.k)
        table[repr(key)] = knobs
    return {"points": per_point, "shapes": table}


def _finite(v: float, digits: int) -> float | None:
    """A JSON-safe number: None where nothing was measured (NaN, e.g. on the CPU)."""
    v = float(v)
    return round(v, digits) if math.isfinite(v) else None


def load_shapes_config(path: str) -> int:
    """Put a ``--tune`` JSON's ``shapes`` into ``decode_linear._CONFIGS``; returns the count."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("shapes"), dict):
        raise ValueError(f"{path}: expected a --tune JSON with a 'shapes' object")
    for key, cfg in data["shapes"].items():
        dl._CONFIGS[tuple(ast.literal_eval(key))] = dict(cfg)
    return len(data["shapes"])


def tune_and_write(
    shapes: list[LinearShape], batches, dtype, device, copy_gbps: float,
    args: argparse.Namespace, stem: Path,
) -> pd.DataFrame:  # fmt: skip
    """``tune`` within ``args.tune_budget``, then the CSV and the best-config JSON next to
    ``stem`` (``<results>/decode[_quick]``), and one line per point on stdout."""
    tdf = tune(shapes, batches, dtype, device, copy_gbps, args.tune_budget)
    atomic_write_text(Path(f"{stem}_linear_tune.csv"), tdf.to_csv(index=False))
    best = best_configs(tdf, shapes, dtype)
    write_json(best, Path(f"{stem}_linear_tune_best.json"))
    for label, b in best["points"].items():
        print(f"{label}: {b['pct_copy_bw']}% (default {b['default_pct_copy_bw']}%) {b['config']}")
    print(f"copy bandwidth {copy_gbps:.0f} GB/s; tune results -> {stem.parent}")
    return tdf
