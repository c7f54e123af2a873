"""lm-eval through Nakta in bf16 and in FP8 on one GPU, each run a fresh process of the CLI as
a user types it (``--model_args checkpoint=DIR`` and ``checkpoint=DIR,quant=fp8``): wall and
acc / acc_norm of each, in the same device call.

    python speed_bench/lm_eval_quant.py --checkpoint /tmp/ckpt-7B \\
        --data .data/hellaswag_val_full.jsonl --shots 0 --out results/<device>/fp8/lm_eval

The FP8 run quantizes the bf16 checkpoint as it loads (what a user with a bf16 checkpoint
does); runs alternate bf16, fp8 (``--repeats``), after one untimed short warm-up run of each
(Triton's compiles and the page cache). Writes ``lm_eval_fp8.json`` and ``lm_eval_fp8.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if not __package__:  # run by path: import from this checkout
    sys.path[0] = str(REPO)

from nakta_model.io_utils import atomic_write_text  # noqa: E402
from speed_bench.lm_eval_children import read_results  # noqa: E402
from speed_bench.lm_eval_dp import TASK, Runner, _command  # noqa: E402
from speed_bench.lm_eval_dp_report import run_phases  # noqa: E402

QUANTS = ("bf16", "fp8")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a bf16 Nakta/Meta/HF checkpoint folder")
    p.add_argument("--data", required=True, help="HellaSwag .jsonl for hellaswag_local")
    p.add_argument("--shots", type=int, default=0)
    p.add_argument("--limit", type=int, default=None, help="tasks (default: all)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs of each quant")
    p.add_argument("--warmup-limit", type=int, default=32, help="0: no warm-up run")
    p.add_argument("--run-timeout-s", type=float, default=150.0)
    p.add_argument("--deadline-s", type=float, default=None, help="start no run past this")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.repeats < 1 or a.shots < 0 or a.warmup_limit < 0 or (a.limit is not None and a.limit < 1):
        p.error("--repeats >= 1, --shots >= 0, --warmup-limit >= 0, --limit >= 1")
    a.dtype = "bf16"
    return a


def model_args(ckpt: Path, quant: str) -> str:
    return f"checkpoint={ckpt},dtype=bf16" + (",quant=fp8" if quant == "fp8" else "")


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    a = parse_args(argv)
    out, ckpt = Path(a.out), Path(a.checkpoint).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    runner = Runner(a, out, work, started)
    if a.warmup_limit:
        for q in QUANTS:
            res = work / "runs" / f"warmup_{q}" / "lm_eval"
            cmd = _command(a, model_args(ckpt, q), "nakta", TASK, a.shots, a.warmup_limit, 1, res)
            rec = runner.run(f"warmup_{q}", cmd)
            print(f"warm-up {q}: {rec.get('wall_s', 0):.1f} s {rec['error'] or ''}", flush=True)
    rows = []
    for i in range(a.repeats):
        for q in QUANTS:
            name = f"{TASK}_{a.shots}shot_{a.limit or 'all'}_{q}_{i}"
            res = work / "runs" / name / "lm_eval"
            rec = runner.run(name, _command(a, model_args(ckpt, q), "nakta", TASK, a.shots,
                                            a.limit, 1, res))  # fmt: skip
            row = {"quant": q, "repeat": i, "task": TASK, "num_fewshot": a.shots,
                   "limit": a.limit, "error": rec["error"]}  # fmt: skip
            if "spawn_unix" in rec:
                row.update(run_phases(rec["ranks"], rec["spawn_unix"], rec["end_unix"]))
            if rec["error"] is None:
                r = read_results(Path(rec["lm_eval_out"]), TASK)
                row.update(acc=r["acc"], acc_norm=r.get("acc_norm"))
            print(f"{name}: {json.dumps({k: row.get(k) for k in ('wall_s', 'acc', 'error')})}")
            rows.append(row)
    summary = {"checkpoint": ckpt.name, "runs": rows, **_ratio(rows)}
    atomic_write_text(out / "lm_eval_fp8.json", json.dumps(summary, indent=2) + "\n")
    atomic_write_text(out / "lm_eval_fp8.md", markdown(summary))
    print(markdown(summary))
    return 0 if all(r["error"] is None for r in rows) else 1


def _ratio(rows: list[dict]) -> dict:
    """Median wall of each quant and bf16 over fp8 (> 1: FP8 is faster)."""
    import statistics

    walls = {
        q: [r["wall_s"] for r in rows if r["quant"] == q and r["error"] is None] for q in QUANTS
    }
    med = {q: statistics.median(w) if w else None for q, w in walls.items()}
    ratio = med["bf16"] / med["fp8"] if med["bf16"] and med["fp8"] else None
    return {"median_wall_s": med, "bf16_over_fp8_wall": ratio}


def markdown(summary: dict) -> str:
    lines = [
        f"# lm-eval `{TASK}` through Nakta, bf16 vs FP8 ({summary['checkpoint']})",
        "",
        "Fresh CLI processes; wall = process start to exit; FP8 = the bf16 checkpoint "
        "quantized at load (`quant=fp8`).",
        "",
        "| quant | shots | tasks | wall s | first request s | scoring s | after s | acc | "
        "acc_norm |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v, spec=".2f"):
        return "-" if v is None else format(v, spec)

    for r in summary["runs"]:
        lines.append(
            f"| {r['quant']} | {r['num_fewshot']} | {r['limit'] or 'all'} | "
            f"{f(r.get('wall_s'))} | {f(r.get('first_request_s'))} | {f(r.get('scoring_s'))} | "
            f"{f(r.get('after_scoring_s'))} | {f(r.get('acc'), '.4f')} | "
            f"{f(r.get('acc_norm'), '.4f')} |"
        )
    if summary["bf16_over_fp8_wall"]:
        lines += ["", f"bf16 wall / fp8 wall: **{summary['bf16_over_fp8_wall']:.3f}x**"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
