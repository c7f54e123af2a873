"""nakta_model.load, the one way to build a model: a Meta or HF directory read in memory gives the
very tensors of its convert.py conversion (tp 1 and 2, any shard count), writes nothing to disk,
never aliases what a source handed out; errors name the source."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from checkpoint_factory import TINY_PARAMS, meta_state_dict, write_meta_checkpoint
from hf_factory import write_hf_checkpoint

import convert
import nakta_model
from nakta_model import checkpoint as ck
from nakta_model.config import ModelArgs
from nakta_model.loading import load
from nakta_model.parallel import ParallelConfigError, ParallelContext
from nakta_model.sources import MetaRankShard, state_dict_source

REPO = Path(__file__).resolve().parents[1]
ARGS = ModelArgs.from_meta_params(TINY_PARAMS)


@pytest.fixture
def temp_root(tmp_path, monkeypatch):
    """A private system temp dir (``tempfile.gettempdir()``) for this test."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def _rank(tp: int, rank: int) -> ParallelContext | None:
    return ParallelContext(rank, tp) if tp > 1 else None


def _converted(src: Path, out: Path, tp: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's tensors of ``convert.py SRC OUT --tp TP``."""
    convert.convert(src, out, tp=tp, quiet=True)
    return [ck.load_rank_state_dict(out, rank, tp)[1] for rank in range(tp)]


def _assert_same_tensors(model, want: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


@pytest.mark.parametrize("n_shards, tp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_meta_dir_loads_as_its_conversion_and_writes_nothing(
    tmp_path, temp_root, monkeypatch, n_shards, tp
):
    meta = write_meta_checkpoint(tmp_path / "meta", TINY_PARAMS, n_shards=n_shards, seed=3)
    want = _converted(meta, tmp_path / "conv", tp)
    before = sorted(p.name for p in meta.iterdir())

    def no_writes(*a, **kw):
        raise AssertionError("loading a Meta dir must not write a checkpoint")

    monkeypatch.setattr(ck, "write_checkpoint", no_writes)
    for rank in range(tp):
        model = load(meta, "cpu", None, _rank(tp, rank), kernels="reference")
        _assert_same_tensors(model, want[rank])
    assert sorted(p.name for p in meta.iterdir()) == before
    assert list(temp_root.iterdir()) == []


@pytest.mark.parametrize("tie", [False, True])
def test_hf_dir_loads_as_its_conversion(tmp_path, tie):
    hf, _ = write_hf_checkpoint(tmp_path / "hf", TINY_PARAMS, seed=4, n_files=2, tie=tie)
    for tp in (1, 2):
        want = _converted(hf, tmp_path / f"conv{tp}", tp)
        for rank in range(tp):
            model = load(hf, "cpu", None, _rank(tp, rank), kernels="reference")
            _assert_same_tensors(model, want[rank])


def test_dtype_converts_and_none_keeps_the_source_dtype(tmp_path):
    meta = write_meta_checkpoint(tmp_path / "meta", TINY_PARAMS, seed=3, dtype=torch.bfloat16)
    assert load(meta, "cpu").dtype == torch.bfloat16
    model = load(meta, "cpu", torch.float32)
    (want,) = _converted(meta, tmp_path / "conv", 1)
    assert model.dtype == torch.float32
    _assert_same_tensors(model, {k: v.float() for k, v in want.items()})
    with pytest.raises(TypeError, match="dtype must be one of"):
        load(meta, "cpu", torch.int8)


def test_the_model_never_shares_storage_with_its_source():
    sd = meta_state_dict(TINY_PARAMS, seed=1)
    for tp, rank in ((1, 0), (2, 1)):
        model = load(state_dict_source(sd, ARGS), "cpu", None, _rank(tp, rank))
        mine = {p.untyped_storage().data_ptr() for p in model.state_dict().values()}
        theirs = {t.untyped_storage().data_ptr() for t in sd.values()}
        assert not mine & theirs
        norm = model.norm.weight.clone()
        sd["norm.weight"].add_(1.0)  # the caller changes its tensors: the model does not change
        assert torch.equal(model.norm.weight, norm)


def test_a_rank_shard_of_one_process_is_the_whole_model():
    sd = meta_state_dict(TINY_PARAMS, seed=2)
    whole = load(state_dict_source(sd, ARGS), "cpu")
    _assert_same_tensors(load(MetaRankShard(sd, ARGS), "cpu"), whole.state_dict())


def test_bad_sources_are_named(tmp_path):
    with pytest.raises(ck.CheckpointError, match="nowhere is not a Nakta checkpoint"):
        load(tmp_path / "nowhere", "cpu")
    with pytest.raises(TypeError, match="source must be a checkpoint directory .* got int"):
        load(12, "cpu")
    meta = write_meta_checkpoint(tmp_path / "meta", TINY_PARAMS, n_shards=2)
    (meta / "consolidated.01.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(ck.CheckpointError, match=r"consolidated\.01\.pth: cannot read"):
        load(meta, "cpu")
    (meta / "consolidated.01.pth").unlink()
    (meta / "consolidated.00.pth").rename(meta / "consolidated.02.pth")
    with pytest.raises(ck.CheckpointError, match=r"missing shard\(s\) consolidated\.00\.pth"):
        load(meta, "cpu")


def test_a_checkpoint_sharded_for_another_tp_is_refused_as_a_grid_error(tmp_path):
    out = ck.save_checkpoint(tmp_path / "tp1", meta_state_dict(TINY_PARAMS), ARGS)
    with pytest.raises(ParallelConfigError, match=r"sharded for tp=1, but this run has --tp 2"):
        load(out, "cpu", parallel=ParallelContext(0, 2))
    assert nakta_model.load is load


# A fresh interpreter loads the Meta dir and sends itself SIGTERM while the third tensor is
# built: with nothing written anywhere there is nothing to clean up.
_SCRIPT = """
import os, signal, sys
import torch
from nakta_model import loading
real, calls = loading.nakta_tensor, []
def nakta_tensor(*a, **kw):
    calls.append(1)
    if len(calls) == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    return real(*a, **kw)
loading.nakta_tensor = nakta_tensor
loading.load(sys.argv[1], "cpu", torch.float32)
"""


def test_a_signal_during_a_meta_load_leaves_nothing(tmp_path):
    meta = write_meta_checkpoint(tmp_path / "meta", TINY_PARAMS, seed=3)
    before = sorted(p.name for p in tmp_path.iterdir())
    root = tmp_path / "tmp"
    root.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(root), "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(meta)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert list(root.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir() if p != root) == before
