"""accuracy_test.models.load_nakta: the on-the-fly conversion of a Meta dir leaves nothing in the
temp dir, whether the load succeeds, fails, or is interrupted by SIGINT/SIGTERM, and removes
conversions left by killed runs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from checkpoint_factory import TINY_PARAMS, write_meta_checkpoint

from accuracy_test import models

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def meta_dir(tmp_path):
    return write_meta_checkpoint(tmp_path / "meta", TINY_PARAMS, seed=3)


@pytest.fixture
def temp_root(tmp_path, monkeypatch):
    """A private system temp dir (``tempfile.gettempdir()``) for this test."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_conversion_is_removed_once_loaded_and_stale_ones_are_swept(meta_dir, temp_root):
    stale = temp_root / "nakta_convert_abcdefgh"
    stale.mkdir()
    marker = {"pid": _dead_pid(), "host": socket.gethostname(), "started": 0.0}
    (stale / ".nakta-tmp").write_text(json.dumps(marker))
    foreign = temp_root / "nakta_convert_zzzzzzzz"  # no marker: someone else's, kept
    foreign.mkdir()
    handle = models.load_nakta(meta_dir, torch.device("cpu"), torch.float32)
    assert sorted(p.name for p in temp_root.iterdir()) == [foreign.name]
    assert handle.model.state_dict()["norm.weight"].shape == (TINY_PARAMS["dim"],)
    handle.close()
    assert handle.model is None


def test_failed_conversion_leaves_nothing(meta_dir, temp_root):
    (meta_dir / "consolidated.00.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="converting .* failed with exit code 2"):
        models.load_nakta(meta_dir, torch.device("cpu"), torch.float32)
    assert list(temp_root.iterdir()) == []


# load_nakta in a fresh interpreter that sends itself SIGNAL during the conversion (third
# output tensor) or at the start of the model load (the converted checkpoint is complete).
_SCRIPT = """
import os, signal, sys
import torch
import nakta_model
from nakta_model import checkpoint as ck
from accuracy_test import models
signum = getattr(signal, sys.argv[1])
if sys.argv[2] == "convert":
    real, calls = ck.nakta_tensor, []
    def nakta_tensor(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signum)
        return real(*a, **kw)
    ck.nakta_tensor = nakta_tensor
else:
    def load(*a, **kw):
        os.kill(os.getpid(), signum)
    nakta_model.load = load
models.load_nakta(sys.argv[3], torch.device("cpu"), torch.float32)
"""


@pytest.mark.parametrize(
    "signame, when", [("SIGTERM", "convert"), ("SIGTERM", "load"), ("SIGINT", "convert")]
)
def test_signal_removes_the_temporary_conversion(tmp_path, meta_dir, signame, when):
    root = tmp_path / "tmp"
    root.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(root), "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, signame, when, str(meta_dir)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    # SIGTERM: the default action after the cleanup; SIGINT: an uncaught KeyboardInterrupt,
    # which Python turns into death by SIGINT as well.
    assert proc.returncode == -getattr(signal, signame), proc.stderr
    assert list(root.iterdir()) == []
