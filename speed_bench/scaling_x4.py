"""The 4-GPU scoring catalogue in one summary: the seed's 4-process command, 30B / 65B at tp=4
against ``llama_org`` at MP=4, the scaling grids (1, 2 and 4 GPUs; tp x dp = 4x1, 2x2, 1x4)
and the lm-eval rows of the data-parallel report.

    python -m speed_bench.scaling_x4 RUN... [--seed-command RC WALL_S] [--lm-eval FILE] \\
        --out speed_bench/results/<device>-x4/scaling_x4 [--index]

``RUN``: ``run_all`` result folders or ``summary.json`` files. A scoring row per run and engine:
``vs_llama_org`` is its tasks/s over ``llama_org``'s in the same run (same grid, dtype and
weights) and ``pred_agree`` the share of tasks whose acc and acc_norm predictions equal
``llama_org``'s; a run without ``llama_org`` (the scaling grids) has ``vs_llama_org`` null and
``pred_agree`` against the one-GPU run of the same preset, dtype, engine and workload given in
the same command (1.0 for that run itself; null when none was given). ``--lm-eval``: an
``lm_eval_dp_summary.json`` (``speed_bench.lm_eval_dp``); its HellaSwag ``runs`` become the
lm-eval rows.

The jobs run in separate device calls, so an existing summary in ``--out`` is merged: a new row
replaces the old row of the same preset, dtype, grid and engine (and kind: against
``llama_org`` or not), the other rows stay; ``--lm-eval`` replaces every lm-eval row.
Results of another device are refused. Writes ``scaling_x4_summary.{json,md,csv,png}``; with
``--index`` also the device folder's index ``README.md`` (the folder above ``--out``).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

if not __package__:  # run by path: import from the repo root, not from this script's folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import pandas as pd

from bench_common.report import save_figure, write_json
from nakta_model.cli import InputError, OneLineArgumentParser, exit_on_input_error
from nakta_model.io_utils import atomic_write_text
from speed_bench.scaling import agreement, load_summary

GPUS = 4
STEM = "scaling_x4_summary"
TOP_KEYS = ("device_name", "gpus", "seed_command", "scoring", "lm_eval")
SEED_KEYS = ("rc", "wall_s")
SCORING_KEYS = (
    "preset",
    "dtype",
    "tp",
    "dp",
    "engine",
    "tasks_per_s",
    "vs_llama_org",
    "pred_agree",
)
LM_EVAL_KEYS = ("preset", "tp", "dp", "num_fewshot", "limit", "wall_s", "hf_wall_s")
# what the lm-eval data-parallel report's runs must carry (hf_wall_s may be missing: no hf run)
LM_EVAL_SOURCE_KEYS = ("task", "preset", "tp", "dp", "num_fewshot", "limit", "wall_s")
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
_PRESET_ORDER = {"7B": 0, "13B": 1, "30B": 2, "65B": 3}
# issue 43's targets, checked in the table's notes
SCORING_TARGET = 2.37  # nakta_cache / llama_org at tp=4 (the seed's figure), 30B and 65B
LM_EVAL_TARGETS = {(0, None): 0.35, (10, 2000): 0.33}  # 7B dp=4 wall / one-GPU wall
HF_TARGET = 2.5  # 30B through lm-eval at tp=4 against --model hf (parallelize=True)


def slug(name: str) -> str:
    """``bench_common.ceilings.device_slug``'s folder name for a device name."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def preset_of(model: str) -> str:
    """``random-30B`` -> ``30B`` (a checkpoint's name stays as it is)."""
    return model.removeprefix("random-")


def _key(row: dict) -> tuple:
    return (
        row["preset"],
        row["dtype"],
        row["tp"],
        row["dp"],
        row["engine"],
        row["vs_llama_org"] is None,
    )


