"""lm_eval_speed's report: the hf/nakta wall ratios, the markdown table and the figure.

Kept apart from the runner (``lm_eval_speed.py``) so each reads in one sitting; both share the
task name and the ``default`` batch-size label (a run with no ``--batch_size`` flag at all).
"""

from __future__ import annotations

import json
from pathlib import Path

TASK = "hellaswag_local"
DEFAULT = "default"  # batch size: no --batch_size flag at all


def _fmt(v: object, spec: str = ".4g") -> str:
    return "" if v is None else format(v, spec) if isinstance(v, float) else str(v)


def _task(r: dict) -> str:
    return r.get("task") or TASK


def _label(r: dict) -> str:
    """A run's model, and "plain lm-eval" for hf on lm-eval as shipped."""
    return r["model"] + (" (plain lm-eval)" if r.get("harness") == "plain" else "")


def _groups(runs: list[dict]) -> list[tuple[str, int]]:
    """(task, shot count) pairs in the order the runs first name them."""
    return list(dict.fromkeys((_task(r), r["num_fewshot"]) for r in runs))


def _wall(
    runs: list[dict], model: str, task: str, shot: int, harness: str = "fixed"
) -> dict[str, float]:
    """Wall seconds of one model's successful runs of one task and shot count, by batch size
    (``harness``: through the entry's fixes, or lm-eval as shipped: "plain")."""
    return {
        r["batch_size"]: r["wall_s"]
        for r in runs
        if r["model"] == model
        and _task(r) == task
        and r["num_fewshot"] == shot
        and r["error"] is None
        and r.get("harness", "fixed") == harness
    }


def ratios(runs: list[dict]) -> list[dict]:
    """Per task and shot count: nakta/hf wall at each batch size and best vs best; nakta
    default/best."""
    out = []
    for task, shot in _groups(runs):
        hf, nk = _wall(runs, "hf", task, shot), _wall(runs, "nakta", task, shot)
        plain = _wall(runs, "hf", task, shot, "plain")
        row: dict = {"task": task, "num_fewshot": shot}
        row["nakta_over_hf"] = {bs: nk[bs] / hf[bs] for bs in nk if bs in hf}
        if hf and nk:
            row["best_nakta_over_best_hf"] = min(nk.values()) / min(hf.values())
        if plain and nk:  # against lm-eval as shipped: what a user of lm_eval --model hf meets
            row["best_nakta_over_best_hf_plain"] = min(nk.values()) / min(plain.values())
        if nk:
            best = min(nk, key=nk.get)
            row["nakta_best_batch_size"] = best
            if DEFAULT in nk:
                row["nakta_default_over_best"] = nk[DEFAULT] / nk[best]
        out.append(row)
    return out


