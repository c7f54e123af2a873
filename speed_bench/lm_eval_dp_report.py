"""The lm-eval data-parallel measurement's numbers, table and plot (``lm_eval_dp.py`` writes them).

A run's phases come from its process's start and end (measured by the driver) and every rank's
timing file (``NAKTA_LM_EVAL_TIMING``: ``entry_unix`` + events): ``first_request_s`` is when
the LAST rank sent its first request (the run cannot score faster than its slowest replica's
start), ``scoring_s`` from then to the last rank's last answer, ``after_scoring_s`` from then to
the process's exit. The three add up to ``wall_s``.

Each rank's fixed time is broken down by :func:`rank_breakdown` (:data:`BREAKDOWN_SPANS`: the
interpreter, lm-eval's imports and set-up, the model's module, its constructor, lm-eval loading
the docs and building the requests, the scorer's warm-up, the tail after the last answer).

Files: ``lm_eval_dp_summary.json`` (``device_name``, ``gpus_available``, ``runs``: exactly the
keys of :data:`RUN_KEYS`, ``hf_wall_s`` None where no hf run stood beside; ``ranks``: one row
per rank of every run, :func:`rank_rows`), ``lm_eval_dp_ranks.json`` (each run's per-rank
phases, token shares, errors and logs), ``lm_eval_dp_summary.md`` (the table, the dp/1-GPU
ratios against the issues' targets, the per-rank breakdown, the suite runs) and
``lm_eval_dp_summary.png``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "RUN_KEYS",
    "markdown",
    "rank_breakdown",
    "rank_phases",
    "rank_rows",
    "run_phases",
    "summary_record",
    "write_outputs",
]

RUN_KEYS = (
    "preset",
    "gpus",
    "tp",
    "dp",
    "task",
    "num_fewshot",
    "limit",
    "wall_s",
    "first_request_s",
    "scoring_s",
    "after_scoring_s",
    "acc",
    "hf_wall_s",
)
# a row of the summary's per-rank table: the run's identity, the rank, its breakdown
# the issues' targets: dp wall / 1-GPU wall, per (dp, shots) (issue 43: 0.35x / 0.33x at dp=4)
WALL_TARGETS = {(2, 10): 0.6, (2, 0): 0.7, (4, 10): 0.33, (4, 0): 0.35}
FIXED_SLACK_S = 2.0  # dp's fixed part (wall - scoring) may exceed one GPU's by this much


def rank_phases(timing: dict) -> dict:
    """One rank's moments (unix seconds) and shares, from its timing file."""
    entry, ev = timing["entry_unix"], timing.get("events") or {}
    ll = timing.get("loglikelihood") or {}
    out = {
        "rank": timing.get("rank", 0),
        "first_request_unix": entry + ev["first_request"] if "first_request" in ev else None,
        "last_request_end_unix": entry + ev["last_request_end"]
        if "last_request_end" in ev
        else None,
        "exit_unix": entry + ev["exit"] if "exit" in ev else None,
        "model_start_unix": entry + ev["model_start"] if "model_start" in ev else None,
        "model_ready_unix": entry + ev["model_end"] if "model_end" in ev else None,
        # the rank's Python started (under torchrun: after the launcher's own start-up)
        "python_start_unix": entry + ev["process_start"] if "process_start" in ev else None,
    }
    for key in ("tokenize_s", "score_s", "gather_s", "shard_s", "items"):
        out[key] = ll.get(key)
    out["requests_s"] = timing.get("requests_s")
    out["load_s"] = timing.get("load_s")
    out["breakdown"] = rank_breakdown(timing)
    return out


