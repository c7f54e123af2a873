"""Where a decode step's time goes in the chain itself: the engine's CUDA-graph decode
(dependent launches, early weight tiles and all) under ``torch.profiler``, kernel by kernel.

``speed_bench.decode_speed``'s budget times each launch alone; here the launches overlap as
they do in a run, so a kernel's own duration says little (under PDL its blocks start early and wait).
What each adds to the step is its *increment*: its end minus the previous kernel's end. Per
launch kind (wqkv / attention / wo / w13 / w2 and, on the GEMM path from 8 rows, the other
launches of a layer; found by their order in a layer; the step's tail: its inputs, the LM head,
the next token) the increments' sum a step is set beside the kind's
byte floor a step (the bytes it must read over the copy bandwidth measured in this run; the
tail's: the LM head's, once). Outputs in
``model_profile/results/<device>/decode_b<batch>[_fp8]/``: ``timeline.csv`` / ``timeline.md``,
``timeline.png`` and ``summary.json`` (step time, its floor, tok/s under the profiler).

    python -m model_profile.decode_timeline [--preset 7B] [--quant fp8] [--batch 1]
        [--prompt 64] [--gen 64] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run by path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd
import torch

from bench_common.ceilings import copy_bandwidth_gbps, device_slug
from bench_common.report import results_dir, save_figure, write_json, write_table

LAYER_KINDS = ("wqkv", "attention", "wo", "w13", "w2", "other")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="7B")
    p.add_argument("--quant", choices=["fp8"], default=None, help="the FP8 model (e4m3 weights)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    p.add_argument("--gen", type=int, default=64, help="new tokens profiled")
    p.add_argument("--batch", type=int, default=1, help="rows decoded together")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--dump", action="store_true", help="also write every kernel (kernels.csv)")
    a = p.parse_args(argv)
    for name in ("prompt", "gen", "batch"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(a, name)}")
    if a.gen < 8:
        p.error(f"--gen must be >= 8 (steady steps are averaged), got {a.gen}")
    return a


# ----------------------------------------------------------------------------- the timeline
def kernels_from_trace(trace: dict) -> list[dict]:
    """The trace's GPU kernels in start order: name, start and end in microseconds."""
    rows = [{"name": e["name"], "start": float(e["ts"]), "end": float(e["ts"]) + float(e["dur"])}
            for e in trace.get("traceEvents", [])
            if e.get("cat") == "kernel" and "dur" in e]  # fmt: skip
    return sorted(rows, key=lambda r: r["start"])


def _is_linear(name: str) -> bool:
    return "decode_linear" in name


def _is_attention(name: str) -> bool:
    return "_attn_" in name or "decode_attention" in name


def label_kernels(kernels: list[dict]) -> list[str]:
    """A kind per kernel by its place in a decode layer: the linear launched right before
    attention is ``wqkv``, the first after it ``wo``, then ``w13`` and ``w2``; attention's
    launches (split, combine, prefix) ``attention``; everything else ``tail`` (the LM head,
    sampling and bookkeeping between steps, and the prefill before the first step)."""
    labels = ["tail"] * len(kernels)
    after = None  # the last layer kind seen
    for i, k in enumerate(kernels):
        name = k["name"]
        nxt = kernels[i + 1]["name"] if i + 1 < len(kernels) else ""
        if _is_attention(name):
            labels[i], after = "attention", "attention"
        elif _is_linear(name) and _is_attention(nxt):
            labels[i], after = "wqkv", "wqkv"
        elif _is_linear(name) and after in ("attention", "wo", "w13"):
            labels[i] = after = {"attention": "wo", "wo": "w13", "w13": "w2"}[after]
        else:
            after = None
    return labels


MATMUL_KINDS = ("wqkv", "wo", "w13", "w2")


def _is_matmul(name: str) -> bool:
    from model_profile.profile import categorize

    return _is_linear(name) or categorize(name, None) == "gemm"


