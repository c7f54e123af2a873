"""Generation at throughput scale: N prompts through each engine, output tokens/s and latency.

    python -m speed_bench.throughput                                  # 7B on a GPU, tiny on the CPU
    python -m speed_bench.throughput --prompts 1000 --input-len 128 --output-len 128 \\
        --max-batch 64,128,256 --engines nakta,hf --hf-batches 32,64
    python -m speed_bench.throughput --lengths uniform:64-256/64-256

Workload: ``--prompts`` requests of BOS + seeded random token ids (``--seed``). Lengths are fixed
(``--input-len``, ``--output-len``: every prompt that long, BOS included, and that many new
tokens each) or, with ``--lengths uniform:A-B/C-D``, drawn per request independently and
uniformly from the integers A..B (prompt length) and C..D (new tokens), both ends included, from
the same seeded generator. Greedy decoding, EOS ignored (it never stops a row): every request
gets exactly its new tokens.

Engines (``speed_bench/throughput_engines.py``): ``nakta`` (one ``Generator(max_batch=B)`` call,
continuous batching, for each B of ``--max-batch``), ``nakta_fp8`` (the same on the FP8 model;
not run unless named), ``hf`` (``transformers`` generate with a
static cache over batches of each B of ``--hf-batches``; skipped with the reason when
``transformers`` is missing), ``llama_org`` (Meta's loop over batches of each B of
``--max-batch``). A ``max_batch`` an engine refuses (``Generator``: above the decode step's ``max_rows()``) is
skipped with its error, the other runs go on. Each run is warmed up first (compilation, graph
capture, allocation), then timed from outside as one call over all requests.

Per run: ``output_tok_s`` = new tokens asked for / wall seconds (a batched engine that decodes
a row past its request's length gets no credit for it); ``requests_s``; time to first token per
request, host side, from the start of the call until that request's first new token is known on
the host (median and p99); ``peak_mem_gb`` (``torch.cuda.max_memory_allocated``, 1e9 bytes; null
off the GPU); for nakta ``step_floor_pct``: the byte floor of its mean decode step (the weights
once + the K/V the mean step reads, at the mean rows in flight and mean context,
``decode_speed.step_bytes``) over the copy bandwidth measured in this run, as a percentage of the
mean decode step's measured time (``Generator.stats``: decode seconds / decode steps).

Writes to ``--out`` (after every run, so a run cut short keeps the finished ones) (default ``speed_bench/results/<device>/throughput/``):
``throughput_summary.json`` (``{"device_name", "runs": [{"engine", "prompts", "input_len",
"output_len", "max_batch", "output_tok_s", "requests_s", "ttft_median_s", "ttft_p99_s",
"peak_mem_gb", "step_floor_pct"}]}``; lengths are ints, or the ``uniform:A-B`` spec when drawn),
``throughput.md`` / ``.csv`` (those columns plus wall, prefill / decode split and the floor
terms) and ``throughput.png`` (output tok/s against max_batch, one line per engine).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run by path: import from the repo root, not from this script's folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import gc
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
import torch

from bench_common.ceilings import copy_bandwidth_gbps, device_slug
from bench_common.report import results_dir, save_figure, write_json, write_table
from nakta_model.cli import InputError, OneLineArgumentParser, exit_on_input_error
from speed_bench.decode_speed import _DTYPES, _skip, _weights, step_bytes
from speed_bench.throughput_engines import BUILDERS, Outcome

ENGINES = ("nakta", "nakta_fp8", "nakta_kv8", "nakta_fp8_kv8", "hf", "llama_org")
DEFAULT_ENGINES = ("nakta", "hf", "llama_org")
SUMMARY_KEYS = (
    "engine", "prompts", "input_len", "output_len", "max_batch", "output_tok_s", "requests_s",
    "ttft_median_s", "ttft_p99_s", "peak_mem_gb", "step_floor_pct",
)  # fmt: skip
_UNIFORM = re.compile(r"uniform:(\d+)-(\d+)/(\d+)-(\d+)")


@dataclass
class Workload:
    prompts: list[list[int]]
    outputs: list[int]
    input_label: int | str  # the fixed length, or the distribution it was drawn from
    output_label: int | str


def parse_args(argv: Sequence[str] | None):
    p = OneLineArgumentParser(
        prog="python -m speed_bench.throughput", description=__doc__.split("\n\n")[0]
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help="random weights of this shape (default 7B on a GPU, tiny)")
    src.add_argument("--checkpoint", type=Path, help="Nakta, Meta or HF checkpoint folder")
    p.add_argument("--prompts", type=int, help="number of requests (default 1000; CPU 12)")
    p.add_argument("--input-len", type=int, help="prompt tokens, BOS included (128; CPU 8)")
    p.add_argument("--output-len", type=int, help="new tokens per request (128; CPU 8)")
    p.add_argument(
        "--lengths", help="uniform:A-B/C-D: prompt and output lengths drawn per request "
        "uniformly from A..B and C..D (instead of --input-len / --output-len)",
    )  # fmt: skip
    p.add_argument(
        "--engines", default=",".join(DEFAULT_ENGINES), help="nakta,hf,llama_org (nakta_fp8: FP8)"
    )
    p.add_argument(
        "--max-batch", help="rows in flight for nakta and llama_org, comma-separated (64; CPU 4)"
    )
    p.add_argument("--hf-batches", help="HF batch sizes tried, comma-separated (32,64; CPU 2)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="default bf16 on GPU, fp32 on CPU")
    p.add_argument("--device", help="default cuda when present")
    p.add_argument(
        "--kv-cache", choices=["bf16", "fp8"], default="bf16",
        help="fp8: each nakta / nakta_fp8 engine also runs with an e4m3 KV cache (nakta_kv8 / "
        "nakta_fp8_kv8) beside the bf16-KV one",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="results folder (default results/<device>/throughput)")
    a = p.parse_args(argv)
    a.engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    if a.kv_cache == "fp8":  # each Nakta engine also with e4m3 KV pages, beside it
        kv8 = {"nakta": ["nakta", "nakta_kv8"], "nakta_fp8": ["nakta_fp8", "nakta_fp8_kv8"]}
        a.engines = list(dict.fromkeys(x for e in a.engines for x in kv8.get(e, [e])))
    bad = [e for e in a.engines if e not in ENGINES]
    if bad or not a.engines:
        p.error(f"--engines: unknown engine {bad[0] if bad else ''!r}; choose from {ENGINES}")
    for name in ("prompts", "input_len", "output_len"):
        v = getattr(a, name)
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if a.lengths is not None:
        if a.input_len is not None or a.output_len is not None:
            p.error("--lengths replaces --input-len / --output-len: give one or the other")
        m = _UNIFORM.fullmatch(a.lengths)
        if not m or any(int(x) < 1 for x in m.groups()):
            p.error(f"--lengths takes uniform:A-B/C-D with 1 <= A, C, got {a.lengths!r}")
        lo_in, hi_in, lo_out, hi_out = map(int, m.groups())
        if lo_in > hi_in or lo_out > hi_out:
            p.error(f"--lengths {a.lengths}: each range must run low-high")
        a.uniform = (lo_in, hi_in, lo_out, hi_out)
    else:
        a.uniform = None
    for name in ("max_batch", "hf_batches"):
        text = getattr(a, name)
        if text is not None:
            try:
                vals = [int(x) for x in text.split(",") if x.strip()]
            except ValueError:
                vals = []
            if not vals or min(vals) < 1:
                p.error(
                    f"--{name.replace('_', '-')} takes positive comma-separated ints, got {text!r}"
                )
            setattr(a, name, vals)
    return a


def make_workload(
    n: int, input_len: int | tuple[int, int], output_len: int | tuple[int, int], vocab: int,
    seed: int,
) -> Workload:  # fmt: skip
    """``n`` prompts of BOS + random ids in ``[3, vocab)``; a length given as ``(lo, hi)`` is
    drawn per request uniformly from ``lo..hi`` (inclusive)."""
    rng = random.Random(seed)

    def draw(spec) -> int:
        return spec if isinstance(spec, int) else rng.randint(*spec)

    prompts, outputs = [], []
    for _ in range(n):
        length, new = draw(input_len), draw(output_len)
        prompts.append([1] + [rng.randrange(3, vocab) for _ in range(length - 1)])
        outputs.append(new)
    label = lambda s: s if isinstance(s, int) else f"uniform:{s[0]}-{s[1]}"  # noqa: E731
    return Workload(prompts, outputs, label(input_len), label(output_len))


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile, linear between order statistics (numpy's default)."""
    import numpy as np

    return float(np.percentile(list(values), q))


