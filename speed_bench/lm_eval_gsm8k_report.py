"""Numbers, table and plot of the full-size GSM8K-shaped lm-eval run (``lm_eval_gsm8k.py``).

Measured and extrapolated numbers never share a column: ``wall_s`` is always measured (process
start to end, on the ``docs`` the run did); a run on fewer docs than the full task (``hf``
under ``--hf-limit``) also gets ``extrapolated_full_wall_s``: its fixed part (wall minus the
generation phase) plus its generation phase scaled linearly to ``full_docs``. Linear in docs
is a lower bound for ``hf``: it generates in whole batches, each as long as its longest row,
so a last, partly filled batch costs nearly a full one.

Files: ``lm_eval_summary.json`` (exactly :data:`SUMMARY_KEYS`, each run exactly
:data:`RUN_KEYS`), ``lm_eval_summary.md`` and ``lm_eval_summary.png``, written atomically.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "RUN_KEYS",
    "SUMMARY_KEYS",
    "TARGET",
    "extrapolate",
    "markdown",
    "ratios",
    "write_outputs",
]

TARGET = 6.0  # issue 28: nakta >= 6x `--model hf` in wall clock on all 1,319 docs

RUN_KEYS = (
    "model",
    "batch_size",
    "task",
    "docs",  # documents the run generated for (lm-eval's sample count)
    "full_docs",  # documents of the full measurement (the task's, or --limit)
    "num_fewshot",
    "max_gen_toks",
    "wall_s",  # measured: process start to end
    "load_s",  # model construction, inside the child (the entry's timing hook)
    "generate_s",  # inside generate_until (the entry's timing hook)
    "docs_s",  # docs / generate_s
    "answer_tokens",  # tokens of the answers as returned (after lm-eval's stop cut)
    "engine_tokens",  # tokens nakta's engine generated (None for hf)
    "exact_match",
    "extrapolated_full_wall_s",  # only for runs on fewer docs than full_docs, else None
    "timeout_s",
    "log",
    "error",  # None, the failure, or "skipped: ..." (not started: --deadline-s)
    "engine",  # nakta: the engine's counters (prefill_s, decode_s, decode_steps, max_batch...)
    "nakta_load",  # nakta: the load's parts (read_s, warm_up_s, prefetched)
    "events",  # the child's moments, seconds from its entry (process start, model, requests)
)
SUMMARY_KEYS = (
    "device_name",
    "gpus_available",
    "runs",
    "ratio_hf_over_nakta",  # measured: best hf wall / nakta wall, both on full_docs
    "ratio_hf_over_nakta_extrapolated",  # hf's extrapolated full wall / nakta's measured one
    "ratio_hf_over_nakta_same_docs",  # measured, both on hf's subset (nakta run there too)
    "target_hf_over_nakta",
    "setup",  # weights, dtype, versions, how long making the weights took
)


def extrapolate(run: dict) -> float | None:
    """A subset run's wall on ``full_docs``: fixed part + generation scaled linearly."""
    if run["error"] or not run["docs"] or run["docs"] >= run["full_docs"]:
        return None
    if run["wall_s"] is None or run["generate_s"] is None:
        return None
    fixed = run["wall_s"] - run["generate_s"]
    return fixed + run["generate_s"] * run["full_docs"] / run["docs"]


def _ok(runs: Sequence[dict], model: str, full: bool) -> list[dict]:
    return [
        r
        for r in runs
        if r["model"] == model
        and r["error"] is None
        and r["wall_s"] is not None
        and (r["docs"] == r["full_docs"]) == full
    ]


def ratios(runs: Sequence[dict]) -> dict:
    """The three hf / nakta wall ratios (None where a side is missing); hf's best run is the
    peer: its fastest batch size."""
    out = dict.fromkeys(SUMMARY_KEYS[3:6])
    nakta_full, hf_full = _ok(runs, "nakta", True), _ok(runs, "hf", True)
    if nakta_full and hf_full:
        out["ratio_hf_over_nakta"] = min(r["wall_s"] for r in hf_full) / nakta_full[0]["wall_s"]
    hf_sub = [r for r in _ok(runs, "hf", False) if r["extrapolated_full_wall_s"] is not None]
    if nakta_full and hf_sub:
        best = min(r["extrapolated_full_wall_s"] for r in hf_sub)
        out["ratio_hf_over_nakta_extrapolated"] = best / nakta_full[0]["wall_s"]
    nakta_sub = _ok(runs, "nakta", False)
    if nakta_sub and hf_sub:
        same = [r for r in hf_sub if r["docs"] == nakta_sub[0]["docs"]]
        if same:
            best = min(r["wall_s"] for r in same)
            out["ratio_hf_over_nakta_same_docs"] = best / nakta_sub[0]["wall_s"]
    return out


def _fmt(x: object, spec: str = ".1f") -> str:
    if x is None:
        return "-"
    return format(x, spec) if isinstance(x, float) else str(x)


def _ratio_line(name: str, value: float | None, what: str) -> str:
    if value is None:
        return f"- {name}: - (no such pair of finished runs)"
    verdict = "meets" if value >= TARGET else "misses"
    return f"- {name}: **{value:.2f}x** ({what}; {verdict} the >= {TARGET:g}x target)"


