"""Atomic file writes: a reader never sees a half-written file, a crash leaves the old one.

Directories (checkpoints) are written into a marked temporary directory beside the target and
renamed into place at the end. The marker (:data:`TEMP_MARKER`: pid, host, start time) lets a
later writer into the same parent tell a temporary directory whose writer died (SIGKILL, power
loss) from one still being written, and remove only the former. SIGINT/SIGTERM during a write
remove the temporary directory, then reach whoever handled them before (see
:func:`interruptible`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import os
import re
import shutil
import signal
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = [
    "HIDDEN_TEMP_DIR",
    "STALE_AFTER_S",
    "TEMP_MARKER",
    "Interrupted",
    "atomic_output_dir",
    "atomic_output_file",
    "atomic_write_bytes",
    "atomic_write_text",
    "check_output_dir",
    "interruptible",
    "make_temp_dir",
    "read_temp_marker",
    "remove_stale_temp_dirs",
    "rename_noreplace",
    "signals_deferred",
]

TEMP_MARKER = ".nakta-tmp"
# A temp dir on another host cannot be probed for its pid: it is stale after this long.
STALE_AFTER_S = 24 * 3600
# ``.NAME.XXXXXXXX.tmp``: what atomic_output_dir creates beside NAME (mkdtemp's 8 random chars).
HIDDEN_TEMP_DIR = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp")
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


@contextlib.contextmanager
def atomic_output_file(path: str | os.PathLike, mode: str = "wb") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; it is renamed onto ``path`` only on success.

    For writers that want a file name (``torch.save``, ``safetensors``, ``matplotlib``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix or ".tmp"
    )
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


# ------------------------------------------------------------------------------------ signals


class Interrupted(BaseException):
    """SIGINT/SIGTERM arrived inside :func:`interruptible`; raised where the code was, so that
    ``except``/``finally`` blocks clean up (a BaseException: ``except Exception`` lets it pass)."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_status(self) -> int:
        """The shell's status for a process killed by this signal (130 for SIGINT, 143 for TERM)."""
        return 128 + self.signum


class _SignalScope:
    """Our handler for one :func:`interruptible` block; holds signals back while deferred."""

    def __init__(self) -> None:
        self.deferred = 0
        self.pending: int | None = None
        self.raised = False

    def handle(self, signum: int, frame: object) -> None:
        if self.deferred or self.raised:  # in a critical step, or already unwinding: hold it
            self.pending = self.pending or signum
            return
        self.raised = True
        raise Interrupted(signum)

    def release(self) -> None:
        if self.pending is not None and not self.deferred and not self.raised:
            signum, self.pending = self.pending, None
            self.raised = True
            raise Interrupted(signum)