def label_by_layer(kernels: list[dict], n_layers: int) -> list[str] | None:
    """Kinds for a step of any batch (GEMVs or GEMMs, fused or not): a step starts at its
    ``step_inputs`` launch and holds ``n_layers`` equal runs of launches (the spacing of its
    attention split launches), then the tail. In a layer the matmul launches, in order, are
    ``wqkv``, ``wo``, ``w13``, ``w2`` (a cuBLAS split-K reduction counts with its GEMM);
    attention's launches ``attention``; the rest ``other`` (norms, RoPE, SwiGLU, quantization,
    residual adds). A step that does not read so is left ``tail`` (``steps_of`` drops it);
    None where none does (the step kernels off: ``label_kernels`` then)."""
    labels = ["tail"] * len(kernels)
    starts = [i for i, k in enumerate(kernels) if "step_inputs" in k["name"]]
    if not starts:
        return None
    found = False
    for s, e in zip(starts, starts[1:] + [len(kernels)], strict=True):
        attn = [i for i in range(s, e) if "_attn_split" in kernels[i]["name"]]
        gaps = {b - a for a, b in zip(attn, attn[1:], strict=False)}
        if len(attn) != n_layers or len(gaps) > 1:
            continue
        period = gaps.pop() if gaps else e - s - 1
        first = s + 1
        layers = [range(first + i * period, first + (i + 1) * period) for i in range(n_layers)]
        if layers[-1].stop > e:
            continue
        for layer in layers:
            names = {i: kernels[i]["name"] for i in layer}
            mm = [i for i in layer if _is_matmul(names[i]) and "splitKreduce" not in names[i]]
            if len(mm) != len(MATMUL_KINDS):
                break
            for i in layer:
                labels[i] = "attention" if _is_attention(names[i]) else "other"
            for i, kind in zip(mm, MATMUL_KINDS, strict=True):
                labels[i] = kind
            for i in layer:  # cuBLAS's split-K reduction: part of the GEMM before it
                if "splitKreduce" in names[i] and labels[i - 1] in MATMUL_KINDS:
                    labels[i] = labels[i - 1]
        else:
            found = True
    return labels if found else None


def steps_of(kernels: list[dict], labels: list[str], n_layers: int) -> list[list[int]]:
    """Kernel indices per decode step: ``n_layers`` layers from a ``wqkv``, then the tail up
    to the next step's first ``wqkv``. Kernels before the first ``wqkv`` (prefill) and a step
    without all its layers are left out."""

    def run_starts(kind: str, lo: int = 0, hi: int = len(labels)) -> list[int]:
        # a kind's launches in a row are one matmul (a GEMM and its split-K reduction)
        return [i for i in range(lo, hi) if labels[i] == kind and (i == 0 or labels[i - 1] != kind)]

    starts = run_starts("wqkv")
    if not starts:
        return []
    firsts = starts[::n_layers]
    spans = zip(firsts, firsts[1:] + [len(kernels)], strict=True)
    return [list(range(s, e)) for s, e in spans
            if all(len(run_starts(kind, s, e)) == n_layers for kind in ("wqkv", "w2"))]  # fmt: skip


def increments(kernels: list[dict], labels: list[str], steps: list[list[int]]) -> pd.DataFrame:
    """Per kind over the steady steps (the first two and the last left out): calls a step, mean
    duration and mean increment (end minus the previous kernel's end) a call, in microseconds."""
    steady = steps[2:-1] if len(steps) > 4 else steps
    rows = []
    for idx in steady:
        for j in idx:
            prev_end = kernels[j - 1]["end"] if j > 0 else kernels[j]["start"]
            k = kernels[j]
            rows.append({"kind": labels[j], "dur_us": k["end"] - k["start"],
                         "inc_us": k["end"] - prev_end})  # fmt: skip
    df = pd.DataFrame(rows, columns=["kind", "dur_us", "inc_us"])
    g = df.groupby("kind")
    out = pd.DataFrame({"calls_per_step": g.size() / max(len(steady), 1),
                        "mean_dur_us": g["dur_us"].mean(), "mean_inc_us": g["inc_us"].mean()})  # fmt: skip
    out["step_us"] = out["calls_per_step"] * out["mean_inc_us"]
    return out


def floors_us(model, context: float, bw_gbps: float, batch: int = 1) -> dict[str, float]:
    """Bytes each kind must read a layer (weights with their scales; ``batch`` rows' K/V at
    ``context``) over the copy bandwidth, in microseconds; ``tail`` is the LM head's (and final
    norm's) weights; ``other`` (activations only) 0."""

    def nbytes(module) -> int:
        ts = list(module.parameters()) + list(module.buffers())
        return sum(t.numel() * t.element_size() for t in ts)

    layer, args = model.layers[0], model.args
    kv_elem = torch.empty((), dtype=model.dtype).element_size()
    per = {
        "wqkv": nbytes(layer.attention.wqkv),
        "attention": 2 * args.n_kv_heads * args.head_dim * context * kv_elem * batch,
        "wo": nbytes(layer.attention.wo),
        "w13": nbytes(layer.feed_forward.w13),
        "w2": nbytes(layer.feed_forward.w2),
        "tail": nbytes(model.output) + nbytes(model.norm),
        "other": 0,
    }
    return {k: v / (bw_gbps * 1e3) for k, v in per.items()}


