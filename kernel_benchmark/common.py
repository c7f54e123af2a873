"""What the kernel benchmarks share: what runs on a CPU and the exit status (every bench), the
way a bench overrides a kernel's launch configuration (``tuned``), and for RMSNorm and SwiGLU
their command line, the torch.compile peer, the sweep loop and the timing of one sweep point,
the one-panel-per-mode plot, and the head-to-head vs Liger (rows and table)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pandas as pd
import torch

from bench_common.report import save_figure, write_table
from bench_common.timing import interleaved_ms, rotated_ms
from nakta_model.kernels._checks import interpreter_enabled

CPU_NOTE = (
    "On a CPU a run is a smoke test of tiny shapes: the PyTorch paths are timed (the times "
    "measure Python overhead, not kernels); Nakta's Triton kernels run only in Triton's "
    "interpreter (start with TRITON_INTERPRET=1), otherwise they are listed as skipped; "
    "torch.compile, Liger-Kernel and TransformerEngine are compared on a GPU only. Exit status "
    "1 when no path was measured."
)


@contextlib.contextmanager
def tuned(kernel_module: ModuleType, **config: object) -> Iterator[None]:
    """Run the block with ``config`` as the kernel module's launch-config override (its
    ``_TUNE``: every kernel file's ``_config`` applies it last), restoring it after."""
    saved = dict(kernel_module._TUNE)
    kernel_module._TUNE.clear()
    kernel_module._TUNE.update(config)
    try:
        yield
    finally:
        kernel_module._TUNE.clear()
        kernel_module._TUNE.update(saved)


def triton_skip_reason(device: torch.device) -> str | None:
    """Why Nakta's Triton kernels cannot run on ``device`` in this process, or None."""
    if device.type == "cuda" or (device.type == "cpu" and interpreter_enabled()):
        return None
    return f"Triton kernels need a GPU, not {device.type} (or TRITON_INTERPRET=1 on the CPU)"


def announce(device: torch.device, note: str = CPU_NOTE) -> None:
    """Say what this run measures when it is not on a GPU (before any output of the sweep)."""
    if device.type != "cuda":
        print(f"[{device.type}] {note}", flush=True)


def measured(df: pd.DataFrame) -> bool:
    """Whether ``df`` holds at least one measured row (``status`` "ok..." or no status)."""
    if not len(df):
        return False
    return "status" not in df or bool(df["status"].astype(str).str.startswith("ok").any())


def exit_status(*frames: pd.DataFrame) -> int:
    """The bench's exit status: 0 when any path was measured, else 1 (and why, on stderr)."""
    if any(measured(df) for df in frames):
        return 0
    print("error: nothing was measured: every path failed or was skipped", file=sys.stderr)
    return 1


def compiled(fn: Callable) -> Callable:
    """``torch.compile(fn, dynamic=False)``, with donated buffers off so a retained graph can
    run backward more than once, and room for the recompiles a sweep of shapes and grad modes
    causes. Static shapes: left to itself, torch.compile recompiles a function for dynamic
    shapes once it sees a second shape, and on an H200 those kernels ran RMSNorm at ~45% of
    copy bandwidth where the first (static) shape ran at ~87%, so every shape after the first
    measured a slower peer than torch.compile can be."""
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False
    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(dynamo_config, knob):
            setattr(dynamo_config, knob, 64)
    return torch.compile(fn, dynamic=False)


def cli(
    description: str,
    run: Callable[[argparse.Namespace, torch.device], pd.DataFrame],
    argv: list[str] | None = None,
) -> pd.DataFrame:
    """Parse the shared options and call ``run(args, device)``, on a side stream on CUDA
    (CUDA graphs cannot be captured on the default stream)."""
    p = argparse.ArgumentParser(description=description, epilog=CPU_NOTE)
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
    announce(device)
    with torch.cuda.stream(torch.cuda.Stream(device)) if on_gpu else contextlib.nullcontext():
        return run(args, device)


def sweep_point_rows(
    entries: dict[str, tuple[dict, list[Callable[[], object]], dict]],
    device: torch.device,
    nbytes: int,
    copy_gbps: float,
) -> list[dict]:
    """The rows of one sweep point (shape and mode): ``entries`` maps each path to its row
    keys, its calls and the columns measured before (eager time, mismatch). On CUDA the paths
    are timed together in rotated rounds (``rotated_ms``), so the order they are listed in does
    not decide close comparisons; ``us_eager`` (launch overhead included) is kept as measured."""
    times, errors = ({}, {})
    if device.type == "cuda":
        times, errors = rotated_ms({p: calls for p, (_, calls, _) in entries.items()})
    rows = []
    for p, (keys, _, measured) in entries.items():
        us = times.get(p, float("nan")) * 1e3
        status = f"ok; no CUDA graph: {errors[p]}" if p in errors else "ok"
        us_eager = measured["us_eager"]
        rows.append(
            keys
            | {"status": status, "us": us, "GB/s": nbytes / us / 1e3}
            | {"pct_copy_bw": 100 * nbytes / us / 1e3 / copy_gbps, "us_eager": us_eager}
            | {"pct_copy_bw_eager": 100 * nbytes / us_eager / 1e3 / copy_gbps}
            | {k: v for k, v in measured.items() if k != "us_eager"}
        )
    return rows


