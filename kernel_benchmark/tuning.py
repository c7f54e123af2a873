"""What the launch-config tuners share: compiling a candidate grid in spawned worker processes
(Triton's disk cache then serves the timing process) and writing one device family's winners
into a tuned-config JSON that the kernel loads.

Used by ``tune_fp8_decode.py`` (decode_linear's FP8 GEMVs) and ``tune_fp8_decode_gemm.py``
(fp8_decode_gemm); each builds its own task list and table keys.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from pathlib import Path

import torch


def precompile(
    warm: Callable[..., int], tasks: Sequence[tuple], jobs: int, deadline: float
) -> None:
    """``warm(*task)`` for every task in ``jobs`` spawned processes until ``deadline`` (each
    returns how many configs it ran); what is left compiles later, while timing."""
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