def scoring_rows(summaries: list[dict]) -> list[dict]:
    """One row per run and engine (module doc: ``vs_llama_org``, ``pred_agree``)."""
    rows = []
    for s in summaries:
        tp, dp = int(s.get("tp", 1)), int(s.get("dp", 1))
        if tp * dp > GPUS:
            raise ValueError(f"run {s['model']} tp {tp} x dp {dp} uses more than {GPUS} GPUs")
        engines = s["engines"]
        has_ref = "llama_org" in engines and s.get("reference_engine") == "llama_org"
        dtype = _DTYPES.get(s.get("dtype"), s.get("dtype"))
        for name, e in engines.items():
            if has_ref:
                vs = e["tasks_per_s"] / engines["llama_org"]["tasks_per_s"]
                agree = e.get("pred_agree_vs_ref")
            else:
                vs, agree = None, _agree_one_gpu(s, name, summaries)
            rows.append(
                {
                    "preset": preset_of(s["model"]),
                    "dtype": dtype,
                    "tp": tp,
                    "dp": dp,
                    "engine": name,
                    "tasks_per_s": float(e["tasks_per_s"]),
                    "vs_llama_org": vs,
                    "pred_agree": agree,
                }
            )
    return rows


def _agree_one_gpu(run: dict, engine: str, summaries: list[dict]) -> float | None:
    """Prediction agreement of ``run``'s ``engine`` with the one-GPU run of the same model,
    dtype, workload and engine among ``summaries`` (None when there is none)."""

    def same(b: dict) -> bool:
        return (
            b.get("gpus", b.get("tp", 1) * b.get("dp", 1)) == 1
            and engine in b["engines"]
            and (b["model"], b.get("dtype"), b["workload"]["name"], b["workload"]["tasks"])
            == (run["model"], run.get("dtype"), run["workload"]["name"], run["workload"]["tasks"])
        )

    base = next((b for b in summaries if same(b)), None)
    if base is None:
        return None
    return agreement(
        run.get("predictions", {}).get(engine), base.get("predictions", {}).get(engine)
    )


def lm_eval_rows(report: dict, source: str | Path) -> list[dict]:
    """The HellaSwag runs of an ``lm_eval_dp_summary.json`` as lm-eval rows."""
    runs = report.get("runs")
    if not isinstance(runs, list):
        raise ValueError(f"{source}: not an lm-eval data-parallel summary (no 'runs' list)")
    rows = []
    for i, r in enumerate(runs):
        missing = [k for k in LM_EVAL_SOURCE_KEYS if k not in r]
        if missing:
            raise ValueError(f"{source}: runs[{i}] has no {', '.join(map(repr, missing))}")
        if "hellaswag" not in str(r["task"]):
            continue  # a suite run: not a row of this table
        if int(r["tp"]) * int(r["dp"]) > GPUS:
            raise ValueError(f"{source}: runs[{i}] uses more than {GPUS} GPUs")
        rows.append({k: r.get(k) for k in LM_EVAL_KEYS})
    return rows


def _lm_key(row: dict) -> tuple:
    return (row["preset"], row["tp"], row["dp"], row["num_fewshot"], row["limit"])


def merge_lm_eval_rows(reports: list[list[dict]]) -> list[dict]:
    """The rows of several reports, one per run: a later report's row replaces an earlier one's
    (the same call's hf beside it travels with it)."""
    merged: dict[tuple, dict] = {}
    for rows in reports:
        merged.update((_lm_key(r), r) for r in rows)
    return list(merged.values())