def with_floors(df: pd.DataFrame, floors: dict[str, float], n_layers: int) -> pd.DataFrame:
    """``increments``' table in layer order with each kind's floor a step (a layer kind's bytes
    once a layer, however many launches it takes: split-K reductions, attention's combine; the
    tail's, the LM head's, once), its share and its loss."""
    order = [k for k in (*LAYER_KINDS, "tail") if k in df.index]
    df = df.loc[order].reset_index().rename(columns={"index": "kind"})
    per_layer = df["kind"].map(floors)
    df["floor_step_us"] = per_layer.where(df["kind"] == "tail", per_layer * n_layers)
    df["pct_of_floor"] = 100 * df["floor_step_us"] / df["step_us"]
    df["loss_us_per_step"] = df["step_us"] - df["floor_step_us"]
    return df


# ----------------------------------------------------------------------------- main
def _plot(df: pd.DataFrame, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    x = range(len(df))
    ax.bar([i - 0.2 for i in x], df["step_us"], 0.4, label="time in the chain")
    ax.bar([i + 0.2 for i in x], df["floor_step_us"], 0.4, label="byte floor", color="lightgray")
    ax.set_xticks(list(x), df["kind"])
    ax.set_ylabel("us a step")
    ax.set_title(title, fontsize=9)
    ax.legend()
    save_figure(fig, path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_timeline needs a CUDA GPU (it profiles device kernels)")
    from nakta_model.generation import Generator, greedy_requests
    from nakta_model.loading import load
    from speed_bench.weights import weight_source

    device = torch.device("cuda")
    weights = weight_source(a.preset, None, a.seed)
    model = load(weights.source(device, torch.bfloat16), device, torch.bfloat16, quant=a.quant)
    gen = Generator(model, max_batch=a.batch, max_seq_len=a.prompt + a.gen + 8)
    g = torch.Generator().manual_seed(a.seed)
    vocab = weights.args.vocab_size
    prompts = [[1] + torch.randint(3, vocab, (a.prompt - 1,), generator=g).tolist()
               for _ in range(a.batch)]  # fmt: skip

    def run(n: int) -> None:
        gen.generate(greedy_requests(prompts, n, eos_id=None))

    bw = copy_bandwidth_gbps(device="cuda")
    run(8)  # compile, capture, allocate
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        run(a.gen)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace_path))
        kernels = kernels_from_trace(json.loads(trace_path.read_text()))
    labels = label_by_layer(kernels, model.args.n_layers) or label_kernels(kernels)
    slug = device_slug(device)
    name = f"decode_b{a.batch}" + ("_fp8" if a.quant else "")
    out = a.out or results_dir(__file__, slug) / name
    out.mkdir(parents=True, exist_ok=True)
    if a.dump:  # before the reading, so that a trace it cannot read is there to look at
        dump = pd.DataFrame(kernels).assign(kind=labels)
        write_table(dump, out, "kernels", "Every kernel of the profiled run, in start order")
    steps = steps_of(kernels, labels, model.args.n_layers)
    if len(steps) < 4:
        raise SystemExit(
            f"decode_timeline: found {len(steps)} decode steps in the trace, need 4+ (a layer "
            "must read as four matmul launches around attention; --dump lists the kernels)"
        )
    df = increments(kernels, labels, steps)
    floors = floors_us(model, a.prompt + a.gen / 2, bw, a.batch)
    df = with_floors(df, floors, model.args.n_layers)
    step_us = float(df["step_us"].sum())
    floor_step = float(df["floor_step_us"].sum())
    what = f"random {a.preset}, {'FP8' if a.quant else 'bf16'}, batch {a.batch}, prompt {a.prompt}"
    notes = (
        f"{what}, {a.gen} new tokens under torch.profiler; {slug}, copy bandwidth {bw:.0f} GB/s "
        f"measured in this run; {len(steps)} steps found, the steady ones averaged. increment = "
        "a kernel's end minus the previous kernel's end (what it adds to the chain); floor = "
        f"the bytes it must read over the copy bandwidth. Step {step_us:.0f} us against a "
        f"{floor_step:.0f} us floor ({100 * floor_step / step_us:.1f}%)."
    )
    write_table(df, out, "timeline", "A decode step, kernel by kernel, in the chain", notes)
    _plot(df, out / "timeline.png", what)
    summary = {
        "device": slug, "preset": a.preset, "quant": a.quant, "batch": a.batch,
        "prompt": a.prompt, "gen": a.gen,
        "copy_gbps": bw, "steps_found": len(steps), "step_us": step_us,
        "floor_step_us": floor_step, "tok_s_under_profiler": a.batch * 1e6 / step_us,
        "kinds": df.to_dict(orient="records"),
    }  # fmt: skip
    write_json(summary, out / "summary.json")

    print(df.to_string(index=False))
    print(notes)
    return summary


if __name__ == "__main__":
    main()
