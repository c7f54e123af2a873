"""lm-eval's index of its built-in tasks, kept on disk between runs.

Every ``TaskManager`` lm-eval 0.4.13 builds parses each of the ~14,000 yaml files it ships
(``TaskIndex.build``: 11-16 s of one process on a slow CPU) before it runs anything, whatever
tasks were asked for. That index is a pure function of those files, so this module keeps the
built-in folder's index in a file under the user's cache folder and reads it back (about 0.7 s)
while the folder's files are unchanged: the cache is keyed by lm-eval's version and Python's,
and checked against the path, size and modification time of every file under the folder (a
yaml's ``include:`` may name any file there). Any change, or a cache that cannot be read,
builds the index as lm-eval does and writes it again.

Same index, same tasks: the entries (name, kind, yaml path, parsed config, tags) and their
order are those the build gives, ``--include_path`` folders are still indexed fresh on every run
and merged over the built-ins exactly as lm-eval merges them, and the warnings the build logged
(duplicate names) are logged again from the cache. ``NAKTA_LM_EVAL_LOCAL_TASKS=0`` (lm-eval's
whole index, as lm-eval builds it) turns it off.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import marshal
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

FORMAT = 1  # bump when the cached layout changes


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/nakta/lm_eval_task_index`` (``~/.cache`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nakta" / "lm_eval_task_index"


def builtin_tasks_dir() -> Path:
    """The folder of lm-eval's own task yamls (the one ``TaskManager`` adds by default)."""
    import lm_eval.tasks.manager as manager

    return Path(manager.__file__).parent


def folder_signature(root: Path) -> str:
    """A digest of every file under ``root``: relative path, size, modification time (ns)."""
    digest = hashlib.sha256()
    stack = [str(root)]
    while stack:
        folder = stack.pop()
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                stack.append(e.path)
                continue
            with contextlib.suppress(OSError):  # a file vanishing mid-walk: not in the digest
                st = e.stat()
                rel = os.path.relpath(e.path, root)
                digest.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def cache_file(root: Path, directory: Path | None = None) -> Path:
    """The cache file of ``root``'s index for this lm-eval and this Python."""
    import lm_eval

    version = getattr(lm_eval, "__version__", "unknown")
    key = f"{FORMAT}\0{version}\0{sys.version}\0{root.resolve()}"
    name = hashlib.sha256(key.encode()).hexdigest()[:24]
    return (directory or cache_dir()) / f"{name}.marshal"


def _encode(index: dict, warnings: list[tuple[int, str]], signature: str) -> bytes:
    rows = [
        (key, e.name, e.kind.name, None if e.yaml_path is None else str(e.yaml_path), e.cfg,
         e.tags)
        for key, e in index.items()
    ]  # fmt: skip
    return marshal.dumps((FORMAT, signature, warnings, rows))


def _decode(data: bytes, signature: str) -> tuple[dict, list[tuple[int, str]]] | None:
    """The index and the build's warnings, or None when ``data`` is of other files."""
    from lm_eval.tasks._index import Entry, Kind

    fmt, stored, warnings, rows = marshal.loads(data)
    if fmt != FORMAT or stored != signature:
        return None
    index = {
        key: Entry(name=name, kind=Kind[kind], yaml_path=None if path is None else Path(path),
                   cfg=cfg, tags=set(tags))
        for key, name, kind, path, cfg, tags in rows
    }  # fmt: skip
    return index, warnings


class _Recorder(logging.Handler):
    """Collects the warnings the index build logs, to log them again on a cache hit."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelno, record.getMessage()))


def cached_index(root: Path, build, directory: Path | None = None) -> dict:
    """``build([root])``'s index, from the cache file when ``root``'s files are unchanged;
    otherwise built (its warnings recorded) and the cache file written."""
    import lm_eval.tasks._index as index_module

    log = index_module.log
    signature = folder_signature(root)
    path = cache_file(root, directory)
    with contextlib.suppress(OSError, ValueError, EOFError, TypeError, KeyError):
        got = _decode(path.read_bytes(), signature)
        if got is not None:
            index, warnings = got
            for level, message in warnings:
                log.log(level, "%s", message)
            return index
    recorder = _Recorder()
    log.addHandler(recorder)
    try:
        index = build([root])
    finally:
        log.removeHandler(recorder)
    with contextlib.suppress(OSError, ValueError):  # read-only home, unmarshallable config
        from nakta_model.io_utils import atomic_write_bytes

        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, _encode(index, recorder.records, signature))
    return index


def merged_build(build, paths: Iterable[Path], builtin: Path, directory: Path | None = None):
    """``TaskIndex.build(paths)`` with ``builtin``'s part from :func:`cached_index`: each
    folder indexed on its own, later folders overriding earlier ones as lm-eval merges them."""
    import lm_eval.tasks._index as index_module

    builtin = builtin.resolve()
    index: dict = {}
    for root in paths:
        root = Path(root)
        if root.resolve() == builtin:
            path_index = cached_index(root, build, directory)
        else:
            path_index = build([root])
        for name, entry in path_index.items():
            if name in index:
                index_module.log.warning(
                    "Task '%s' from %s overrides existing task from %s",
                    name,
                    entry.yaml_path,
                    index[name].yaml_path,
                )
            index[name] = entry
    return index


@contextlib.contextmanager
def builtin_index_cached(
    directory: Path | None = None, builtin: Path | None = None
) -> Iterator[None]:
    """Inside the block, every ``TaskManager`` reads the index of ``builtin`` (lm-eval's own
    task folder when None) from the cache in ``directory`` (:func:`cache_dir` when None) and
    indexes any other folder as lm-eval does (:func:`merged_build`); builds asked with
    ``resolve_includes=False`` are lm-eval's own."""
    from lm_eval.tasks._index import TaskIndex

    original = TaskIndex.__dict__["build"]
    build = original.__func__
    builtin = builtin_tasks_dir() if builtin is None else Path(builtin)

    def cached_build(paths: Iterable[Path], *, resolve_includes: bool = True) -> dict:
        paths = list(paths)
        if not resolve_includes:
            return build(paths, resolve_includes=resolve_includes)
        return merged_build(build, paths, builtin, directory)

    TaskIndex.build = staticmethod(cached_build)
    try:
        yield
    finally:
        TaskIndex.build = original


def requested_output_types(manager: object, tasks: object) -> set[str] | None:
    """The ``output_type`` of every task ``tasks`` (lm-eval's matched names) stands for, read
    from ``manager``'s index (groups and tags expanded), or None where any of them cannot be
    told from the index alone."""
    from lm_eval.tasks._index import Kind

    index = getattr(manager, "task_index", None)
    if not isinstance(index, dict) or not isinstance(tasks, (list, tuple)) or not tasks:
        return None
    types: set[str] = set()
    stack, seen = list(tasks), set()
    while stack:
        name = stack.pop()
        if not isinstance(name, str):
            return None  # an inline config
        if name in seen:
            continue
        seen.add(name)
        entry = index.get(name)
        if entry is None:
            return None
        if entry.kind is Kind.TASK:
            output_type = (entry.cfg or {}).get("output_type")
            if not isinstance(output_type, str):
                return None  # lm-eval's default decides: not read here
            types.add(output_type)
        elif entry.kind is Kind.GROUP:
            members = (entry.cfg or {}).get("task")
            members = [members] if isinstance(members, str) else members
            if not isinstance(members, list):
                return None
            stack.extend(members)
        elif entry.kind is Kind.TAG:
            stack.extend(sorted(entry.tags))
        else:
            return None  # a Python task
    return types