_scopes: list[_SignalScope] = []


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Turn SIGINT/SIGTERM into :class:`Interrupted` inside the block, then hand them on.

    Why: SIGTERM's default action kills the process on the spot, so no cleanup runs and a
    multi-GB temporary directory stays behind. Inside the block the signal raises instead; when
    it leaves the block, the previous handlers are restored and the signal is raised again, so
    it ends up where it would have gone (the default SIGTERM action: the process exits with
    status 143; Python's SIGINT handler: ``KeyboardInterrupt``). Signals that were ignored
    (``SIG_IGN``, e.g. SIGINT of a background job) stay ignored. Outside the main thread
    (where handlers cannot be installed) the block runs unprotected.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    scope = _SignalScope()
    previous = {}
    for signum in _SIGNALS:
        old = signal.getsignal(signum)
        if old is signal.SIG_IGN or old is None:  # ignored, or owned by C code: leave it
            continue
        previous[signum] = old
        signal.signal(signum, scope.handle)
    _scopes.append(scope)
    try:
        yield
    except Interrupted as e:
        _restore_handlers(scope, previous)
        signal.raise_signal(e.signum)  # the previous handler acts (may not return)
        raise
    finally:
        _restore_handlers(scope, previous)
        if scope.pending is not None and not scope.raised:  # held back, then an error left
            signal.raise_signal(scope.pending)


def _restore_handlers(scope: _SignalScope, previous: dict) -> None:
    """Put the previous handlers back where ours is still installed (idempotent)."""
    if scope in _scopes:
        _scopes.remove(scope)
    for signum, old in previous.items():
        if signal.getsignal(signum) == scope.handle:
            signal.signal(signum, old)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM back (inside :func:`interruptible`) until the block is done.

    For steps that must not stop halfway: the renames that install a directory and the removal
    of a temporary one. Python-level deferral, not ``pthread_sigmask``: Python runs handlers in
    the main thread whichever thread the kernel delivered the signal to.
    """
    on_main = threading.current_thread() is threading.main_thread()
    scope = _scopes[-1] if _scopes and on_main else None
    if scope is None:  # no handler of ours: nothing to hold back
        yield
        return
    scope.deferred += 1
    try:
        yield
    finally:
        scope.deferred -= 1
    scope.release()


# ------------------------------------------------------------------ marked temporary dirs


def make_temp_dir(parent: str | os.PathLike, prefix: str, suffix: str = "") -> Path:
    """``mkdtemp`` in ``parent`` plus a :data:`TEMP_MARKER` file saying who made it."""
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=prefix, suffix=suffix))
    marker = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.time(),
        "proc_start": _proc_start_ticks(os.getpid()),
    }
    (tmp / TEMP_MARKER).write_text(json.dumps(marker) + "\n")
    return tmp


def read_temp_marker(directory: str | os.PathLike) -> dict | None:
    """The marker of a temp dir made by :func:`make_temp_dir`; None when absent or not ours."""
    f = Path(directory) / TEMP_MARKER
    try:
        if not stat.S_ISREG(os.lstat(f).st_mode):
            return None
        marker = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    valid = (
        isinstance(marker, dict)
        and isinstance(marker.get("pid"), int)
        and marker["pid"] > 0
        and isinstance(marker.get("host"), str)
        and isinstance(marker.get("started"), (int, float))
    )
    return marker if valid else None


def _proc_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` (clock ticks since boot, Linux ``/proc``), to detect pid reuse."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
        return int(raw.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _is_stale(marker: dict, now: float) -> bool:
    """Its writer is gone: a dead (or reused) pid on this host; older than a day elsewhere."""
    if marker["host"] != socket.gethostname():
        return now - marker["started"] > STALE_AFTER_S
    pid = marker["pid"]
    if not _pid_alive(pid):
        return True
    recorded = marker.get("proc_start")
    current = _proc_start_ticks(pid)
    return isinstance(recorded, int) and current is not None and current != recorded


def remove_stale_temp_dirs(parent: str | os.PathLike, name: re.Pattern) -> list[Path]:
    """Remove the temp dirs in ``parent`` left by writers that died; return what was removed.

    Only a real directory (not a symlink) whose name matches ``name`` AND that holds a valid
    marker AND whose writer is gone (:func:`_is_stale`) is touched; anything else is left alone.
    """
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return []
    removed = []
    now = time.time()
    for entry in entries:
        if not name.fullmatch(entry.name) or not entry.is_dir(follow_symlinks=False):
            continue
        marker = read_temp_marker(entry.path)
        if marker is None or not _is_stale(marker, now):
            continue
        with signals_deferred():
            shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(Path(entry.path))
    return removed


# -------------------------------------------------------------------------------- renames

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}


@functools.cache
def _renameat2() -> Callable | None:
    """glibc's ``renameat2`` (Linux >= 3.15, glibc >= 2.28), or None where it is missing."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def rename_noreplace(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename ``src`` to ``dst``; ``FileExistsError`` if ``dst`` exists, whatever it is.

    A plain ``rename`` of a directory silently replaces an *empty* directory at ``dst``. With
    ``renameat2(RENAME_NOREPLACE)`` the check and the rename are one atomic step. Without it
    (other kernels or libcs, some network filesystems) it is a check followed by a rename: an
    empty directory created at ``dst`` in the microseconds between them would be replaced.
    """
    fn = _renameat2()
    if fn is not None:
        rc = fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE)
        if rc == 0:
            return
        err = ctypes.get_errno()
        if err not in _UNSUPPORTED:
            raise OSError(err, os.strerror(err), os.fspath(src), None, os.fspath(dst))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(dst))
    os.rename(src, dst)


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort: not every filesystem allows it)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --------------------------------------------------------------------- output dir, checked first


def _within(inner: Path, outer: Path) -> bool:
    """``inner`` is ``outer`` or lies under it, through symlinks and bind mounts alike."""
    try:
        outer_st = os.stat(outer)
    except OSError:
        return False
    real = inner.resolve()
    for p in (real, *real.parents):
        try:
            st = os.stat(p)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (outer_st.st_dev, outer_st.st_ino):
            return True
    return False


def _check_creatable(out_dir: Path) -> None:
    """The nearest existing ancestor of ``out_dir`` is a directory we may write into."""
    parent = out_dir.absolute().parent
    existing = next(p for p in (parent, *parent.parents) if os.path.lexists(p))
    if not existing.is_dir():
        raise ValueError(f"cannot create output {out_dir}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"cannot create output {out_dir}: no write permission in {existing}")


def check_output_dir(
    out_dir: str | os.PathLike,
    force: bool = False,
    *,
    source: str | os.PathLike | None = None,
    may_replace: Callable[[Path], None] | None = None,
) -> None:
    """Refuse, before any work, an output directory that must not be created or replaced.

    Never the ``source`` directory (itself, a directory holding it, a directory inside it),
    never a symlink or a file, never where it cannot be created; an existing one only with
    ``force`` and only if ``may_replace(out_dir)`` does not raise. :func:`atomic_output_dir`
    checks the same again when it writes; this finds the problem before hours of work.
    """
    out_dir = Path(out_dir)
    if source is not None:
        source = Path(source)
        if _within(source, out_dir):
            what = (
                "is the input directory"
                if _within(out_dir, source)
                else f"contains the input {source}"
            )
            raise ValueError(f"output {out_dir} {what}: refusing (it would destroy the source)")
        if _within(out_dir, source):
            raise ValueError(
                f"output {out_dir} is inside the input directory {source}: write the checkpoint "
                "elsewhere"
            )
    _check_creatable(out_dir)
    if out_dir.is_symlink():
        raise ValueError(
            f"output {out_dir} is a symbolic link (to {os.readlink(out_dir)}); refusing to "
            "replace it: give the real directory"
        )
    if not os.path.lexists(out_dir):
        return
    if not out_dir.is_dir():
        raise ValueError(f"output {out_dir} exists and is not a directory; refusing to replace it")
    if not force:
        raise FileExistsError(f"output {out_dir} already exists (pass --force to replace it)")
    if may_replace is not None:
        may_replace(out_dir)


# ------------------------------------------------------------------------- atomic output dir


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _existing_output(
    path: Path, force: bool, may_replace: Callable[[Path], None] | None
) -> tuple[int, int] | None:
    """Identity of the directory ``force`` may replace, None when ``path`` does not exist."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise FileExistsError(
            f"output {path} is a symbolic link (to {os.readlink(path)}); refusing to replace it: "
            "give the real directory"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise FileExistsError(
            f"output {path} exists and is not a directory; refusing to replace it"
        )
    if not force:
        raise FileExistsError(f"output {path} already exists (pass --force to replace it)")
    if may_replace is not None:
        may_replace(path)
    return _identity(st)


@contextlib.contextmanager
def atomic_output_dir(
    path: str | os.PathLike,
    force: bool = False,
    *,
    may_replace: Callable[[Path], None] | None = None,
    notify: Callable[[str], None] | None = None,
) -> Iterator[Path]:
    """Yield a marked temporary directory beside ``path``; it becomes ``path`` only on success.

    Refuses an existing ``path`` unless ``force``, and never replaces a symlink or a file;
    ``may_replace(path)`` may refuse (raise) what ``force`` would replace. The old directory is
    removed only after the new one is complete, and only if it is still the very directory seen
    at the start (same ``st_dev``/``st_ino``): a directory that appears at ``path`` (or replaces
    it) while we write is left alone and ``FileExistsError`` is raised. Stale temp dirs of dead
    writers in the same parent are removed first (``notify`` hears of each). SIGINT/SIGTERM
    remove the temporary directory (:func:`interruptible`).

    What remains unprotected: SIGKILL or power loss leave the temp dir (a later write sweeps
    it); without ``renameat2`` see :func:`rename_noreplace`; with ``force`` there is an instant
    between moving the old directory aside and renaming the new one in where ``path`` is absent.
    """
    path = Path(path)
    with interruptible():
        expected = _existing_output(path, force, may_replace)
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in remove_stale_temp_dirs(path.parent, HIDDEN_TEMP_DIR):
            if notify is not None:
                notify(f"removed {stale}, a temporary directory left by a writer that died")
        with signals_deferred():
            tmp = make_temp_dir(path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            yield tmp
        except BaseException:
            with signals_deferred():
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        with signals_deferred():
            try:
                os.unlink(tmp / TEMP_MARKER)  # the marker must not ship with the output
                _install(tmp, path, expected)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        _fsync_dir(path.parent)


def _install(tmp: Path, path: Path, expected: tuple[int, int] | None) -> None:
    if expected is None:
        try:
            rename_noreplace(tmp, path)
        except FileExistsError:
            raise FileExistsError(
                f"output {path} appeared while this write ran (another process?); left it "
                "alone and discarded this write"
            ) from None
        return
    _replace_dir(tmp, path, expected)


def _replace_dir(tmp: Path, path: Path, expected: tuple[int, int]) -> None:
    """Swap ``tmp`` in for the directory ``expected`` at ``path``, checking what was moved."""
    trash = make_temp_dir(path.parent, prefix=f".{path.name}.", suffix=".tmp")
    aside = trash / "replaced"
    try:
        os.rename(path, aside)
    except FileNotFoundError:  # the old one vanished meanwhile: nothing left to replace
        shutil.rmtree(trash)
        _install(tmp, path, None)
        return
    except OSError:
        shutil.rmtree(trash, ignore_errors=True)
        raise
    if _identity(os.lstat(aside)) != expected:
        _put_back(aside, path, trash)
        raise FileExistsError(
            f"output {path} was replaced by another directory while this write ran; left it "
            "alone and discarded this write"
        )
    try:
        rename_noreplace(tmp, path)
    except FileExistsError:
        os.unlink(trash / TEMP_MARKER)  # keep the old checkpoint: never swept
        raise FileExistsError(
            f"output {path} appeared while the old one was moved aside; the old one is kept "
            f"at {aside}, this write was discarded"
        ) from None
    shutil.rmtree(aside)
    shutil.rmtree(trash)


def _put_back(aside: Path, path: Path, trash: Path) -> None:
    """Return someone else's directory that we moved aside to where it was."""
    try:
        rename_noreplace(aside, path)
    except OSError:
        os.unlink(trash / TEMP_MARKER)  # never sweep someone else's data
        raise FileExistsError(
            f"output {path} changed twice while this write ran; the directory found there is "
            f"kept at {aside}"
        ) from None
    shutil.rmtree(trash)