def build_summary(
    device_name: str,
    old: dict | None,
    runs: list[dict],
    seed_command: dict | None,
    lm_eval: list[dict] | None,
) -> dict:
    """``old`` (or an empty summary) with the new rows merged in (module doc)."""
    summary = {
        "device_name": device_name,
        "gpus": GPUS,
        "seed_command": (old or {}).get("seed_command"),
        "scoring": list((old or {}).get("scoring", [])),
        "lm_eval": list((old or {}).get("lm_eval", [])),
    }
    if seed_command is not None:
        summary["seed_command"] = seed_command
    new = scoring_rows(runs)
    keys = {_key(r) for r in new}
    summary["scoring"] = [r for r in summary["scoring"] if _key(r) not in keys] + new
    summary["scoring"].sort(
        key=lambda r: (
            _PRESET_ORDER.get(r["preset"], 9),
            r["preset"],
            r["vs_llama_org"] is None,
            r["dtype"],
            r["tp"] * r["dp"],
            -r["tp"],
            r["engine"],
        )
    )
    if lm_eval is not None:  # a row of the same run (preset, grid, shots, limit) is replaced
        new_keys = {_lm_key(r) for r in lm_eval}
        kept = [r for r in summary["lm_eval"] if _lm_key(r) not in new_keys]
        summary["lm_eval"] = sorted(
            kept + lm_eval,
            key=lambda r: (
                _PRESET_ORDER.get(r["preset"], 9),
                r["num_fewshot"],
                r["limit"] or 0,
                r["tp"] * r["dp"],
                -r["tp"],
            ),
        )
    check_schema(summary)
    return summary


def check_schema(summary: dict) -> None:
    """The issue's schema, key for key (ValueError naming the first difference)."""

    def keys(obj: dict, want: tuple, where: str) -> None:
        if not isinstance(obj, dict) or set(obj) != set(want):
            got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise ValueError(f"{where}: keys {got}, expected {sorted(want)}")

    keys(summary, TOP_KEYS, "summary")
    if summary["gpus"] != GPUS:
        raise ValueError(f"summary: gpus {summary['gpus']}, expected {GPUS}")
    if summary["seed_command"] is not None:
        keys(summary["seed_command"], SEED_KEYS, "seed_command")
    for i, r in enumerate(summary["scoring"]):
        keys(r, SCORING_KEYS, f"scoring[{i}]")
    for i, r in enumerate(summary["lm_eval"]):
        keys(r, LM_EVAL_KEYS, f"lm_eval[{i}]")


# ----------------------------------------------------------------------------- tables
def llama_org_table(summary: dict) -> pd.DataFrame:
    """Rows measured beside ``llama_org`` (the tp=4 comparisons)."""
    df = pd.DataFrame([r for r in summary["scoring"] if r["vs_llama_org"] is not None])
    return df.reindex(columns=list(SCORING_KEYS))


def grid_table(summary: dict) -> pd.DataFrame:
    """The scaling grids: speed-up and efficiency against the one-GPU row of the same preset,
    dtype and engine."""
    rows = [dict(r) for r in summary["scoring"] if r["vs_llama_org"] is None]
    for r in rows:
        base = next(
            (
                b
                for b in rows
                if b["tp"] * b["dp"] == 1
                and (b["preset"], b["dtype"], b["engine"]) == (r["preset"], r["dtype"], r["engine"])
            ),
            None,
        )
        r["gpus"] = r["tp"] * r["dp"]
        r["speedup_vs_1gpu"] = r["tasks_per_s"] / base["tasks_per_s"] if base else None
        r["efficiency"] = r["speedup_vs_1gpu"] / r["gpus"] if base else None
    cols = ["preset", "dtype", "engine", "tp", "dp", "gpus", "tasks_per_s", "speedup_vs_1gpu",
            "efficiency", "pred_agree"]  # fmt: skip
    return pd.DataFrame(rows).reindex(columns=cols)


def lm_eval_table(summary: dict) -> pd.DataFrame:
    """lm-eval walls with the one-GPU wall of the same preset, shots and limit, and hf's."""
    rows = [dict(r) for r in summary["lm_eval"]]
    for r in rows:
        base = next(
            (
                b
                for b in rows
                if b["tp"] * b["dp"] == 1
                and (b["preset"], b["num_fewshot"], b["limit"])
                == (r["preset"], r["num_fewshot"], r["limit"])
            ),
            None,
        )
        r["wall_vs_1gpu"] = r["wall_s"] / base["wall_s"] if base else None
        r["hf_over_nakta"] = r["hf_wall_s"] / r["wall_s"] if r["hf_wall_s"] else None
    cols = [*LM_EVAL_KEYS, "wall_vs_1gpu", "hf_over_nakta"]
    return pd.DataFrame(rows).reindex(columns=cols)


