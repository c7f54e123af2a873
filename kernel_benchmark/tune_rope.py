"""``bench_rope.py --tune``: block-size sweep of both RoPE kernels (forward; the backward is
the same kernel), GPU time from CUDA-graph replays.

Each configuration overrides the kernel file's ``_TUNE`` (``rope.py`` for the fused QKV path,
``rope_te.py`` for the TE-compatible API) and is timed at a few shapes; "heuristic" is the
committed rule. Writes ``rope_tune.{csv,md}`` and ``rope_tune_best.json`` (per kernel, the
configuration with the best worst-case share of copy bandwidth over the shapes).
"""

from __future__ import annotations

import argparse
import ast
import functools
import itertools
import time
from pathlib import Path

import pandas as pd
import torch

from bench_common.report import write_json, write_table
from kernel_benchmark.common import tuned
from kernel_benchmark.rope_shapes import DEFAULT, QKV_TOKENS, graph_ms
from nakta_model.kernels import rope, rope_te
from nakta_model.kernels.rope import apply_rope_qkv_, build_rope_cache
from nakta_model.kernels.rope_te import RotaryPositionEmbedding, apply_rotary_pos_emb


def tune(
    device, dtype, copy_gbps: float, budget_s: float = 75.0, te_only: bool = False
) -> pd.DataFrame:
    """Block-size sweep of both kernels (forward; backward is the same kernel), GPU time from
    CUDA-graph replay. TE configurations run one at a time over every shape (the committed
    heuristic first), so a spent ``budget_s`` drops whole configurations, never shapes."""
    from tqdm import tqdm

    te_shapes = {
        "default": {},
        "seq512": {"seq_length": 512},
        "batch2": {"batch": 2},
        "batch4": {"batch": 4},
        "batch8": {"batch": 8},
        "heads8": {"heads": 8},
        "rotary0.5": {"rotary_percent": 0.5},
    }
    base = dict(
        BLOCK_B=16, ROWS=16, TARGET=4096, num_warps=4, MIN_PROGRAMS=1024, PREFETCH=False,
        JOINT=False,
    )  # fmt: skip
    te_confs = [
        {**base, **change}
        for change in (
            dict(TARGET=2048),  # the previous heuristic
            dict(ROWS=1, TARGET=2048),  # one position per program: only the early first loads
            dict(PREFETCH=True, TARGET=2048),
            dict(MIN_PROGRAMS=2048, TARGET=2048),
            dict(num_warps=8),
            dict(ROWS=4, TARGET=2048),
            dict(ROWS=1, TARGET=2048, PREFETCH=True),
            dict(ROWS=1),
            dict(MIN_PROGRAMS=512, TARGET=2048),
        )
    ]
    qkv_shapes = {"7B": (32, False), "13B": (40, False), "65B": (64, False)}
    qkv_confs = [
        dict(JOINT=j, TARGET=tg, num_warps=w)
        for j, tg, w in itertools.product((False, True), (2048, 4096), (4, 8))
    ]
    jobs = [] if te_only else [("qkv", n, c) for n in qkv_shapes for c in [None, *qkv_confs]]
    jobs += [("te", n, c) for c in [None, *te_confs] for n in te_shapes]
    rows, cache, t_start = [], {}, time.perf_counter()
    for kind, shape, conf in tqdm(jobs, desc="tune"):
        if time.perf_counter() - t_start > budget_s:
            print(f"tune budget spent: stopped before {kind} {shape}")
            break
        key = (kind, shape)
        if key not in cache:
            if kind == "te":
                extra = te_shapes[shape]
                cfg = {**DEFAULT, **{k: v for k, v in extra.items() if k != "interleaved"}}
                s, b, h, d = cfg["seq_length"], cfg["batch"], cfg["heads"], cfg["hidden"]
                t = torch.randn(s, b, h, d, device=device, dtype=dtype)
                emb = RotaryPositionEmbedding(d, cfg["rotary_percent"], device=device)(s)
                fn = functools.partial(
                    apply_rotary_pos_emb, t, emb, interleaved=extra.get("interleaved", False)
                )
                cache[key] = (fn, 2 * t.numel() * t.element_size())
            else:
                nh, il = qkv_shapes[shape]
                qkv = torch.randn(QKV_TOKENS, 3 * nh * 128, device=device, dtype=dtype)
                cos, sin = build_rope_cache(8192, 128, device=device)
                pos = torch.randint(0, 8192, (QKV_TOKENS,), device=device)
                fn = functools.partial(
                    apply_rope_qkv_, qkv, pos, cos, sin, nh, nh, 128, interleaved=il
                )
                cache[key] = (fn, 2 * 2 * QKV_TOKENS * nh * 128 * qkv.element_size())
        fn, nbytes = cache[key]
        try:
            with torch.no_grad(), tuned(rope_te if kind == "te" else rope, **(conf or {})):
                ms = graph_ms(fn, True)
            pct = 100 * nbytes / (ms * 1e-3) / 1e9 / copy_gbps
        except Exception as ex:
            ms, pct = float("nan"), float("nan")
            print(f"{kind} {shape} {conf}: {str(ex).splitlines()[0][:100]}")
        rows.append(
            {
                "kernel": kind,
                "shape": shape,
                "config": "heuristic" if conf is None else str(conf),
                "us": ms * 1e3,
                "pct_copy_bw": pct,
            }
        )
    return pd.DataFrame(rows)


def best_configs(tdf: pd.DataFrame) -> dict:
    """Per kernel, the tried configuration with the best worst-case % of copy bandwidth over the
    tuned shapes (ties broken by the mean); only configurations measured at every shape."""
    best = {}
    for kind, grp in tdf.groupby("kernel"):
        table = grp.pivot_table(index="config", columns="shape", values="pct_copy_bw")
        table = table.dropna()
        if not len(table):
            continue
        score = table.min(axis=1) + 0.25 * table.mean(axis=1)
        name = score.idxmax()
        best[kind] = {
            "config": {} if name == "heuristic" else ast.literal_eval(name),
            "min_pct": float(table.loc[name].min()),
            "per_shape": {k: round(float(v), 1) for k, v in table.loc[name].items()},
        }
    return best


def tune_and_write(
    device: torch.device, dtype: torch.dtype, copy_gbps: float, args: argparse.Namespace, out: Path
) -> pd.DataFrame:
    """``tune`` within ``args.tune_budget`` (TE kernel only with ``args.te_only``), its tables
    and best configurations under ``out``, and per shape the heuristic vs the best on stdout."""
    tdf = tune(device, dtype, copy_gbps, args.tune_budget, args.te_only)
    title = "RoPE launch configurations (forward)"
    write_table(tdf, out, "rope_tune", title, f"copy {copy_gbps:.0f} GB/s")
    best = best_configs(tdf)
    write_json(best, out / "rope_tune_best.json")
    print("best:", best)
    for (kind, shape), grp in tdf.groupby(["kernel", "shape"], sort=False):
        grp = grp.sort_values("pct_copy_bw", ascending=False)
        heur = grp[grp["config"] == "heuristic"]["pct_copy_bw"].iloc[0]
        top = grp.iloc[0]
        print(
            f"{kind:4s} {shape:20s} heuristic {heur:5.1f}%  best {top['pct_copy_bw']:5.1f}% "
            f"{top['config']}"
        )
    return tdf
