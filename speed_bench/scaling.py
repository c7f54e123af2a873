"""Multi-GPU scaling: several ``run_all`` summaries (one GPU, ``--tp``, ``--dp``) in one table.

    python -m speed_bench.scaling results/DEV/random-7B-tp1-dp1 results/DEV/random-7B-tp1-dp2 \\
        ... --out speed_bench/results/DEV/scaling

For every run and engine: GPUs, tasks/s, tokens/s, MFU (over all its GPUs), peak memory per GPU;
against the one-GPU run of the same model, workload and engine (when there is one): the
speed-up, the scaling efficiency (speed-up / GPUs) and the share of tasks whose acc and acc_norm
predictions are identical (same random weights on every grid, so anything below 100% is
rounding in another all-reduce order, never a different model).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if not __package__:  # run by path: import from the repo root, not from this script's folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import pandas as pd

from bench_common.report import save_figure, write_json, write_table

COLUMNS = [
    "model",
    "engine",
    "tp",
    "dp",
    "gpus",
    "tasks",
    "tasks_per_s",
    "tokens_per_s",
    "mfu",
    "peak_mem_gb",
    "speedup_vs_1gpu",
    "efficiency",
    "pred_agree_vs_1gpu",
    "acc",
    "acc_norm",
]


def load_summary(path: str | Path) -> dict:
    """A ``summary.json`` or the folder holding one."""
    path = Path(path)
    if path.is_dir():
        path = path / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(f"no run_all summary at {path}")
    summary = json.loads(path.read_text())
    for key in ("model", "engines", "workload"):
        if key not in summary:
            raise ValueError(f"{path} is not a speed_bench.run_all summary (no {key!r})")
    return summary


def agreement(a: dict | None, b: dict | None) -> float | None:
    """Share of tasks whose acc and acc_norm predictions (a summary's digit strings) are both
    equal; None when either is missing or their lengths differ."""
    if not a or not b or len(a["acc"]) != len(b["acc"]) or not a["acc"]:
        return None
    same = sum(
        x == y and xn == yn
        for x, y, xn, yn in zip(a["acc"], b["acc"], a["acc_norm"], b["acc_norm"])
    )
    return same / len(a["acc"])


def scaling_table(summaries: list[dict]) -> pd.DataFrame:
    rows = []
    for s in summaries:
        tp, dp = s.get("tp", 1), s.get("dp", 1)
        for engine, e in s["engines"].items():
            rows.append(
                {
                    "model": s["model"],
                    "engine": engine,
                    "tp": tp,
                    "dp": dp,
                    "gpus": s.get("gpus", tp * dp),
                    "tasks": s["workload"]["tasks"],
                    "tasks_per_s": e["tasks_per_s"],
                    "tokens_per_s": e["tokens_per_s"],
                    "mfu": e["mfu"],
                    "peak_mem_gb": e.get("peak_mem_gb"),
                    "acc": e["acc"],
                    "acc_norm": e["acc_norm"],
                    "_workload": s["workload"]["name"],
                    "_dtype": s.get("dtype"),
                    "_preds": s.get("predictions", {}).get(engine),
                }
            )
    for r in rows:
        base = [
            b
            for b in rows
            if b["gpus"] == 1
            and (b["model"], b["engine"], b["_workload"], b["tasks"], b["_dtype"])
            == (r["model"], r["engine"], r["_workload"], r["tasks"], r["_dtype"])
        ]
        if base:
            r["speedup_vs_1gpu"] = r["tasks_per_s"] / base[0]["tasks_per_s"]
            r["efficiency"] = r["speedup_vs_1gpu"] / r["gpus"]
            r["pred_agree_vs_1gpu"] = agreement(r["_preds"], base[0]["_preds"])
    df = pd.DataFrame(rows).reindex(columns=COLUMNS)
    return df.sort_values(["model", "engine", "gpus", "tp"], kind="stable").reset_index(drop=True)


def plot(df: pd.DataFrame):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(df)), 4))
    labels = [f"{m}\ntp{t} dp{d}" for m, t, d in zip(df["model"], df["tp"], df["dp"])]
    ax.bar(
        range(len(df)),
        df["tasks_per_s"],
        color=["tab:blue" if g == 1 else "tab:orange" for g in df["gpus"]],
    )
    for i, (v, sp) in enumerate(zip(df["tasks_per_s"], df["speedup_vs_1gpu"])):
        extra = f"\n{sp:.2f}x" if pd.notna(sp) and df["gpus"][i] > 1 else ""
        ax.text(i, v, f"{v:.3g}{extra}", ha="center", va="bottom")
    ax.set_xticks(range(len(df)), labels)
    ax.set_ylabel("HellaSwag tasks / s (blue: 1 GPU, orange: grid)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> pd.DataFrame:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="run_all result folders or summary.json files")
    p.add_argument("--out", type=Path, required=True, help="folder for scaling.{csv,md,json,png}")
    args = p.parse_args(argv)
    summaries = [load_summary(r) for r in args.runs]
    df = scaling_table(summaries)
    args.out.mkdir(parents=True, exist_ok=True)
    devices = sorted({s["device"] for s in summaries})
    notes = (
        f"Devices: {', '.join(devices)}. One row per run and engine; MFU divides by the sum of "
        "every GPU's measured bf16 matmul peak; peak_mem_gb is the largest rank's. "
        "speedup_vs_1gpu / efficiency / pred_agree_vs_1gpu compare with the one-GPU run of the "
        "same model, engine, workload and dtype (same random weights)."
    )
    write_table(df, args.out, "scaling", "Multi-GPU HellaSwag scaling", notes)
    write_json(
        {"devices": devices, "rows": json.loads(df.to_json(orient="records"))},
        args.out / "scaling.json",
    )
    import matplotlib.pyplot as plt

    fig = plot(df)
    save_figure(fig, args.out / "scaling.png")
    plt.close(fig)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(df.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    return df


if __name__ == "__main__":
    main()