def targets(summary: dict) -> list[str]:
    """Issue 43's targets, each with the measured figure and met / NOT met (those measured)."""
    out = []
    for r in summary["scoring"]:
        if r["engine"] == "nakta_cache" and r["vs_llama_org"] is not None and r["tp"] == GPUS:
            head = (
                f"{r['preset']} tp={r['tp']} {r['dtype']}: nakta_cache {r['vs_llama_org']:.2f}x "
                f"llama_org, predictions {_pct(r['pred_agree'])} equal"
            )
            if r["dtype"] != "fp16":
                # The target is the seed's run, in fp16; in bf16 both engines round 8 bits
                # coarser, so a near-tie task can flip between them without either being wrong.
                out.append(f"{head} (beside the target, which is judged in fp16 as the seed ran)")
                continue
            ok = r["vs_llama_org"] >= SCORING_TARGET and r["pred_agree"] == 1.0
            out.append(
                f"{head} (target >= {SCORING_TARGET}x, all equal): {'met' if ok else 'NOT met'}"
            )
    lm = lm_eval_table(summary)
    for r in lm.to_dict("records"):
        if r["preset"] == "7B" and r["dp"] == GPUS and r["tp"] == 1:
            limit = None if pd.isna(r["limit"]) else int(r["limit"])
            goal = LM_EVAL_TARGETS.get((int(r["num_fewshot"]), limit))
            shown = "all" if limit is None else limit
            if goal is not None and pd.notna(r["wall_vs_1gpu"]):
                ok = r["wall_vs_1gpu"] <= goal
                out.append(
                    f"lm-eval 7B dp={GPUS} {int(r['num_fewshot'])}-shot limit {shown}: "
                    f"{r['wall_vs_1gpu']:.2f}x the one-GPU wall (target <= {goal}x): "
                    f"{'met' if ok else 'NOT met'}"
                )
        if r["preset"] == "30B" and r["tp"] == GPUS and pd.notna(r["hf_over_nakta"]):
            ok = r["hf_over_nakta"] >= HF_TARGET
            out.append(
                f"lm-eval 30B tp={GPUS}: {r['hf_over_nakta']:.2f}x --model hf parallelize=True "
                f"(target >= {HF_TARGET}x): {'met' if ok else 'NOT met'}"
            )
    return out


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def _md(df: pd.DataFrame) -> str:
    if df.empty:
        return "(none measured yet)"
    df = df.astype(object).where(df.notna(), None)  # tabulate shows None as missingval
    try:
        return df.to_markdown(index=False, floatfmt=".4g", missingval="-")
    except ImportError:  # no tabulate: the plain table bench_common writes then
        from bench_common.report import _plain_md

        return _plain_md(df)


