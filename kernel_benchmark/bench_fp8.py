"""FP8 on Hopper, kernel by kernel: the quantizing kernels against copy bandwidth, the FP8 GEMMs
against bf16, the decode GEMVs with FP8 weights against bf16 weights, all in one process.

Why: FP8 pays only if quantizing the activations costs (almost) nothing beside the GEMMs it
speeds up (issue 27: eager quantization ate the whole 1.59x), and if the decode GEMVs reach the
same fraction of copy bandwidth on half the bytes. Sections (``--sections``):

* ``quant``: at the 7B widths and ``--tokens`` rows, GB/s and % of the copy bandwidth measured
  in this run, bytes counted as a perfect kernel moves them (inputs read once, e4m3 codes and
  fp32 scales written): ``rms_norm_fp8`` with the residual (hidden 4096), ``swiglu_fp8``
  (F = 11008, row held in registers and the two-pass loop), ``quantize_rows`` (4096, both
  layouts), each beside the unfused eager path (Nakta's bf16 kernel, then PyTorch ops:
  absmax, divide, multiply, clamp, cast);
* ``gemm``: TFLOP/s of the 7B block GEMMs (wqkv, wo, w13, w2) at ``--tokens`` rows: bf16
  ``F.linear``, ``fp8_matmul`` (row-wise scales, cuBLASLt ``_scaled_mm``) and ``_scaled_mm``
  with per-tensor scales, beside the bf16 8192^3 matmul rate of this run; ``layer`` rows sum
  the four; ``rel_err_fp32``: cuBLASLt's fp32 accumulation against the exact reference;
* ``decode``: the 7B decode GEMVs (``decode_linear`` with their fused prologue/epilogues) at
  ``--batches``, bf16 weights vs e4m3 weights + fp32 row scales, CUDA-graph replays over input
  copies larger than L2, GB/s and % of copy bandwidth.

    python -m kernel_benchmark.bench_fp8 [--tokens 1024,4096,16384] [--batches 1,32]

Outputs ``results/<device>/fp8_{quant,gemm,decode}.{csv,md}``, ``fp8.png`` and
``fp8_summary.json``. GPU only (compute capability >= 8.9): a CPU run says so and exits 1.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path

if not __package__:  # run by path: import from the repo root, not from this script's folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import pandas as pd
import torch
import torch.nn.functional as F

from bench_common.ceilings import copy_bandwidth_gbps, device_slug
from bench_common.report import results_dir, save_figure, write_json, write_table
from bench_common.timing import eager_ms, input_sets, rotated_ms

SECTIONS = ("quant", "gemm", "decode")
HIDDEN, FFN = 4096, 11008  # LLaMA-7B
SQUARE = 8192
GEMMS = {"wqkv": (4096, 12288), "wo": (4096, 4096), "w13": (4096, 22016), "w2": (11008, 4096)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1024,4096,16384", help="rows of the scoring kernels")
    p.add_argument("--batches", default="1,32", help="decode batch sizes (1..64)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"subset of {SECTIONS}")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    def ints(name: str, text: str, hi: int) -> list[int]:
        try:
            vals = [int(t) for t in text.split(",") if t.strip()]
        except ValueError:
            p.error(f"--{name} must be comma-separated ints, got {text!r}")
        if not vals or min(vals) < 1 or max(vals) > hi:
            p.error(f"--{name} needs ints in [1, {hi}], got {text!r}")
        return vals

    args.tokens = ints("tokens", args.tokens, 1 << 20)
    args.batches = ints("batches", args.batches, 64)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad or not args.sections:
        p.error(f"--sections must be a subset of {','.join(SECTIONS)}, got {bad or 'none'}")
    return args


# --------------------------------------------------------------------------- quantizing kernels


def quant_cases(tokens: int, device: torch.device) -> list[tuple[str, str, int, Callable]]:
    """``(op, path, bytes moved, call)`` of each quantizing kernel and its unfused peer."""
    from kernel_benchmark.common import tuned
    from nakta_model.kernels import fp8_quant
    from nakta_model.kernels import swiglu as swiglu_mod
    from nakta_model.kernels.fp8_quant import quantize_rows, quantize_rows_reference
    from nakta_model.kernels.rmsnorm import rms_norm, rms_norm_fp8
    from nakta_model.kernels.swiglu import swiglu, swiglu_fp8

    bf16 = dict(device=device, dtype=torch.bfloat16)
    x, r = torch.randn(tokens, HIDDEN, **bf16), torch.randn(tokens, HIDDEN, **bf16)
    w = 1 + 0.1 * torch.randn(HIDDEN, **bf16)
    gu = torch.randn(tokens, 2 * FFN, **bf16)
    scales = 4 * tokens
    norm_bytes = tokens * HIDDEN * (2 + 2 + 2 + 1) + scales  # x, residual in; h, codes out
    swiglu_bytes = tokens * FFN * (4 + 1) + scales
    quant_bytes = tokens * HIDDEN * (2 + 1) + scales

    def looped_swiglu():
        saved = dict(swiglu_mod._FP8_TUNE)
        swiglu_mod._FP8_TUNE.update(BLOCK_N=2048)
        try:
            return swiglu_fp8(gu)
        finally:
            swiglu_mod._FP8_TUNE.clear()
            swiglu_mod._FP8_TUNE.update(saved)

    def looped_quant():
        with tuned(fp8_quant, BLOCK_N=1024):
            return quantize_rows(x)

    def eager_norm():
        y, h = rms_norm(x, w, 1e-5, r)
        return quantize_rows_reference(y), h

    return [
        ("rms_norm+res", "nakta_fp8", norm_bytes, lambda: rms_norm_fp8(x, w, 1e-5, r)),
        ("rms_norm+res", "bf16_kernel+eager_quant", norm_bytes, eager_norm),
        ("rms_norm+res", "bf16_kernel_only", norm_bytes, lambda: rms_norm(x, w, 1e-5, r)),
        ("swiglu", "nakta_fp8", swiglu_bytes, lambda: swiglu_fp8(gu)),
        ("swiglu", "nakta_fp8_two_pass", swiglu_bytes, looped_swiglu),
        (
            "swiglu",
            "bf16_kernel+eager_quant",
            swiglu_bytes,
            lambda: quantize_rows_reference(swiglu(gu)),
        ),  # fmt: skip
        ("quantize_rows", "nakta_fp8", quant_bytes, lambda: quantize_rows(x)),
        ("quantize_rows", "nakta_fp8_two_pass", quant_bytes, looped_quant),
        ("quantize_rows", "eager", quant_bytes, lambda: quantize_rows_reference(x)),
    ]


def measure_quant(tokens: list[int], device, copy_gbps: float, progress) -> list[dict]:
    timer = functools.partial(eager_ms, device=device, warmup=10, rep=40)
    rows = []
    for m in progress(tokens, desc="quant"):
        for op, path, nbytes, call in quant_cases(m, device):
            ms = timer(call)
            gbps = nbytes / (ms * 1e-3) / 1e9
            rows.append({"op": op, "tokens": m, "path": path, "us": ms * 1e3, "GB/s": gbps,
                         "pct_copy_bw": 100 * gbps / copy_gbps, "MB": nbytes / 1e6})  # fmt: skip
        torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------------- FP8 GEMMs


def _square_tflops(timer, g: torch.Generator, bf16: dict) -> float:
    """The bf16 ``8192^3`` matmul rate of this run (the ceiling the GEMM rows compare to)."""
    a, b = (torch.randn(SQUARE, SQUARE, generator=g, **bf16) for _ in range(2))
    return 2 * SQUARE**3 / (timer(lambda: a @ b) * 1e-3) / 1e12


def measure_gemm(tokens: list[int], device, progress) -> list[dict]:
    from nakta_model.kernels.fp8_gemm import fp8_matmul, fp8_matmul_reference
    from nakta_model.kernels.fp8_quant import quantize_rows, quantize_weight

    timer = functools.partial(eager_ms, device=device, warmup=25, rep=100)
    g = torch.Generator(device=device).manual_seed(0)
    bf16 = dict(device=device, dtype=torch.bfloat16)
    peak = _square_tflops(timer, g, bf16)
    rows = [{"shape": f"{SQUARE}^3", "M": SQUARE, "K": SQUARE, "N": SQUARE, "path": "bf16",
             "ms": 2 * SQUARE**3 / peak / 1e9, "tflops": peak}]  # fmt: skip
    weights = {}
    for name, (k, n) in GEMMS.items():
        w = torch.randn(n, k, generator=g, **bf16) / k**0.5
        weights[name] = (w, *quantize_weight(w))
    one = torch.ones((), device=device)
    for m in progress(tokens, desc="gemm"):
        xs = {k: torch.randn(m, k, generator=g, **bf16) for k in {HIDDEN, FFN}}
        xq = {k: quantize_rows(x) for k, x in xs.items()}
        totals: dict[str, list[float]] = {}
        for name, (w, wq, ws) in weights.items():
            n, k = w.shape
            x, (q, s) = xs[k], xq[k]
            paths = {
                "bf16": lambda x=x, w=w: F.linear(x, w),
                "fp8_rowwise": lambda q=q, s=s, wq=wq, ws=ws: fp8_matmul(q, s, wq, ws),
                "fp8_tensorwise": lambda q=q, wq=wq: torch._scaled_mm(
                    q, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16
                ),
            }
            acc = torch._scaled_mm(q, wq.t(), scale_a=s[:, None], scale_b=ws[None, :],
                                   out_dtype=torch.float32)  # fmt: skip
            exact = fp8_matmul_reference(q, s, wq, ws, torch.float32)
            rel_err = float((acc - exact).norm() / exact.norm())
            del acc, exact
            for path, call in paths.items():
                ms = timer(call)
                flop = 2 * m * k * n
                t = totals.setdefault(path, [0.0, 0.0])
                t[0], t[1] = t[0] + flop, t[1] + ms
                rows.append({"shape": name, "M": m, "K": k, "N": n, "path": path, "ms": ms,
                             "tflops": flop / (ms * 1e-3) / 1e12,
                             "rel_err_fp32": rel_err if path == "fp8_rowwise" else None})  # fmt: skip
        for path, (flop, ms) in totals.items():
            rows.append({"shape": "layer", "M": m, "K": 0, "N": 0, "path": path, "ms": ms,
                         "tflops": flop / (ms * 1e-3) / 1e12})  # fmt: skip
        del xs, xq
    df = pd.DataFrame(rows)
    df["of_bf16_peak"] = df["tflops"] / peak
    base = df[df["path"] == "bf16"].set_index(["shape", "M"])["ms"]
    df["speedup_vs_bf16"] = [base[(r.shape, r.M)] / r.ms for r in df.itertuples()]
    return df.to_dict("records")


# ------------------------------------------------------------------------------ decode GEMVs


def measure_decode(batches: list[int], device, copy_gbps: float, progress) -> list[dict]:
    from kernel_benchmark.decode_shapes import (
        MODELS,
        linear_bytes,
        linear_kwargs,
        linear_shapes,
        make_linear_set,
    )
    from nakta_model.kernels import decode_linear as dl
    from nakta_model.kernels.decode_linear import decode_linear
    from nakta_model.kernels.fp8_quant import FP8_DTYPE, quantize_weight

    shapes = [s for s in linear_shapes("7B", MODELS["7B"]) if s.kind != "head"]
    points = [(s, b) for s in shapes for b in batches]
    rows = []
    for shape, batch in progress(points, desc="decode"):
        n_sets = input_sets(device, shape.n * shape.k * 2)
        sets = [make_linear_set(shape, batch, torch.bfloat16, device, i) for i in range(n_sets)]
        calls: dict[str, list[Callable[[], object]]] = {"bf16": [], "fp8": []}
        with torch.no_grad():
            for t in sets:
                kw = linear_kwargs(shape, t)
                wq, ws = quantize_weight(t["w"])
                calls["bf16"].append(lambda t=t, kw=kw: decode_linear(t["x"], t["w"], **kw,
                                                                      out=t["out"]))  # fmt: skip
                calls["fp8"].append(lambda t=t, kw=kw, wq=wq, ws=ws: decode_linear(
                    t["x"], wq, weight_scale=ws, **kw, out=t["out"]))  # fmt: skip
            ms, errors = rotated_ms(calls, rounds=3, budget_ms=5.0)
        full = linear_bytes(shape, batch, 2)
        nbytes = {"bf16": full, "fp8": full - shape.n * shape.k + 4 * shape.n}
        for path in calls:
            us = ms.get(path, float("nan")) * 1e3
            wdt = FP8_DTYPE if path == "fp8" else torch.bfloat16
            cfg = dl._config(torch.bfloat16, batch, shape.n_cols, shape.k, shape.variant, device,
                             wdt)  # fmt: skip
            rows.append({"kind": shape.kind, "N": shape.n, "K": shape.k, "batch": batch,
                         "weights": path, "status": errors.get(path, "ok"), "us": us,
                         "GB/s": nbytes[path] / us / 1e3,
                         "pct_copy_bw": 100 * nbytes[path] / us / 1e3 / copy_gbps,
                         "MB": nbytes[path] / 1e6,
                         "config": " ".join(f"{k}={cfg[k]}" for k in
                                            ("USE_DOT", "BLOCK_N", "BLOCK_K", "num_warps"))})  # fmt: skip
        del sets, calls
    df = pd.DataFrame(rows)
    base = df[df["weights"] == "bf16"].set_index(["kind", "batch"])["us"]
    df["speedup_vs_bf16"] = [base[(r.kind, r.batch)] / r.us for r in df.itertuples()]
    return df.to_dict("records")


# ------------------------------------------------------------------------------------ output


def plot(frames: dict[str, pd.DataFrame], title: str):
    """One panel per section: % of copy bandwidth (quant, decode), TFLOP/s (gemm)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(k, v) for k, v in frames.items() if len(v)]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(6 * max(1, len(panels)), 5))
    axes = [axes] if not hasattr(axes, "__len__") else list(axes)
    for ax, (name, df) in zip(axes, panels):
        if name == "quant":
            t = df.pivot_table(index=["op", "tokens"], columns="path", values="pct_copy_bw")
            ax.set_xlabel("% of copy bandwidth")
        elif name == "gemm":
            t = df[df["shape"] != f"{SQUARE}^3"].pivot_table(
                index=["shape", "M"], columns="path", values="tflops"
            )
            ax.set_xlabel("TFLOP/s")
        else:
            t = df.pivot_table(index=["kind", "batch"], columns="weights", values="pct_copy_bw")
            ax.set_xlabel("% of copy bandwidth")
        t = t.dropna(how="all")
        if t.empty:  # nothing timed in this section (the table says why)
            ax.set_title(f"{name}: not timed")
            continue
        t.index = [" ".join(map(str, i)) for i in t.index]
        t.plot.barh(ax=ax, width=0.8)
        ax.invert_yaxis()
        ax.set_title(name)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def write_results(frames: dict[str, pd.DataFrame], out: Path, slug: str, copy_gbps: float) -> dict:
    """Tables, the plot and the summary JSON of whatever sections ran; returns the summary."""
    out.mkdir(parents=True, exist_ok=True)
    common = f"{slug}, torch {torch.__version__}, copy bandwidth {copy_gbps:.0f} GB/s (this run)."
    notes = {
        "quant": "Bytes: inputs read once + e4m3 codes and fp32 row scales written (h too "
        "with the residual). eager_quant: PyTorch ops after Nakta's bf16 kernel.",
        "gemm": "do_bench medians; fp8_rowwise = fp8_matmul (per-row x per-column scales); "
        "fp8_tensorwise = _scaled_mm with scalar scales; layer = the four summed. rel_err_fp32: "
        "normwise error of _scaled_mm's fp32 output against the exact fp32 reference.",
        "decode": "CUDA-graph replays over input copies > 3x L2; bytes: weights (e4m3 + fp32 "
        "scales for fp8), x, norm weight, residual, outputs, K/V writes.",
    }
    summary: dict = {"device": slug, "copy_gbps": copy_gbps}
    for name, df in frames.items():
        if not len(df):
            continue
        write_table(df, out, f"fp8_{name}", f"FP8 kernels: {name}", f"{common} {notes[name]}")
        if name == "quant":
            best = df.groupby(["op", "path"])["pct_copy_bw"].min()
            summary["quant_min_pct_copy_bw"] = {f"{o} {p}": float(v) for (o, p), v in best.items()}
        elif name == "gemm":
            layer = df[df["shape"] == "layer"]
            summary["gemm_layer_speedup_vs_bf16"] = {
                f"{r.path} M{r.M}": float(r.speedup_vs_bf16) for r in layer.itertuples()
            }
        else:
            summary["decode_speedup_vs_bf16"] = {
                f"{r.kind} b{r.batch}": float(r.speedup_vs_bf16)
                for r in df[df["weights"] == "fp8"].itertuples()
            }
    save_figure(plot(frames, f"FP8 kernels on {slug}"), out / "fp8.png")
    write_json(summary, out / "fp8_summary.json")
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("bench_fp8 needs a GPU of compute capability >= 8.9: nothing measured",
              file=sys.stderr)  # fmt: skip
        return 1
    from tqdm import tqdm

    device = torch.device("cuda")
    slug = device_slug(device)
    copy_gbps = copy_bandwidth_gbps()
    frames = {s: pd.DataFrame() for s in args.sections}
    if "quant" in frames:
        frames["quant"] = pd.DataFrame(measure_quant(args.tokens, device, copy_gbps, tqdm))
    if "gemm" in frames:
        frames["gemm"] = pd.DataFrame(measure_gemm(args.tokens, device, tqdm))
    if "decode" in frames:
        frames["decode"] = pd.DataFrame(measure_decode(args.batches, device, copy_gbps, tqdm))
    out = args.out or results_dir(__file__, slug)
    summary = write_results(frames, out, slug, copy_gbps)
    for name, df in frames.items():
        print(f"\n{name}\n" + df.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(summary)
    print(f"results -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
