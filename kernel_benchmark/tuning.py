"""What the launch-config tuners share: compiling a candidate grid in spawned worker processes
(Triton's disk cache then serves the timing process) and writing one device family's winners
into a tuned-config JSON that the kernel loads.

Also the sweep itself (``time_points``: each point timed in turn until the budget is spent,
its best printed; ``config_key`` / ``config_label`` for its candidates) and its results (``write_results``: every timing, the best per point, the
winners into the kernel's table). Used by ``tune_fp8_decode.py`` (decode_linear's FP8 GEMVs)
and ``tune_fp8_decode_gemm.py`` (fp8_decode_gemm); each builds its own points, timing, table
keys and log line.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from pathlib import Path

import pandas as pd
import torch


def config_key(cfg: dict[str, int], knobs: Sequence[str]) -> tuple[int, ...]:
    """A launch config's identity over a tuner's ``knobs`` (candidates deduplicated by it)."""
    return tuple(int(cfg[k]) for k in knobs)


def config_label(cfg: dict[str, int], knobs: Sequence[str]) -> str:
    """``"KNOB=value ..."`` over ``knobs``: the tuners' log lines and timing paths."""
    return " ".join(f"{k}={cfg[k]}" for k in knobs)


def precompile(
    warm: Callable[..., int], tasks: Sequence[tuple], jobs: int, deadline: float
) -> None:
    """``warm(*task)`` for every task in ``jobs`` spawned processes until ``deadline`` (each
    returns how many configs it ran); what is left compiles later, while timing, as does
    everything when the pool itself fails."""
    try:
        _precompile(warm, tasks, jobs, deadline)
    except Exception as ex:  # noqa: BLE001 - the timing loop compiles what is missing
        print(f"precompile failed ({type(ex).__name__}: {ex}); compiling while timing")


def _precompile(warm: Callable[..., int], tasks: Sequence[tuple], jobs: int, deadline: float):
    t0 = time.perf_counter()
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))
    try:
        futures = [pool.submit(warm, *t) for t in tasks]
        done, pending = wait(futures, timeout=max(1.0, deadline - time.perf_counter()),
                             return_when=FIRST_EXCEPTION)  # fmt: skip
        n = sum(f.result() for f in done if f.exception() is None)
        failed = [f.exception() for f in done if f.exception() is not None]
        print(f"precompile: {n} configs in {time.perf_counter() - t0:.0f}s with {jobs} jobs"
              f"{f', {len(pending)} tasks left' if pending else ''}"
              f"{f', worker error: {failed[0]}' if failed else ''}", flush=True)  # fmt: skip
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # no worker left on the GPU while timing


def time_points(
    points: Sequence[tuple],
    time_point: Callable[[tuple], list[dict]],
    best_per_point: Callable[[pd.DataFrame], list[dict]],
    describe: Callable[[tuple, dict], str],
    t0: float,
    deadline: float,
) -> list[dict]:
    """Every timing row of ``time_point(point)`` for the points in order, until ``deadline``
    (the points left are named); after each point its best (``best_per_point``) is printed
    as ``describe(point, best)``."""
    rows: list[dict] = []
    for i, point in enumerate(points):
        if time.perf_counter() > deadline:
            print(f"budget spent: {len(points) - i} points not tuned", flush=True)
            break
        new = time_point(point)
        rows += new
        best = best_per_point(pd.DataFrame(new))
        if best:
            print(f"[{i + 1}/{len(points)} {time.perf_counter() - t0:.0f}s] "
                  f"{describe(point, best[0])}", flush=True)  # fmt: skip
        torch.cuda.empty_cache()
    return rows


def write_results(
    rows: list[dict],
    best_per_point: Callable[[pd.DataFrame], list[dict]],
    *,
    out: Path,
    stem: str,
    title: str,
    notes: str,
    summary: dict,
    family: str,
    device_name: str,
    configs: Path,
    write_configs: bool,
    update: Callable[[Path, str, str, list[dict]], object],
    t0: float,
    keep: Callable[[dict], bool] = lambda best: True,
) -> list[dict]:
    """``out/<stem>.csv`` / ``.md`` (every timing), ``out/<stem>.json`` (``summary`` and the
    best per point) and, with ``write_configs``, the best points that ``keep`` takes into the
    kernel's table (``update``: the tuner's ``update_configs``) under this device ``family``
    (``device_name`` recorded beside it).
    Returns the best per point."""
    from bench_common.report import write_json, write_table

    df = pd.DataFrame(rows)
    best = best_per_point(df) if len(df) else []
    if len(df):
        write_table(df, out, stem, title, notes)
    write_json({**summary, "family": family, "best": best}, out / f"{stem}.json")
    chosen = [b for b in best if keep(b)]
    if chosen and write_configs:
        if not family:
            print("no device family for this GPU: tuned configs not written", flush=True)
        else:
            update(configs, family, device_name, chosen)
            print(f"tuned configs ({len(chosen)} points, family {family}) -> {configs}")
    print(f"done in {time.perf_counter() - t0:.0f}s; results -> {out}", flush=True)
    return best


def write_family(
    path: Path, family: str, device_name: str, rows: dict[str, tuple[dict, dict]], about: str,
    load: Callable[[Path], object],
) -> dict:  # fmt: skip
    """Put ``rows`` (table key -> (config, measured figures)) under ``family`` in the
    tuned-config JSON at ``path`` (other families kept, this family's rows of these keys
    replaced), atomically; ``load`` (the kernel's reader) checks the file before (a malformed
    one stops here, not overwritten) and after. Returns the document written."""
    from nakta_model.io_utils import atomic_write_text

    doc: dict = {"devices": {}}
    if path.is_file():
        load(path)
        doc = json.loads(path.read_text())
    block = doc["devices"].setdefault(family, {"entries": {}})
    entries, measured = block.setdefault("entries", {}), block.setdefault("measured", {})
    for key, (config, figures) in rows.items():
        entries[key] = config
        measured[key] = figures
    block["device_name"] = device_name
    block["versions"] = f"torch {torch.__version__}"
    doc["about"] = about
    doc["devices"] = dict(sorted(doc["devices"].items()))
    block["entries"] = dict(sorted(entries.items()))
    atomic_write_text(path, json.dumps(doc, indent=2, sort_keys=True) + "\n")
    load(path)  # what was written loads
    return doc
