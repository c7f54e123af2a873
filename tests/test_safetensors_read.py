"""The chunked, threaded safetensors reader gives what safetensors itself reads."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from nakta_model.safetensors_read import read_safetensors


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


@pytest.mark.parametrize("chunk, threads", [(7, 3), (64, 1), (1 << 20, 4)])
def test_equals_safetensors(st_file, chunk, threads):
    want = load_file(str(st_file))
    got = read_safetensors(st_file, "cpu", chunk_bytes=chunk, threads=threads)
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


@pytest.mark.gpu
def test_gpu_read_equals_safetensors(st_file):
    want = load_file(str(st_file), device="cuda")
    got = read_safetensors(st_file, "cuda", chunk_bytes=100, threads=3)
    for k, v in want.items():
        assert got[k].is_cuda and torch.equal(got[k], v)
