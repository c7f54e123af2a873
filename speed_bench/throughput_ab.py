"""One table from the runs of an A/B of throughput settings (``scripts/gpu_throughput_ab.sh``).

    python -m speed_bench.throughput_ab STAGE

Each folder under STAGE holds one ``speed_bench.throughput`` run (a fresh process) named after
its setting; the table puts their nakta rows side by side, in the order the runs finished, and
is written as ``STAGE/throughput_ab.md`` / ``.csv`` (the figures a setting is judged on:
output tok/s, and what moved it: mean rows a step, prefill / decode seconds, overlapped chunks).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from bench_common.report import write_table

COLUMNS = ["run", "max_batch", "overlap", "output_tok_s", "mean_rows", "wall_s", "prefill_s",
           "decode_s", "decode_steps", "overlapped_chunks", "ttft_median_s", "ttft_p99_s",
           "peak_mem_gb", "step_floor_pct"]  # fmt: skip


def collect(stage: Path) -> pd.DataFrame:
    """The nakta rows of every run folder's ``throughput.csv``, oldest first."""
    rows = []
    for csv in sorted(stage.glob("*/throughput.csv"), key=lambda p: p.stat().st_mtime):
        df = pd.read_csv(csv)
        for _, r in df[df["engine"].str.startswith("nakta")].iterrows():
            rows.append({"run": csv.parent.name, **{c: r.get(c) for c in COLUMNS[1:]}})
    return pd.DataFrame(rows, columns=COLUMNS)


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        raise SystemExit("usage: python -m speed_bench.throughput_ab STAGE (a folder of runs)")
    stage = Path(args[0])
    df = collect(stage)
    if df.empty:
        raise SystemExit(f"error: no throughput.csv under {stage}/*/")
    notes = (
        "Each run a fresh process of speed_bench.throughput (nakta only), in the order listed; "
        "overlap = NAKTA_PREFILL_OVERLAP. Repeats of one setting show the run-to-run spread."
    )
    write_table(df, stage, "throughput_ab", "Throughput A/B", notes)
    print(df.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    return df


if __name__ == "__main__":
    main()
