"""What the command-line tools share: a bad path is one line (``error: ...``) and exit status 2.

Tools check what they were given before any heavy work (:func:`require_file`,
:func:`require_dir`, :func:`require_meta_checkpoint`, or a loader's failure re-raised as
:class:`InputError` naming the file). In one process :func:`exit_on_input_error` prints the
message and exits 2, no traceback. Under ``torchrun`` the checks go through
:func:`checked_on_every_rank`: if any rank fails, every rank raises the same
:class:`~nakta_model.parallel.ParallelConfigError`, which :func:`~nakta_model.parallel.launch`
prints once and turns into exit status 2 on every rank (a rank that alone sees a missing file
cannot leave the others waiting, nor exit before rank 0 has said why).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from nakta_model.parallel import ParallelConfigError, gather_objects, is_distributed

R = TypeVar("R")

META_CHECKPOINT = "a Meta checkpoint folder: params.json + consolidated.*.pth"


class InputError(ValueError):
    """Something given on the command line that cannot be used; the message names it."""

    def __str__(self) -> str:  # one line, whatever a wrapped library error put in it
        return re.sub(r"\s*\n\s*", " ", super().__str__()).strip()


def require_file(path: str | Path, option: str, expected: str) -> Path:
    """``path`` as a ``Path`` when it is an existing file, else :class:`InputError`."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{option} {path}: no such file (expected {expected})")
    if not p.is_file():
        raise InputError(f"{option} {path}: not a file (expected {expected})")
    return p


def require_dir(path: str | Path, option: str, expected: str) -> Path:
    """``path`` as a ``Path`` when it is an existing directory, else :class:`InputError`."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{option} {path}: no such directory (expected {expected})")
    if not p.is_dir():
        raise InputError(f"{option} {path}: not a directory (expected {expected})")
    return p


def require_meta_checkpoint(path: str | Path, option: str = "--checkpoint") -> Path:
    """A folder holding ``params.json`` and at least one ``consolidated.*.pth``."""
    p = require_dir(path, option, META_CHECKPOINT)
    missing = [] if (p / "params.json").is_file() else ["params.json"]
    if not any(p.glob("consolidated.*.pth")):
        missing.append("consolidated.*.pth")
    if missing:
        raise InputError(
            f"{option} {path}: not a checkpoint, no {' or '.join(missing)} in it "
            f"(expected {META_CHECKPOINT})"
        )
    return p


def checked_on_every_rank(check: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    """``check(*args, **kwargs)``; under a process group, an :class:`InputError` on ANY rank
    becomes the same ``ParallelConfigError`` on every rank.

    The message is the error itself when every rank failed alike (the usual case: one host, one
    file system), else each failing rank's message. Other exceptions are bugs and propagate.
    """
    if not is_distributed():
        return check(*args, **kwargs)
    error: str | None = None
    result: Any = None
    try:
        result = check(*args, **kwargs)
    except InputError as e:
        error = str(e)
    messages = gather_objects(error)
    failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
    if not failed:
        return result
    if len(failed) == len(messages) and len({m for _, m in failed}) == 1:
        raise ParallelConfigError(failed[0][1])
    raise ParallelConfigError("; ".join(f"rank {rank}: {m}" for rank, m in failed))


def exit_on_input_error(fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    """``fn(*args, **kwargs)`` in one process; an :class:`InputError` prints ``error: ...``
    on stderr and exits with status 2 instead of a traceback."""
    try:
        return fn(*args, **kwargs)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
