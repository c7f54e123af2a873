"""Write benchmark results as CSV + markdown table (+ PNG by the caller), atomically."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from nakta_model.io_utils import atomic_output_file, atomic_write_text


def results_dir(bench_file: str, device: str) -> Path:
    """``<folder of the benchmark>/results/<device>/``."""
    out = Path(bench_file).resolve().parent / "results" / device
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_table(df: pd.DataFrame, out_dir: Path, stem: str, title: str, notes: str = "") -> None:
    """``stem.csv`` and ``stem.md`` (a markdown table with a title and notes)."""
    atomic_write_text(out_dir / f"{stem}.csv", df.to_csv(index=False))
    md = [f"# {title}", ""]
    if notes:
        md += [notes.strip(), ""]
    md.append(df.to_markdown(index=False, floatfmt=".3g") if _has_tabulate() else _plain_md(df))
    atomic_write_text(out_dir / f"{stem}.md", "\n".join(md) + "\n")


def write_json(obj: object, path: Path) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def save_figure(fig, path: Path) -> None:
    with atomic_output_file(path) as tmp:
        fig.savefig(tmp, dpi=120, bbox_inches="tight", format="png")


def _has_tabulate() -> bool:
    try:
        import tabulate  # noqa: F401
    except ImportError:
        return False
    return True


def _plain_md(df: pd.DataFrame) -> str:
    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in df.itertuples(index=False):
        lines.append("| " + " | ".join(fmt(v) for v in row) + " |")
    return "\n".join(lines)
