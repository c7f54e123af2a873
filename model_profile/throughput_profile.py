"""Where a throughput run's GPU time goes: ``speed_bench.throughput``'s nakta engine (N prompts,
greedy, EOS ignored, one ``Generator`` call) under ``torch.profiler``, kernel by kernel.

The decode step runs as CUDA-graph replays, so its kernels have no aten op to name them: each
kernel is put in a category by its name (GEMM / attention / elementwise, as
``model_profile.profile`` does). Outputs in ``model_profile/results/<device>/throughput/``:
``kernels.csv`` / ``kernels.md`` (calls, total and mean device time, share of the summed kernel
time) and ``summary.json`` (wall, the engine's own prefill / decode split and steps, kernel time
per category, and the summed kernel time against the wall: the rest is the GPU idle between
kernels). No trace file is written: a 10 s run holds ~10^5 kernels.

    python -m model_profile.throughput_profile [--prompts 1000] [--input-len 128]
        [--output-len 128] [--max-batch 256] [--preset 7B]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run by path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd
import torch

from bench_common.ceilings import device_slug
from bench_common.report import results_dir, write_json
from model_profile.profile import CATEGORIES, categorize
from nakta_model.io_utils import atomic_output_file, atomic_write_text


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="7B")
    p.add_argument("--prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument(
        "--shared-prefix", type=int, default=0,
        help="every prompt starts with the same N tokens (a few-shot prompt: GSM8K-shaped runs)",
    )  # fmt: skip
    p.add_argument("--quant", choices=["fp8"], default=None, help="the FP8 model (e4m3 weights)")
    p.add_argument("--top", type=int, default=25, help="kernels in kernels.md")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    for name in ("prompts", "input_len", "output_len", "max_batch", "top"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if not 0 <= a.shared_prefix < a.input_len:
        p.error(f"--shared-prefix must be in [0, --input-len), got {a.shared_prefix}")
    return a


def kernel_table(prof) -> pd.DataFrame:
    """Per kernel name: calls and device microseconds (CUDA events only)."""
    rows = []
    for e in prof.key_averages():
        us = float(getattr(e, "self_device_time_total", 0.0) or 0.0)
        if us <= 0 or e.key.startswith(("aten::", "cuda")):  # host-side ops and API calls
            continue
        rows.append({"name": e.key, "category": categorize(e.key, None), "calls": e.count,
                     "total_us": us})  # fmt: skip
    df = pd.DataFrame(rows, columns=["name", "category", "calls", "total_us"])
    df = df.sort_values("total_us", ascending=False).reset_index(drop=True)
    total = df["total_us"].sum() or 1.0
    df["total_ms"] = df["total_us"] / 1e3
    df["mean_us"] = df["total_us"] / df["calls"].clip(lower=1)
    df["share"] = df["total_us"] / total
    return df


def main(argv: Sequence[str] | None = None) -> dict:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("throughput_profile needs a CUDA GPU (it profiles device kernels)")
    from torch.profiler import ProfilerActivity, profile

    from nakta_model.config import PRESETS
    from speed_bench.throughput import make_workload
    from speed_bench.throughput_engines import NaktaThroughput
    from speed_bench.weights import RandomWeights

    if a.preset not in PRESETS:
        raise SystemExit(f"--preset must be one of {sorted(PRESETS)}, got {a.preset!r}")
    device, dtype = torch.device("cuda"), torch.bfloat16
    weights = RandomWeights(PRESETS[a.preset], a.preset, seed=0)
    work = make_workload(a.prompts, a.input_len, a.output_len, weights.args.vocab_size, 0)
    if a.shared_prefix:  # BOS + the first prompt's ids, then each prompt's own
        head = work.prompts[0][: a.shared_prefix]
        work.prompts[:] = [head + p[a.shared_prefix :] for p in work.prompts]
    max_seq = -(-(a.input_len + a.output_len + 1) // 64) * 64
    engine = NaktaThroughput(weights, device, dtype, max_seq, quant=a.quant)
    engine.warm_up(work.prompts, work.outputs, a.max_batch)
    engine.run(work.prompts, work.outputs, a.max_batch)  # the first call's allocations
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        outcome = engine.run(work.prompts, work.outputs, a.max_batch)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    df = kernel_table(prof)
    cats = {c: float(df.loc[df["category"] == c, "total_us"].sum()) / 1e3 for c in CATEGORIES}
    busy_ms = float(df["total_us"].sum()) / 1e3
    stats = outcome.stats or {}
    summary = {
        "device_name": torch.cuda.get_device_name(),
        "preset": a.preset,
        "prompts": a.prompts,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "max_batch": a.max_batch,
        "shared_prefix": a.shared_prefix,
        "quant": a.quant,
        "wall_s": wall,
        "output_tok_s": sum(work.outputs) / wall,
        "prefill_s": stats.get("prefill_s"),
        "decode_s": stats.get("decode_s"),
        "decode_steps": stats.get("decode_steps"),
        "kernel_ms_by_category": cats,
        "kernel_ms": busy_ms,
        "idle_ms": max(0.0, wall * 1e3 - busy_ms),
        "note": "profiler on: its overhead is in wall_s; kernel times are device times",
    }
    name = f"throughput_{a.quant}" if a.quant else "throughput"
    out = a.out or results_dir(__file__, device_slug(device)) / name
    out.mkdir(parents=True, exist_ok=True)
    with atomic_output_file(out / "kernels.csv") as tmp:
        df.to_csv(tmp, index=False)
    top = df.head(a.top).copy()
    top["name"] = top["name"].map(lambda s: s if len(s) <= 90 else s[:87] + "...")
    md = (
        f"# Throughput run, kernel by kernel\n\n{summary['device_name']}, {a.preset} bf16 random "
        f"weights, {a.prompts} prompts {a.input_len}/{a.output_len} (shared prefix "
        f"{a.shared_prefix}), max_batch {a.max_batch}: "
        f"wall {wall:.2f} s under the profiler ({summary['output_tok_s']:.0f} tok/s), kernels "
        f"{busy_ms:.0f} ms ("
        + ", ".join(f"{c} {v:.0f}" for c, v in cats.items() if v)
        + ")\n\n"
        + top[["name", "category", "calls", "total_ms", "mean_us", "share"]].to_markdown(
            index=False, floatfmt=".3g"
        )
        + "\n"
    )
    atomic_write_text(out / "kernels.md", md)
    write_json(summary, out / "summary.json")
    print(md)
    return summary


if __name__ == "__main__":
    main()
