"""nakta_model.load, the one way to build a model: a Meta or HF directory read in memory gives the
very tensors of its convert.py conversion (tp 1 and 2, any shard count), writes nothing to disk,
never aliases what a source handed out; errors name the source.

Here too: the chunked, threaded safetensors reader and nakta_model.prefetch (an early read is used
only for the very file and device).
"""

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
from safetensors.torch import load_file, save_file

import convert
import nakta_model
from nakta_model import checkpoint as ck
from nakta_model import prefetch
from nakta_model.config import ModelArgs
from nakta_model.loading import load
from nakta_model.parallel import ParallelConfigError, ParallelContext
from nakta_model.safetensors_read import read_safetensors
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


# ------------------------------------------------------------------------------------------------
# The chunked, threaded safetensors reader gives what safetensors itself reads.
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def st_file(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(33, 17, generator=g),
        "b": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "c": torch.randn(101, generator=g).to(torch.float16),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize(
    "chunk, threads, method",
    [(7, 3, "pinned"), (64, 1, "pinned"), (1 << 20, 4, "pinned")]
    + [(0, 1, "mapped"), (0, 3, "mapped"), (0, 2, "mapped_populate")],
)
def test_equals_safetensors(st_file, chunk, threads, method):
    want = load_file(str(st_file))
    got = read_safetensors(st_file, "cpu", chunk_bytes=chunk or 1, threads=threads, method=method)
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v)
    # views of one buffer: one allocation for the whole file
    assert len({t.untyped_storage().data_ptr() for t in got.values() if t.numel()}) == 1


def test_truncated_and_malformed_files_name_the_file(st_file, tmp_path):
    data = st_file.read_bytes()
    short = tmp_path / "short.safetensors"
    short.write_bytes(data[:-10])
    with pytest.raises(ValueError, match="short.safetensors: tensor .* bad data offsets"):
        read_safetensors(short, "cpu")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{nope")
    with pytest.raises(ValueError, match="bad.safetensors: the safetensors header is not valid"):
        read_safetensors(bad, "cpu")
    tiny = tmp_path / "tiny.safetensors"
    tiny.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="tiny.safetensors: not a safetensors file"):
        read_safetensors(tiny, "cpu")
    with pytest.raises(ValueError, match="method must be one of"):
        read_safetensors(st_file, "cpu", method="fast")


def test_mapped_read_releases_the_map_and_owns_its_buffer(st_file):
    """The map is closed when the read returns (no tensor still views it: closing would raise
    otherwise), and the tensors live in their own buffer, not in the file's pages."""
    got = read_safetensors(st_file, "cpu", threads=2, method="mapped")
    before = got["a"].clone()
    st_file.write_bytes(b"\0" * st_file.stat().st_size)  # the file changes after the read
    assert torch.equal(got["a"], before)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["pinned", "mapped", "mapped_populate"])
def test_gpu_read_equals_safetensors(st_file, method):
    want = load_file(str(st_file), device="cuda")
    got = read_safetensors(st_file, "cuda", chunk_bytes=100, threads=3, method=method)
    for k, v in want.items():
        assert got[k].is_cuda and torch.equal(got[k], v)


# ------------------------------------------------------------------------------------------------
# nakta_model.prefetch: a read started early is handed to the loader only for the very file and
# device; anything else reads again (and a failed prefetch raises nothing itself).
# ------------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _empty():
    prefetch.discard()
    yield
    prefetch.discard()


@pytest.fixture
def prefetch_file(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.randn(33, 17), "b": torch.randn(5).to(torch.bfloat16)}, str(path))
    return path


def test_a_prefetch_is_taken_once_and_equals_a_read(prefetch_file):
    prefetch.prefetch(prefetch_file, "cpu")
    got = prefetch.take(prefetch_file, "cpu")
    want = read_safetensors(prefetch_file, "cpu")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert prefetch.take(prefetch_file, "cpu") is None  # taken: the next load reads itself


def test_no_prefetch_another_device_or_a_changed_file_reads_again(prefetch_file):
    assert prefetch.take(prefetch_file, "cpu") is None
    prefetch.prefetch(prefetch_file, "cpu")
    assert prefetch.take(prefetch_file, "meta") is None  # another device
    prefetch.prefetch(prefetch_file, "cpu")
    prefetch.take(prefetch_file, "cpu")  # (waits for the read before the file changes)
    prefetch.prefetch(prefetch_file, "cpu")
    prefetch._pending[(str(prefetch_file.resolve()), "cpu")][1].result()
    save_file({"a": torch.zeros(2)}, str(prefetch_file))  # rewritten after the prefetch
    os.utime(prefetch_file, ns=(1, 1))
    assert prefetch.take(prefetch_file, "cpu") is None


def test_a_failed_prefetch_hands_out_nothing(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{nope")
    future = prefetch.prefetch(bad, "cpu")
    assert prefetch.take(bad, "cpu") is None and isinstance(future.exception(), ValueError)
    with pytest.raises(FileNotFoundError):  # nothing to prefetch: the caller's own error
        prefetch.prefetch(tmp_path / "none.safetensors", "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_prefetch_onto_a_missing_gpu_hands_out_nothing(prefetch_file):
    prefetch.prefetch(prefetch_file, "cuda:0")  # lm-eval's default device, on a CPU-only machine
    assert prefetch.take(prefetch_file, "cuda:0") is None


def test_plain_cuda_means_device_zero():
    assert prefetch._device_name("cuda") == "cuda:0"
    assert prefetch._device_name(torch.device("cuda", 1)) == "cuda:1"
    assert prefetch._device_name("cpu") == "cpu"


def test_the_gil_changes_hands_quickly_inside_and_as_before_after():
    before = sys.getswitchinterval()
    with prefetch.quick_gil_handoff():
        assert sys.getswitchinterval() == min(before, prefetch.SWITCH_INTERVAL_S) < 0.005
    assert sys.getswitchinterval() == before


def _prefetch_checkpoint(tmp_path):
    from convert import convert

    meta = write_meta_checkpoint(tmp_path / "meta", {**TINY_PARAMS, "max_seq_len": 64}, seed=1)
    return convert(meta, tmp_path / "nakta", quiet=True)


def test_load_takes_the_prefetched_shard(tmp_path, monkeypatch):
    ckpt = _prefetch_checkpoint(tmp_path)
    want = load(ckpt, "cpu", kernels="reference")
    reads = []
    real = prefetch.take

    def counted(path, device):
        got = real(path, device)
        reads.append(got is not None)
        return got

    monkeypatch.setattr(prefetch, "take", counted)
    prefetch.prefetch(next(ckpt.glob("*.safetensors")), "cpu")
    got = load(ckpt, "cpu", kernels="reference")
    assert reads == [True] and not prefetch._pending
    for (name, a), (_, b) in zip(want.state_dict().items(), got.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.gpu
def test_gpu_load_takes_the_prefetched_shard(tmp_path):
    ckpt = _prefetch_checkpoint(tmp_path)
    want = load(ckpt, "cuda", torch.bfloat16)
    prefetch.prefetch(next(ckpt.glob("*.safetensors")), "cuda")  # plain cuda: device 0
    got = load(ckpt, "cuda", torch.bfloat16)
    assert not prefetch._pending and got.device == torch.device("cuda", 0)
    for (name, a), (_, b) in zip(want.state_dict().items(), got.state_dict().items()):
        assert torch.equal(a, b), name