# Where a rank's fixed time goes: (column, from event, to event) in the entry's timing events
# (seconds since the entry module was imported; ``process_start`` is negative). A missing event
# (an older entry, a run that stopped early) leaves its column empty.
BREAKDOWN_SPANS = (
    ("python_s", "process_start", None),  # interpreter start-up, site, to the entry's import
    ("lm_eval_import_s", None, "args_parsed"),  # lm-eval's CLI modules, its argument parsing
    # lm-eval's task machinery imported (datasets), its evaluator, its configuration built
    ("config_s", "args_parsed", "task_index_start"),
    ("task_index_s", "task_index_start", "task_index_end"),  # lm-eval's TaskManager index
    # simple_evaluate up to the model: its seeds, which import torch
    ("lm_eval_setup_s", "task_index_end", "get_model_start"),
    ("model_import_s", "get_model_start", "get_model_end"),  # the adapter: Triton, Nakta
    ("model_build_s", "model_start", "model_end"),  # constructor: process group, tokenizer, load
    ("tasks_load_s", "tasks_load_start", "tasks_load_end"),  # lm-eval loads the task's docs
    ("requests_build_s", "evaluate_start", "first_request"),  # lm-eval builds the requests
    # the scorer's kernels ready (on a thread from the model's construction, or evaluate's
    # start: warm_up_wait_s is what the first request still waited for it)
    ("warm_up_s", "load_warm_up_start", "load_warm_up_end"),
    ("after_last_answer_s", "last_request_end", "exit"),  # metrics, results, env report
)
BREAKDOWN_KEYS = (
    *(name for name, _, _ in BREAKDOWN_SPANS),
    "init_parallel_s",
    "read_s",
    "warm_up_wait_s",
    "tokenize_s",
    "score_s",
    "gather_s",
)


def rank_breakdown(timing: dict) -> dict:
    """:data:`BREAKDOWN_KEYS` of one rank's timing file (seconds; None where not recorded):
    the spans between its events, the constructor's process-group rendezvous
    (``init_parallel_s``) and weight read (``read_s``), and the loglikelihood split."""
    ev = dict(timing.get("events") or {})
    ev[None] = 0.0  # the entry's own import
    out: dict = {}
    for name, start, end in BREAKDOWN_SPANS:
        a, b = ev.get(start), ev.get(end)
        out[name] = None if a is None or b is None else b - a
    load = timing.get("nakta_load") or {}
    ll = timing.get("loglikelihood") or {}
    out["init_parallel_s"] = load.get("init_parallel_s")
    out["read_s"] = load.get("read_s")
    out["warm_up_wait_s"] = load.get("warm_up_wait_s")  # what the first request still waited
    for key in ("tokenize_s", "score_s", "gather_s"):
        out[key] = ll.get(key)
    return out


def run_phases(ranks: Sequence[dict], spawn_unix: float, end_unix: float) -> dict:
    """``wall_s`` and its three phases (module doc) from every rank's :func:`rank_phases`."""
    firsts = [r["first_request_unix"] for r in ranks]
    lasts = [r["last_request_end_unix"] for r in ranks]
    wall = end_unix - spawn_unix
    if not ranks or None in firsts or None in lasts:
        return {"wall_s": wall, "first_request_s": None, "scoring_s": None, "after_scoring_s": None}
    first, last = max(firsts), max(lasts)
    return {
        "wall_s": wall,
        "first_request_s": first - spawn_unix,
        "scoring_s": last - first,
        "after_scoring_s": end_unix - last,
    }


def rank_rows(ranks: dict) -> list[dict]:
    """The summary's per-rank table: one row per rank of every run in ``ranks`` (the driver's
    ``{run name: {"preset", "tp", "dp", "num_fewshot", "limit", "launcher", "ranks": [...]}}``),
    with the run's identity and the rank's :data:`BREAKDOWN_KEYS`."""
    rows = []
    for name, info in ranks.items():
        for r in info.get("ranks") or []:
            row = {"run": name, "launcher": info.get("launcher")}
            row.update({k: info.get(k) for k in ("preset", "tp", "dp", "num_fewshot", "limit")})
            row["rank"] = r["rank"]
            row.update({k: (r.get("breakdown") or {}).get(k) for k in BREAKDOWN_KEYS})
            rows.append(row)
    return rows


def summary_record(run: dict) -> dict:
    """The run as the summary's schema has it: exactly :data:`RUN_KEYS`."""
    return {key: run.get(key) for key in RUN_KEYS}


def _fmt(v: object, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec) if isinstance(v, float) else str(v)


def _pairs(runs: Sequence[dict]) -> list[tuple[dict, dict]]:
    """(1-GPU run, dp run) of the same task, shots and limit."""
    out = []
    for one in (r for r in runs if r["dp"] == 1 and r["tp"] == 1):
        for dp in (r for r in runs if r["dp"] > 1 and r["tp"] == 1):
            same = ("preset", "task", "num_fewshot", "limit")
            if all(one[k] == dp[k] for k in same):
                out.append((one, dp))
    return out


