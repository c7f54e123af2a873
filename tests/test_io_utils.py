"""io_utils: no-replace renames, concurrent writers at the final rename, marked temp dirs and
their stale sweep, and the SIGINT/SIGTERM scope (in-process; the subprocess runs that kill a
real conversion are in test_convert.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from nakta_model import io_utils
from nakta_model.io_utils import (
    TEMP_MARKER,
    Interrupted,
    atomic_output_dir,
    interruptible,
    make_temp_dir,
    read_temp_marker,
    remove_stale_temp_dirs,
    rename_noreplace,
    signals_deferred,
)


@pytest.fixture(params=["renameat2", "fallback"])
def rename_impl(request, monkeypatch):
    """Run a test with the kernel's RENAME_NOREPLACE and with the check-then-rename fallback."""
    if request.param == "renameat2":
        if io_utils._renameat2() is None:
            pytest.skip("no renameat2 in this libc")
    else:
        monkeypatch.setattr(io_utils, "_renameat2", lambda: None)
    return request.param


def _hidden(parent) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_rename_noreplace_refuses_even_an_empty_directory(tmp_path, rename_impl):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "f").write_text("ours")
    dst.mkdir()  # os.rename would silently replace an empty directory
    with pytest.raises(FileExistsError):
        rename_noreplace(src, dst)
    assert (src / "f").exists() and list(dst.iterdir()) == []
    dst.rmdir()
    rename_noreplace(src, dst)
    assert (dst / "f").read_text() == "ours" and not src.exists()


@pytest.mark.parametrize("intruder_files", [[], ["theirs.txt"]])
def test_output_that_appears_during_the_write_is_left_alone(tmp_path, rename_impl, intruder_files):
    out = tmp_path / "out"
    appeared = pytest.raises(FileExistsError, match="appeared while this write ran")
    with appeared, atomic_output_dir(out) as tmp:
        (tmp / "ours.txt").write_text("ours")
        out.mkdir()  # another process creates OUT meanwhile
        for name in intruder_files:
            (out / name).write_text("theirs")
    assert sorted(p.name for p in out.iterdir()) == intruder_files
    assert _hidden(tmp_path) == []  # nothing of ours left


def test_forced_replace_refuses_a_directory_swapped_in_meanwhile(tmp_path, rename_impl):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    replaced = pytest.raises(FileExistsError, match="replaced by another directory")
    with replaced, atomic_output_dir(out, force=True) as tmp:
        (tmp / "new.txt").write_text("new")
        os.rename(out, tmp_path / "moved")  # someone replaces OUT by another directory
        out.mkdir()
        (out / "theirs.txt").write_text("theirs")
    assert sorted(p.name for p in out.iterdir()) == ["theirs.txt"]
    assert (tmp_path / "moved" / "old.txt").read_text() == "old"
    assert _hidden(tmp_path) == []


def test_forced_replace_swaps_the_same_directory_and_leaves_no_temp(tmp_path, rename_impl):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with atomic_output_dir(out, force=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]  # no marker shipped
    assert _hidden(tmp_path) == []


