"""FP8 against bf16 in one table: scoring, decoding, accuracy (issue 27's summary).

    python -m speed_bench.fp8_report --scoring results/.../fp8_scoring/summary.json \\
        --decode .../fp8_decode/decode_summary.json \\
        --parity accuracy_test/results/stories260K_bf16_cuda.json ... --out results/<device>/fp8

It measures nothing itself: it reads what ``run_all`` (engines ``nakta_cache`` and
``nakta_cache_fp8`` in one process), ``decode_speed`` (engines ``nakta`` and ``nakta_fp8`` in
one process) and ``accuracy_test.parity --quant fp8`` wrote, and writes ``fp8_summary.json``
(``{"device_name", "scoring": {"bf16_tasks_per_s", "fp8_tasks_per_s"}, "decode": [{"batch",
"bf16_tok_s", "fp8_tok_s", "fp8_floor_tok_s"}], "accuracy": [{"model", "quant", "tasks",
"flips_vs_truth", "mean_abs_dll_vs_truth"}]}``), ``fp8.csv`` / ``fp8.md`` and ``fp8.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

if not __package__:  # run by path: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import pandas as pd

from bench_common.report import save_figure, write_json, write_table

SCORING_ENGINES = ("nakta_cache", "nakta_cache_fp8")


def _read(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def scoring_rates(summary: dict) -> dict:
    """bf16 and fp8 tasks/s of the shared-context engine, from one ``run_all`` summary."""
    engines = summary.get("engines", {})
    missing = [e for e in SCORING_ENGINES if e not in engines]
    if missing:
        raise ValueError(f"run_all summary lacks engine(s) {missing}: run both in one process")
    bf16, fp8 = (engines[e]["tasks_per_s"] for e in SCORING_ENGINES)
    return {"bf16_tasks_per_s": bf16, "fp8_tasks_per_s": fp8, "fp8_vs_bf16": fp8 / bf16}


def decode_rows(summary: dict, prompt: int = 64) -> list[dict]:
    """Per batch size: tok/s of engines ``nakta`` (bf16) and ``nakta_fp8`` at ``prompt`` tokens
    from one ``decode_speed`` run, and the fp8 floor."""

    def by_batch(engine: str) -> dict[int, dict]:
        return {
            r["batch"]: r
            for r in summary.get("runs", [])
            if r.get("engine") == engine
            and r.get("prompt") == prompt
            and not r.get("shared_prefix")
        }

    b, f = by_batch("nakta"), by_batch("nakta_fp8")
    rows = []
    for batch in sorted(set(b) & set(f)):
        rows.append(
            {
                "batch": batch,
                "bf16_tok_s": b[batch]["tok_s"],
                "fp8_tok_s": f[batch]["tok_s"],
                "fp8_floor_tok_s": f[batch]["floor_tok_s"],
                "fp8_vs_bf16": f[batch]["tok_s"] / b[batch]["tok_s"],
                "fp8_pct_of_floor": 100 * f[batch]["tok_s"] / f[batch]["floor_tok_s"],
            }
        )
    if not rows:
        raise ValueError(f"no batch size at prompt {prompt} with both nakta and nakta_fp8")
    return rows


def accuracy_rows(parity: dict) -> list[dict]:
    """nakta bf16 and nakta fp8 against the fp32 truth, from one ``parity --quant fp8`` run."""
    truth = parity.get("truth")
    if not truth or "nakta_fp8" not in truth:
        raise ValueError("parity result has no fp8 truth comparison: run parity --quant fp8")
    cfg = parity.get("config", {})
    rows = []
    for key, quant in (("nakta", cfg.get("dtype", "bf16")), ("nakta_fp8", "fp8")):
        t = truth[key]
        rows.append(
            {
                "model": cfg.get("model", "?"),
                "quant": quant,
                "tasks": cfg.get("n_tasks"),
                "flips_vs_truth": sum(t["n_flips"].values()),
                "mean_abs_dll_vs_truth": t["ll_abs_diff"]["mean"],
                "acc": t["acc"],
                "acc_norm": t["acc_norm"],
            }
        )
    return rows


def build(scoring: dict, decode: dict, parities: Sequence[dict]) -> dict:
    return {
        "device_name": decode.get("device") or scoring.get("device", "?"),
        "model": scoring.get("model"),
        "scoring": scoring_rates(scoring),
        "decode": decode_rows(decode),
        "accuracy": [row for p in parities for row in accuracy_rows(p)],
    }


def write(summary: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(summary, out / "fp8_summary.json")
    s = summary["scoring"]
    rows = [
        {
            "what": f"scoring {summary.get('model')} (tasks/s)",
            "bf16": s["bf16_tasks_per_s"],
            "fp8": s["fp8_tasks_per_s"],
            "fp8/bf16": s["fp8_vs_bf16"],
            "note": "",
        }
    ]
    for d in summary["decode"]:
        rows.append(
            {
                "what": f"decode batch {d['batch']} (tok/s)",
                "bf16": d["bf16_tok_s"],
                "fp8": d["fp8_tok_s"],
                "fp8/bf16": d["fp8_vs_bf16"],
                "note": f"fp8 {d['fp8_pct_of_floor']:.1f}% of its floor "
                f"({d['fp8_floor_tok_s']:.0f} tok/s)",
            }
        )
    acc = {}
    for a in summary["accuracy"]:
        acc.setdefault(a["model"], {})[a["quant"]] = a
    for model, q in acc.items():
        bf = next(v for k, v in q.items() if k != "fp8")
        f8 = q["fp8"]
        rows.append(
            {
                "what": f"{model}: flips vs fp32 truth ({f8['tasks']} tasks, acc + acc_norm)",
                "bf16": bf["flips_vs_truth"],
                "fp8": f8["flips_vs_truth"],
                "fp8/bf16": f8["flips_vs_truth"] / max(1, bf["flips_vs_truth"]),
                "note": f"mean |dll| {bf['mean_abs_dll_vs_truth']:.4f} -> "
                f"{f8['mean_abs_dll_vs_truth']:.4f}",
            }
        )
    notes = (
        f"Device: {summary['device_name']}. bf16 and fp8 measured in the same process "
        "(scoring; decoding). fp8: e4m3 block matrices with per-channel "
        "scales; scoring also quantizes the activations per token (W8A8), decoding streams "
        "e4m3 weights against bf16 activations (W8A16)."
    )
    write_table(pd.DataFrame(rows), out, "fp8", "FP8 against bf16", notes)
    _plot(summary, out / "fp8.png")


def _plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    labels = ["scoring"] + [f"decode b{d['batch']}" for d in summary["decode"]]
    ratios = [summary["scoring"]["fp8_vs_bf16"]] + [d["fp8_vs_bf16"] for d in summary["decode"]]
    axes[0].bar(labels, ratios, color="#4c72b0")
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set_ylabel("fp8 speed / bf16 speed")
    axes[0].set_title(f"Speed ({summary['device_name']})")
    acc = [a for a in summary["accuracy"]]
    models = sorted({a["model"] for a in acc})
    width = 0.38
    for i, quant in enumerate(["bf16", "fp8"]):
        is_fp8 = quant == "fp8"  # the other row is the run's dtype (bf16, fp16 or fp32)
        vals = [
            next(
                (
                    a["flips_vs_truth"]
                    for a in acc
                    if a["model"] == m and (a["quant"] == "fp8") == is_fp8
                ),
                0,
            )
            for m in models
        ]
        axes[1].bar([j + i * width for j in range(len(models))], vals, width, label=quant)
    axes[1].set_xticks([j + width / 2 for j in range(len(models))], models, fontsize=8)
    axes[1].set_ylabel("flips vs fp32 truth")
    axes[1].set_title("Accuracy cost")
    axes[1].legend()
    save_figure(fig, path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scoring", type=Path, required=True, help="run_all summary.json")
    p.add_argument("--decode", type=Path, required=True, help="decode_summary.json")
    p.add_argument("--parity", type=Path, nargs="*", default=[], help="parity --quant fp8 JSONs")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    a = p.parse_args(argv)
    try:
        summary = build(_read(a.scoring), _read(a.decode), [_read(x) for x in a.parity])
    except (ValueError, KeyError, TypeError) as e:  # a missing file, or one of another shape
        what = e if isinstance(e, ValueError) else f"an input lacks or mistypes {e!r}"
        print(f"fp8_report: error: {what}", file=sys.stderr)
        return 2
    write(summary, a.out)
    print((a.out / "fp8.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
