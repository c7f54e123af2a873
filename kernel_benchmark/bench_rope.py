"""RoPE: Nakta's fused Triton kernels vs the PyTorch reference, Liger-Kernel and TransformerEngine.

Why: rotary embedding is purely memory-bound, so the yardstick is bytes moved over the copy
bandwidth measured in the same run. Every path is timed on the same inputs and credited with the
same minimal byte count, whatever it actually moves:

* TE-compatible API (``apply_rotary_pos_emb``), forward: read t + write the output + read the
  freqs rows used (fp32); backward: read the gradient + write the input gradient + freqs.
  Sweeps vary one axis around ``s=4096, b=16, h=32, d=128``, bf16, sbhd: seq_length, head size
  d, rotary_percent, batch, heads and margin (``s = 4096 - margin`` tokens with random
  ``start_positions`` into a 4096-row table).
* Model path (``apply_rope_qkv_``), forward only (inference), at LLaMA-7B/13B/65B head counts
  (32/40/64 heads of 128) over 16K tokens: read + write of Q and K (V is untouched) + the
  cos/sin rows read. ``nakta_cache`` also writes K and V into a KV cache: its count adds the K
  write, the V read and the V write.

Paths: ``nakta`` (fused Triton), ``torch`` (the PyTorch reference: TE's unfused algorithm /
``apply_rope_qkv_reference``), ``liger`` (``liger_kernel.ops.rope.LigerRopeFunction``, in place on
q and k each holding half of the heads, with precomputed cos/sin in the input dtype; it has no
per-sequence start positions, so the margin rows give it per-batch cos/sin tables), ``te``
(TransformerEngine's fused kernel, when importable). Backward rows time ``torch.autograd.grad``
on a retained graph, the same for every path. ``--tune`` sweeps the kernels' launch
configurations instead (the ``--tune`` section below).

    python -m kernel_benchmark.bench_rope [--quick] [--tune]
    python kernel_benchmark/bench_rope.py ...   # by path too; on a CPU a smoke run (--help)
"""

from __future__ import annotations

import argparse
import ast
import functools
import itertools
import sys
import time
from collections.abc import Callable
from pathlib import Path

if not __package__:  # run by path: import from the repo root, not from this script's folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import pandas as pd
import torch

from bench_common.ceilings import copy_bandwidth_gbps, device_slug
from bench_common.report import results_dir, save_figure, write_json, write_table
from bench_common.timing import eager_ms
from kernel_benchmark.common import CPU_NOTE, announce, exit_status, triton_skip_reason, tuned
from nakta_model.kernels import rope, rope_te
from nakta_model.kernels.rope import apply_rope_qkv_, apply_rope_qkv_reference, build_rope_cache
from nakta_model.kernels.rope_te import RotaryPositionEmbedding, apply_rotary_pos_emb

# ----------------------------------------------------------------------------- cases
# The TransformerEngine-shaped sweep around s=4096 b=16 h=32 d=128 and the fused QK shapes.
DEFAULT = dict(seq_length=4096, batch=16, heads=32, hidden=128, rotary_percent=1.0, margin=0)
SWEEPS = {
    "seq_length": [512, 1024, 2048, 4096],
    "hidden": [128, 256, 512],
    "rotary_percent": [0.5, 1.0],
    "batch": [2, 4, 8, 16],
    "heads": [8, 16, 32, 64],
    "margin": [0, 10, 100],
}
QUICK_SWEEPS = {"seq_length": [512, 4096], "hidden": [512], "rotary_percent": [0.5], "margin": [10]}
LLAMA_HEADS = {"7B": 32, "13B": 40, "65B": 64}
QKV_TOKENS = 16384


def graph_ms(fn: Callable[[], object], quick: bool) -> float:
    """Median milliseconds per call replaying a CUDA graph of back-to-back calls: the GPU time,
    free of host overhead (no L2 flush; every sweep tensor is larger than L2 or nearly so)."""
    import triton.testing

    return float(
        triton.testing.do_bench_cudagraph(fn, rep=15 if quick else 25, return_mode="median")
    )


TARGETS = {"default": 90.0, "sweep": 80.0, "qkv": 90.0}


