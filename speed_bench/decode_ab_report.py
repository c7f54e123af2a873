"""Batch-1 decode A/B calls in one table: each call's settings, run in fresh processes, beside
that call's own baseline (settings are compared within a call only: a call is one machine).

    python -m speed_bench.decode_ab_report --stage "queue=STAGE_DIR" --stage ... --out DIR

Each stage folder holds the ``runs.csv`` that ``scripts/gpu_decode_b1_ab.sh`` (and the
early-weight A/B before it) writes: ``run,engine,tok_s,pct_of_floor,floor_tok_s`` with runs
named ``r<N>_<setting>``. Writes ``decode_b1_ab.csv`` (every run), ``decode_b1_ab.md`` (per
call, setting and engine: runs, median and range of tok/s, median % of the floor) and
``decode_b1_ab.png`` (the FP8 medians). It measures nothing itself.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

if not __package__:  # run by path: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import pandas as pd

from bench_common.report import save_figure, write_table


def read_stage(label: str, folder: Path) -> pd.DataFrame:
    """A stage's runs with the call's label and each run's setting (``r<N>_<setting>``)."""
    path = Path(folder) / "runs.csv"
    try:
        df = pd.read_csv(path)
    except (OSError, pd.errors.ParserError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    missing = {"run", "engine", "tok_s", "pct_of_floor"} - set(df.columns)
    if missing:
        raise ValueError(f"{path}: missing columns {sorted(missing)}")
    setting = df["run"].str.extract(r"^r\d+_(.+)$")[0]
    if setting.isna().any():
        raise ValueError(f"{path}: runs must be named r<N>_<setting>, got {df['run'].tolist()}")
    return df.assign(call=label, setting=setting)


def summarize(runs: pd.DataFrame) -> pd.DataFrame:
    """Per call, setting and engine, in the order first seen: runs, median / min / max tok/s,
    median % of the floor."""
    g = runs.groupby(["call", "setting", "engine"], sort=False)
    return g.agg(runs=("tok_s", "size"), median_tok_s=("tok_s", "median"),
                 min_tok_s=("tok_s", "min"), max_tok_s=("tok_s", "max"),
                 median_pct_of_floor=("pct_of_floor", "median")).reset_index()  # fmt: skip


def _plot(table: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fp8 = table[table["engine"] == "nakta_fp8"]
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(fp8)), 3.8))
    labels = [f"{c}\n{s}" for c, s in zip(fp8["call"], fp8["setting"], strict=True)]
    ax.bar(range(len(fp8)), fp8["median_tok_s"], color="tab:blue")
    err = [fp8["median_tok_s"] - fp8["min_tok_s"], fp8["max_tok_s"] - fp8["median_tok_s"]]
    ax.errorbar(range(len(fp8)), fp8["median_tok_s"], yerr=err, fmt="none", color="black")
    ax.set_xticks(range(len(fp8)), labels, fontsize=6, rotation=60, ha="right")
    ax.set_ylim(fp8["min_tok_s"].min() * 0.9, fp8["max_tok_s"].max() * 1.02)
    ax.set_ylabel("FP8 batch-1 tok/s (median, range)")
    save_figure(fig, path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> pd.DataFrame:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", action="append", required=True, metavar="LABEL=DIR",
                   help="a call's label and its stage folder (repeat)")  # fmt: skip
    p.add_argument("--notes", default="", help="text under the table's title")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    frames = []
    for spec in a.stage:
        label, eq, folder = spec.partition("=")
        if not eq or not label or not folder:
            p.error(f"--stage must be LABEL=DIR, got {spec!r}")
        try:
            frames.append(read_stage(label, Path(folder)))
        except ValueError as e:
            p.error(str(e))
    runs = pd.concat(frames, ignore_index=True)
    a.out.mkdir(parents=True, exist_ok=True)
    cols = ["call", "setting", "run", "engine", "tok_s", "pct_of_floor", "floor_tok_s"]
    write_table(runs[[c for c in cols if c in runs.columns]], a.out, "decode_b1_ab_runs",
                "Every run of the batch-1 decode A/B calls")  # fmt: skip
    table = summarize(runs)
    write_table(table, a.out, "decode_b1_ab", "Batch-1 decode A/B calls", a.notes)
    _plot(table, a.out / "decode_b1_ab.png")
    print(table.to_string(index=False))
    return table


if __name__ == "__main__":
    main()
