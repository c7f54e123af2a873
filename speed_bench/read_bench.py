"""How fast a checkpoint reaches the GPU, alone and beside a busy Python thread.

The lm-eval adapter reads the weights on worker threads while lm-eval's main thread builds
requests in pure Python. A reader that needs the GIL between its steps then waits for that
thread at every step (Python hands the GIL over every ``sys.getswitchinterval()`` seconds), so a
read that takes 1.4 s alone took 3-5 s inside a real lm-eval run. This benchmark reads one
safetensors file with each of ``read_safetensors``'s methods (page cache warm), with no other
thread, and beside a thread that runs Python bytecode non-stop at the default 5 ms and at the
adapter's 0.5 ms switch interval; it also reports how much the busy thread slowed down (the
contention goes both ways). The ceiling is the pinned host-to-device copy rate, measured in the
same run (on a CPU device: a host copy).

    python -m speed_bench.read_bench --file CKPT/model.tp00-of-01.safetensors [--out DIR]

Writes ``read_bench.{csv,md,json,png}`` under ``speed_bench/results/<device>/`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import torch

from bench_common.ceilings import device_slug
from bench_common.report import results_dir, save_figure, write_json, write_table
from nakta_model.safetensors_read import read_safetensors

# (label, method, threads, chunk bytes)
READERS = (
    ("pinned 64 MiB x4", "pinned", 4, 64 << 20),
    ("pinned 256 MiB x4", "pinned", 4, 256 << 20),
    ("mapped x4", "mapped", 4, 0),
    ("mapped x8", "mapped", 8, 0),
    ("mapped+populate x4", "mapped_populate", 4, 0),
)
CONDITIONS = (("alone", None), ("busy, 5 ms", 0.005), ("busy, 0.5 ms", 0.0005))


class BusyThread:
    """Runs Python bytecode without pause (dict and string work, like building requests) and
    counts its loops, to measure both sides of the GIL contention."""

    def __init__(self):
        self.loops, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            d = {str(i): i for i in range(200)}
            self.loops += len("".join(d)) > 0

    def __enter__(self) -> BusyThread:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def busy_rate(seconds: float = 0.5) -> float:
    """Loops per second of a ``BusyThread`` running alone."""
    with BusyThread() as b:
        time.sleep(seconds)
        n = b.loops
    return n / seconds


def ceiling_gbps(device: torch.device, nbytes: int = 1 << 30) -> float:
    """The ceiling, best of five: one pinned host buffer copied to the GPU (on the CPU: one
    host buffer copied to another)."""
    on_gpu = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_gpu)
    dest = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(5):
        if on_gpu:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dest.copy_(host, non_blocking=on_gpu)
        if on_gpu:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def read_once(path: Path, device: torch.device, method: str, threads: int, chunk: int) -> float:
    """Seconds for one ``read_safetensors`` onto ``device`` (synchronized)."""
    kw = {"chunk_bytes": chunk} if chunk else {}
    t0 = time.perf_counter()
    tensors = read_safetensors(path, device, threads=threads, method=method, **kw)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    del tensors
    gc.collect()
    return seconds


def measure(path: Path, device: torch.device, repeats: int) -> pd.DataFrame:
    size = path.stat().st_size
    alone_rate = busy_rate()
    rows = []
    for label, method, threads, chunk in READERS:
        for cond, interval in CONDITIONS:
            times, slowdowns = [], []
            for _ in range(repeats):
                previous = sys.getswitchinterval()
                if interval is None:
                    times.append(read_once(path, device, method, threads, chunk))
                    continue
                sys.setswitchinterval(interval)
                try:
                    with BusyThread() as b:
                        t = read_once(path, device, method, threads, chunk)
                        loops = b.loops
                finally:
                    sys.setswitchinterval(previous)
                times.append(t)
                slowdowns.append(1 - loops / t / alone_rate)
            best = min(times)
            rows.append(
                {
                    "reader": label,
                    "method": method,
                    "threads": threads,
                    "condition": cond,
                    "seconds": best,
                    "gb_s": size / best / 1e9,
                    "busy_thread_slowed": (sum(slowdowns) / len(slowdowns)) if slowdowns else None,
                }
            )
            print(f"{label:>22} {cond:>13}: {best:.3f} s, {size / best / 1e9:.1f} GB/s", flush=True)
    return pd.DataFrame(rows)


def _records(df: pd.DataFrame) -> list[dict]:
    """Rows for JSON: pandas' NaN (no busy thread) as null."""
    return [{k: None if pd.isna(v) else v for k, v in r.items()} for r in df.to_dict("records")]


def plot(df: pd.DataFrame, ceiling: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    readers = list(dict.fromkeys(df["reader"]))
    width = 0.8 / len(CONDITIONS)
    for i, (cond, _) in enumerate(CONDITIONS):
        sub = df[df["condition"] == cond].set_index("reader").loc[readers]
        xs = [r + i * width for r in range(len(readers))]
        ax.bar(xs, sub["gb_s"], width, label=cond)
    ax.axhline(ceiling, color="k", ls="--", lw=1, label=f"ceiling {ceiling:.0f} GB/s")
    ax.set_xticks([r + width for r in range(len(readers))], readers, fontsize=8)
    ax.set_ylabel("GB/s (file -> device)")
    ax.set_title("read_safetensors, page cache warm: alone vs beside a busy Python thread")
    ax.legend(fontsize=8)
    save_figure(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--file", required=True, type=Path, help="a safetensors file (any size)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--ceiling-mib", type=int, default=1024, help="size of the ceiling's copy")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if not a.file.is_file():
        raise SystemExit(f"error: --file {a.file} is not a file")
    if a.repeats < 1 or a.ceiling_mib < 1:
        raise SystemExit("error: --repeats and --ceiling-mib must be >= 1")
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"error: --device {a.device}: CUDA is not available here")
    with open(a.file, "rb") as f:  # page cache warm, as in a run that follows another
        while f.read(256 << 20):
            pass
    ceiling = ceiling_gbps(device, a.ceiling_mib << 20)
    df = measure(a.file, device, a.repeats)
    df["of_ceiling"] = df["gb_s"] / ceiling
    out = a.out or results_dir(__file__, device_slug(device))
    out.mkdir(parents=True, exist_ok=True)
    size_gb = a.file.stat().st_size / 1e9
    notes = (
        f"{a.file.name}: {size_gb:.2f} GB, page cache warm; best of {a.repeats}. Ceiling "
        f"({'pinned host-to-device' if device.type == 'cuda' else 'host'} copy, same run): "
        f"{ceiling:.1f} GB/s. busy_thread_slowed: the loop rate the busy "
        f"Python thread lost while the read ran. torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs."
    )
    write_table(df, out, "read_bench", "Checkpoint read onto the GPU", notes)
    write_json(
        {"file_gb": size_gb, "ceiling_gb_s": ceiling, "runs": _records(df)},
        out / "read_bench.json",
    )
    plot(df, ceiling, out / "read_bench.png")
    print(f"wrote {out}/read_bench.{{csv,md,json,png}}")


if __name__ == "__main__":
    main()
