"""Decode-step kernels: Nakta's fused ``decode_linear`` and ``decode_attention`` vs cuBLAS, the
unfused chain and SDPA.

Why: decoding a few tokens streams every weight once per token, so a decode step is only as
fast as its matmuls read weights. Each fused kernel is measured against the copy bandwidth
measured in the same run (bytes read + written by a large device-to-device copy).

Linear layers (LLaMA 7B / 13B / 65B decode shapes, batch 1..32): ``wqkv`` with RMSNorm +
RoPE (+ K/V cache write), ``wo`` + residual, ``w13`` with RMSNorm + SwiGLU, ``w2`` + residual,
LM head with RMSNorm and fp32 logits. Paths on the same inputs: ``nakta`` (one
``decode_linear``), ``cublas`` (``F.linear`` alone: less work, the matmul's own floor) and
``unfused`` (Nakta's RMSNorm kernel, ``F.linear``, then Nakta's SwiGLU / RoPE kernel or
eager's residual add: the model's current path). GB/s counts the same minimal bytes for every
path: weight, x, norm weight, residual, output and K/V cache writes.

Attention (batch 1 / 8 / 32, contexts 128..4096, 32 query heads x 128, MHA and GQA with 8 KV
heads, cache of 4096 positions per row): ``nakta`` (``decode_attention``, workspace
preallocated) vs ``sdpa_flash`` (``F.scaled_dot_product_attention`` with the flash backend on
the same cache views) and ``sdpa`` (backend left to PyTorch); ``--kv-cache fp8`` adds
``nakta_kv8``, the same K/V from an e4m3 cache with per-position scales. GB/s counts the K/V
bytes read (codes and scales for ``nakta_kv8``).

Times: GPU time from CUDA-graph replays (one call captured, replayed many times), the inputs
cycled over enough copies (weights included) that they do not stay in the 50 MB L2; paths at
one point are captured and replayed in turn over 3 rounds and the medians kept
(``rotated_ms``). ``mismatch`` is the fraction of Nakta's outputs that differ in any bit from
the eager reference (``decode_linear_reference`` / ``decode_attention_reference``).

``--tune`` tunes ``decode_linear``'s launch config per (shape, batch bucket) of the first
model instead (the ``--tune`` section below: coordinate descent within ``--tune-budget`` seconds; writes
``decode_linear_tune.csv`` and ``decode_linear_tune_best.json``, whose ``shapes`` go into
``decode_linear._CONFIGS``, or back in with ``--shapes-config`` to measure with them).

    python -m kernel_benchmark.bench_decode [--quick] [--tune] [--models 7B,13B,65B]

On the CPU (``--quick``, Triton interpreter) everything runs at toy sizes with wall-clock
times: a smoke test of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import itertools
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from bench_common.ceilings import copy_bandwidth_gbps, device_slug
from bench_common.report import results_dir, save_figure, write_json, write_table
from bench_common.timing import graph_ms, input_sets, rotated_ms
from kernel_benchmark.common import tuned
from kernel_benchmark.decode_shapes import (
    BATCHES,
    KINDS,
    LINEAR_PATHS,
    MODELS,
    TINY,
    LinearShape,
    cpu_us,
    linear_bytes,
    linear_mismatch,
    linear_shapes,
    make_linear_set,
    nakta_call,
)
from nakta_model.io_utils import atomic_write_text
from nakta_model.kernels import decode_attention as da_mod
from nakta_model.kernels import decode_linear as dl
from nakta_model.kernels.decode_attention import (
    attention_workspace,
    decode_attention,
    decode_attention_reference,
    decode_splits,
)
from nakta_model.kernels.fp8_quant import quantize_rows_reference


def time_paths(
    calls: dict[str, list[Callable[[], object]]], device: torch.device
) -> tuple[dict[str, float], dict[str, str]]:
    """us per call of each path: CUDA-graph replays in rotated rounds on the GPU, one
    wall-clock call on the CPU. Returns (path -> us, path -> why it could not be timed)."""
    if device.type == "cuda":
        ms, errors = rotated_ms(calls, rounds=3, budget_ms=5.0)
        return {p: v * 1e3 for p, v in ms.items()}, errors
    times, errors = {}, {}
    for p, cs in calls.items():
        try:
            times[p] = cpu_us(cs[0])
        except Exception as ex:
            errors[p] = str(ex).splitlines()[0][:80] if str(ex) else type(ex).__name__
    return times, errors


def _status(path: str, errors: dict[str, str]) -> str:
    return f"failed: {errors[path]}" if path in errors else "ok"


def bench_linear_point(
    shape: LinearShape, batch: int, dtype, device, copy_gbps: float
) -> list[dict]:
    e = dtype.itemsize
    n_sets = input_sets(device, shape.n * shape.k * e)
    sets = [make_linear_set(shape, batch, dtype, device, seed=i) for i in range(n_sets)]
    cfg = dl._config(dtype, batch, shape.n_cols, shape.k, shape.variant, device)
    with torch.no_grad():
        calls = {p: [make(shape, t) for t in sets] for p, make in LINEAR_PATHS.items()}
        times, errors = time_paths(calls, device)
    mismatch = float("nan") if "nakta" in errors else linear_mismatch(shape, sets[0])
    nbytes = linear_bytes(shape, batch, e)
    rows = []
    for p in LINEAR_PATHS:
        us = times.get(p, float("nan"))
        row = {"model": shape.model, "kind": shape.kind, "N": shape.n, "K": shape.k}
        row |= {"batch": batch, "path": p, "status": _status(p, errors), "us": us}
        row |= {"GB/s": nbytes / us / 1e3, "pct_copy_bw": 100 * nbytes / us / 1e3 / copy_gbps}
        row |= {"MB": nbytes / 1e6, "input_sets": n_sets}
        row |= {"mismatch": mismatch if p == "nakta" else float("nan")}
        row |= {"config": _config_str(cfg) if p == "nakta" else ""}
        rows.append(row)
    return rows


def _config_str(cfg: dict) -> str:
    keys = ("USE_DOT", "BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
    return " ".join(f"{k}={cfg[k]}" for k in keys)


# ------------------------------------------------------------------------------- attention


@dataclass(frozen=True)
class AttnCase:
    batch: int
    n_q: int
    n_kv: int
    head_dim: int
    s_max: int

    @property
    def name(self) -> str:
        return "mha" if self.n_q == self.n_kv else f"gqa{self.n_q // self.n_kv}"


def make_attn_set(case: AttnCase, dtype, device, seed: int, kv8: bool = False) -> dict:
    """One input set; ``kv8`` adds the same K/V as an e4m3 cache (``k8``/``v8``, one fp32 scale
    per position and head in ``ks``/``vs``: the model's ``kv_cache="fp8"`` layout)."""
    g = torch.Generator(device=device).manual_seed(seed)
    b, hq, hkv, hd, s = case.batch, case.n_q, case.n_kv, case.head_dim, case.s_max
    kv_shape = (b * s, hkv, hd)  # the model's flat cache, viewed per row
    t = {
        "q": torch.randn(b, hq, hd, generator=g, device=device).to(dtype),
        "k": torch.randn(kv_shape, generator=g, device=device).to(dtype).view(b, s, hkv, hd),
        "v": torch.randn(kv_shape, generator=g, device=device).to(dtype).view(b, s, hkv, hd),
        "lens": torch.zeros(b, dtype=torch.int32, device=device),
    }
    t["out"] = torch.empty_like(t["q"])
    splits = decode_splits(b, hkv, s, device)
    t["ws"] = attention_workspace(b, hq, hd, splits, device)
    if kv8:
        for name in ("k", "v"):
            codes = quantize_rows_reference(t[name].reshape(-1, hd))
            t[f"{name}8"] = codes.q.view(b, s, hkv, hd)
            t[f"{name}s"] = codes.scale.view(b, s, hkv)
        t["out8"] = torch.empty_like(t["q"])
    return t


def attn_calls(case: AttnCase, t: dict, ctx: int, device) -> dict[str, Callable[[], object]]:
    q4 = t["q"].unsqueeze(2)  # [B, hq, 1, hd]
    k = t["k"][:, :ctx].transpose(1, 2)  # [B, hkv, ctx, hd] views of the same cache
    v = t["v"][:, :ctx].transpose(1, 2)
    gqa = case.n_q != case.n_kv

    def nakta():
        return decode_attention(t["q"], t["k"], t["v"], t["lens"], out=t["out"], workspace=t["ws"])

    def sdpa():
        return F.scaled_dot_product_attention(q4, k, v, enable_gqa=gqa)

    calls = {"nakta": nakta, "sdpa": sdpa}
    if "k8" in t:

        def nakta_kv8():
            return decode_attention(t["q"], t["k8"], t["v8"], t["lens"], out=t["out8"],
                                    workspace=t["ws"], k_scale=t["ks"], v_scale=t["vs"])  # fmt: skip

        calls["nakta_kv8"] = nakta_kv8
    if not gqa:  # MHA's CUDA-core path (fp32 throughout), forced: the default uses tl.dot

        def nakta_fma():
            saved = dict(da_mod._TUNE)
            da_mod._TUNE.update(USE_DOT=0)
            try:
                return nakta()
            finally:
                da_mod._TUNE.clear()
                da_mod._TUNE.update(saved)

        calls["nakta_fma"] = nakta_fma
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa_flash():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(q4, k, v, enable_gqa=gqa)

        calls["sdpa_flash"] = sdpa_flash
    return calls


def bench_attention_case(
    case: AttnCase, contexts: list[int], dtype, device, copy_gbps: float, kv8: bool = False
) -> list[dict]:
    """Every context of one (batch, heads) case on the same caches (lengths set per context);
    ``kv8``: also ``nakta_kv8``, the same keys and values read from an e4m3 cache (its GB/s
    counts its own bytes: codes and scales)."""
    e = dtype.itemsize
    kv_bytes = {c: 2 * case.batch * c * case.n_kv * case.head_dim * e for c in contexts}
    kv8_bytes = {c: 2 * case.batch * c * case.n_kv * (case.head_dim + 4) for c in contexts}
    n_sets = input_sets(device, min(kv_bytes.values()))
    sets = [make_attn_set(case, dtype, device, seed=i, kv8=kv8) for i in range(n_sets)]
    splits = decode_splits(case.batch, case.n_kv, case.s_max, device)
    rows = []
    for ctx in contexts:
        for t in sets:
            t["lens"].fill_(ctx)
        per_set = [attn_calls(case, t, ctx, device) for t in sets]
        calls = {p: [c[p] for c in per_set] for p in per_set[0]}
        with torch.no_grad():
            times, errors = time_paths(calls, device)
        t0 = sets[0]  # its out holds what Nakta's timed calls wrote
        ref = decode_attention_reference(t0["q"], t0["k"], t0["v"], t0["lens"])
        mismatch = {"nakta": float("nan") if "nakta" in errors else _differ(t0["out"], ref)}
        if kv8:  # against the reference on the same codes and scales
            ref8 = decode_attention_reference(t0["q"], t0["k8"], t0["v8"], t0["lens"],
                                              k_scale=t0["ks"], v_scale=t0["vs"])  # fmt: skip
            mismatch["nakta_kv8"] = (
                float("nan") if "nakta_kv8" in errors else _differ(t0["out8"], ref8)
            )
        for p in calls:
            us = times.get(p, float("nan"))
            nbytes = kv8_bytes[ctx] if p == "nakta_kv8" else kv_bytes[ctx]
            row = {"heads": case.name, "n_q": case.n_q, "n_kv": case.n_kv, "batch": case.batch}
            row |= {"context": ctx, "path": p, "status": _status(p, errors), "us": us}
            row |= {"GB/s": nbytes / us / 1e3, "pct_copy_bw": 100 * nbytes / us / 1e3 / copy_gbps}
            row |= {"n_splits": splits if p in mismatch else float("nan")}
            row |= {"mismatch": mismatch.get(p, float("nan"))}
            rows.append(row)
    return rows


def _differ(got: torch.Tensor, want: torch.Tensor) -> float:
    """Fraction of outputs that differ in any bit."""
    return (got != want).float().mean().item()


# ------------------------------------------------------------------------------------ plots


def plot(linear: pd.DataFrame, attn: pd.DataFrame, title: str):
    """Left: % of copy bandwidth per linear kind of the first model vs batch; right: attention
    vs context at batch 1 (us on the CPU, where there are no GPU times)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lin = linear[linear["status"] == "ok"]
    value = "pct_copy_bw" if lin["pct_copy_bw"].notna().any() else "us"
    kinds = list(dict.fromkeys(lin["kind"]))
    n_attn = attn["heads"].nunique() if len(attn) else 0
    fig, axes = plt.subplots(1, len(kinds) + n_attn, figsize=(3.6 * (len(kinds) + n_attn), 3.8),
                             squeeze=False)  # fmt: skip
    model = lin["model"].iloc[0] if len(lin) else ""
    for ax, kind in zip(axes[0], kinds):
        sub = lin[(lin["kind"] == kind) & (lin["model"] == model)]
        sub.pivot_table(index="batch", columns="path", values=value).plot(ax=ax, marker="o")
        ax.set_title(f"{model} {kind}")
        ax.set_xscale("log", base=2)
        ax.set_ylabel("% of copy bandwidth" if value == "pct_copy_bw" else "us per call")
        ax.grid(alpha=0.3)
    ok = attn[attn["status"] == "ok"] if len(attn) else attn
    for ax, heads in zip(axes[0][len(kinds) :], dict.fromkeys(ok["heads"]) if len(ok) else []):
        sub = ok[(ok["heads"] == heads) & (ok["batch"] == ok["batch"].min())]
        sub.pivot_table(index="context", columns="path", values=value).plot(ax=ax, marker="o")
        ax.set_title(f"attention {heads}, batch {int(sub['batch'].min())}")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------- main


def summarize(linear: pd.DataFrame, attn: pd.DataFrame) -> list[str]:
    """Per model at batch 1: Nakta's and cuBLAS's share of copy bandwidth over the whole layer
    stack, and the tokens/s the five kernels of a layer (+ head) allow at context 512."""
    lines = []
    ok = linear[(linear["status"] == "ok") & (linear["batch"] == 1)]
    attn_us = float("nan")
    if len(attn):
        a = attn[(attn["path"] == "nakta") & (attn["batch"] == 1) & (attn["heads"] == "mha")]
        a = a[a["context"] == 512] if (a["context"] == 512).any() else a
        attn_us = float(a["us"].median()) if len(a) else float("nan")
    for model in dict.fromkeys(ok["model"]):
        n_layers = {"7B": 32, "13B": 40, "65B": 80}.get(model, 1)
        for path in ("nakta", "cublas", "unfused"):
            sel = ok[(ok["model"] == model) & (ok["path"] == path)].set_index("kind")["us"]
            if not set(KINDS) <= set(sel.index):
                continue
            layer = sum(sel[k] for k in ("wqkv", "wo", "w13", "w2"))
            step_us = n_layers * (layer + (attn_us if path == "nakta" else 0.0)) + sel["head"]
            step = (
                ""
                if path != "nakta"
                else f" (+ attention at context 512: {1e6 / step_us:.0f} tok/s)"
            )
            lines.append(
                f"{model} batch 1 {path}: matmuls {n_layers} x {layer:.1f} us + head "
                f"{sel['head']:.1f} us = {1e6 / (n_layers * layer + sel['head']):.0f} tok/s{step}"
            )
    return lines


def run(args: argparse.Namespace, device: torch.device) -> tuple[pd.DataFrame, pd.DataFrame]:
    on_gpu = device.type == "cuda"
    dtype = getattr(torch, args.dtype)
    if on_gpu:
        models = {m: MODELS[m] for m in args.models.split(",")}
        batches = BATCHES if not args.quick else (1, 4, 16)
        contexts = [128, 256, 512, 1024, 2048, 4096] if not args.quick else [128, 1024, 4096]
        attn_batches, s_max, head_dim = (1, 8, 32), 4096, 128
        attn_heads = ((32, 32), (32, 8))
        copy_gbps = copy_bandwidth_gbps(device=str(device))
        attn_heads = args.attn_heads or attn_heads
    else:  # smoke run in the interpreter
        models, batches = {"tiny": TINY}, (2,)
        contexts, attn_batches, s_max, head_dim = [16, 40], (2,), 40, 16
        attn_heads = ((4, 4), (4, 2))
        copy_gbps = float("nan")
    if args.batches:
        batches = tuple(int(b) for b in args.batches.split(","))
    if args.attn_batches:
        attn_batches = tuple(int(b) for b in args.attn_batches.split(","))
    if args.contexts:
        contexts = [int(c) for c in args.contexts.split(",")]
        s_max = max(s_max, max(contexts))
    slug = device_slug(device)
    out = Path(args.out) if args.out else results_dir(__file__, slug)
    stem = "decode" + ("_quick" if args.quick else "")
    shapes = [s for name, m in models.items() for s in linear_shapes(name, m)]
    if args.shapes_config:
        print(f"loaded {load_shapes_config(args.shapes_config)} tuned shape configs")
    if args.tune:
        tuned = [s for s in shapes if s.model == next(iter(models))]
        tdf = tune_and_write(tuned, batches, dtype, device, copy_gbps, args, out / stem)
        return tdf, pd.DataFrame()
    from tqdm import tqdm

    notes = notes_text(slug, args.dtype, copy_gbps)
    rows = []
    if args.attention_only:
        shapes, stem = [], stem + "_attention_only"
    for shape, batch in tqdm(list(itertools.product(shapes, batches)), desc="decode_linear"):
        rows += bench_linear_point(shape, batch, dtype, device, copy_gbps)
        if on_gpu:
            torch.cuda.empty_cache()
    linear = pd.DataFrame(rows)
    if not args.attention_only:
        write_table(linear, out, f"{stem}_linear", "Decode linear layers: Nakta vs cuBLAS", notes)
    rows = []
    cases = [AttnCase(b, hq, hkv, head_dim, s_max) for b in attn_batches for hq, hkv in attn_heads]
    for case in tqdm(cases, desc="decode_attention"):
        rows += bench_attention_case(case, contexts, dtype, device, copy_gbps,
                                     kv8=args.kv_cache == "fp8")  # fmt: skip
        if on_gpu:
            torch.cuda.empty_cache()
    attn = pd.DataFrame(rows)
    write_table(attn, out, f"{stem}_attention", "Decode attention: Nakta vs SDPA", notes)
    show = ["heads", "batch", "context", "path", "us", "pct_copy_bw", "n_splits", "status"]
    print(attn[show].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    if not args.attention_only:
        fig = plot(linear, attn, f"Decode kernels ({args.dtype}) on {slug}")
        save_figure(fig, out / f"{stem}.png")
        show = ["model", "kind", "batch", "path", "us", "pct_copy_bw", "mismatch", "status"]
        print(linear[show].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
        for line in summarize(linear, attn) if on_gpu else []:
            print(line)
    print(f"copy bandwidth {copy_gbps:.0f} GB/s; results -> {out}")
    return linear, attn


def notes_text(slug: str, dtype: str, copy_gbps: float) -> str:
    cpu = ""
    if slug == "cpu":
        cpu = "CPU SMOKE RUN (Triton interpreter, toy shapes, one wall-clock call per path): "
        cpu += "not a measurement. "
    return cpu + (
        f"Device: {slug}; {dtype}; copy bandwidth measured in this run: {copy_gbps:.0f} GB/s "
        "(bytes read + written). `us` = GPU time per call from CUDA-graph replays (inputs, "
        "weights included, cycled over `input_sets` copies to defeat L2; paths replayed in "
        "turn, median of 3 rounds). Linear GB/s = weight + x + norm weight + residual + output "
        "+ K/V cache writes, the same count for every path (cublas does the matmul only). "
        "Attention GB/s = K/V bytes read. `mismatch` = fraction of Nakta's "
        "outputs that differ in any bit from the eager reference. `config` = Nakta's launch "
        "configuration (decode_linear._config)."
    )


# ---------------------------------------------------------------------------- --tune
# Coordinate descent over ``decode_linear``'s launch config. Per (shape, batch bucket) of the
# first model, batch 1 first: from the current default config (``decode_linear._config``),
# ``BLOCK_N`` / ``BLOCK_K`` / ``num_stages`` / ``num_warps`` / ``USE_DOT`` are moved one at a time to
# their neighbours, keeping whatever is faster, within ``--tune-budget`` seconds. Every
# measurement goes to ``<stem>_linear_tune.csv``, the best config per point to
# ``<stem>_linear_tune_best.json``, whose ``shapes`` are per-shape entries of
# ``decode_linear._CONFIGS`` (paste them there, or pass the file back with ``--shapes-config``).


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


def _head_pairs(text: str) -> tuple[tuple[int, int], ...] | None:
    """``"32:32,32:8"`` -> ``((32, 32), (32, 8))``; None unless every pair is Q:KV with positive
    ints and KV dividing Q."""
    pairs = []
    for part in text.split(","):
        q, sep, kv = part.partition(":")
        if not (sep and q.isdigit() and kv.isdigit()) or int(kv) < 1 or int(q) % int(kv):
            return None
        pairs.append((int(q), int(kv)))
    return tuple(pairs)


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description="Decode-step kernels vs cuBLAS / SDPA.")
    p.add_argument("--quick", action="store_true", help="fewer batches and contexts")
    p.add_argument("--tune", action="store_true", help="only tune decode_linear launch configs")
    p.add_argument("--tune-budget", type=float, default=200.0, help="--tune: seconds")
    p.add_argument(
        "--models",
        default="7B,13B,65B",
        help="comma-separated, from 7B,13B,65B,llama3-8B,llama3.2-1B",
    )
    p.add_argument("--batches", default=None, help="comma-separated batch sizes")
    p.add_argument("--shapes-config", default=None, help="a --tune JSON to measure with")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="results folder (default results/<device>)")
    p.add_argument("--attention-only", action="store_true", help="skip decode_linear")
    p.add_argument("--attn-batches", default=None, help="attention batch sizes (1,8,32)")
    p.add_argument("--contexts", default=None, help="attention contexts (128,...,4096)")
    p.add_argument(
        "--attn-heads", default=None, help="attention Q:KV head counts on a GPU (32:32,32:8)"
    )
    p.add_argument(
        "--kv-cache",
        default="bf16",
        choices=["bf16", "fp8"],
        help="fp8: attention also reads an e4m3 cache of the same K/V (nakta_kv8)",
    )
    args = p.parse_args(argv)
    if args.attn_heads is not None:
        pairs = _head_pairs(args.attn_heads)
        if pairs is None:
            p.error(f"--attn-heads: expected Q:KV pairs with KV dividing Q (e.g. 32:8), "
                    f"got {args.attn_heads!r}")  # fmt: skip
        args.attn_heads = pairs
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        p.error(f"--models: unknown {sorted(unknown)}; choose from {sorted(MODELS)}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with (
        torch.cuda.stream(torch.cuda.Stream(device))
        if device.type == "cuda"
        else (contextlib.nullcontext())
    ):
        return run(args, device)


if __name__ == "__main__":
    main()