def run_sweep(
    bench_shape: Callable[[int, int], list[dict]],
    tokens: list[int],
    widths: list[int],
    *,
    width: str,
    modes: tuple[str, ...],
    out: Path,
    stem: str,
    title: str,
    notes: str,
    plot_title: str,
    mismatch: str,
    on_gpu: bool,
) -> pd.DataFrame:
    """``bench_shape(tokens, width)`` over every shape, 16K tokens (the targets) first so a run
    cut short still has them; the table and plot are rewritten after every shape, so a cut-short
    run leaves its rows. Prints the 16K rows (every row on the CPU) and each path that failed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tqdm import tqdm

    rows = []
    shapes = [(m, w) for m in sorted(tokens, key=lambda t: (t != 16384, t)) for w in widths]
    for m, w in tqdm(shapes, desc=f"{stem} shapes"):
        rows += bench_shape(m, w)
        if on_gpu:
            torch.cuda.empty_cache()
        df = pd.DataFrame(rows)
        write_table(df, out, stem, title, notes)
        if measured(df):  # nothing to plot when every path failed
            fig = plot_modes(df, plot_title, modes, width)
            save_figure(fig, out / f"{stem}.png")
            plt.close(fig)
    show = df[df["status"].str.startswith("ok")]
    if on_gpu:
        show = show[show.tokens == 16384]
    cols = ["tokens", width, "mode", "path", "us", "pct_copy_bw", "us_eager", mismatch]
    if len(show):
        print(show[cols].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    for _, r in df[df["status"] != "ok"].iterrows():
        print(f"{r['tokens']}x{r[width]} {r['mode']} {r['path']}: {r['status']}")
    return df


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


InputSets = list[dict[str, torch.Tensor]]


def head_to_head_rows(
    names: list[str],
    make_sets: Callable[[int], InputSets],
    make_calls: Callable[[str, InputSets], list[Callable[[], object]]],
    device: torch.device,
    nbytes: int,
    copy_gbps: float,
    **keys: object,
) -> list[dict]:
    """Head-to-head of the paths ``names`` in alternating rounds (``interleaved_ms``): one row
    per path with ``keys``, us, % of copy bandwidth for ``nbytes`` per call, the largest
    in-block spread and the median of every block.

    ``make_sets(seed)`` makes one group of input sets and ``make_calls(path, sets)`` a path's
    calls on them. Each of the P paths gets its own group, allocated once; block ``b`` (of 2P)
    gives path ``j`` the group ``(j + b) mod P``, refilled with fresh values first (a peer may
    write into its inputs), and the second P blocks run the paths in reverse order. So every
    path runs on every allocation, in both orders: the same kernel measured ~1% apart on two
    allocations of one shape (docs/experiments.md), which a fixed assignment turns
    into a difference between paths. us = median of the 2P block medians."""
    n = len(names)
    groups = [make_sets(k) for k in range(n)]
    per_block: dict[str, list[tuple[float, float]]] = {p: [] for p in names}
    for block in range(2 * n):
        if block:  # fresh values, same tensors (so the same allocations)
            for k, group in enumerate(groups):
                for old, new in zip(group, make_sets(k + n * block)):
                    for name, t in old.items():
                        t.copy_(new[name])
        order = names if block < n else names[::-1]
        calls = {p: make_calls(p, groups[(names.index(p) + block) % n]) for p in order}
        for p, res in interleaved_ms(calls, device).items():
            per_block[p].append(res)
        del calls
    rows = []
    for p in names:
        meds = sorted(ms * 1e3 for ms, _ in per_block[p])
        us = 0.5 * (meds[(len(meds) - 1) // 2] + meds[len(meds) // 2])
        rows.append(
            keys
            | {"path": p, "us": us, "pct_copy_bw": 100 * nbytes / us / 1e3 / copy_gbps}
            | {"spread": max(sp for _, sp in per_block[p])}
            | {"us_blocks": "/".join(f"{ms * 1e3:.1f}" for ms, _ in per_block[p])}
        )
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
        f"Device: {slug}; {dtype}; copy bandwidth {copy_gbps:.0f} GB/s. 2P blocks (P paths) "
        "of 15 rounds; each round replays one CUDA graph per path, in turn; every path runs "
        "on each path's input allocation (refilled with fresh values per block), in both path "
        "orders. us = median of the block medians (us_blocks); spread = largest (max - min) "
        "/ median within a block. Same byte counts as the sweep.",
    )
    print(h2h.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
