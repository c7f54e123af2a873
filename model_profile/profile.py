"""Where the time goes: torch.profiler traces of llama_org and Nakta scoring the same tasks.

Each engine (``llama_org``, ``nakta``, ``nakta_cache``, built through speed_bench's public
``engines`` module as ``speed_bench.run_all`` builds them) is built from the same weights,
warmed up, then profiled scoring one fixed set of HellaSwag-shaped tasks (the embedded
workload; 7B preset on a GPU, tiny on the CPU), or with ``--workload mmlu`` MMLU-shaped ones
whose 5-shot prefix is shared by every question of a subject (where the prefix cache works);
``--checkpoint`` profiles a Nakta, Meta or HF folder's weights instead. Outputs in
``model_profile/results/<device>/``:

* ``<engine>.pt.trace.json`` -- Chrome traces (open in chrome://tracing or Perfetto); large,
  git-ignored, never committed;
* ``kernels_<engine>.csv/.md`` -- top kernels (GPU) or ops (CPU): calls, total time, share;
* ``categories.csv/.md`` + ``profile.png`` -- time per engine split into GEMM, attention,
  elementwise (norms, RoPE, activations, casts, log-softmax...), memcpy and gaps;
* ``gemms_<engine>.csv/.md`` (GPU) -- each matmul shape's calls, time, TFLOP/s and fraction of
  the ``n x n x n`` bf16 matmul rate measured in the same run: what the GEMMs leave on the table
  apart from the other categories;
* ``summary.json``.

GPU: the device timeline (kernels, copies) over the profiled span; ``gaps`` is the time the
GPU sat idle between them (launch overhead and host work the GPU waited for). CPU: self time
of each aten op; ``gaps`` is wall time outside any op (Python). A kernel is put in a category
by the aten op that launched it (``aten::mm`` -> GEMM, ``aten::bmm``/``softmax``/SDPA ->
attention), else by its name (``gemm``/``nvjet``/``cutlass`` -> GEMM, ``flash``/``fmha`` ->
attention).

    python -m model_profile.profile [--preset 7B] [--tasks 64] [--workload mmlu] [--shots 10]
    python -m model_profile.profile --checkpoint CKPT     # convert.py's output, Meta or HF
    python model_profile/profile.py ...        # by path works too (also from model_profile/)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

if not __package__:  # run by path: import from the repo root, not from this script's folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import pandas as pd
import torch

from bench_common.ceilings import device_slug
from bench_common.report import results_dir, save_figure, write_json, write_table
from nakta_model.io_utils import atomic_output_file

CATEGORIES = ("gemm", "attention", "elementwise", "memcpy", "gaps")
DEFAULT_ENGINES = ("llama_org", "nakta", "nakta_cache")

_GEMM_OPS = {"aten::mm", "aten::addmm", "aten::linear", "aten::_addmm_activation"}
_ATTN_OPS = re.compile(
    r"aten::(bmm|baddbmm|_?softmax|scaled_dot_product|_scaled_dot_product|_flash_attention|"
    r"_efficient_attention|_cudnn_attention)"
)
_GEMM_NAME = re.compile(r"gemm|nvjet|cutlass|cublas|xmma|wgmma|s16816|matmul", re.I)
_ATTN_NAME = re.compile(r"flash|fmha|attention|attn|softmax", re.I)
_COPY_NAME = re.compile(r"^memcpy|^memset|^Memcpy|^Memset", re.I)


def categorize(name: str, op: str | None) -> str:
    """GEMM / attention / elementwise / memcpy for one kernel (or CPU op) and its aten op."""
    if _COPY_NAME.search(name):
        return "memcpy"
    if op is not None:
        if _ATTN_OPS.match(op):
            return "attention"
        if op in _GEMM_OPS:
            return "gemm"
    if _ATTN_NAME.search(name):
        return "attention"
    if _GEMM_NAME.search(name) or name in _GEMM_OPS:
        return "gemm"
    return "elementwise"


# ----------------------------------------------------------------------------- summaries
def _busy_union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``[start, end)`` intervals (overlapping streams count once)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _mm_shape(op: str, dims) -> tuple[int, int, int] | None:
    """``(M, K, N)`` of an ``aten::mm`` / ``aten::addmm`` from its recorded input dims."""
    if not isinstance(dims, list):
        return None
    mats = [d for d in dims if isinstance(d, list) and len(d) == 2]
    if op not in ("aten::mm", "aten::addmm") or len(mats) < 2:
        return None
    (m, k), (k2, n) = mats[-2], mats[-1]
    return (m, k, n) if k == k2 else None


def summarize_gemms(trace: dict, peak_tflops: float | None) -> pd.DataFrame:
    """Per matmul shape: calls, device time, TFLOP/s (2 M K N per call) and share of ``peak``.

    Needs a trace recorded with ``record_shapes=True``; kernels of one op call are summed."""
    events = trace["traceEvents"]
    shape_of: dict[int, tuple[int, int, int]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op":
            args = e.get("args", {})
            mnk = _mm_shape(e["name"], args.get("Input Dims"))
            if mnk is not None and args.get("External id") is not None:
                shape_of[args["External id"]] = mnk
    rows: dict[tuple[int, int, int], dict] = {}
    calls: dict[tuple[int, int, int], set] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "kernel":
            continue
        ext = e.get("args", {}).get("External id")
        mnk = shape_of.get(ext)
        if mnk is None:
            continue
        m, k, n = mnk
        r = rows.setdefault(mnk, {"M": m, "K": k, "N": n, "calls": 0, "total_us": 0.0})
        calls.setdefault(mnk, set()).add(ext)
        r["total_us"] += float(e.get("dur", 0.0))
    cols = ["M", "K", "N", "calls", "total_ms", "avg_us", "tflops", "of_peak", "share"]
    if not rows:
        return pd.DataFrame(columns=cols)
    for mnk, r in rows.items():
        r["calls"] = len(calls[mnk])
    df = pd.DataFrame(list(rows.values()))
    df["total_ms"] = df["total_us"] / 1e3
    df["avg_us"] = df["total_us"] / df["calls"]
    df["tflops"] = 2 * df["M"] * df["K"] * df["N"] * df["calls"] / (df["total_us"] * 1e-6) / 1e12
    df["of_peak"] = df["tflops"] / peak_tflops if peak_tflops else float("nan")
    df["share"] = df["total_us"] / df["total_us"].sum()
    return df.sort_values("total_us", ascending=False)[cols]


def summarize_gpu_trace(trace: dict) -> tuple[pd.DataFrame, dict[str, float]]:
    """Per-kernel table and per-category microseconds from a Chrome trace's device events."""
    events = trace["traceEvents"]
    ext_op: dict[int, str] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op":
            ext = e.get("args", {}).get("External id")
            if ext is not None:
                ext_op[ext] = e["name"]  # later (inner) ops overwrite outer ones
    rows: dict[str, dict] = {}
    intervals = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        name, dur = e["name"], float(e.get("dur", 0.0))
        op = ext_op.get(e.get("args", {}).get("External id"))
        cat = "memcpy" if e["cat"] != "kernel" else categorize(name, op)
        r = rows.setdefault(name, {"name": name, "op": op or "", "category": cat, "calls": 0,
                                   "total_us": 0.0})  # fmt: skip
        r["calls"] += 1
        r["total_us"] += dur
        intervals.append((float(e["ts"]), float(e["ts"]) + dur))
    df = pd.DataFrame(list(rows.values()), columns=["name", "op", "category", "calls", "total_us"])
    cats = {c: 0.0 for c in CATEGORIES}
    for r in rows.values():
        cats[r["category"]] += r["total_us"]
    if intervals:
        span = max(e for _, e in intervals) - min(s for s, _ in intervals)
        cats["gaps"] = max(0.0, span - _busy_union(intervals))
    return df, cats