def markdown(summary: dict) -> str:
    m = summary
    lines = [
        f"# lm-eval speed: hf vs nakta ({m['weights']}, {m['dtype']}, {m['device']})",
        "",
        f"`{m.get('task', TASK)}` (data `{m['data']}`; limit {m['limit']}, few-shot limit "
        f"{m['fewshot_limit']}, unless the task names its own), "
        f"lm-eval {m['lm_eval']}, transformers {m['transformers']}, torch {m['torch']}. "
        "wall = child process start to end; load = model construction (nakta: weights "
        "prefetched onto the GPU since lm-eval parsed its arguments, then the kernels' "
        "warm-up; wait = what the first request still waited, with background_load=true); "
        "1st request = process start to the first "
        "model call; scoring = lm-eval's evaluate(), of which model = inside the model's "
        "request methods. `default` = no --batch_size flag.",
        "",
        "| task | model | shots | batch size | wall s | load s | wait s | 1st request s | "
        "scoring s | model s | acc | acc_norm | exact_match | n | "
        "tokens computed / unique / requested |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["runs"]:
        tokens = "-"
        if r.get("computed_tokens"):
            tokens = f"{r['computed_tokens']} / {r['unique_tokens']} / {r['request_tokens']}"
        lines.append(
            f"| {_task(r)} | {_label(r)} | {r['num_fewshot']} | {r['batch_size']} | "
            f"{_fmt(r['wall_s'])} | {_fmt(r['load_s'])} | {_fmt(r.get('load_wait_s'))} | "
            f"{_fmt(r.get('first_request_s'))} | {_fmt(r['scoring_s'])} | "
            f"{_fmt(r.get('requests_s'))} | {_fmt(r.get('acc'))} | "
            f"{_fmt(r.get('acc_norm'))} | {_fmt(r.get('exact_match'))} | {_fmt(r['n'])} | "
            f"{tokens} |" + (f" failed: {r['error']}" if r["error"] else "")
        )
    lines += ["", "## Ratios (wall seconds)", ""]
    for row in summary["ratios"]:
        parts = [f"nakta/hf at {bs}: {x:.3g}" for bs, x in row["nakta_over_hf"].items()]
        if "best_nakta_over_best_hf" in row:
            parts.append(f"best nakta / best hf: {row['best_nakta_over_best_hf']:.3g}")
        if "best_nakta_over_best_hf_plain" in row:
            parts.append(
                "best nakta / best hf on lm-eval as shipped: "
                f"{row['best_nakta_over_best_hf_plain']:.3g}"
            )
        if "nakta_default_over_best" in row:
            parts.append(
                f"nakta default / its best ({row['nakta_best_batch_size']}): "
                f"{row['nakta_default_over_best']:.3g}"
            )
        head = f"- {row.get('task', TASK)} {row['num_fewshot']}-shot: "
        lines.append(head + ("; ".join(parts) or "no pair"))
    warm = m.get("warmups") or []
    if warm:
        lines += ["", "## First nakta run on this machine (--warmup, not in the ratios)", ""]
        lines += [
            "Each task and shot count's first nakta run, before the timed ones: Triton's disk "
            "cache empty for its shapes and the checkpoint not yet in the page cache, as on a "
            "user's first run. Its timed twin is the same command run again.",
            "",
        ]
        for r in warm:
            timed = next(
                (
                    t
                    for t in summary["runs"]
                    if (_task(t), t["num_fewshot"], t["model"], t["batch_size"])
                    == (_task(r), r["num_fewshot"], r["model"], r["batch_size"])
                ),
                None,
            )
            twin = f" (timed twin: {_fmt(timed['wall_s'])} s)" if timed else ""
            lines.append(
                f"- {_task(r)} {r['num_fewshot']}-shot, batch {r['batch_size']}: wall "
                f"{_fmt(r['wall_s'])} s, load {_fmt(r['load_s'])} s, scoring "
                f"{_fmt(r['scoring_s'])} s{twin}" + (f" failed: {r['error']}" if r["error"] else "")
            )
    extra = []
    if m.get("convert_s") is not None:
        extra.append(f"- convert.py: {m['convert_s']:.3g} s")
    if m.get("reused_work"):
        extra.append(f"- checkpoints reused from an earlier run (`{m['reused_work']}`)")
    if m["make_hf_s"] is not None:
        extra.append(f"- random HF checkpoint made and saved: {m['make_hf_s']:.3g} s")
    return "\n".join(lines + [""] + extra) + "\n"


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench_common.report import save_figure

    runs = [r for r in summary["runs"] if r["error"] is None]
    groups = _groups(runs) or [(TASK, 0)]
    sizes = list(dict.fromkeys(r["batch_size"] for r in summary["runs"]))
    models = list(dict.fromkeys(_label(r) for r in summary["runs"]))
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    width = 0.8 / max(len(models), 1)
    for ax, (task, shot) in zip(axes[0], groups):
        for j, model in enumerate(models):
            by_bs = {
                r["batch_size"]: r
                for r in runs
                if _label(r) == model and r["num_fewshot"] == shot and _task(r) == task
            }
            xs = [i + j * width for i, bs in enumerate(sizes) if bs in by_bs]
            got = [by_bs[bs] for bs in sizes if bs in by_bs]
            color = f"C{j}"
            ax.bar(xs, [r["wall_s"] for r in got], width, color=color, alpha=0.35)
            ax.bar(xs, [r["scoring_s"] or 0 for r in got], width * 0.6, color=color)
            ax.bar([], [], color=color, label=f"{model}: wall (light), scoring (dark)")
        ax.set_xticks([i + width * (len(models) - 1) / 2 for i in range(len(sizes))])
        ax.set_xticklabels(sizes)
        ax.set_xlabel("--batch_size")
        ax.set_ylabel("seconds")
        ax.set_title(f"{task}, {shot}-shot" if len({t for t, _ in groups}) > 1 else f"{shot}-shot")
        ax.legend(fontsize=8)
    m = summary
    fig.suptitle(
        f"lm-eval {m.get('task', TASK)}: hf vs nakta ({m['weights']}, {m['dtype']}, {m['device']})"
    )
    save_figure(fig, path)
    plt.close(fig)


def write_outputs(summary: dict, out: Path) -> None:
    from nakta_model.io_utils import atomic_write_text

    atomic_write_text(
        out / "lm_eval_summary.json", json.dumps(summary, indent=2, sort_keys=True) + "\n"
    )
    atomic_write_text(out / "lm_eval_summary.md", markdown(summary))
    plot(summary, out / "lm_eval_summary.png")