def decode_floor(
    args,
    work: Workload,
    stats: dict,
    elem: int,
    bw_gbps: float,
    quant: str | None = None,
    kv_cache: str | None = None,
) -> dict:
    """The byte floor of Nakta's mean decode step against its measured mean step.

    Decoding a request's new token j (j >= 2: the first comes from the prefill) attends to its
    L + j - 1 positions, so a request of prompt L and O new tokens has O - 1 decoded tokens
    over (O - 1) L + (O - 1) O / 2 positions. Mean rows a step = decoded tokens / steps; mean
    context = positions / decoded tokens (idle batch entries and tokens decoded past a row's
    end are work the floor does not count)."""
    tokens = sum(o - 1 for o in work.outputs)
    positions = sum((o - 1) * len(p) + (o - 1) * o / 2 for p, o in zip(work.prompts, work.outputs))
    steps = stats["decode_steps"]
    if not steps or not tokens:
        return {"step_floor_pct": None}
    rows, context = tokens / steps, positions / tokens
    floor_s = step_bytes(args, rows, context, elem, quant=quant, kv_cache=kv_cache) / (
        bw_gbps * 1e9
    )
    step_s = stats["decode_s"] / steps
    return {
        "mean_rows": rows,
        "mean_context": context,
        "step_ms": 1e3 * step_s,
        "floor_ms": 1e3 * floor_s,
        "step_floor_pct": 100 * floor_s / step_s,
    }


