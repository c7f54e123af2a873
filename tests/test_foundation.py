import os

import pytest
import torch

from nakta_model.io_utils import atomic_output_dir, atomic_write_text
from nakta_model.kernels import _checks


def test_interpreter_is_on_without_cuda():
    if not torch.cuda.is_available():
        assert _checks.interpreter_enabled()


def test_check_dtype_names_argument():
    with pytest.raises(TypeError, match="weight must have dtype"):
        _checks.check_dtype("weight", torch.zeros(2, dtype=torch.int32))


def test_check_ndim_names_argument():
    with pytest.raises(ValueError, match="t must have 3 or 4 dimensions"):
        _checks.check_ndim("t", torch.zeros(2), (3, 4))


def test_check_triton_device_rejects_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="x is on cpu"):
        _checks.check_triton_device("x", torch.zeros(2))


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path):
    p = tmp_path / "a.txt"
    atomic_write_text(p, "one")
    atomic_write_text(p, "two")
    assert p.read_text() == "two"
    assert os.listdir(tmp_path) == ["a.txt"]


def test_atomic_dir_failure_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError), atomic_output_dir(out) as tmp:
        (tmp / "half").write_text("x")
        raise RuntimeError("boom")
    assert not out.exists()
    assert os.listdir(tmp_path) == []


def test_atomic_dir_refuses_existing_without_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(FileExistsError, match="--force"), atomic_output_dir(out):
        pass
    with atomic_output_dir(out, force=True) as tmp:
        (tmp / "new").write_text("x")
    assert (out / "new").exists()


def test_compile_constants_are_marked_in_place_when_asked():
    """The compile path marks ``device_family`` / ``sm_count`` as constants just before
    ``torch.compile`` (importing the compiler at module import cost every lm-eval run seconds
    on the H200 host): the functions callers hold are the ones marked."""
    held = (_checks.device_family, _checks.sm_count)
    _checks.mark_compile_constants()
    assert (_checks.device_family, _checks.sm_count) == held
    assert all(getattr(f, "_dynamo_marked_constant", False) for f in held)  # dynamo's mark
