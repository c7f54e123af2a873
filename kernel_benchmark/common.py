"""What the RMSNorm and SwiGLU benchmarks share: their command line, the torch.compile peer,
the one-panel-per-mode plot, and the head-to-head vs Liger (rows and table)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch

from nakta_model.bench.report import write_table
from nakta_model.bench.timing import interleaved_ms


def compiled(fn: Callable) -> Callable:
    """``torch.compile(fn)``, with donated buffers off so a retained graph can run backward
    more than once, and room for the recompiles a sweep of shapes and grad modes causes."""
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False
    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(dynamo_config, knob):
            setattr(dynamo_config, knob, 64)
    return torch.compile(fn)


def cli(
    description: str,
    run: Callable[[argparse.Namespace, torch.device], pd.DataFrame],
    argv: list[str] | None = None,
) -> pd.DataFrame:
    """Parse the shared options and call ``run(args, device)``, on a side stream on CUDA
    (CUDA graphs cannot be captured on the default stream)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="fewer shapes")
    p.add_argument(
        "--tune", action="store_true", help="sweep Nakta launch configs first, use the best"
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="results folder (default results/<device>)")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    with torch.cuda.stream(torch.cuda.Stream(device)) if on_gpu else contextlib.nullcontext():
        return run(args, device)


def plot_modes(df: pd.DataFrame, title: str, modes: tuple[str, ...], width: str):
    """One panel per mode: % of copy bandwidth (us per call on the CPU, where there are no
    graph timings) per path over the ``tokens x width`` cases."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = df[df["status"].str.startswith("ok")]
    value = "pct_copy_bw" if ok["pct_copy_bw"].notna().any() else "us_eager"
    shown = [m for m in modes if m in set(ok["mode"])] or ["fwd"]
    fig, axes = plt.subplots(1, len(shown), figsize=(5 * len(shown), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], shown):
        sub = ok[ok["mode"] == mode].copy()
        if sub.empty:
            continue
        sub["case"] = sub["tokens"].map(lambda t: f"{t // 1024}K") + "x" + sub[width].map(str)
        table = sub.pivot_table(index="case", columns="path", values=value, sort=False)
        table.plot(ax=ax, marker="o")
        ax.set_title(mode)
        ax.set_ylabel("% of copy bandwidth" if value == "pct_copy_bw" else "us per call")
        ax.set_xticks(range(len(table.index)))
        ax.set_xticklabels(table.index, rotation=60, ha="right", fontsize=7)
        ax.axhline(100, color="gray", lw=0.8, ls="--")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def head_to_head_rows(
    calls: dict[str, list[Callable[[], object]]],
    device: torch.device,
    nbytes: int,
    copy_gbps: float,
    **keys: object,
) -> list[dict]:
    """Time ``calls`` (path -> calls) in alternating rounds (``interleaved_ms``): one row per
    path with ``keys``, us, % of copy bandwidth for ``nbytes`` per call, and the spread."""
    rows = []
    for p, (ms, spread) in interleaved_ms(calls, device).items():
        us = ms * 1e3
        pct = 100 * nbytes / us / 1e3 / copy_gbps
        rows.append(keys | {"path": p, "us": us, "pct_copy_bw": pct, "spread": spread})
    return rows


def write_head_to_head(
    h2h: pd.DataFrame, out: Path, stem: str, kernel: str, slug: str, dtype: str, copy_gbps: float
) -> None:
    """``<stem>_head_to_head.{csv,md}``, and the table on stdout."""
    write_table(
        h2h,
        out,
        f"{stem}_head_to_head",
        f"{kernel} head-to-head at the target shape: Nakta vs Liger in alternating rounds",
        f"Device: {slug}; {dtype}; copy bandwidth {copy_gbps:.0f} GB/s. Median of 15 "
        "rounds; each round replays one CUDA graph per path, in turn; spread = (max - min) "
        "/ median. Same byte counts as the sweep.",
    )
    print(h2h.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