def markdown(summary: dict) -> str:
    seed = summary["seed_command"]
    seed_line = "not run yet" if seed is None else f"rc {seed['rc']} in {seed['wall_s']:.1f} s"
    lines = [
        f"# Four GPUs: HellaSwag scoring and lm-eval ({summary['device_name']} x {GPUS})",
        "",
        "The seed's command as written, `cd speed_bench && torchrun --nproc_per_node 4 "
        f"nakta_speed.py` (its default: random 7B at tp=4, 1,000 embedded tasks): {seed_line}.",
        "",
        "## Against `llama_org` at MP=4",
        "",
        "Random weights of each preset (the same seed for every engine and grid), real HellaSwag "
        "text spread over the validation file; each row's engines in one process per rank. "
        "vs_llama_org: tasks/s over llama_org's in the same run (same dtype: llama_org runs "
        "fp16 and bf16 alike); pred_agree: share of tasks whose acc and acc_norm predictions "
        "equal llama_org's. Tasks: 1,000 for 30B; 65B as the `x4_big` job's `LIMIT65` says "
        "(1,000 by default, 500 in the committed run, as the issue's own 65B run; each run's "
        "count is in the call's log).",
        "",
        _md(llama_org_table(summary)),
        "",
        "## Scaling: 1, 2 and 4 GPUs",
        "",
        "nakta_cache; speed-up and efficiency against the one-GPU row of the same preset and "
        "dtype; pred_agree: share of tasks whose predictions equal the one-GPU run's (same "
        "weights, so anything below 100% is another all-reduce order's rounding).",
        "",
        _md(grid_table(summary)),
        "",
        "## lm-eval HellaSwag (fresh processes, wall clock)",
        "",
        "limit `-`: all 10,042 tasks. wall_vs_1gpu: the wall over the one-GPU wall of the same "
        "preset, shots and limit (same call); hf_over_nakta: `--model hf` (parallelize=True "
        "over the GPUs) wall over nakta's.",
        "",
        _md(lm_eval_table(summary)),
        "",
    ]
    checks = targets(summary)
    if checks:
        lines += ["## Issue 43's targets", "", *[f"- {c}" for c in checks], ""]
    return "\n".join(lines)


def flat_table(summary: dict) -> pd.DataFrame:
    """Every row of the summary in one frame (the csv): ``part`` says which list it is from."""
    a = pd.DataFrame(summary["scoring"]).assign(part="scoring")
    b = pd.DataFrame(summary["lm_eval"]).assign(part="lm_eval")
    cols = ["part", *SCORING_KEYS, *[k for k in LM_EVAL_KEYS if k not in SCORING_KEYS]]
    return pd.concat([a, b], ignore_index=True).reindex(columns=cols)


