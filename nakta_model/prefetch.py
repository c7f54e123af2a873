"""Read a checkpoint's weights onto the GPU before the model that needs them is built.

A command like lm-eval spends seconds of pure-Python start-up (imports, task loading) before it
constructs the model. Under the GIL, Python work on a second thread only takes turns with that
start-up (building the whole model early finished no sooner than building it when asked), but
the weight read is not Python work: file reads and host-to-device copies. Started early on a
thread, it overlaps the start-up, provided the interpreter hands the GIL back quickly: at
Python's default 5 ms switch interval a reader beside a busy Python thread runs at a fraction
of its rate alone, at 0.5 ms close to it (``speed_bench/read_bench.py``; the figures:
docs/experiments.md). So the switch interval is 0.5 ms while a prefetch runs.

``prefetch(file, device)`` starts the read (registered at once, read on a non-daemon thread: an
exit waits for it); ``take(file, device)`` (``load_rank_state_dict`` calls it) returns those
tensors if the same file (path, inode, size, mtime) was prefetched onto the same device, else
None, and the caller reads it itself. A failed prefetch returns None too:
the caller's own read then raises the error where it always did.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["SWITCH_INTERVAL_S", "discard", "prefetch", "quick_gil_handoff", "take"]

SWITCH_INTERVAL_S = 0.0005
_lock = threading.Lock()
_pending: dict[tuple[str, str], tuple[tuple, Future]] = {}  # (path, device) -> (stamp, read)
handed_out = 0  # prefetches taken so far (callers compare before and after a load)


def _stamp(path: Path) -> tuple:
    """What makes a file "the same file": inode, size, modification time."""
    st = os.stat(path)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _device_name(device: torch.device | str) -> str:
    """``cuda`` -> ``cuda:0`` without importing torch (the current device of a process that
    never chose another), so that a prefetch can be registered before torch is imported."""
    name = str(device)
    return "cuda:0" if name == "cuda" else name


@contextlib.contextmanager
def quick_gil_handoff() -> Iterator[None]:
    """A 0.5 ms switch interval inside the block; the previous one restored after (unless
    somebody changed it meanwhile)."""
    previous = sys.getswitchinterval()
    mine = min(previous, SWITCH_INTERVAL_S)
    sys.setswitchinterval(mine)
    try:
        yield
    finally:
        if sys.getswitchinterval() == mine:
            sys.setswitchinterval(previous)


def prefetch(path: str | os.PathLike, device: torch.device | str) -> Future:
    """Start reading safetensors file ``path`` onto ``device``; returns its future (``take``
    hands the tensors out). Registered before this returns, on the caller's thread, without
    importing torch: torch, CUDA and the read all happen on the prefetch's thread, so a
    ``take`` that comes before the read has even begun still waits for it."""
    path, device = Path(path), _device_name(device)
    stamp = _stamp(path)
    future: Future = Future()

    def run() -> None:
        try:
            import torch

            from nakta_model.safetensors_read import read_safetensors

            target = torch.device(device)
            if target.type == "cuda":
                torch.cuda.set_device(target)
            with quick_gil_handoff():
                future.set_result(read_safetensors(path, target))
        except BaseException as e:  # noqa: BLE001 -- the taker reads again and raises
            future.set_exception(e)

    with _lock:
        _pending[(str(path.resolve()), device)] = (stamp, future)
    threading.Thread(target=run, name="nakta-prefetch").start()  # an exit waits for it
    return future


def take(path: str | os.PathLike, device: torch.device | str) -> dict[str, torch.Tensor] | None:
    """The tensors of a prefetch of this very file onto ``device`` (waiting for it to end), or
    None when there was none, the file changed since, or the prefetch failed."""
    with _lock:
        stamp, future = _pending.pop(
            (str(Path(path).resolve()), _device_name(device)), (None, None)
        )
    if future is None:
        return None
    try:
        same = _stamp(Path(path)) == stamp
    except OSError:
        same = False
    if not same or future.exception() is not None:
        return None
    global handed_out
    handed_out += 1
    return future.result()


def discard() -> None:
    """Drop every prefetch nobody took (their memory goes once their reads end)."""
    with _lock:
        _pending.clear()