# ----------------------------------------------------------------------------- timing
def time_ms(fn: Callable[[], object], device: torch.device, quick: bool) -> float:
    """Median milliseconds of eager calls: CUDA events via triton's do_bench (L2 flushed between
    calls). Includes the host's launch overhead wherever it exceeds the GPU time."""
    return eager_ms(fn, device, warmup=10 if quick else 25, rep=30 if quick else 60)


def timings(eager: Callable, graph: Callable | None, device, quick: bool) -> dict:
    """``us`` = GPU time (CUDA graph) where the path can be captured, else eager; both kept."""
    out = {"us_eager": time_ms(eager, device, quick) * 1e3}
    if graph is not None and device.type == "cuda":
        try:
            out["us_graph"] = graph_ms(graph, quick) * 1e3
        except Exception as ex:  # not capturable: keep the eager time only
            print(f"graph capture failed ({str(ex).splitlines()[0][:60]}); eager time kept")
    out["us"] = out.get("us_graph", out["us_eager"])
    out["timer"] = "cuda_graph" if "us_graph" in out else "eager"
    return out


def host_overhead_us(fn: Callable, n: int = 300) -> float:
    """Host time per call at a tiny size (launch-bound): what the CPU spends per call."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


# ----------------------------------------------------------------------------- peers
def _liger():
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except Exception:  # not installed, or its package init fails on this machine
        return None
    return LigerRopeFunction


def _te():
    try:
        from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb as te_apply
    except Exception:
        try:
            from transformer_engine.pytorch import apply_rotary_pos_emb as te_apply
        except Exception:
            return None
    return te_apply


# ----------------------------------------------------------------------------- TE-API cases
MODES = ("fwd", "bwd")


def _failed(ex: Exception) -> str:
    return f"failed: {(str(ex).splitlines() or [type(ex).__name__])[0][:80]}"


def te_case_rows(cfg: dict, device, dtype, quick: bool, copy_gbps: float) -> list[dict]:
    """Forward and backward of every path at one configuration."""
    s_table = cfg["seq_length"]
    s = s_table - cfg["margin"]
    b, h, d = cfg["batch"], cfg["heads"], cfg["hidden"]
    g = torch.Generator(device=device).manual_seed(s * 31 + b * 7 + h + d)
    t = torch.randn(s, b, h, d, generator=g, device=device, dtype=dtype)
    grad = torch.randn(s, b, h, d, generator=g, device=device, dtype=dtype)
    emb = RotaryPositionEmbedding(d, cfg["rotary_percent"], device=device)(s_table)
    d2 = emb.shape[-1]
    starts = None
    if cfg["margin"]:
        starts = torch.randint(
            0, cfg["margin"], (b,), generator=g, device=device, dtype=torch.int32
        )
    e = t.element_size()
    nbytes = 2 * t.numel() * e + s * d2 * 4

    paths: dict[str, Callable] = {
        "nakta": lambda x: apply_rotary_pos_emb(x, emb, "sbhd", starts, fused=True),
        "torch": lambda x: apply_rotary_pos_emb(x, emb, "sbhd", starts, fused=False),
    }
    te_apply = _te()
    if te_apply is not None and device.type == "cuda":
        paths["te"] = lambda x: te_apply(x, emb, "sbhd", start_positions=starts, fused=True)

    rows = []
    base = {**cfg, "dtype": str(dtype).removeprefix("torch."), "MB_moved": nbytes / 1e6}
    skip = triton_skip_reason(device)
    if skip:  # listed, not dropped: the table says why Nakta has no row here
        del paths["nakta"]
        rows += [{**base, "mode": m, "path": "nakta", "status": f"skipped: {skip}"} for m in MODES]

    def record(mode, name, eager, graph=None):
        row = {**base, "mode": mode, "path": name}
        try:
            tm = timings(eager, graph, device, quick)
        except Exception as ex:  # a peer that does not take this shape
            rows.append({**row, "status": _failed(ex)})
            return
        gbps = nbytes / (tm["us"] * 1e-6) / 1e9
        rows.append(
            {
                **row,
                "status": "ok",
                **tm,
                "GB/s": gbps,
                "pct_copy_bw": 100 * gbps / copy_gbps,
                "pct_copy_bw_eager": 100 * nbytes / (tm["us_eager"] * 1e-6) / 1e9 / copy_gbps,
            }
        )

    emb32 = emb.float()
    for name, fn in paths.items():
        with torch.no_grad():
            # the fused path never synchronises, so it can be captured; the reference cannot
            record(
                "fwd", name, lambda fn=fn: fn(t), (lambda fn=fn: fn(t)) if name == "nakta" else None
            )
        tg = t.detach().requires_grad_()
        try:
            out = fn(tg)
        except Exception as ex:  # a peer that does not take this shape
            rows.append({**base, "mode": "bwd", "path": name, "status": _failed(ex)})
            continue
        direct = None
        if name == "nakta":  # exactly what the autograd node runs
            direct = lambda: rope_te._launch(  # noqa: E731
                grad, emb32, "sbhd", starts, False, None, 1, 0, backward=True
            )
        record(
            "bwd",
            name,
            lambda out=out, tg=tg: torch.autograd.grad(out, tg, grad, retain_graph=True),
            direct,
        )
        del out, tg

    liger = _liger()
    if liger is not None and device.type == "cuda" and h % 2 == 0:
        from liger_kernel.ops.rope import rope_backward

        # q and k: half of the heads each, physically [b, s, h/2, d], seen as [b, h/2, s, d].
        q = torch.randn(b, s, h // 2, d, generator=g, device=device, dtype=dtype)
        k = torch.randn(b, s, h // 2, d, generator=g, device=device, dtype=dtype)
        pos = torch.arange(s, device=device)[None, :] + (
            starts[:, None] if starts is not None else 0
        )
        ang = emb[:, 0, 0, :][pos]  # [1 or b, s, d2]
        cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
        fwd = lambda: liger.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # noqa: E731
        with torch.no_grad():
            record("fwd", "liger", fwd, fwd)
        qg = q.detach().requires_grad_().clone()
        kg = k.detach().requires_grad_().clone()
        oq, ok = liger.apply(qg.transpose(1, 2), kg.transpose(1, 2), cos, sin)
        gq = torch.randn_like(q).transpose(1, 2)
        gk = torch.randn_like(k).transpose(1, 2)
        record(
            "bwd",
            "liger",
            lambda: torch.autograd.grad((oq, ok), (qg, kg), (gq, gk), retain_graph=True),
            lambda: rope_backward(gq, gk, cos, sin),
        )
    return rows


def te_configs(quick: bool) -> list[tuple[str, dict]]:
    """(sweep name, configuration) pairs; the default shape appears under every sweep."""
    sweeps = QUICK_SWEEPS if quick else SWEEPS
    out = [("default", dict(DEFAULT))]
    for axis, values in sweeps.items():
        for v in values:
            out.append((axis, {**DEFAULT, axis: v}))
    return out


# ----------------------------------------------------------------------------- QKV path
def qkv_rows(model: str, device, dtype, quick: bool, copy_gbps: float) -> list[dict]:
    nh, hd, tokens = LLAMA_HEADS[model], 128, QKV_TOKENS
    g = torch.Generator(device=device).manual_seed(nh)
    qkv = torch.randn(tokens, 3 * nh * hd, generator=g, device=device, dtype=dtype)
    cos, sin = build_rope_cache(8192, hd, device=device)
    pos = torch.randint(0, 8192, (tokens,), generator=g, device=device)
    e = qkv.element_size()
    qk_bytes = 2 * (2 * tokens * nh * hd * e) + 2 * tokens * (hd // 2) * 4
    cache_bytes = qk_bytes + 3 * tokens * nh * hd * e  # + K write, V read, V write
    k_cache = torch.empty(tokens, nh, hd, device=device, dtype=dtype)
    v_cache = torch.empty_like(k_cache)
    slots = torch.randperm(tokens, device=device)
    args = (qkv, pos, cos, sin, nh, nh, hd)
    paths = {
        "nakta": (lambda: apply_rope_qkv_(*args, interleaved=False), qk_bytes),
        "nakta_interleaved": (lambda: apply_rope_qkv_(*args, interleaved=True), qk_bytes),
        "nakta_cache": (
            lambda: apply_rope_qkv_(
                *args, interleaved=False, k_cache=k_cache, v_cache=v_cache, cache_slots=slots
            ),
            cache_bytes,
        ),
        "torch": (lambda: apply_rope_qkv_reference(*args, interleaved=False), qk_bytes),
    }
    liger = _liger()
    if liger is not None and device.type == "cuda":
        q = torch.randn(1, tokens, nh, hd, generator=g, device=device, dtype=dtype)
        k = torch.randn(1, tokens, nh, hd, generator=g, device=device, dtype=dtype)
        c = torch.cat((cos[pos], cos[pos]), -1)[None].to(dtype)
        s_ = torch.cat((sin[pos], sin[pos]), -1)[None].to(dtype)
        paths["liger"] = (
            lambda: liger.apply(q.transpose(1, 2), k.transpose(1, 2), c, s_),
            qk_bytes,
        )
    rows = []
    for name, (fn, nbytes) in paths.items():
        row = {"model": model, "heads": nh, "head_dim": hd, "tokens": tokens, "path": name}
        with torch.no_grad():  # the reference synchronises (position check): eager only
            tm = timings(fn, None if name == "torch" else fn, device, quick)
        gbps = nbytes / (tm["us"] * 1e-6) / 1e9
        rows.append(
            {
                **row,
                "MB_moved": nbytes / 1e6,
                **tm,
                "GB/s": gbps,
                "pct_copy_bw": 100 * gbps / copy_gbps,
                "pct_copy_bw_eager": 100 * nbytes / (tm["us_eager"] * 1e-6) / 1e9 / copy_gbps,
            }
        )
    return rows


# ----------------------------------------------------------------------------- host
def host_overheads(device, dtype) -> dict:
    """Host microseconds per call at a launch-bound size (1 x 16 tokens x 2 heads)."""
    t = torch.randn(16, 1, 2, 128, device=device, dtype=dtype)
    emb = RotaryPositionEmbedding(128, device=device)(16)
    tg = t.clone().requires_grad_()
    qkv = torch.randn(16, 3 * 2 * 128, device=device, dtype=dtype)
    cos, sin = build_rope_cache(16, 128, device=device)
    pos = torch.arange(16, device=device)
    out = {}
    with torch.no_grad():
        out["nakta_te_fwd_no_grad"] = host_overhead_us(lambda: apply_rotary_pos_emb(t, emb))
        out["nakta_qkv_fwd"] = host_overhead_us(
            lambda: apply_rope_qkv_(qkv, pos, cos, sin, 2, 2, 128, interleaved=False)
        )
    out["nakta_te_fwd_autograd"] = host_overhead_us(lambda: apply_rotary_pos_emb(tg, emb))
    liger = _liger()
    if liger is not None:
        q = torch.randn(1, 16, 1, 128, device=device, dtype=dtype)
        c = torch.randn(1, 16, 128, device=device, dtype=dtype)
        with torch.no_grad():
            out["liger_fwd_no_grad"] = host_overhead_us(
                lambda: liger.apply(q.transpose(1, 2), q.transpose(1, 2), c, c)
            )
    return out


# ----------------------------------------------------------------------------- report
def plot(te: pd.DataFrame, qkv: pd.DataFrame, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = te[te["status"] == "ok"]
    value = "pct_copy_bw" if ok["pct_copy_bw"].notna().any() else "GB/s"
    axes_names = [a for a in SWEEPS if a in set(ok["sweep"])]
    fig, axes = plt.subplots(
        2, len(axes_names) + 1, figsize=(4 * (len(axes_names) + 1), 7.5), squeeze=False
    )
    for col, axis in enumerate(axes_names):
        for row, mode in enumerate(("fwd", "bwd")):
            ax = axes[row][col]
            sub = ok[(ok["sweep"] == axis) & (ok["mode"] == mode)]
            table = sub.pivot_table(index=axis, columns="path", values=value)
            table.plot(ax=ax, marker="o", legend=(col == 0))
            ax.set_title(f"{mode}: {axis}")
            ax.axhline(100, color="gray", lw=0.8, ls="--")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            if col == 0:
                ax.set_ylabel("% of copy bandwidth" if value == "pct_copy_bw" else "GB/s")
    ax = axes[0][-1]
    if len(qkv):
        table = qkv.pivot_table(index="model", columns="path", values=value, sort=False)
        table.plot.bar(ax=ax, rot=0)
        ax.set_title(f"fused QK in place, {QKV_TOKENS} tokens")
        ax.axhline(100, color="gray", lw=0.8, ls="--")
        ax.legend(fontsize=7)
    axes[1][-1].axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def summarize(te: pd.DataFrame, qkv: pd.DataFrame) -> dict:
    """The issue's targets: % of copy bandwidth at the default shape, every sweep point, QKV.

    ``pct`` uses the GPU time (CUDA graph); ``pct_eager`` the eager calls, host overhead included.
    """
    ok = te[(te["status"] == "ok") & (te["path"] == "nakta")]
    out: dict = {}
    for mode in ("fwd", "bwd"):
        sub = ok[ok["mode"] == mode]
        for col, tag in (("pct_copy_bw", ""), ("pct_copy_bw_eager", "_eager")):
            if col not in sub or not sub[col].notna().any():
                continue
            default = sub[sub["sweep"] == "default"][col]
            if len(default):
                out[f"{mode}_default_pct{tag}"] = round(float(default.iloc[0]), 1)
            worst = sub.loc[sub[col].idxmin()]
            axis = worst["sweep"]
            out[f"{mode}_min_sweep_pct{tag}"] = round(float(worst[col]), 1)
            out[f"{mode}_min_sweep_point{tag}"] = (
                axis if axis == "default" else f"{axis}={worst[axis]}"
            )
    if len(qkv):
        sub = qkv[qkv["path"] == "nakta"]
        out["qkv_pct"] = {r["model"]: round(float(r["pct_copy_bw"]), 1) for _, r in sub.iterrows()}
        out["qkv_pct_eager"] = {
            r["model"]: round(float(r["pct_copy_bw_eager"]), 1) for _, r in sub.iterrows()
        }
    return out


# ---------------------------------------------------------------------------- --tune
# Block-size sweep of both RoPE kernels (forward; the backward is the same kernel), GPU time from
# CUDA-graph replays. Each configuration overrides the kernel file's ``_TUNE`` (``rope.py`` for the
# fused QKV path, ``rope_te.py`` for the TE-compatible API) and is timed at a few shapes;
# "heuristic" is the committed rule. Writes ``rope_tune.{csv,md}`` and ``rope_tune_best.json`` (per
# kernel, the configuration with the best worst-case share of copy bandwidth over the shapes).


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


def main(argv: list[str] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    p = argparse.ArgumentParser(description="RoPE paths vs copy bandwidth.", epilog=CPU_NOTE)
    p.add_argument("--quick", action="store_true", help="fewer sweep points and repetitions")
    p.add_argument("--tune", action="store_true", help="only sweep Nakta block sizes")
    p.add_argument("--te-only", action="store_true", help="--tune: the TE-API kernel only")
    p.add_argument("--tune-budget", type=float, default=75.0, help="--tune: seconds")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="results folder (default results/<device>)")
    p.add_argument("--te-config", default=None, help="JSON launch config for the TE kernel")
    p.add_argument("--qkv-config", default=None, help="JSON launch config for the QKV kernel")
    args = p.parse_args(argv)
    from tqdm import tqdm

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    dtype = getattr(torch, args.dtype)
    slug = device_slug(device)
    out = Path(args.out) if args.out else results_dir(__file__, slug)
    copy_gbps = copy_bandwidth_gbps(device=str(device)) if on_gpu else float("nan")
    announce(device)
    print(f"copy bandwidth {copy_gbps:.0f} GB/s on {slug}", flush=True)

    if args.tune:
        if not on_gpu:
            p.error("--tune needs a GPU (CUDA graphs time the launch configurations)")
        if not args.te_only:
            print("host us per call:", host_overheads(device, dtype))
        return tune_and_write(device, dtype, copy_gbps, args, out), pd.DataFrame()

    import json

    if args.te_config:
        rope_te._TUNE.update(json.loads(args.te_config))
    if args.qkv_config:
        rope._TUNE.update(json.loads(args.qkv_config))
    launch = {
        "te": {**rope_te._CONFIGS["rope_te"], **rope_te._TUNE},
        "qkv": {**rope._CONFIGS["rope_qkv"], **rope._TUNE},
    }
    print("launch configs:", launch)
    if on_gpu:
        configs = te_configs(args.quick)
        models = list(LLAMA_HEADS)
    else:  # a smoke run: the interpreter is far too slow for real sizes
        small = dict(seq_length=8, batch=2, heads=2, hidden=16, rotary_percent=1.0, margin=0)
        configs = [("default", small), ("margin", {**small, "margin": 2})]
        models = []
    rows, done = [], {}
    for sweep, cfg in tqdm(configs, desc="rope TE-API points"):
        key = tuple(sorted(cfg.items()))
        if key not in done:
            done[key] = te_case_rows(cfg, device, dtype, args.quick, copy_gbps)
            if on_gpu:
                torch.cuda.empty_cache()
        rows += [{"sweep": sweep, **r} for r in done[key]]
    te = pd.DataFrame(rows)
    qrows = []
    for model in tqdm(models, desc="rope QKV models"):
        qrows += qkv_rows(model, device, dtype, args.quick, copy_gbps)
        torch.cuda.empty_cache()
    qkv = pd.DataFrame(qrows)

    stem = "rope_quick" if args.quick else "rope"
    notes = (
        f"Device: {slug}; {args.dtype}; copy bandwidth measured in this run: {copy_gbps:.0f} GB/s "
        "(bytes read + written). GB/s = minimal bytes (t read + output written + freqs rows "
        "read, fp32) / median time (triton do_bench), the same count for every path. Backward "
        "= torch.autograd.grad on a retained graph. Sweeps vary one axis around s=4096, b=16, "
        "h=32, d=128, rotary_percent=1, sbhd; margin m runs s=4096-m tokens with random "
        "start_positions in [0, m). `us` is the GPU time from CUDA-graph replay of back-to-back "
        "calls where the path can be captured (`timer`), `us_eager` the eager call with triton's "
        "do_bench (L2 flushed; includes host overhead when it exceeds the GPU time); backward "
        "`us` times the backward function itself (the autograd node's body), `us_eager` "
        "torch.autograd.grad on a retained graph. Liger rotates q and k in place, so for "
        "rotary_percent < 1 it never touches the pass-through channels that Nakta (a new "
        "tensor, TE semantics) must copy: its % there exceeds 100. "
        + ("" if _te() is not None else "TransformerEngine is not importable here: no TE rows. ")
        + ("" if _liger() is not None else "Liger-Kernel is not importable here: no liger rows. ")
        + f"Launch configs: {launch['te']}."
    )
    write_table(te, out, stem, "RoPE (TE-compatible API): Nakta vs PyTorch, Liger, TE", notes)
    if len(qkv):
        qnotes = (
            f"Device: {slug}; {args.dtype}; copy bandwidth {copy_gbps:.0f} GB/s. In-place rotation "
            f"of the Q and K heads of a fused [tokens, 3*heads*128] QKV matrix, {QKV_TOKENS} "
            "tokens; bytes = Q+K read and written + cos/sin rows (fp32); nakta_cache also writes "
            "K and V to a KV cache (+ K write, V read, V write). Liger gets separate contiguous q "
            "and k tensors and precomputed per-token cos/sin. `us`: CUDA-graph GPU time (the "
            "PyTorch reference synchronises: eager); `us_eager`: do_bench eager calls. "
            f"Launch config: {launch['qkv']}."
        )
        write_table(qkv, out, f"{stem}_qkv", "RoPE, fused QK in place (model path)", qnotes)
    summary = summarize(te, qkv) | {
        "copy_gbps": copy_gbps,
        "device": slug,
        "targets": TARGETS,
        "launch_configs": launch,
    }
    if on_gpu:
        summary["host_us_per_call"] = host_overheads(device, dtype)
    write_json(summary, out / f"{stem}_summary.json")
    if (te["status"] == "ok").any():  # nothing to plot when every path failed
        save_figure(plot(te, qkv, f"RoPE ({args.dtype}) on {slug}"), out / f"{stem}.png")

    show = te[te["status"] == "ok"]
    cols = [
        "sweep",
        "seq_length",
        "batch",
        "heads",
        "hidden",
        "rotary_percent",
        "margin",
        "mode",
        "path",
        "us",
        "pct_copy_bw",
        "us_eager",
        "pct_copy_bw_eager",
    ]
    if len(show):
        print(show[cols].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    for _, r in te[te["status"] != "ok"].iterrows():
        print(f"{r['sweep']} {r['mode']} {r['path']}: {r['status']}")
    if len(qkv):
        print(
            qkv[["model", "path", "us", "GB/s", "pct_copy_bw", "pct_copy_bw_eager"]].to_string(
                index=False, float_format=lambda v: f"{v:.3g}"
            )
        )
    for k, v in summary.items():
        print(f"{k}: {v}")
    print(f"results -> {out}")
    return te, qkv


if __name__ == "__main__":
    sys.exit(exit_status(*main()))