def ratio_rows(runs: Sequence[dict]) -> list[dict]:
    """Per pair: the wall ratio and the fixed parts, against the issue's targets."""
    rows = []
    for one, dp in _pairs(runs):
        if one["wall_s"] is None or dp["wall_s"] is None:
            continue
        ratio = dp["wall_s"] / one["wall_s"]
        target = WALL_TARGETS.get((dp["dp"], one["num_fewshot"]))
        fixed = {}
        for name, r in (("one", one), ("dp", dp)):
            fixed[name] = None if r["scoring_s"] is None else r["wall_s"] - r["scoring_s"]
        fixed_ok = None
        if None not in fixed.values():
            fixed_ok = fixed["dp"] <= fixed["one"] + FIXED_SLACK_S
        rows.append(
            {
                "task": one["task"],
                "num_fewshot": one["num_fewshot"],
                "limit": one["limit"],
                "dp": dp["dp"],
                "wall_ratio": ratio,
                "target": target,
                "wall_ok": None if target is None else ratio <= target,
                "fixed_one_s": fixed["one"],
                "fixed_dp_s": fixed["dp"],
                "fixed_ok": fixed_ok,
            }
        )
    return rows


def markdown(summary: dict, ranks: dict | None = None, suite: list[dict] | None = None) -> str:
    """The runs table, the ratios against the targets, per-rank phases, the suite runs."""
    lines = [
        f"# lm-eval through Nakta: 1 GPU vs data parallel ({summary['device_name']}, "
        f"{summary['gpus_available']} GPUs available)",
        "",
        "Fresh processes, the project's entry (`python -m accuracy_test.lm_eval_cli`). A dp run "
        "starts its ranks through the entry itself (`--model_args ...,dp=N`, launcher `nakta`: "
        "`nakta_model.spawn`) or `torchrun --nproc_per_node N` (launcher `torchrun`); this "
        "table holds the first launcher measured, the per-rank table every run. first request "
        "/ scoring / after scoring add up to the wall (the slowest rank's moments).",
        "",
        "| model | task | shots | limit | GPUs | tp | dp | wall s | first request s | scoring s "
        "| after scoring s | acc | hf wall s | hf / nakta |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary["runs"]:
        hf = r.get("hf_wall_s")
        ratio = f"{hf / r['wall_s']:.2f}x" if hf and r["wall_s"] else "-"
        lines.append(
            f"| {r.get('preset') or '-'} | {r['task']} | {r['num_fewshot']} | {_fmt(r['limit'])} "
            f"| {r['gpus']} | {r['tp']} "
            f"| {r['dp']} | {_fmt(r['wall_s'])} | {_fmt(r['first_request_s'])} "
            f"| {_fmt(r['scoring_s'])} | {_fmt(r['after_scoring_s'])} | {_fmt(r['acc'], '.4f')} "
            f"| {_fmt(hf)} | {ratio} |"
        )
    rows = ratio_rows(summary["runs"])
    if rows:
        lines += [
            "",
            "| task | shots | limit | dp wall / 1-GPU wall | target | fixed part 1 GPU s "
            "| fixed part dp s | fixed <= 1 GPU + 2 s |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for x in rows:
            ok = {True: "yes", False: "NO", None: "-"}
            target = "-" if x["target"] is None else f"<= {x['target']}"
            lines.append(
                f"| {x['task']} | {x['num_fewshot']} | {_fmt(x['limit'])} "
                f"| {x['wall_ratio']:.2f} ({ok[x['wall_ok']]}) | {target} "
                f"| {_fmt(x['fixed_one_s'])} | {_fmt(x['fixed_dp_s'])} | {ok[x['fixed_ok']]} |"
            )
    if ranks:
        lines += [
            "",
            "Per rank (seconds after the process started; shares of the loglikelihood requests):",
            "",
            "| run | launcher | wall s | rank | model ready | first request | last answer | exit "
            "| tokenize s | score s | gather s | requests | python started |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, info in ranks.items():
            spawn = info["spawn_unix"]
            for r in info["ranks"]:
                at = {
                    k: None if r.get(k) is None else r[k] - spawn
                    for k in (
                        "model_ready_unix",
                        "first_request_unix",
                        "last_request_end_unix",
                        "exit_unix",
                        "python_start_unix",
                    )
                }
                lines.append(
                    f"| {name} | {info.get('launcher') or '-'} | {_fmt(info.get('wall_s'))} "
                    f"| {r['rank']} | {_fmt(at['model_ready_unix'])} "
                    f"| {_fmt(at['first_request_unix'])} | {_fmt(at['last_request_end_unix'])} "
                    f"| {_fmt(at['exit_unix'])} | {_fmt(r['tokenize_s'], '.2f')} "
                    f"| {_fmt(r['score_s'], '.2f')} | {_fmt(r['gather_s'], '.2f')} "
                    f"| {_fmt(r['items'])} | {_fmt(at['python_start_unix'])} |"
                )
    if summary.get("ranks"):
        cols = BREAKDOWN_KEYS
        lines += [
            "",
            "Where each rank's time goes (seconds; spans between the entry's timing events: "
            "python = interpreter start to the entry, lm-eval import = to its arguments parsed, "
            "config = to lm-eval's task index (its task machinery and datasets imported), "
            "lm-eval setup = from the index to the model (its seeds import torch), model import "
            "= the adapter's modules (Triton, Nakta), model build = the constructor (of it init parallel = the process "
            "group's rendezvous, read = the weights), tasks load = lm-eval loading the docs, "
            "requests build = evaluate's start to the first request, warm up = the scorer's "
            "warm-up (on a thread from evaluate's start; warm up wait = what the first request "
            "still waited), after last answer = to the entry's exit):",
            "",
            "| run | rank | " + " | ".join(c[:-2].replace("_", " ") for c in cols) + " |",
            "|---|---:|" + "---:|" * len(cols),
        ]
        for r in summary["ranks"]:
            lines.append(
                f"| {r['run']} | {r['rank']} | "
                + " | ".join(_fmt(r[c], ".2f") for c in cols)
                + " |"
            )
    if suite:
        lines += [
            "",
            "A suite of tasks in one lm-eval call vs one call per task (same limit per task):",
            "",
            "| model | batch size | how | tasks | limit | wall s | scores |",
            "|---|---|---|---|---:|---:|---|",
        ]
        for s in suite:
            scores = ", ".join(
                f"{t} {v:.4f}" for t, v in (s.get("acc") or {}).items() if v is not None
            )
            err = f" FAILED: {s['error']}" if s.get("error") else ""
            lines.append(
                f"| {s['model']} | {s.get('batch_size') or 'default'} | {s['mode']} "
                f"| {len(s['tasks'])} | {_fmt(s['limit'])} "
                f"| {_fmt(s['wall_s'])} | {scores}{err} |"
            )
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    """Stacked bars per run: first request, scoring, after scoring (seconds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in summary["runs"] if r["wall_s"] is not None]
    labels = [
        f"{r['num_fewshot']}-shot {r['limit'] or 'all'}\n{r['gpus']} GPU{'s' if r['gpus'] > 1 else ''}"
        f" dp={r['dp']}"
        for r in runs
    ]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(runs) + 2), 4.5))
    bottom = [0.0] * len(runs)
    for key, color in (
        ("first_request_s", "#bbbbbb"),
        ("scoring_s", "#3a7dc9"),
        ("after_scoring_s", "#e08a2e"),
    ):
        values = [r[key] or 0.0 for r in runs]
        ax.bar(labels, values, bottom=bottom, color=color, label=key[:-2].replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, r in enumerate(runs):
        ax.text(i, r["wall_s"], f"{r['wall_s']:.1f}s", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("seconds (process start to exit)")
    ax.set_title(f"lm-eval hellaswag_local through Nakta, {summary['device_name']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(
    summary: dict, out: Path, ranks: dict | None = None, suite: list[dict] | None = None
) -> list[Path]:
    """The summary (exact schema), per-rank details, table and plot into ``out``, atomically."""
    from nakta_model.io_utils import atomic_output_file, atomic_write_text

    bad = [sorted(set(r) ^ set(RUN_KEYS)) for r in summary["runs"] if set(r) != set(RUN_KEYS)]
    if bad or set(summary) != {"device_name", "gpus_available", "runs", "ranks"}:
        raise ValueError(f"summary does not follow the schema: {sorted(summary)} {bad}")
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "lm_eval_dp_summary.json", out / "lm_eval_dp_summary.md"]
    atomic_write_text(files[0], json.dumps(summary, indent=2) + "\n")
    atomic_write_text(files[1], markdown(summary, ranks, suite))
    details = {"ranks": ranks or {}, "suite": suite or []}
    files.append(out / "lm_eval_dp_ranks.json")
    atomic_write_text(files[-1], json.dumps(details, indent=2) + "\n")
    files.append(out / "lm_eval_dp_summary.png")
    with atomic_output_file(files[-1]) as tmp:
        plot(summary, tmp)
    return files