def measure(engine, work: Workload, max_batch: int, device: torch.device) -> dict:
    """Warm up, then time one call over every request; the summary row's measured fields."""
    engine.warm_up(work.prompts, work.outputs, max_batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    out: Outcome = engine.run(work.prompts, work.outputs, max_batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    short = [i for i, (g, o) in enumerate(zip(out.generated, work.outputs)) if g < o]
    if short:
        i = short[0]
        raise RuntimeError(
            f"{engine.name} stopped {len(short)} requests early (request {i}: "
            f"{out.generated[i]} of {work.outputs[i]} tokens): EOS must not end a row"
        )
    ttft = [t - t0 for t in out.first_token_at]
    if any(t != t for t in ttft):
        raise RuntimeError(f"{engine.name}: a request's first token was never seen")
    n = len(work.prompts)
    row = {
        "output_tok_s": sum(work.outputs) / wall,
        "requests_s": n / wall,
        "ttft_median_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "peak_mem_gb": torch.cuda.max_memory_allocated(device) / 1e9
        if device.type == "cuda"
        else None,
        "wall_s": wall,
        "generated_tokens": sum(out.generated),
        "ttft_s": ttft,
    }
    if out.stats:
        row.update(prefill_s=out.stats["prefill_s"], decode_s=out.stats["decode_s"])
        row["decode_steps"] = out.stats["decode_steps"]
        row["prefill_burst"] = out.stats.get("prefill_burst")
        row["nakta_stats"] = out.stats
    return row


def main(argv: Sequence[str] | None = None) -> dict:
    a = parse_args(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    dtype = _DTYPES[a.dtype or ("bf16" if on_gpu else "fp32")]
    weights = exit_on_input_error(_weights, a, on_gpu)
    args = weights.args
    n = a.prompts or (1000 if on_gpu else 12)
    if a.uniform:
        lo_in, hi_in, lo_out, hi_out = a.uniform
        inp, outp = (lo_in, hi_in), (lo_out, hi_out)
    else:
        inp, outp = a.input_len or (128 if on_gpu else 8), a.output_len or (128 if on_gpu else 8)
    longest = (inp if isinstance(inp, int) else inp[1]) + (
        outp if isinstance(outp, int) else outp[1]
    )
    if longest > args.max_seq_len:
        exit_on_input_error(_too_long, longest, args.max_seq_len)
    work = make_workload(n, inp, outp, args.vocab_size, a.seed)
    batches = a.max_batch or ([64] if on_gpu else [4])
    hf_batches = a.hf_batches or ([32, 64] if on_gpu else [2])
    max_seq = -(-(longest + 1) // 64) * 64  # rows of whole 64-position pages
    elem = torch.empty((), dtype=dtype).element_size()
    bw = copy_bandwidth_gbps() if on_gpu else copy_bandwidth_gbps(64 << 20, device="cpu")
    name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    out = a.out or results_dir(__file__, device_slug(device)) / "throughput"
    out.mkdir(parents=True, exist_ok=True)
    print(f"{weights.name} {str(dtype)[6:]} on {name}, copy {bw:.0f} GB/s; {n} prompts")
    plan = [(e, b) for e in a.engines for b in (hf_batches if e == "hf" else batches)]
    runs, skipped = [], {}
    from tqdm.auto import tqdm

    bar = tqdm(total=len(plan), desc="throughput", unit="run")
    for engine_name in a.engines:
        todo = [b for e, b in plan if e == engine_name]
        reason = _skip(engine_name, device)
        if reason:
            skipped[engine_name] = reason
            bar.write(f"[{engine_name}] skipped: {reason}")
            bar.update(len(todo))
            continue
        engine = BUILDERS[engine_name](weights, device, dtype, max_seq)
        for b in todo:
            bar.set_postfix_str(f"{engine_name} max_batch {b}")
            try:
                m = measure(engine, work, b, device)
            except ValueError as e:  # a max_batch this engine refuses (Generator: > max_rows())
                skipped[f"{engine_name} max_batch {b}"] = f"{type(e).__name__}: {e}"
                bar.write(f"[{engine_name}] max_batch {b} skipped: {e}")
                bar.update(1)
                continue
            row = {"engine": engine_name, "prompts": n, "input_len": work.input_label,
                   "output_len": work.output_label, "max_batch": b, **m}  # fmt: skip
            row["step_floor_pct"] = None
            if "nakta_stats" in m:  # the Nakta engines (bf16 or FP8): their step's floor
                kv = getattr(engine, "kv_cache", None)
                row.update(decode_floor(args, work, m["nakta_stats"], elem, bw, engine.quant, kv))
            runs.append(row)
            bar.update(1)
            write_results(out, name, weights.name, dtype, bw, runs, skipped, quiet=True)
            bar.write(
                f"[{engine_name}] max_batch {b}: {row['output_tok_s']:.1f} tok/s, "
                f"{row['requests_s']:.2f} req/s, TTFT median {row['ttft_median_s']:.3f} s "
                f"p99 {row['ttft_p99_s']:.3f} s, wall {row['wall_s']:.2f} s"
            )
        engine.close()
        del engine
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
    bar.close()
    return write_results(out, name, weights.name, dtype, bw, runs, skipped)


def _too_long(longest: int, limit: int) -> None:
    raise InputError(
        f"--input-len + --output-len (or --lengths' highs) = {longest} exceeds the model's "
        f"max_seq_len {limit}"
    )


def summary_of(device_name: str, runs: list[dict]) -> dict:
    """``throughput_summary.json``: the issue's schema, nothing else."""
    return {"device_name": device_name, "runs": [{k: r[k] for k in SUMMARY_KEYS} for r in runs]}


def write_results(out: Path, device_name, model, dtype, bw, runs, skipped, quiet=False) -> dict:
    summary = summary_of(device_name, runs)
    write_json(summary, out / "throughput_summary.json")
    extra = ["wall_s", "prefill_s", "decode_s", "decode_steps", "mean_rows", "mean_context",
             "step_ms", "floor_ms", "prefill_burst"]  # fmt: skip
    cols = list(SUMMARY_KEYS) + [c for c in extra if any(c in r for r in runs)]
    df = pd.DataFrame([{c: r.get(c) for c in cols} for r in runs], columns=cols)
    hf = [r for r in runs if r["engine"] == "hf"]
    best = max(hf, key=lambda r: r["output_tok_s"]) if hf else None
    notes = (
        f"{model}, {str(dtype).removeprefix('torch.')}, {device_name}; copy bandwidth "
        f"{bw:.0f} GB/s measured in this run. Greedy, EOS ignored; output_tok_s = new tokens "
        "asked for / wall seconds of one call over every request (after a warm-up); TTFT from "
        "the call's start to the request's first new token on the host; step_floor_pct = byte "
        "floor of nakta's mean decode step (weights + K/V at the mean rows and context) / its "
        "measured mean step."
    )
    if best:
        notes += f" HF's best batch: {best['max_batch']} ({best['output_tok_s']:.1f} tok/s)."
    if skipped:
        notes += " Skipped: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()) + "."
    write_table(df, out, "throughput", "Generation throughput", notes)
    if runs:
        save_figure(_plot(df, device_name, model), out / "throughput.png")
    if not quiet:
        print(df.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
        print(f"results -> {out}")
    return summary


def _plot(df: pd.DataFrame, device_name: str, model: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for engine in sorted(set(df["engine"])):
        sub = df[df["engine"] == engine].sort_values("max_batch")
        ax.plot(sub["max_batch"], sub["output_tok_s"], marker="o", label=engine)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max_batch (rows in flight)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Throughput, {model} on {device_name}")
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


if __name__ == "__main__":
    main()