def markdown(summary: dict) -> str:
    setup = summary["setup"]
    runs = summary["runs"]
    task = runs[0]["task"] if runs else "-"
    lines = [
        f"# lm-eval generate_until at full size: nakta vs hf ({summary['device_name']})",
        "",
        f"`{task}` through `python -m accuracy_test.lm_eval_cli`, every run a fresh process; "
        f"weights {setup.get('weights')} ({setup.get('dtype')}), lm-eval {setup.get('lm_eval')}, "
        f"transformers {setup.get('transformers')}, torch {setup.get('torch')}. "
        "wall = process start to end (measured here); load = model construction and generate = "
        "inside `generate_until` (both measured inside the child); answer tokens = the answers "
        "as returned (after lm-eval's stop-string cut) encoded again by the model's tokenizer, "
        "the same measure for both models (decoded text of random tokens need not re-encode to "
        "as many tokens); engine tokens = the tokens nakta's engine decoded. nakta runs at its "
        "defaults (no `--batch_size`); hf at the batch sizes given. Extrapolated walls (hf on a "
        "subset): the run's fixed part (wall - generate) plus its generate time scaled "
        "linearly to all docs, a lower bound for hf (whole batches, each as long as its "
        "longest row).",
        "",
        "| model | batch size | docs | shots | max new | wall s (measured) | load s | generate s "
        "| docs/s | answer tokens | engine tokens | exact_match | wall s on all docs "
        "(extrapolated) | error |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['model']} | {r['batch_size']} | {_fmt(r['docs'])} | {_fmt(r['num_fewshot'])} "
            f"| {_fmt(r['max_gen_toks'])} | {_fmt(r['wall_s'], '.2f')} | {_fmt(r['load_s'], '.2f')} "
            f"| {_fmt(r['generate_s'], '.2f')} | {_fmt(r['docs_s'], '.2f')} "
            f"| {_fmt(r['answer_tokens'])} | {_fmt(r['engine_tokens'])} "
            f"| {_fmt(r['exact_match'], '.4f')} | {_fmt(r['extrapolated_full_wall_s'], '.1f')} "
            f"| {r['error'] or ''} |"
        )
    full = runs[0]["full_docs"] if runs else None
    lines += [
        "",
        f"## hf / nakta wall clock (target: nakta >= {TARGET:g}x hf on all {_fmt(full)} docs)",
        "",
        _ratio_line(
            "measured, both on all docs", summary["ratio_hf_over_nakta"], "hf's best batch size"
        ),
        _ratio_line(
            "hf extrapolated to all docs / nakta measured on all docs",
            summary["ratio_hf_over_nakta_extrapolated"],
            "hf's best subset run; linear in docs, a lower bound for hf",
        ),
        _ratio_line(
            "measured, both on hf's subset",
            summary["ratio_hf_over_nakta_same_docs"],
            "the same first docs",
        ),
    ]
    made = [f"{k} {setup[k]:.1f} s" for k in ("make_hf_s", "convert_s") if setup.get(k) is not None]
    if made:
        lines += ["", f"Weights made for this run: {', '.join(made)} (not in any run's wall)."]
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    """One bar per run's measured wall; hatched bars for extrapolated full-size walls."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = []  # (label, seconds, color, hatch)
    for r in summary["runs"]:
        if r["wall_s"] is None or r["error"]:
            continue
        color = "#3a7dc9" if r["model"] == "nakta" else "#e08a2e"
        label = f"{r['model']} bs {r['batch_size']}\n{r['docs']} docs"
        bars.append((label, r["wall_s"], color, None))
        if r["extrapolated_full_wall_s"] is not None:
            label = f"{r['model']} bs {r['batch_size']}\n{r['full_docs']} docs (extrap.)"
            bars.append((label, r["extrapolated_full_wall_s"], color, "//"))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(bars) + 2), 4.5))
    for i, (_label, seconds, color, hatch) in enumerate(bars):
        fill = "white" if hatch else color
        ax.bar(i, seconds, color=fill, edgecolor=color, hatch=hatch)
        ax.text(i, seconds, f"{seconds:.1f}s", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    ax.set_ylabel("seconds, process start to end (hatched: extrapolated)")
    task = summary["runs"][0]["task"] if summary["runs"] else ""
    ax.set_title(f"lm-eval {task}: nakta vs hf, {summary['device_name']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(summary: dict, out: Path) -> list[Path]:
    """The summary (exact schema), its table and its plot into ``out``, atomically."""
    from nakta_model.io_utils import atomic_output_file, atomic_write_text

    bad = [sorted(set(r) ^ set(RUN_KEYS)) for r in summary["runs"] if set(r) != set(RUN_KEYS)]
    if bad or set(summary) != set(SUMMARY_KEYS):
        raise ValueError(f"summary does not follow the schema: {sorted(summary)} {bad}")
    out.mkdir(parents=True, exist_ok=True)
    files = [out / f"lm_eval_summary.{ext}" for ext in ("json", "md", "png")]
    ordered = {k: summary[k] for k in SUMMARY_KEYS}
    ordered["runs"] = [{k: r[k] for k in RUN_KEYS} for r in summary["runs"]]
    atomic_write_text(files[0], json.dumps(ordered, indent=2) + "\n")
    atomic_write_text(files[1], markdown(ordered))
    with atomic_output_file(files[2]) as tmp:
        plot(ordered, tmp)
    return files