def plot(summary: dict):
    """tasks/s against llama_org, the grids' speed-up, lm-eval walls: one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 4.5))
    ref = llama_org_table(summary)
    ax = axes[0]
    if not ref.empty:
        groups = list(dict.fromkeys(zip(ref["preset"], ref["dtype"])))
        engines = list(dict.fromkeys(ref["engine"]))
        w = 0.8 / len(engines)
        for j, eng in enumerate(engines):
            sub = ref[ref["engine"] == eng]
            vals = {(p, d): v for p, d, v in zip(sub["preset"], sub["dtype"], sub["tasks_per_s"])}
            xs = [i + j * w for i in range(len(groups))]
            ys = [vals.get(g, 0.0) for g in groups]
            ax.bar(xs, ys, width=w, label=eng)
            for x, y in zip(xs, ys):
                ax.text(x, y, f"{y:.3g}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(groups))],
                      [f"{p} tp={GPUS} {d}" for p, d in groups])  # fmt: skip
        ax.legend()
    ax.set_ylabel("HellaSwag tasks / s")
    ax.set_title("against llama_org (MP=4)")
    grid = grid_table(summary).dropna(subset=["speedup_vs_1gpu"])
    ax = axes[1]
    if not grid.empty:
        labels = [f"{p}\n{t}x{d}" for p, t, d in zip(grid["preset"], grid["tp"], grid["dp"])]
        colors = {1: "tab:blue", 2: "tab:orange", 4: "tab:green"}
        ax.bar(range(len(grid)), grid["speedup_vs_1gpu"],
               color=[colors.get(g, "tab:gray") for g in grid["gpus"]])  # fmt: skip
        for i, v in enumerate(grid["speedup_vs_1gpu"]):
            ax.text(i, v, f"{v:.2f}x", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(grid)), labels, fontsize=8)
    ax.set_ylabel("speed-up vs 1 GPU (blue 1, orange 2, green 4 GPUs)")
    ax.set_title("scaling, tp x dp")
    lm = lm_eval_table(summary)
    ax = axes[2]
    if not lm.empty:
        labels = [
            f"{p} {t}x{d}\n{int(s)}-shot {'all' if pd.isna(n) else int(n)}"
            for p, t, d, s, n in zip(
                lm["preset"], lm["tp"], lm["dp"], lm["num_fewshot"], lm["limit"]
            )
        ]
        x = range(len(lm))
        ax.bar([i - 0.2 for i in x], lm["wall_s"], width=0.4, label="nakta")
        ax.bar([i + 0.2 for i in x], lm["hf_wall_s"].fillna(0.0), width=0.4, label="hf")
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.legend()
    ax.set_ylabel("lm-eval wall clock (s)")
    ax.set_title("lm-eval HellaSwag")
    for ax in axes:
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{summary['device_name']} x {GPUS}")
    fig.tight_layout()
    return fig


def _commit() -> str:
    """``commit <hash> (<date>)`` of the tree that ran, or words saying it is not known."""
    unknown = "the device calls of the commit that added these files"
    try:
        out = subprocess.run(
            ["git", "log", "-1", "--format=%h (%cs)"],
            capture_output=True, text=True, timeout=10, cwd=Path(__file__).resolve().parent,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return unknown
    return f"commit {out.stdout.strip()}" if out.stdout.strip() else unknown


def index_readme(summary: dict, folder: Path, commit: str) -> str:
    """The device folder's index: which files, what they show, which command made them."""
    ref = llama_org_table(summary)
    head = [
        f"{r.preset} {r.dtype} {r.vs_llama_org:.2f}x"
        for r in ref.itertuples()
        if r.engine == "nakta_cache"
    ]
    grid = grid_table(summary).dropna(subset=["speedup_vs_1gpu"])
    best = [
        f"{r.preset} {r.tp}x{r.dp} {r.speedup_vs_1gpu:.2f}x"
        for r in grid.itertuples()
        if r.gpus == GPUS
    ]
    shows = []
    if summary["seed_command"]:
        s = summary["seed_command"]
        shows.append(f"the seed's 4-process command: rc {s['rc']} in {s['wall_s']:.0f} s")
    if head:
        shows.append("nakta_cache vs llama_org (MP=4): " + ", ".join(head))
    if best:
        shows.append("4-GPU grids vs 1 GPU: " + ", ".join(best))
    if summary["lm_eval"]:
        shows.append(f"{len(summary['lm_eval'])} lm-eval runs")
    rows = [
        "| [`scaling_x4/scaling_x4_summary.md`](scaling_x4/scaling_x4_summary.md) (+ json, csv, "
        f"png) | {'; '.join(shows) or 'nothing measured yet'} | `scripts/reproduce_scoring.sh "
        "x4_seed x4_scaling`, then `x4_big` (one device call each, the first call's files "
        "unpacked in between; each step's exact command is in the script); the lm-eval rows: "
        "`scripts/reproduce_lm_eval.sh x4` (7B, 1 GPU vs dp=4), `x4_30b` (tp=4 beside `--model "
        "hf`), `x4_30b_2x2`, folded with `python -m speed_bench.scaling_x4 --lm-eval ... --index` |"
    ]
    lm = folder / "lm_eval_dp" / "lm_eval_dp_summary.md"
    if lm.is_file():
        rows.append(
            "| [`lm_eval_dp/lm_eval_dp_summary.md`](lm_eval_dp/lm_eval_dp_summary.md) (+ json, "
            "png) | lm-eval on four GPUs, per-rank phases: the source of the lm-eval rows | "
            "`scripts/reproduce_lm_eval.sh` (its 4-GPU job) |"
        )
    return "\n".join(
        [
            f"# speed_bench results: four {summary['device_name']} of one host",
            "",
            "The 4-GPU catalogue (HellaSwag scoring against `llama_org` at MP=4, the scaling "
            f"grids, lm-eval), made by {commit}. How it works: "
            "[docs/multi-gpu.md](../../../docs/multi-gpu.md). Each run's own table is in its "
            "device call's log (`scoring_log.txt`), not in the tree.",
            "",
            "| files | what they show | command |",
            "|---|---|---|",
            *rows,
            "",
        ]
    )


