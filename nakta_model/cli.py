"""What the command-line tools share: a bad path is one line (``error: ...``) and exit status 2.

Tools check what they were given before any heavy work (:func:`require_file`,
:func:`require_dir`, :func:`require_checkpoint`, or a loader's failure re-raised as
:class:`InputError` naming the file: :func:`checkpoint_errors` around any read of a
checkpoint, :func:`checkpoint_tokenizer_path` for the tokenizer that goes with one). In one process :func:`exit_on_input_error` prints the
message and exits 2, no traceback. Under ``torchrun`` the checks go through
:func:`checked_on_every_rank`: if any rank fails, every rank raises the same
:class:`~nakta_model.parallel.ParallelConfigError`, which :func:`~nakta_model.parallel.launch`
prints once and turns into exit status 2 on every rank (a rank that alone sees a missing file
cannot leave the others waiting, nor exit before rank 0 has said why).
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from nakta_model.parallel import ParallelConfigError, gather_objects, is_distributed

R = TypeVar("R")

CHECKPOINT = (
    "a checkpoint folder: Nakta (convert.py's params.json + manifest.json), "
    "Meta (params.json + consolidated.*.pth) or HF (config.json + weights)"
)
# what a checkpoint that does not read raises (CheckpointError is a ValueError; torch.load of a
# truncated .pth: RuntimeError, EOFError or an unpickling error; a file that vanished: OSError)
LOAD_ERRORS = (ValueError, OSError, RuntimeError, EOFError, KeyError, pickle.UnpicklingError)


class InputError(ValueError):
    """Something given on the command line that cannot be used; the message names it."""

    def __str__(self) -> str:  # one line, whatever a wrapped library error put in it
        return re.sub(r"\s*\n\s*", " ", super().__str__()).strip()


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad argument is one ``error:`` line (and exit status 2), not the usage
    block first: the message names the option, ``--help`` shows the rest."""

    def error(self, message: str):
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr, flush=True)
        raise SystemExit(2)


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


def require_checkpoint(path: str | Path, option: str = "--checkpoint") -> Path:
    """A folder in one of the three formats ``nakta_model.load`` reads (files looked at, none
    read: a truncated or corrupt one is caught by :func:`checkpoint_errors` when it loads)."""
    from nakta_model.sources import checkpoint_format

    p = require_dir(path, option, CHECKPOINT)
    if checkpoint_format(p) is None:
        found = "params.json without consolidated.*.pth or manifest.json"
        if not (p / "params.json").is_file():
            found = "no params.json or config.json"
        raise InputError(
            f"{option} {path}: not a checkpoint, {found} in it (expected {CHECKPOINT})"
        )
    return p


@contextmanager
def checkpoint_errors(path: str | Path, option: str = "--checkpoint") -> Iterator[None]:
    """Inside: any failure to read checkpoint ``path`` (missing, truncated or corrupt file,
    wrong format) becomes one :class:`InputError` naming it. A ``ParallelConfigError`` (a
    grid's verdict, already the same on every rank) passes through unchanged."""
    try:
        yield
    except (InputError, ParallelConfigError):
        raise
    except LOAD_ERRORS as e:
        raise InputError(f"{option} {path}: cannot load it: {type(e).__name__}: {e}") from e


def checkpoint_tokenizer_path(
    checkpoint: str | Path | None,
    tokenizer: str | Path | None,
    option: str = "--tokenizer",
    vocab_size: int | None = None,
) -> Path:
    """``tokenizer`` when given (it must be a file), else the checkpoint's own (a HF
    ``tokenizer.json`` or ``tokenizer.model`` in the folder, or Meta's parent folder's
    ``tokenizer.model`` when it fits ``vocab_size``)."""
    if tokenizer is not None:
        return require_file(tokenizer, option, "a SentencePiece tokenizer.model")
    if checkpoint is None:
        raise InputError(f"{option} is needed (no checkpoint to take its tokenizer.model from)")
    from nakta_model.sources import checkpoint_tokenizer

    if (Path(checkpoint) / "tokenizer.json").is_file():  # a HF folder: what AutoTokenizer reads
        return Path(checkpoint) / "tokenizer.json"

    with checkpoint_errors(checkpoint):
        found = checkpoint_tokenizer(checkpoint, vocab_size)
    if found is None:
        raise InputError(
            f"--checkpoint {checkpoint} holds no tokenizer.model: pass {option} "
            "(a SentencePiece tokenizer.model)"
        )
    return found


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


QUIET_RANK_DELAY_S = 2.0  # torchrun stops every rank when the first exits: rank 0 prints first


def _launched_rank() -> int:
    """This process's ``RANK`` under a launcher of several processes (``WORLD_SIZE`` > 1), else 0."""
    try:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return int(os.environ.get("RANK", "0"))
    except ValueError:
        pass
    return 0


def exit_with_error(message: str) -> NoReturn:
    """``error: message`` on stderr and exit status 2, from any command, under torchrun too.

    In one process: the line, then ``SystemExit(2)``; so too on rank 0 of a launch
    (``torchrun``, ``nakta_model.spawn``) that failed before its process group was up, the other
    ranks exiting quietly a moment later. Under a process group of several ranks
    (each rank met the same failure): rank 0 prints, the others wait a moment so rank 0 is the
    one torchrun reports, and every rank ends through
    :func:`~nakta_model.process_exit.exit_without_teardown` -- a group still alive (pinned by a
    library, or never destroyed by lm-eval) must not meet the interpreter's teardown, which
    aborts at random (SIGABRT instead of status 2).
    """
    import torch.distributed as dist

    from nakta_model.process_exit import exit_without_teardown

    line = "error: " + re.sub(r"\s*\n\s*", " ", str(message)).strip()
    group = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if not group:
        if _launched_rank() > 0:  # a rank of a launch whose group is not up yet: rank 0 says it
            time.sleep(QUIET_RANK_DELAY_S)
        else:
            print(line, file=sys.stderr, flush=True)
        raise SystemExit(2)
    if dist.get_rank() == 0:
        print(line, file=sys.stderr, flush=True)
    else:
        time.sleep(QUIET_RANK_DELAY_S)
    exit_without_teardown(2)
