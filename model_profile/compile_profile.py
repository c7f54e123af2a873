"""What a machine's first run compiles: every Triton compile of a fresh process on an empty
Triton cache, kernel by kernel, and the wall time of each phase a user's first run goes through.

A user's first lm-eval run pays for compiling every kernel it launches (Triton's on-disk cache
is empty on a fresh machine); later runs load them from the cache. This tool times that cost
phase by phase on random weights at a real shape, in the order a run meets it:

- ``load``: building the model (no kernel runs),
- ``score``: ``scoring.warm_up`` (what a loglikelihood task's first batch would compile),
- ``generate``: a first ``Generator`` call (GSM8K-shaped: prompts sharing a few-shot prefix,
  up to ``--max-batch`` rows, answers of 1..``--output-len`` tokens so that the rows finish
  one by one and the step walks down every batch bucket, as a real run's tail does; compiles
  the prefill and decode kernels, captures the steps).

Outputs in ``model_profile/results/<device>/compile/``: ``compiles.csv`` (one row per compile:
phase, kernel, seconds), ``compile.md`` (per phase: wall, compiles, compile seconds; the
slowest kernels) and ``compile_summary.json``.

    python -m model_profile.compile_profile [--preset 7B] [--phases score,generate]
        [--prompts 512] [--input-len 925] [--shared-prefix 878] [--output-len 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run by path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = ("score", "generate")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="7B")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated: {PHASES}")
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--input-len", type=int, default=925)
    p.add_argument("--shared-prefix", type=int, default=878)
    p.add_argument("--output-len", type=int, default=64, help="answers of 1..N tokens")
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--quant", choices=["fp8"], default=None)
    p.add_argument(
        "--keep-cache", action="store_true",
        help="use Triton's cache as it is (default: an empty one, as on a fresh machine)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    a.phases = [s for s in a.phases.split(",") if s]
    bad = [s for s in a.phases if s not in PHASES]
    if bad:
        p.error(f"--phases takes {PHASES}, got {bad}")
    for name in ("prompts", "input_len", "output_len", "max_batch"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if not 0 <= a.shared_prefix < a.input_len:
        p.error(f"--shared-prefix must be in [0, --input-len), got {a.shared_prefix}")
    return a


class CompileLog:
    """Wraps ``triton.compiler.compile`` (JIT functions bind it at their first launch, so this
    must run before any kernel does): one record per compile, tagged with the current phase."""

    def __init__(self):
        import triton.compiler as tc

        self.records: list[dict] = []
        self.phase = "load"
        orig = tc.compile

        def timed(src, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return orig(src, *args, **kwargs)
            finally:
                name = getattr(getattr(src, "fn", None), "__name__", type(src).__name__)
                self.records.append(
                    {"phase": self.phase, "kernel": name, "seconds": time.perf_counter() - t0,
                     "specialization": specialization(src)}
                )  # fmt: skip

        tc.compile = timed


def specialization(src) -> str:
    """What tells this compile of a kernel from its others: the constexpr values and the integer
    or pointer arguments Triton specialised (``==1`` or divisible by 16), by name."""
    fn = getattr(src, "fn", None)
    names = list(getattr(fn, "arg_names", []))

    def name(key) -> str:
        i = key[0] if isinstance(key, tuple) and key else key
        return names[i] if isinstance(i, int) and i < len(names) else str(key)

    consts = getattr(src, "constants", None) or getattr(src, "constexprs", None) or {}
    parts = [f"{name(k)}={v}" for k, v in consts.items() if isinstance(v, (bool, int, float, str))]
    attrs = getattr(src, "attrs", None) or {}
    parts += [f"{name(k)}:{','.join(str(a[-1]) for a in v)}" for k, v in attrs.items() if v]
    return " ".join(parts)


def _phase_rows(records: list[dict], walls: dict[str, float]) -> list[dict]:
    rows = []
    for phase, wall in walls.items():
        mine = [r for r in records if r["phase"] == phase]
        rows.append({"phase": phase, "wall_s": wall, "compiles": len(mine),
                     "compile_s": sum(r["seconds"] for r in mine)})  # fmt: skip
    return rows


def main(argv: Sequence[str] | None = None) -> dict:
    a = parse_args(argv)
    if not a.keep_cache:  # before triton reads its cache directory
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton_empty_")
    cache = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    empty = not cache.is_dir() or not any(cache.iterdir())
    log = CompileLog()

    import pandas as pd
    import torch

    from bench_common.ceilings import device_slug
    from bench_common.report import results_dir, write_json
    from nakta_model import scoring
    from nakta_model.config import PRESETS
    from nakta_model.generation import GenerationRequest, Generator
    from nakta_model.io_utils import atomic_output_file, atomic_write_text
    from nakta_model.loading import load
    from speed_bench.throughput import make_workload
    from speed_bench.weights import RandomWeights

    if not torch.cuda.is_available():
        raise SystemExit("compile_profile needs a CUDA GPU (Triton compiles for the device)")
    if a.preset not in PRESETS:
        raise SystemExit(f"--preset must be one of {sorted(PRESETS)}, got {a.preset!r}")
    device, dtype = torch.device("cuda"), torch.bfloat16
    walls: dict[str, float] = {}
    t0 = time.perf_counter()
    weights = RandomWeights(PRESETS[a.preset], a.preset, seed=0)
    model = load(weights.source(device, dtype), device, dtype, quant=a.quant)
    torch.cuda.synchronize()
    walls["load"] = time.perf_counter() - t0
    for phase in a.phases:
        log.phase = phase
        t0 = time.perf_counter()
        if phase == "score":
            scoring.warm_up(model)
        else:
            work = make_workload(
                a.prompts, a.input_len, (1, a.output_len), weights.args.vocab_size, 0
            )
            head = work.prompts[0][: a.shared_prefix]
            prompts = [head + p[a.shared_prefix :] for p in work.prompts]
            max_seq = -(-(a.input_len + a.output_len + 1) // 256) * 256
            gen = Generator(model, max_batch=a.max_batch, max_seq_len=max_seq)
            gen.generate([GenerationRequest(p, n) for p, n in zip(prompts, work.outputs)])
        torch.cuda.synchronize()
        walls[phase] = time.perf_counter() - t0
    phases = _phase_rows(log.records, walls)
    df = pd.DataFrame(log.records, columns=["phase", "kernel", "seconds", "specialization"])
    by_kernel = (
        df.groupby(["phase", "kernel"])["seconds"].agg(["count", "sum"]).reset_index()
        .sort_values("sum", ascending=False)
    )  # fmt: skip
    summary = {
        "device_name": torch.cuda.get_device_name(),
        "preset": a.preset,
        "quant": a.quant,
        "empty_cache": empty,
        "cpu_count": os.cpu_count(),
        "phases": phases,
        "compiles": len(log.records),
        "compile_s": float(df["seconds"].sum()),
    }
    out = a.out or results_dir(__file__, device_slug(device)) / "compile"
    out.mkdir(parents=True, exist_ok=True)
    with atomic_output_file(out / "compiles.csv") as tmp:
        df.to_csv(tmp, index=False)
    md = (
        f"# First-run compilation, phase by phase\n\n{summary['device_name']}, {a.preset} "
        f"{a.quant or 'bf16'} random weights, "
        + ("an empty Triton cache" if empty else "a Triton cache holding earlier compiles")
        + f": {summary['compiles']} compiles, {summary['compile_s']:.1f} s\n\n"
        + pd.DataFrame(phases).to_markdown(index=False, floatfmt=".2f")
        + "\n\n"
        + by_kernel.head(30).rename(columns={"count": "compiles", "sum": "seconds"})
        .to_markdown(index=False, floatfmt=".2f")
        + "\n"
    )  # fmt: skip
    atomic_write_text(out / "compile.md", md)
    write_json(summary, out / "compile_summary.json")
    print(md)
    return summary


if __name__ == "__main__":
    main()
