"""FP8 against bf16 in one table: issue 27's summary (scoring, decoding, accuracy) and, in the
``kv`` mode, issue 42's (the FP8 KV cache and the leaner FP8 step).

    python -m speed_bench.fp8_report --scoring results/.../fp8_scoring/summary.json \\
        --decode .../fp8_decode/decode_summary.json \\
        --parity accuracy_test/results/stories260K_bf16_cuda.json ... --out results/<device>/fp8

It measures nothing itself: it reads what ``run_all`` (engines ``nakta_cache`` and
``nakta_cache_fp8`` in one process), ``decode_speed`` (engines ``nakta`` and ``nakta_fp8`` in
one process) and ``accuracy_test.parity --quant fp8`` wrote, and writes ``fp8_summary.json``
(``{"device_name", "scoring": {"bf16_tasks_per_s", "fp8_tasks_per_s"}, "decode": [{"batch",
"bf16_tok_s", "fp8_tok_s", "fp8_floor_tok_s"}], "accuracy": [{"model", "quant", "tasks",
"flips_vs_truth", "mean_abs_dll_vs_truth"}]}``), ``fp8.csv`` / ``fp8.md`` and ``fp8.png``.

``kv`` mode:

    python -m speed_bench.fp8_report kv \\
        --throughput results/<device>/throughput_fp8/throughput_summary.json \\
        --long results/<device>/fp8_kv_long/decode_summary.json \\
        --decode results/<device>/fp8_kv/decode_lean/decode_summary.json \\
        --b1 results/<device>/fp8_kv/b1_outside/throughput_summary.json \\
        --accuracy accuracy_test/results/kv_cache_accuracy.json \\
        --out results/<device>/fp8_kv

Likewise it only reads what the benches wrote, and writes
``fp8_kv_summary.json`` in issue 42's schema::

    {"device_name": str,
     "throughput": [{"weights": "bf16"|"fp8", "kv": "bf16"|"fp8", "max_batch": int,
                     "output_tok_s": float}],
     "long_context": {"bf16_kv_tok_s": float, "fp8_kv_tok_s": float},
     "step_floor_pct": [{"batch": int, "weights": str, "pct": float}],
     "b1_outside": {"bf16_tok_s": float, "fp8_tok_s": float},
     "accuracy": [{"model": str, "kv": str, "top1_agree_vs_fp32": float,
                   "mean_kl_vs_fp32": float}]}

plus ``fp8_kv.md`` / ``.csv`` (each figure beside its target) and ``fp8_kv.png``. Sources:
``--throughput``: ``speed_bench.throughput`` with ``--engines nakta,nakta_fp8 --kv-cache fp8``
(engines ``nakta`` / ``nakta_kv8`` / ``nakta_fp8`` / ``nakta_fp8_kv8`` = weights x KV), the
``--workload`` rows only (default 128/128); ``--long``: ``decode_speed --engines nakta
--kv-cache fp8`` at long contexts (``nakta`` bf16 KV, ``nakta_kv8`` FP8 KV; one batch and prompt);
``--decode``: ``decode_speed --engines nakta,nakta_fp8`` (each batch's ``pct_of_floor``, prompt 64
by default); ``--b1``: ``speed_bench.throughput --max-batch 1`` with engines ``nakta`` and
``nakta_fp8`` (the whole ``generate()`` call timed from outside); ``--accuracy``:
``accuracy_test.kv_cache_accuracy`` (``model`` is written ``name/dtype``: the model's dtype beside
its KV cache's). A source not given leaves its key null (``long_context``, ``b1_outside``) or
empty (the lists) and its table rows say "not measured": nothing is made up.
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


# ----------------------------------------------------------------------------------------------
# issue 42: the ``kv`` mode
# ----------------------------------------------------------------------------------------------

# engine name -> (weights, kv) in the throughput and decode benches
PRECISIONS = {
    "nakta": ("bf16", "bf16"),
    "nakta_kv8": ("bf16", "fp8"),
    "nakta_fp8": ("fp8", "bf16"),
    "nakta_fp8_kv8": ("fp8", "fp8"),
}
_DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

# issue 42's targets (what the table says met / not met against)
TARGET_FP8_FP8_TOK_S = 20_000.0  # FP8 weights + FP8 KV, 1,000 x 128/128
TARGET_BF16_FP8_TOK_S = 14_000.0  # bf16 weights + FP8 KV
TARGET_LONG_RATIO = 1.6  # FP8 KV / bf16 KV at 32 x 4K contexts
TARGET_FP8_FLOOR_PCT = 75.0  # FP8 weights at 8 and 32 rows
TARGET_FLOOR_BATCHES = (8, 32)
TARGET_B1_RATIO = 1.7  # FP8 / bf16, batch-1 generate() from outside


def _runs(summary: dict, what: str) -> list[dict]:
    runs = summary.get("runs")
    if not isinstance(runs, list):
        raise ValueError(f"{what}: no 'runs' list (is it a bench summary?)")
    return runs


def parse_workload(text: str) -> tuple[int, int]:
    """``"128/128"`` -> (input_len, output_len)."""
    try:
        a, b = (int(v) for v in text.split("/"))
    except ValueError:
        raise ValueError(
            f"--workload must be INPUT/OUTPUT tokens like 128/128, got {text!r}"
        ) from None
    if a < 1 or b < 1:
        raise ValueError(f"--workload lengths must be >= 1, got {text!r}")
    return a, b


def throughput_rows(summary: dict, workload: tuple[int, int]) -> list[dict]:
    """One row per (weights, kv, max_batch) of the nakta engines at ``workload``."""
    rows = []
    for r in _runs(summary, "throughput summary"):
        if r.get("engine") not in PRECISIONS:
            continue
        if (r.get("input_len"), r.get("output_len")) != workload:
            continue
        weights, kv = PRECISIONS[r["engine"]]
        rows.append({"weights": weights, "kv": kv, "max_batch": int(r["max_batch"]),
                     "output_tok_s": float(r["output_tok_s"])})  # fmt: skip
    return rows


def long_context(summary: dict) -> dict:
    """bf16-KV and FP8-KV decode tok/s of one long-context ``decode_speed`` run (engines
    ``nakta`` and ``nakta_kv8`` at the same batch and prompt)."""
    by = {}
    for r in _runs(summary, "long-context decode summary"):
        if r.get("engine") in ("nakta", "nakta_kv8") and not r.get("shared_prefix"):
            by.setdefault((r["batch"], r["prompt"]), {})[r["engine"]] = float(r["tok_s"])
    both = [k for k, v in by.items() if len(v) == 2]
    if len(both) != 1:
        raise ValueError(
            "long-context decode summary: expected one (batch, prompt) with both nakta and "
            f"nakta_kv8, found {sorted(both)}"
        )
    v = by[both[0]]
    return {"bf16_kv_tok_s": v["nakta"], "fp8_kv_tok_s": v["nakta_kv8"]}


def step_floor_rows(summary: dict, prompt: int) -> list[dict]:
    """Each batch's % of its byte floor for bf16 (``nakta``) and FP8 (``nakta_fp8``) weights, both
    with a bf16 KV cache, at ``prompt`` tokens."""
    rows = []
    for r in _runs(summary, "decode summary"):
        if r.get("engine") not in ("nakta", "nakta_fp8") or r.get("prompt") != prompt:
            continue
        if r.get("shared_prefix"):
            continue
        rows.append({"batch": int(r["batch"]), "weights": PRECISIONS[r["engine"]][0],
                     "pct": float(r["pct_of_floor"])})  # fmt: skip
    if not rows:
        raise ValueError(f"decode summary: no nakta / nakta_fp8 run at prompt {prompt}")
    return sorted(rows, key=lambda r: (r["batch"], r["weights"]))


def b1_outside(summary: dict) -> dict:
    """Whole-call output tok/s of ``nakta`` and ``nakta_fp8`` at ``max_batch`` 1."""
    got = {}
    for r in _runs(summary, "batch-1 throughput summary"):
        if r.get("engine") in ("nakta", "nakta_fp8") and r.get("max_batch") == 1:
            got[r["engine"]] = float(r["output_tok_s"])
    missing = [e for e in ("nakta", "nakta_fp8") if e not in got]
    if missing:
        raise ValueError(f"batch-1 throughput summary lacks max_batch 1 run(s) of {missing}")
    return {"bf16_tok_s": got["nakta"], "fp8_tok_s": got["nakta_fp8"]}


def kv_accuracy_rows(result: dict) -> list[dict]:
    """``kv_cache_accuracy``'s rows against the fp32 truth; ``model`` as ``name/dtype``."""
    rows = []
    for a in result.get("accuracy", []):
        dtype = _DTYPE_SHORT.get(a.get("dtype"), a.get("dtype", "?"))
        rows.append({"model": f"{a['model']}/{dtype}", "kv": a["kv"],
                     "top1_agree_vs_fp32": float(a["top1_agree_vs_fp32"]),
                     "mean_kl_vs_fp32": float(a["mean_kl_vs_fp32"])})  # fmt: skip
    if not rows:
        raise ValueError("accuracy result: no 'accuracy' rows (kv_cache_accuracy's output?)")
    return rows


