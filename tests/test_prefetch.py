"""nakta_model.prefetch: a read started early is handed to the loader only for the very file
and device; anything else reads again (and a failed prefetch raises nothing itself)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from checkpoint_factory import TINY_PARAMS, write_meta_checkpoint
from safetensors.torch import save_file

from nakta_model import prefetch
from nakta_model.loading import load
from nakta_model.safetensors_read import read_safetensors


@pytest.fixture(autouse=True)
def _empty():
    prefetch.discard()
    yield
    prefetch.discard()


@pytest.fixture
def st_file(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.randn(33, 17), "b": torch.randn(5).to(torch.bfloat16)}, str(path))
    return path


def test_a_prefetch_is_taken_once_and_equals_a_read(st_file):
    prefetch.prefetch(st_file, "cpu")
    got = prefetch.take(st_file, "cpu")
    want = read_safetensors(st_file, "cpu")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert prefetch.take(st_file, "cpu") is None  # taken: the next load reads itself


def test_no_prefetch_another_device_or_a_changed_file_reads_again(st_file):
    assert prefetch.take(st_file, "cpu") is None
    prefetch.prefetch(st_file, "cpu")
    assert prefetch.take(st_file, "meta") is None  # another device
    prefetch.prefetch(st_file, "cpu")
    prefetch.take(st_file, "cpu")  # (waits for the read before the file changes)
    prefetch.prefetch(st_file, "cpu")
    prefetch._pending[(str(st_file.resolve()), "cpu")][1].result()
    save_file({"a": torch.zeros(2)}, str(st_file))  # rewritten after the prefetch
    os.utime(st_file, ns=(1, 1))
    assert prefetch.take(st_file, "cpu") is None


def test_a_failed_prefetch_hands_out_nothing(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{nope")
    future = prefetch.prefetch(bad, "cpu")
    assert prefetch.take(bad, "cpu") is None and isinstance(future.exception(), ValueError)
    with pytest.raises(FileNotFoundError):  # nothing to prefetch: the caller's own error
        prefetch.prefetch(tmp_path / "none.safetensors", "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_prefetch_onto_a_missing_gpu_hands_out_nothing(st_file):
    prefetch.prefetch(st_file, "cuda:0")  # lm-eval's default device, on a CPU-only machine
    assert prefetch.take(st_file, "cuda:0") is None


def test_plain_cuda_means_device_zero():
    assert prefetch._device_name("cuda") == "cuda:0"
    assert prefetch._device_name(torch.device("cuda", 1)) == "cuda:1"
    assert prefetch._device_name("cpu") == "cpu"


def test_the_gil_changes_hands_quickly_inside_and_as_before_after():
    before = sys.getswitchinterval()
    with prefetch.quick_gil_handoff():
        assert sys.getswitchinterval() == min(before, prefetch.SWITCH_INTERVAL_S) < 0.005
    assert sys.getswitchinterval() == before


def _converted(tmp_path):
    from convert import convert

    meta = write_meta_checkpoint(tmp_path / "meta", {**TINY_PARAMS, "max_seq_len": 64}, seed=1)
    return convert(meta, tmp_path / "nakta", quiet=True)


def test_load_takes_the_prefetched_shard(tmp_path, monkeypatch):
    ckpt = _converted(tmp_path)
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
    ckpt = _converted(tmp_path)
    want = load(ckpt, "cuda", torch.bfloat16)
    prefetch.prefetch(next(ckpt.glob("*.safetensors")), "cuda")  # plain cuda: device 0
    got = load(ckpt, "cuda", torch.bfloat16)
    assert not prefetch._pending and got.device == torch.device("cuda", 0)
    for (name, a), (_, b) in zip(want.state_dict().items(), got.state_dict().items()):
        assert torch.equal(a, b), name