def summarize_cpu_profile(prof, wall_us: float) -> tuple[pd.DataFrame, dict[str, float]]:
    """Per-op self time (no double counting of nested ops) and per-category microseconds."""
    rows = []
    for e in prof.key_averages():
        if e.self_cpu_time_total <= 0 or not e.key.startswith("aten::"):
            continue
        rows.append({"name": e.key, "op": e.key, "category": categorize(e.key, e.key),
                     "calls": e.count, "total_us": float(e.self_cpu_time_total)})  # fmt: skip
    df = pd.DataFrame(rows, columns=["name", "op", "category", "calls", "total_us"])
    cats = {c: 0.0 for c in CATEGORIES}
    for r in rows:
        cats[r["category"]] += r["total_us"]
    cats["gaps"] = max(0.0, wall_us - sum(cats.values()))
    return df, cats


def top_table(df: pd.DataFrame, cats: dict[str, float], top: int) -> pd.DataFrame:
    total = sum(cats.values()) or 1.0
    df = df.sort_values("total_us", ascending=False).head(top).copy()
    df["name"] = df["name"].map(lambda s: s if len(s) <= 90 else s[:87] + "...")
    df["total_ms"] = df["total_us"] / 1e3
    df["avg_us"] = df["total_us"] / df["calls"].clip(lower=1)
    df["share"] = df["total_us"] / total
    return df[["name", "op", "category", "calls", "total_ms", "avg_us", "share"]]