def build_kv(
    *, throughput: Sequence[dict] = (), long: dict | None = None, decode: dict | None = None,
    b1: dict | None = None, accuracy: dict | None = None, workload: tuple[int, int] = (128, 128),
    prompt: int = 64,
) -> dict:  # fmt: skip
    """The summary from whichever sources were given (module docstring)."""
    device = None
    for s in (*throughput, b1, long, decode):
        if s and (s.get("device_name") or s.get("device")):
            device = s.get("device_name") or s.get("device")
            break
    return {
        "device_name": device or "?",
        "throughput": [row for t in throughput for row in throughput_rows(t, workload)],
        "long_context": long_context(long) if long is not None else None,
        "step_floor_pct": step_floor_rows(decode, prompt) if decode is not None else [],
        "b1_outside": b1_outside(b1) if b1 is not None else None,
        "accuracy": kv_accuracy_rows(accuracy) if accuracy is not None else [],
    }


def _met(value: float, target: float) -> str:
    return "met" if value >= target else "not met"


def table_rows(summary: dict) -> list[dict]:
    """What the markdown table shows: each figure, its bf16 counterpart, the target."""
    rows = []
    nm = "not measured"
    targets = {("fp8", "fp8"): TARGET_FP8_FP8_TOK_S, ("bf16", "fp8"): TARGET_BF16_FP8_TOK_S}
    for t in summary["throughput"]:
        target = targets.get((t["weights"], t["kv"]))
        rows.append({
            "what": f"throughput, weights {t['weights']} + KV {t['kv']}, {t['max_batch']} rows",
            "value": f"{t['output_tok_s']:,.0f}", "unit": "output tok/s",
            "target": f">= {target:,.0f}: {_met(t['output_tok_s'], target)}" if target else "",
        })  # fmt: skip
    if not summary["throughput"]:
        rows.append({"what": "throughput", "value": "", "unit": "", "target": nm})
    lc = summary["long_context"]
    if lc:
        ratio = lc["fp8_kv_tok_s"] / lc["bf16_kv_tok_s"]
        rows.append({"what": "long contexts: FP8 KV / bf16 KV decode", "value": f"{ratio:.2f}",
                     "unit": f"x ({lc['fp8_kv_tok_s']:,.0f} / {lc['bf16_kv_tok_s']:,.0f} tok/s)",
                     "target": f">= {TARGET_LONG_RATIO}x: {_met(ratio, TARGET_LONG_RATIO)}"})  # fmt: skip
    else:
        rows.append({"what": "long contexts", "value": "", "unit": "", "target": nm})
    for s in summary["step_floor_pct"]:
        aimed = s["weights"] == "fp8" and s["batch"] in TARGET_FLOOR_BATCHES
        rows.append({
            "what": f"decode step, {s['weights']} weights, batch {s['batch']}",
            "value": f"{s['pct']:.1f}", "unit": "% of its byte floor",
            "target": f">= {TARGET_FP8_FLOOR_PCT:.0f}%: {_met(s['pct'], TARGET_FP8_FLOOR_PCT)}"
            if aimed else "",
        })  # fmt: skip
    if not summary["step_floor_pct"]:
        rows.append({"what": "decode step floor %", "value": "", "unit": "", "target": nm})
    b1 = summary["b1_outside"]
    if b1:
        ratio = b1["fp8_tok_s"] / b1["bf16_tok_s"]
        rows.append({"what": "batch 1, whole generate() call: FP8 / bf16", "value": f"{ratio:.2f}",
                     "unit": f"x ({b1['fp8_tok_s']:.1f} / {b1['bf16_tok_s']:.1f} tok/s)",
                     "target": f">= {TARGET_B1_RATIO}x: {_met(ratio, TARGET_B1_RATIO)}"})  # fmt: skip
    else:
        rows.append({"what": "batch 1 from outside", "value": "", "unit": "", "target": nm})
    for a in summary["accuracy"]:
        rows.append({
            "what": f"{a['model']}, KV {a['kv']}: top-1 agreement with fp32",
            "value": f"{100 * a['top1_agree_vs_fp32']:.1f}%",
            "unit": f"(mean KL {a['mean_kl_vs_fp32']:.3g})", "target": "",
        })  # fmt: skip
    if not summary["accuracy"]:
        rows.append({"what": "accuracy", "value": "", "unit": "", "target": nm})
    return rows