def test_force_never_replaces_a_symlink_or_a_file(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_text("x")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(FileExistsError, match="symbolic link"), atomic_output_dir(link, True):
        pass
    f = tmp_path / "file"
    f.write_text("data")
    with pytest.raises(FileExistsError, match="not a directory"), atomic_output_dir(f, True):
        pass
    assert link.is_symlink() and (target / "keep").exists() and f.read_text() == "data"
    assert _hidden(tmp_path) == []  # no stray .file.old or temp dirs


def test_may_replace_refuses_before_anything_is_created(tmp_path):
    out = tmp_path / "out"
    out.mkdir()

    def refuse(path):
        raise ValueError(f"not allowed: {path.name}")

    entered = []
    refused = pytest.raises(ValueError, match="not allowed: out")
    with refused, atomic_output_dir(out, force=True, may_replace=refuse):
        entered.append(True)
    assert not entered and _hidden(tmp_path) == []


# ---------------------------------------------------------------------------- stale temp dirs


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _fake_temp(parent, name, **marker):
    d = parent / name
    d.mkdir()
    (d / "payload").write_text("x")
    if marker:
        (d / TEMP_MARKER).write_text(json.dumps(marker))
    return d


def test_stale_sweep_removes_only_marked_dirs_of_dead_writers(tmp_path):
    host, now, dead = socket.gethostname(), time.time(), _dead_pid()
    me = os.getpid()
    mine = {"host": host, "started": now}
    stale = [
        _fake_temp(tmp_path, ".a.abcdefgh.tmp", pid=dead, **mine),
        _fake_temp(tmp_path, ".b.abcdefgh.tmp", pid=1, host="elsewhere", started=now - 2 * 86400),
        # a live pid whose start time differs from the recorded one: the pid was reused
        _fake_temp(tmp_path, ".c.abcdefgh.tmp", pid=me, proc_start=-5, **mine),
    ]
    kept = [
        _fake_temp(tmp_path, ".d.abcdefgh.tmp", pid=me, **mine),  # alive
        _fake_temp(tmp_path, ".e.abcdefgh.tmp", pid=1, host="elsewhere", started=now - 3600),
        _fake_temp(tmp_path, ".f.abcdefgh.tmp"),  # no marker: not ours
        _fake_temp(tmp_path, "g.abcdefgh.tmp", pid=dead, **mine),  # name not our pattern
        _fake_temp(tmp_path, ".h.abcdefgh.tmp", pid="12", **mine),  # marker not ours
    ]
    (tmp_path / ".i.abcdefgh.tmp").write_text("a file")
    (tmp_path / ".j.abcdefgh.tmp").symlink_to(stale[0])
    removed = remove_stale_temp_dirs(tmp_path, io_utils.HIDDEN_TEMP_DIR)
    assert sorted(removed) == sorted(stale)
    assert not any(d.exists() for d in stale)
    assert all((d / "payload").exists() for d in kept)
    assert (tmp_path / ".i.abcdefgh.tmp").is_file() and (tmp_path / ".j.abcdefgh.tmp").is_symlink()


def test_make_temp_dir_marker_names_this_process(tmp_path):
    d = make_temp_dir(tmp_path, prefix=".x.", suffix=".tmp")
    assert io_utils.HIDDEN_TEMP_DIR.fullmatch(d.name)
    marker = read_temp_marker(d)
    assert marker["pid"] == os.getpid() and marker["host"] == socket.gethostname()
    assert remove_stale_temp_dirs(tmp_path, io_utils.HIDDEN_TEMP_DIR) == []  # we are alive


def test_atomic_output_dir_sweeps_stale_dirs_and_reports_them(tmp_path):
    dead = _fake_temp(
        tmp_path, ".old.abcdefgh.tmp", pid=_dead_pid(), host=socket.gethostname(), started=0.0
    )
    notes = []
    with atomic_output_dir(tmp_path / "out", notify=notes.append) as tmp:
        (tmp / "f").write_text("x")
    assert not dead.exists() and len(notes) == 1 and str(dead) in notes[0]


# ------------------------------------------------------------------------------------ signals


@pytest.fixture
def recorded_sigterm():
    """A Python SIGTERM handler that records calls (the 'previous handler' of the scope)."""
    calls = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    yield calls
    signal.signal(signal.SIGTERM, old)


def test_signal_in_scope_raises_cleans_up_and_reaches_the_previous_handler(
    tmp_path, recorded_sigterm
):
    out = tmp_path / "out"
    with pytest.raises(Interrupted) as info, atomic_output_dir(out) as tmp:
        (tmp / "half").write_text("x")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # not reached: the handler raises at once
    assert info.value.exit_status == 143
    assert recorded_sigterm == [signal.SIGTERM]  # handed on after the cleanup
    assert os.listdir(tmp_path) == []
    handler = signal.getsignal(signal.SIGTERM)
    assert getattr(handler, "__self__", None) is None  # ours is gone: the recorder is back


def test_ignored_signals_stay_ignored(tmp_path):
    old = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with atomic_output_dir(tmp_path / "out") as tmp:
            os.kill(os.getpid(), signal.SIGTERM)
            (tmp / "f").write_text("x")
        assert (tmp_path / "out" / "f").exists()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, old)


def test_deferred_section_completes_before_the_signal_acts(recorded_sigterm):
    steps = []
    with pytest.raises(Interrupted), interruptible():
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            steps.append("critical step done")
        steps.append("not reached")
    assert steps == ["critical step done"] and recorded_sigterm == [signal.SIGTERM]
