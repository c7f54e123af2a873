"""How ``run_all`` shows its results: the console table, the plot, and the files written.

Kept apart from the run itself so what is measured and how it is laid out change separately.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from bench_common.report import save_figure, write_json, write_table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# the console table's columns (the markdown table and summary.json keep every column)
TABLE_COLUMNS = [
    "engine",
    "wall_s",
    "tasks_per_s",
    "tokens_per_s",
    "mfu",
    "mfu_unique",
    "peak_mem_gb",
    "acc",
    "acc_norm",
    "pred_agree_vs_ref",
]


def plot(df: pd.DataFrame, title: str) -> Figure:
    """tasks/s and both MFUs per engine, side by side (matplotlib is imported only here: the
    headless Agg backend, so a run without a display still writes its plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].bar(df["engine"], df["tasks_per_s"], color="tab:blue")
    axes[0].set_ylabel("HellaSwag tasks / s")
    for i, v in enumerate(df["tasks_per_s"]):
        axes[0].text(i, v, f"{v:.3g}", ha="center", va="bottom")
    x = range(len(df))
    axes[1].bar([i - 0.2 for i in x], 100 * df["mfu"], width=0.4, label="MFU (computed tokens)")
    axes[1].bar(
        [i + 0.2 for i in x], 100 * df["mfu_unique"], width=0.4, label="MFU (unique tokens)"
    )
    axes[1].set_xticks(list(x), df["engine"])
    axes[1].set_ylabel("% of matmul peak measured in this run")
    axes[1].legend()
    for ax in axes:
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def write_results(out: Path, summary: dict, df: pd.DataFrame, notes: str) -> None:
    """``summary.json``, ``speed.md`` / ``speed.csv`` (with ``notes``) and ``speed.png`` in ``out``."""
    write_json(summary, out / "summary.json")
    write_table(df, out, "speed", f"Scoring speed: {summary['workload']['name']}", notes)
    import matplotlib.pyplot as plt

    fig = plot(df, f"{summary['workload']['name']} on {summary['device']}, {summary['model']}")
    save_figure(fig, out / "speed.png")
    plt.close(fig)


def format_table(df: pd.DataFrame) -> str:
    """The console table: shares as percentages, the rest to 4 significant digits."""
    show = df[TABLE_COLUMNS].copy()
    for c in ("mfu", "mfu_unique", "acc", "acc_norm", "pred_agree_vs_ref"):
        show[c] = (100 * show[c]).map(lambda v: f"{v:.1f}%")
    return show.to_string(index=False, float_format=lambda v: f"{v:.4g}")


def json_num(v: object) -> object:
    """NaN and inf become null (JSON has neither; a CPU run's peak memory is NaN)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