# ----------------------------------------------------------------------------- profiling
def profile_engine(engine, requests, device: torch.device, trace_path: Path):
    """Warm up, then profile one scoring pass; returns (per-kernel df, categories, wall ms,
    the trace as a dict on GPU else None)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    engine.score(requests)  # warm-up: compilation, autotuning, allocator growth
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with profile(activities=activities, record_shapes=device.type == "cuda") as prof:
        t0 = time.perf_counter()
        engine.score(requests)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall_us = (time.perf_counter() - t0) * 1e6
    with atomic_output_file(trace_path) as tmp:
        prof.export_chrome_trace(str(tmp))
    trace = None
    if device.type == "cuda":
        trace = json.loads(trace_path.read_text())
        df, cats = summarize_gpu_trace(trace)
    else:
        df, cats = summarize_cpu_profile(prof, wall_us)
    return df, cats, wall_us / 1e3, trace


def plot(cat_df: pd.DataFrame, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    table = cat_df.pivot_table(index="engine", columns="category", values="ms", sort=False)
    table = table[[c for c in CATEGORIES if c in table.columns]]
    table.plot.barh(stacked=True, ax=ax, width=0.6)
    ax.set_xlabel("ms (device timeline on GPU; self CPU time on CPU)")
    ax.set_ylabel("")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    return fig


def _weights(args: argparse.Namespace, on_gpu: bool):
    """The checkpoint's weights (Nakta, Meta or HF folder) or a preset's random ones; one that
    does not load is an ``InputError`` (one ``error:`` line)."""
    from nakta_model.cli import InputError, checkpoint_errors, require_checkpoint
    from speed_bench.weights import weight_source

    if args.checkpoint is None:
        name = args.preset or ("7B" if on_gpu else "tiny")
        try:
            return weight_source(name, None)
        except ValueError as e:
            raise InputError(f"--preset {name}: {e}") from e
    require_checkpoint(args.checkpoint)
    with checkpoint_errors(args.checkpoint):
        return weight_source(None, args.checkpoint)


def main(argv: list[str] | None = None) -> dict:
    from nakta_model.cli import exit_on_input_error
    from speed_bench.engines import EngineConfig, make_engine
    from speed_bench.workload import mmlu_shaped_workload, synthetic_workload

    p = argparse.ArgumentParser(description="Profile llama_org and Nakta on the same tasks.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help="random weights of this shape (default 7B GPU, tiny CPU)")
    src.add_argument("--checkpoint", type=Path, help="Nakta, Meta or HF checkpoint folder")
    p.add_argument("--tasks", type=int, help="tasks (default 64 GPU / 4 CPU)")
    p.add_argument(
        "--workload",
        choices=("hellaswag", "mmlu"),
        default="hellaswag",
        help="HellaSwag-shaped tasks, or MMLU-shaped ones (5-shot prefixes shared per subject)",
    )
    p.add_argument(
        "--shots", type=int, default=0, help="hellaswag workload: few-shot examples per task"
    )
    p.add_argument("--engines", default=",".join(DEFAULT_ENGINES))
    p.add_argument("--token-budget", type=int, help="default 16384 GPU / 2048 CPU")
    p.add_argument("--top", type=int, default=25, help="rows of the per-kernel tables")
    p.add_argument("--device", default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    weights = exit_on_input_error(_weights, args, on_gpu)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    if args.shots and args.workload != "hellaswag":
        p.error("--shots goes with --workload hellaswag (MMLU-shaped tasks are 5-shot)")
    n_tasks = args.tasks or (64 if on_gpu else 4)
    vocab, max_len = weights.args.vocab_size, weights.args.max_seq_len
    if args.workload == "mmlu":
        workload = mmlu_shaped_workload(n_tasks, vocab, 0, max_len)
    else:
        workload = synthetic_workload(n_tasks, vocab, 0, max_len, shots=args.shots)
    cfg = EngineConfig(
        device=device,
        dtype=dtype,
        token_budget=args.token_budget or (16384 if on_gpu else 2048),
        max_length=weights.args.max_seq_len,
        progress=False,
    )
    slug = device_slug(device)
    out = args.out or results_dir(__file__, slug)
    out.mkdir(parents=True, exist_ok=True)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    peak = None
    if on_gpu:
        from bench_common.ceilings import matmul_tflops

        peak = matmul_tflops(device=str(device))
        print(f"measured bf16 matmul peak {peak:.0f} TFLOP/s")
    shared: dict = {}
    cat_rows, summary = [], {}
    for name in engines:
        engine = make_engine(name, weights, cfg, shared)
        df, cats, wall_ms, trace = profile_engine(
            engine, workload.requests, device, out / f"{name}.pt.trace.json"
        )
        gemms = summarize_gemms(trace, peak) if trace is not None else None
        del trace
        if gemms is not None and len(gemms):
            write_table(
                gemms,
                out,
                f"gemms_{name}",
                f"Matmul shapes: {name}",
                f"{weights.name}, {workload.n_tasks} tasks, {slug}. tflops = 2 M K N x calls / "
                f"device time; of_peak against the {peak:.0f} TFLOP/s of an 8192^3 bf16 matmul "
                "measured in this run; share = of all matmul time.",
            )
        engine.close()
        del engine
        if not any(e.startswith("nakta") for e in engines[engines.index(name) + 1 :]):
            shared.clear()
        if on_gpu:
            torch.cuda.empty_cache()
        total = sum(cats.values()) or 1.0
        top = top_table(df, cats, args.top)
        write_table(
            top,
            out,
            f"kernels_{name}",
            f"Top {'kernels' if on_gpu else 'ops'}: {name}",
            f"{weights.name}, {workload.n_tasks} tasks ({workload.request_tokens()} lm-eval "
            f"tokens), {slug}. share = fraction of the engine's profiled time "
            f"({total / 1e3:.1f} ms incl. gaps).",
        )
        for c in CATEGORIES:
            cat_rows.append({"engine": name, "category": c, "ms": cats[c] / 1e3,
                             "share": cats[c] / total})  # fmt: skip
        summary[name] = {
            "wall_ms": wall_ms,
            "profiled_ms": total / 1e3,
            "categories_ms": {c: cats[c] / 1e3 for c in CATEGORIES},
            "top": top.head(10).to_dict("records"),
        }
        if gemms is not None and len(gemms):
            t = gemms["total_ms"].sum()
            flop = float((2 * gemms["M"] * gemms["K"] * gemms["N"] * gemms["calls"]).sum())
            summary[name]["gemm_tflops"] = flop / (t * 1e-3) / 1e12
            summary[name]["gemm_of_peak"] = summary[name]["gemm_tflops"] / peak
        print(f"[{name}] {wall_ms:.1f} ms wall; " + ", ".join(
            f"{c} {100 * cats[c] / total:.0f}%" for c in CATEGORIES))  # fmt: skip
    cat_df = pd.DataFrame(cat_rows)
    write_table(
        cat_df,
        out,
        "categories",
        "Time by category",
        f"{weights.name}, {workload.n_tasks} {args.workload}-shaped tasks, {slug}. gaps = device "
        "idle inside the profiled span (GPU) or time outside aten ops (CPU).",
    )
    import matplotlib.pyplot as plt

    fig = plot(cat_df, f"{weights.name}, {workload.n_tasks} tasks on {slug}")
    save_figure(fig, out / "profile.png")
    plt.close(fig)
    result = {"device": slug, "model": weights.name, "workload": args.workload,
              "peak_matmul_tflops": peak,
              "tasks": workload.n_tasks, "unique_tokens": workload.unique_tokens(),
              "engines": summary}  # fmt: skip
    write_json(result, out / "summary.json")
    print(f"results -> {out} (Chrome traces *.pt.trace.json are not committed)")
    return result


if __name__ == "__main__":
    main()