def write_kv(summary: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(summary, out / "fp8_kv_summary.json")
    notes = (
        f"Device: {summary['device_name']}. Issue 42: an FP8 KV cache (e4m3, one fp32 scale per "
        "token and KV head) and FP8 weights, each against bf16, with the issue's targets. Each "
        "ratio comes from one process (throughput, long contexts, decode steps) or one call "
        "(batch 1). Accuracy: against an fp32 model with an fp32 cache."
    )
    write_table(pd.DataFrame(table_rows(summary)), out, "fp8_kv", "FP8 KV cache and FP8 step",
                notes)  # fmt: skip
    _plot_kv(summary, out / "fp8_kv.png")


def _plot_kv(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    tp = summary["throughput"]
    ax = axes[0]
    if tp:
        labels = [f"w {t['weights']}\nKV {t['kv']}\n{t['max_batch']} rows" for t in tp]
        ax.bar(labels, [t["output_tok_s"] for t in tp], color="#4c72b0")
        ax.axhline(TARGET_FP8_FP8_TOK_S, color="#c44e52", ls="--", lw=1, label="FP8/FP8 target")
        ax.legend(fontsize=8)
    ax.set_ylabel("output tok/s")
    ax.set_title("Throughput" if tp else "Throughput: not measured")
    ax = axes[1]
    steps = summary["step_floor_pct"]
    for weights, color in (("bf16", "#55a868"), ("fp8", "#4c72b0")):
        pts = [s for s in steps if s["weights"] == weights]
        ax.plot([s["batch"] for s in pts], [s["pct"] for s in pts], "o-", color=color,
                label=f"{weights} weights")  # fmt: skip
    ax.axhline(TARGET_FP8_FLOOR_PCT, color="#c44e52", ls="--", lw=1, label="FP8 target")
    if steps:  # a log axis over no points cannot be drawn
        ax.set_xscale("log", base=2)
    ax.set_xlabel("rows per step")
    ax.set_ylabel("% of the byte floor")
    ax.set_title("Decode step" if steps else "Decode step: not measured")
    ax.legend(fontsize=8)
    ax = axes[2]
    acc = summary["accuracy"]
    if acc:
        labels = [f"{a['model']}\nKV {a['kv']}" for a in acc]
        ax.bar(labels, [a["mean_kl_vs_fp32"] for a in acc], color="#8172b2")
        ax.set_yscale("log")
        ax.tick_params(axis="x", labelsize=7)
    ax.set_ylabel("mean KL(fp32 truth || variant)")
    ax.set_title("Accuracy" if acc else "Accuracy: not measured")
    fig.suptitle(summary["device_name"])
    save_figure(fig, path)
    plt.close(fig)


def main_kv(argv: Sequence[str]) -> int:
    """The ``kv`` mode's command line (issue 42's summary)."""
    p = argparse.ArgumentParser(prog="fp8_report kv", description="Issue 42's FP8 KV summary")
    p.add_argument("--throughput", type=Path, nargs="*", default=[],
                   help="speed_bench.throughput summaries (nakta / nakta_fp8, --kv-cache fp8)")  # fmt: skip
    p.add_argument("--long", type=Path, help="decode_speed summary at long contexts (KV fp8)")
    p.add_argument("--decode", type=Path, help="decode_speed summary, nakta and nakta_fp8")
    p.add_argument("--b1", type=Path, help="throughput summary at --max-batch 1")
    p.add_argument("--accuracy", type=Path, help="accuracy_test.kv_cache_accuracy JSON")
    p.add_argument("--workload", default="128/128", help="throughput rows kept (INPUT/OUTPUT)")
    p.add_argument("--prompt", type=int, default=64, help="decode rows' prompt length")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    a = p.parse_args(argv)
    try:
        workload = parse_workload(a.workload)

        def opt(path):
            return _read(path) if path is not None else None

        summary = build_kv(
            throughput=[_read(t) for t in a.throughput], long=opt(a.long), decode=opt(a.decode),
            b1=opt(a.b1), accuracy=opt(a.accuracy), workload=workload, prompt=a.prompt,
        )  # fmt: skip
    except (ValueError, KeyError, TypeError) as e:  # a missing file, or one of another shape
        what = e if isinstance(e, ValueError) else f"an input lacks or mistypes {e!r}"
        print(f"fp8_report kv: error: {what}", file=sys.stderr)
        return 2
    write_kv(summary, a.out)
    print((a.out / "fp8_kv.md").read_text())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["kv"]:
        return main_kv(argv[1:])
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
