"""One table from the runs of A/Bs of throughput settings (``scripts/gpu_throughput_ab.sh``).

    python -m speed_bench.throughput_ab STAGE [STAGE ...] [--out DIR]

Each folder under a STAGE holds one ``speed_bench.throughput`` run (a fresh process) named
after its setting; the table puts their nakta rows side by side, stage by stage (``call``: the
STAGE's position, one device call each) in the order the runs finished, and is written as
``throughput_ab.md`` / ``.csv`` / ``.png`` into ``--out`` (default: the one STAGE): the figures
a setting is judged on (output tok/s) and what moved it (mean rows a step, prefill / decode
seconds, decode steps, overlapped chunks).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from bench_common.report import save_figure, write_table

COLUMNS = ["call", "run", "max_batch", "overlap", "prefill_burst", "output_tok_s", "mean_rows",
           "wall_s", "prefill_s", "decode_s", "decode_steps", "overlapped_chunks",
           "ttft_median_s", "ttft_p99_s", "peak_mem_gb", "step_floor_pct"]  # fmt: skip


def collect(stage: Path, call: int = 1) -> pd.DataFrame:
    """The nakta rows of every run folder's ``throughput.csv`` in ``stage``, oldest first."""
    rows = []
    for csv in sorted(stage.glob("*/throughput.csv"), key=lambda p: p.stat().st_mtime):
        df = pd.read_csv(csv)
        for _, r in df[df["engine"].str.startswith("nakta")].iterrows():
            rows.append({"call": call, "run": csv.parent.name,
                         **{c: r.get(c) for c in COLUMNS[2:]}})  # fmt: skip
    return pd.DataFrame(rows, columns=COLUMNS)


def plot(df: pd.DataFrame, path: Path) -> None:
    """Output tok/s per run, one bar each, in table order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.3 * len(df) + 1.2))
    labels = [f"{c}: {r}" for c, r in zip(df["call"], df["run"])]
    ax.barh(range(len(df)), df["output_tok_s"], color="tab:blue")
    ax.set_yticks(range(len(df)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("output tok/s (1,000 prompts, 128 in / 128 out)")
    ax.set_title("Throughput A/B: one fresh process per run")
    ax.grid(axis="x", alpha=0.3)
    save_figure(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> pd.DataFrame:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stages", nargs="+", type=Path, help="folders of run folders")
    p.add_argument("--out", type=Path, default=None, help="where the table goes")
    a = p.parse_args(argv)
    for stage in a.stages:
        if not stage.is_dir():
            p.error(f"STAGE must be a folder of runs, got {stage}")
    if a.out is None and len(a.stages) > 1:
        p.error("--out is needed with several STAGEs")
    frames = [collect(stage, i + 1) for i, stage in enumerate(a.stages)]
    df = pd.concat([f for f in frames if not f.empty] or frames, ignore_index=True)
    if df.empty:
        raise SystemExit(f"error: no throughput.csv under {', '.join(map(str, a.stages))}/*/")
    out = a.out or a.stages[0]
    out.mkdir(parents=True, exist_ok=True)
    notes = (
        "Each run a fresh process of speed_bench.throughput (nakta only), in the order listed; "
        "call = the device call (STAGE) it ran in; overlap = NAKTA_PREFILL_OVERLAP, "
        "prefill_burst = NAKTA_PREFILL_BURST (blank: one forward per chunk, before it existed). "
        "Repeats of one setting show the run-to-run spread."
    )
    write_table(df, out, "throughput_ab", "Throughput A/B", notes)
    plot(df, out / "throughput_ab.png")
    print(df.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    return df


if __name__ == "__main__":
    main()