# ----------------------------------------------------------------------------- main
def _device_name(given: str | None, old: dict | None, lm: dict | None, runs: list[dict]) -> str:
    """The device's name (``--device-name``, this GPU's, the summary's, the lm-eval report's,
    or the runs' folder name), and every source naming the same device."""
    names = []
    if given:
        names.append(given)
    else:
        import torch

        if torch.cuda.is_available():
            names.append(torch.cuda.get_device_name(0))
    names += [d["device_name"] for d in (old, lm) if d and d.get("device_name")]
    names += [r["device"] for r in runs if r.get("device")]
    if not names:
        raise ValueError("no device name: give --device-name, runs, or an --lm-eval report")
    slugs = dict.fromkeys(slug(n) for n in names)
    if len(slugs) > 1:
        raise ValueError(f"results of several devices cannot share a summary: {list(slugs)}")
    return names[0]


def main(argv: list[str] | None = None) -> dict:
    p = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="*", help="run_all result folders or summary.json files")
    p.add_argument("--seed-command", nargs=2, metavar=("RC", "WALL_S"),
                   help="the seed command's exit status and wall clock (s)")  # fmt: skip
    p.add_argument(
        "--lm-eval", type=Path, action="append",
        help="an lm_eval_dp_summary.json (repeatable: a later file's row of the same run wins)",
    )  # fmt: skip
    p.add_argument("--device-name", help="default: this GPU's name, else the inputs'")
    p.add_argument("--out", type=Path, required=True, help=f"folder for {STEM}.{{json,md,csv,png}}")
    p.add_argument("--index", action="store_true", help="write the device folder's README.md")
    args = p.parse_args(argv)
    if not (args.runs or args.seed_command or args.lm_eval):
        p.error("give run folders, --seed-command or --lm-eval")
    seed = None
    if args.seed_command:
        try:
            seed = {"rc": int(args.seed_command[0]), "wall_s": float(args.seed_command[1])}
        except ValueError:
            p.error(f"--seed-command: RC an integer, WALL_S seconds, got {args.seed_command}")
    runs = [load_summary(r) for r in args.runs]
    lm_report = lm_rows = None
    if args.lm_eval:
        reports = []
        for path in args.lm_eval:
            if not path.is_file():
                p.error(f"--lm-eval {path}: no such file")
            lm_report = json.loads(path.read_text())
            reports.append(lm_eval_rows(lm_report, path))
        lm_rows = merge_lm_eval_rows(reports)
    old_path = args.out / f"{STEM}.json"
    old = json.loads(old_path.read_text()) if old_path.is_file() else None
    if old is not None:
        check_schema(old)
    name = _device_name(args.device_name, old, lm_report, runs)
    summary = build_summary(name, old, runs, seed, lm_rows)

    args.out.mkdir(parents=True, exist_ok=True)
    write_json(summary, old_path)
    atomic_write_text(args.out / f"{STEM}.md", markdown(summary))
    atomic_write_text(args.out / f"{STEM}.csv", flat_table(summary).to_csv(index=False))
    import matplotlib.pyplot as plt

    fig = plot(summary)
    save_figure(fig, args.out / f"{STEM}.png")
    plt.close(fig)
    if args.index:
        folder = args.out.resolve().parent
        atomic_write_text(folder / "README.md", index_readme(summary, folder, _commit()))
    print(markdown(summary))
    return summary


def cli(argv: list[str] | None = None) -> dict:
    """:func:`main` as a command: a file that is missing or not what it should be is one
    ``error:`` line and exit status 2."""

    def run() -> dict:
        try:
            return main(argv)
        except (ValueError, OSError) as e:  # a bad JSON file is a ValueError too
            raise InputError(str(e)) from None

    return exit_on_input_error(run)


if __name__ == "__main__":
    cli()
