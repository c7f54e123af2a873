"""Decode linears at 1..1024 rows: ``decode_linear``'s fused GEMVs against the GEMM path
(``generation/step_gemm.py``: cuBLAS / cuBLASLt W8A8 with the fused norm, SwiGLU and RoPE
kernels around it), block by block and as a whole decode step: where the step should switch.

Why: ``decode_linear`` keeps the rows on the narrow side of its MMA and stops at 64 rows; past
some row count a decode linear is a GEMM and cuBLAS is the right tool. The crossover is where
the GEMM path's step time drops below the GEMVs' (``step_gemm.CROSSOVER``, per dtype / fp8).

Paths: ``decode_linear`` (the fused GEMVs, <= 64 rows); ``gemm`` (``step_gemm`` with cuBLAS, or
cuBLASLt W8A8 for FP8 weights: ``fp8_decode_gemm`` turned off); for fp8 at <= 64 rows also
``triton_fp8`` (``step_gemm`` with its FP8 GEMMs on ``kernels/fp8_decode_gemm``, the swap-AB
Triton kernel, forced on at every measured rows; the LM head stays bf16 on cuBLAS).

Sections (``--sections``):

* ``blocks``: the step's five linears (``wqkv`` + norm + RoPE/KV write, ``wo`` + residual,
  ``w13`` + norm + SwiGLU, ``w2`` + residual, LM head + norm) at the 7B / 13B shapes, for each
  of ``--rows`` and ``--quants`` (bf16 weights; fp8: e4m3 block weights + row scales, the head
  stays bf16), both paths (``decode_linear`` only up to 64 rows) on the same inputs, each a
  CUDA graph replayed over input copies larger than L2, paths in turn (``rotated_ms``). Columns:
  us, GB/s of weights streamed, % of the copy bandwidth (all bytes a perfect kernel moves),
  TFLOP/s and % of the bf16 matmul rate (both ceilings measured in this run), ``rel_err`` of
  the GEMM path against ``decode_gemm_reference``. ``blocks_layer``: per model, quant and rows,
  a step's linears (n_layers x the four blocks + head) on each path, the winner, and the
  crossover the step should use (``decode_gemm_crossover.json``);
* ``step``: ``DecodeStep`` on a random 7B (bf16 and fp8), captured in a CUDA graph, rows
  ``--rows``, both paths (the crossover forced), every row at context ``--context``:
  tok/s and % of the step's byte floor (``speed_bench.decode_speed.step_bytes``).

    python -m kernel_benchmark.bench_decode_gemm [--models 7B,13B] [--quants bf16,fp8]

Writes ``results/<device>/decode_gemm_{blocks,blocks_layer,step}.{csv,md}``,
``decode_gemm.png`` and ``decode_gemm_crossover.json``, rewritten after each model and quant
(a run cut short keeps what it finished). On the CPU (Triton interpreter, toy shapes, one
wall-clock call): a smoke test of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

if not __package__:  # run by path: import from the repo root, not from this script's folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import pandas as pd
import torch

from bench_common.ceilings import copy_bandwidth_gbps, device_slug, matmul_tflops
from bench_common.report import results_dir, save_figure, write_json, write_table
from bench_common.timing import input_sets
from kernel_benchmark.common import tuned
from kernel_benchmark.decode_shapes import (
    MODELS,
    TINY,
    LinearShape,
    linear_kwargs,
    linear_shapes,
    make_linear_set,
)
from nakta_model.generation import step_gemm as sg
from nakta_model.kernels import decode_linear as dl
from nakta_model.kernels import fp8_decode_gemm as fdg
from nakta_model.kernels.fp8_quant import QuantRows, dequantize_rows, quantize_rows, quantize_weight

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
QUANTS = ("bf16", "fp8")
SECTIONS = ("blocks", "step")
N_LAYERS = {"7B": 32, "13B": 40, "65B": 80, "tiny": 2}
DTYPE = torch.bfloat16


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="7B,13B", help="block shapes, from 7B,13B,65B")
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help=f"rows in [1, {sg.MAX_ROWS}]")
    p.add_argument("--quants", default="bf16,fp8", help="bf16 and/or fp8 weights")
    p.add_argument("--sections", default="blocks,step", help=f"subset of {SECTIONS}")
    p.add_argument("--context", type=int, default=128, help="step: positions cached per row")
    p.add_argument("--device", default=None)
    p.add_argument("--out", type=Path, default=None, help="results folder (results/<device>)")
    a = p.parse_args(argv)

    def items(name: str, text: str, allowed) -> list[str]:
        vals = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in vals if v not in allowed]
        if bad or not vals:
            p.error(f"--{name} must be a subset of {','.join(allowed)}, got {text!r}")
        return vals

    a.models = items("models", a.models, tuple(MODELS))
    a.quants = items("quants", a.quants, QUANTS)
    a.sections = items("sections", a.sections, SECTIONS)
    try:
        a.rows = sorted({int(r) for r in a.rows.split(",") if r.strip()})
    except ValueError:
        p.error(f"--rows must be comma-separated ints, got {a.rows!r}")
    if not a.rows or a.rows[0] < 1 or a.rows[-1] > sg.MAX_ROWS:
        p.error(f"--rows needs ints in [1, {sg.MAX_ROWS}], got {a.rows}")
    if a.context < 1:
        p.error(f"--context must be >= 1, got {a.context}")
    return a


# ------------------------------------------------------------------------------------- blocks
# step_gemm, without / with fp8_decode_gemm
GEMM_PATHS = ("gemm", "triton_fp8")
# step_gemm overrides (its _TUNE) that make each path: fp8_decode_gemm off, or on at any rows
PATH_TUNE = {
    "gemm": {"fp8_kernel_min": 1, "fp8_kernel_max": 0},
    "triton_fp8": {"fp8_kernel_min": 1, "fp8_kernel_max": fdg.MAX_ROWS},
}


def paths_at(rows: int, quant: str = "bf16") -> tuple[str, ...]:
    paths = ("decode_linear", "gemm") if rows <= dl.MAX_BATCH else ("gemm",)
    paths += ("triton_fp8",) if quant == "fp8" and rows <= fdg.MAX_ROWS else ()
    return paths


def block_set(shape: LinearShape, rows: int, quant: str, device, seed: int) -> dict:
    """One input set: ``decode_shapes``'s (bf16), with the block weight quantized for fp8
    (and ``w2``'s input as the FP8 SwiGLU hands it over: quantized rows)."""
    t = make_linear_set(shape, rows, DTYPE, device, seed)
    if quant == "fp8" and shape.kind != "head":
        t["w"], t["ws"] = quantize_weight(t["w"])
        if shape.kind == "w2":
            t["xq"] = quantize_rows(t["x"]) if device.type == "cuda" else _ref_quant(t["x"])
    return t


def _ref_quant(x: torch.Tensor) -> QuantRows:
    from nakta_model.kernels.fp8_quant import quantize_rows_reference

    return quantize_rows_reference(x)


def block_call(shape: LinearShape, t: dict, path: str, reference: bool = False):
    kw = {k: v for k, v in linear_kwargs(shape, t).items() if k != "out_dtype"}
    if "ws" in t:
        kw["weight_scale"] = t["ws"]
    if path == "decode_linear":
        return lambda: dl.decode_linear(t["x"], t["w"], **kw)
    fn = sg.decode_gemm_reference if reference else sg.decode_gemm
    x = t.get("xq", t["x"])

    def call():
        with tuned(sg, **PATH_TUNE[path]):
            return fn(x, t["w"], out_dtype=DTYPE, **kw)

    return call


def weight_bytes(shape: LinearShape, quant: str) -> int:
    if quant == "fp8" and shape.kind != "head":
        return shape.n * shape.k + 4 * shape.n
    return shape.n * shape.k * DTYPE.itemsize


def block_bytes(shape: LinearShape, rows: int, quant: str) -> int:
    """Bytes a perfect kernel moves: the weight (+ scales), x, the norm weight, the residual,
    the output and the K/V cache writes (activations in bf16)."""
    e = DTYPE.itemsize
    nbytes = weight_bytes(shape, quant) + rows * shape.k * e + (shape.k * e if shape.norm else 0)
    nbytes += rows * shape.n * e if shape.variant == "residual" else 0
    nbytes += rows * shape.n_out * e
    if shape.variant == "rope":
        nbytes += 2 * rows * shape.heads[1] * shape.heads[2] * e
    return nbytes


def _as_float(y) -> torch.Tensor:
    return dequantize_rows(y.q, y.scale) if isinstance(y, QuantRows) else y.float()


def rel_err(shape: LinearShape, t: dict, path: str = "gemm") -> float:
    """A GEMM path against its plain-PyTorch reference (each on its own call)."""
    with torch.no_grad():
        got = _as_float(block_call(shape, t, path)())
        ref = _as_float(block_call(shape, t, path, reference=True)())
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def time_calls(calls: dict[str, list], device) -> tuple[dict[str, float], dict[str, str]]:
    """us per call: CUDA-graph replays on the GPU (paths in turn), one wall-clock call on the
    CPU (a smoke test)."""
    if device.type == "cuda":
        from bench_common.timing import rotated_ms

        ms, errors = rotated_ms(calls, rounds=3, budget_ms=5.0)
        return {p: v * 1e3 for p, v in ms.items()}, errors
    out = {}
    for p, cs in calls.items():
        t0 = time.perf_counter()
        cs[0]()
        out[p] = (time.perf_counter() - t0) * 1e6
    return out, {}


def bench_block(shape, rows, quant, device, ceilings: dict) -> list[dict]:
    nb = weight_bytes(shape, quant)
    sets = [block_set(shape, rows, quant, device, seed=i) for i in range(input_sets(device, nb))]
    with torch.no_grad():
        calls = {p: [block_call(shape, t, p) for t in sets] for p in paths_at(rows, quant)}
        times, errors = time_calls(calls, device)
    err = {p: rel_err(shape, sets[0], p) for p in calls if p in GEMM_PATHS and p not in errors}
    total = block_bytes(shape, rows, quant)
    out = []
    for p in calls:
        us = times.get(p, float("nan"))
        tflops = 2 * rows * shape.n * shape.k / us / 1e6
        row = {"model": shape.model, "kind": shape.kind, "N": shape.n, "K": shape.k}
        row |= {"quant": quant, "rows": rows, "path": p, "us": us}
        row |= {
            "weight_GB/s": nb / us / 1e3,
            "pct_copy_bw": 100 * total / us / 1e3 / ceilings["copy"],
        }
        row |= {"TFLOP/s": tflops, "pct_matmul": 100 * tflops / ceilings["matmul"]}
        row |= {"rel_err": err.get(p, float("nan")), "input_sets": len(sets)}
        row |= {"status": f"failed: {errors[p]}" if p in errors else "ok"}
        out.append(row)
    return out


def layer_table(blocks: pd.DataFrame) -> pd.DataFrame:
    """Per (model, quant, rows, path): a step's linears, n_layers x (wqkv + wo + w13 + w2) +
    head, in us and us per token; the faster path per point."""
    ok = blocks[blocks["status"] == "ok"]
    rows = []
    for (model, quant, r, path), g in ok.groupby(["model", "quant", "rows", "path"]):
        us = g.set_index("kind")["us"]
        if not {"wqkv", "wo", "w13", "w2", "head"} <= set(us.index):
            continue
        step = N_LAYERS[model] * sum(us[k] for k in ("wqkv", "wo", "w13", "w2")) + us["head"]
        rows.append({"model": model, "quant": quant, "rows": r, "path": path,
                     "linears_us": step, "us_per_token": step / r})  # fmt: skip
    df = pd.DataFrame(rows)
    if len(df):
        best = df.loc[df.groupby(["model", "quant", "rows"])["linears_us"].idxmin()]
        win = {
            (m, q, r): p
            for m, q, r, p in zip(best["model"], best["quant"], best["rows"], best["path"])
        }
        df["winner"] = [win[(m, q, r)] for m, q, r in zip(df["model"], df["quant"], df["rows"])]
    return df


def crossovers(layer: pd.DataFrame) -> dict:
    """Per model and quant: the smallest measured rows from which the GEMM path (the faster of
    ``GEMM_PATHS`` at each rows) is faster at every measured rows up to decode_linear's 64
    (65: never), with the timings it rests on."""
    out: dict = {}
    if not len(layer):
        return out
    for (model, quant), g in layer.groupby(["model", "quant"]):
        piv = g.pivot_table(index="rows", columns="path", values="linears_us")
        if "decode_linear" not in piv or "gemm" not in piv:
            continue
        piv["gemm"] = piv[[p for p in GEMM_PATHS if p in piv]].min(axis=1)
        both = piv[["decode_linear", "gemm"]].dropna().sort_index()
        cross = dl.MAX_BATCH + 1
        for r in reversed(both.index.tolist()):
            if both.loc[r, "gemm"] < both.loc[r, "decode_linear"]:
                cross = int(r)
            else:
                break
        ratio = (both["decode_linear"] / both["gemm"]).round(3)
        out[f"{model}/{quant}"] = {"crossover_rows": cross,
                                   "gemm_speedup_by_rows": {int(k): float(v) for k, v in ratio.items()}}  # fmt: skip
    return out


# --------------------------------------------------------------------------------------- step
def bench_step(quant: str, rows_list, device, copy_gbps: float, context: int) -> list[dict]:
    """``DecodeStep`` on random weights (7B on a GPU, tiny on the CPU) at each rows, both paths."""
    from nakta_model.config import preset
    from nakta_model.generation.step import DecodeStep
    from nakta_model.loading import random_model
    from speed_bench.decode_speed import step_bytes

    on_gpu = device.type == "cuda"
    args = preset("7B") if on_gpu else preset("tiny")
    n = 20 if on_gpu else 1
    model = random_model(args, device, DTYPE, seed=1, quant=None if quant == "bf16" else quant,
                         kernels=None if on_gpu else "triton")  # fmt: skip
    key = sg.crossover_key(DTYPE, None if quant == "bf16" else quant)
    out = []
    for rows in rows_list:
        model.clear_cache()
        model.setup_cache(rows, context + n + 8)
        for path in paths_at(rows, quant):
            over = {key: 1 if path in GEMM_PATHS else dl.MAX_BATCH + 1, **PATH_TUNE.get(path, {})}
            with tuned(sg, **over):  # held while the step is built, captured and run
                step = DecodeStep(model, rows, n + 2, sampling=False,
                                  graph_mode="cuda_graph" if on_gpu else "eager")  # fmt: skip
                buf = step.buffers
                buf.block_table[:, 0].copy_(torch.arange(rows, dtype=torch.int32, device=device))
                buf.positions.fill_(context)
                if on_gpu:
                    step.capture()
                times = []
                for _ in range(3 if on_gpu else 1):
                    buf.positions.fill_(context)
                    buf.step.zero_()
                    times.append(_run_s(step, n, device))
            s = sorted(times)[len(times) // 2]
            floor_s = step_bytes(args, rows, context + n / 2, DTYPE.itemsize,
                                 quant=None if quant == "bf16" else quant) / (copy_gbps * 1e9)  # fmt: skip
            out.append({"model": "7B" if on_gpu else "tiny", "quant": quant, "rows": rows,
                        "path": path, "context": context, "ms_per_step": s * 1e3,
                        "tok_s": rows / s, "floor_tok_s": rows / floor_s,
                        "pct_of_floor": 100 * floor_s / s})  # fmt: skip
            print(f"[step {quant}] rows {rows} {path}: {rows / s:.0f} tok/s "
                  f"({100 * floor_s / s:.1f}% of floor)")  # fmt: skip
            del step
            if on_gpu:
                torch.cuda.empty_cache()
    model.clear_cache()
    return out


def _run_s(step, n: int, device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step.run(n)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / n
    t0 = time.perf_counter()
    step.run(n)
    return (time.perf_counter() - t0) / n


# ------------------------------------------------------------------------------------ report
def plot(blocks: pd.DataFrame, layer: pd.DataFrame, step: pd.DataFrame, title: str):
    """Per quant of the first model: each path's linears per token vs rows; the step's tok/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    quants = list(dict.fromkeys(layer["quant"])) if len(layer) else []
    fig, axes = plt.subplots(1, len(quants) + 1, figsize=(4.5 * (len(quants) + 1), 3.8),
                             squeeze=False)  # fmt: skip
    model = layer["model"].iloc[0] if len(layer) else ""
    for ax, q in zip(axes[0], quants):
        sub = layer[(layer["model"] == model) & (layer["quant"] == q)]
        sub.pivot_table(index="rows", columns="path", values="us_per_token").plot(ax=ax, marker="o")
        ax.set(title=f"{model} {q}: linears per token", ylabel="us / token", xscale="log")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    ax = axes[0][-1]
    if len(step):
        for (q, p), g in step.groupby(["quant", "path"]):
            ax.plot(g["rows"], g["tok_s"], marker="o", label=f"{q} {p}")
        ax.legend()
    ax.set(title="DecodeStep", ylabel="tokens / s", xscale="log")
    ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def notes(slug: str, ceilings: dict) -> str:
    cpu = "CPU SMOKE RUN (Triton interpreter, toy shapes, one wall-clock call): not a measurement. "
    return (cpu if slug == "cpu" else "") + (
        f"Device {slug}; activations bf16; copy bandwidth {ceilings['copy']:.0f} GB/s and bf16 "
        f"matmul {ceilings['matmul']:.0f} TFLOP/s measured in this run. decode_linear: the fused "
        "GEMVs (<= 64 rows); gemm: step_gemm (cuBLAS, or for fp8 cuBLASLt W8A8 with the "
        "quantizing kernels) with the fused norm / SwiGLU / RoPE kernels; triton_fp8: the same "
        "with the FP8 GEMMs on fp8_decode_gemm (swap-AB Triton, split-K). us: CUDA-graph replays "
        "over input copies larger than L2, paths in turn, median of 3 rounds."
    )


def write_all(out: Path, slug: str, ceilings: dict, blocks, step) -> None:
    layer = layer_table(blocks) if len(blocks) else pd.DataFrame()
    text = notes(slug, ceilings)
    if len(blocks):
        write_table(
            blocks, out, "decode_gemm_blocks", "Decode linears: decode_linear vs GEMM", text
        )
        write_table(layer, out, "decode_gemm_blocks_layer", "A step's linears per path", text)
        cross = crossovers(layer)
        write_json({"device": slug, "ceilings": ceilings, "crossovers": cross},
                   out / "decode_gemm_crossover.json")  # fmt: skip
    if len(step):
        write_table(step, out, "decode_gemm_step", "DecodeStep: decode_linear vs GEMM path", text)
    if len(blocks) or len(step):
        save_figure(
            plot(blocks, layer, step, f"Decode GEMM path on {slug}"), out / "decode_gemm.png"
        )


def run(a: argparse.Namespace, device: torch.device) -> dict:
    on_gpu = device.type == "cuda"
    slug = device_slug(device)
    out = a.out or results_dir(__file__, slug)
    out.mkdir(parents=True, exist_ok=True)
    if on_gpu:
        ceilings = {"copy": copy_bandwidth_gbps(device=str(device)),
                    "matmul": matmul_tflops(device=str(device))}  # fmt: skip
        models = {m: MODELS[m] for m in a.models}
    else:
        ceilings = {"copy": float("nan"), "matmul": float("nan")}
        models = {"tiny": TINY}
    print(f"{slug}: copy {ceilings['copy']:.0f} GB/s, bf16 matmul {ceilings['matmul']:.0f} TFLOP/s")
    blocks, step = pd.DataFrame(), pd.DataFrame()
    if "blocks" in a.sections:
        rows_out: list[dict] = []
        for name, m in models.items():
            for quant in a.quants:
                for shape in linear_shapes(name, m):
                    for r in a.rows:
                        rows_out += bench_block(shape, r, quant, device, ceilings)
                        if on_gpu:
                            torch.cuda.empty_cache()
                    blocks = pd.DataFrame(rows_out)
                    write_all(out, slug, ceilings, blocks, step)  # a cut run keeps these
                print(layer_table(blocks).to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    if "step" in a.sections:
        rows_out = []
        for quant in a.quants:
            rows_out += bench_step(quant, a.rows, device, ceilings["copy"], a.context)
            step = pd.DataFrame(rows_out)
            write_all(out, slug, ceilings, blocks, step)
    cross = crossovers(layer_table(blocks)) if len(blocks) else {}
    for k, v in cross.items():
        print(f"crossover {k}: GEMM path from {v['crossover_rows']} rows; "
              f"decode_linear / gemm time by rows {v['gemm_speedup_by_rows']}")  # fmt: skip
    print(f"results -> {out}")
    return {"blocks": blocks, "step": step, "crossovers": cross}


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ctx = (
        torch.cuda.stream(torch.cuda.Stream(device))
        if device.type == "cuda"
        else contextlib.nullcontext()
    )
    with ctx:
        return run(a, device)


if __name__ == "__main__":
    main()
