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
