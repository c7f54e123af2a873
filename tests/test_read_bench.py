"""speed_bench/read_bench.py: every reader, every condition, on a small file on the CPU."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from speed_bench import read_bench


def test_read_bench_measures_every_reader_alone_and_beside_a_busy_thread(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(512, 1024), "b": torch.randn(7)}, str(path))
    out = tmp_path / "out"
    read_bench.main(
        ["--file", str(path), "--device", "cpu", "--repeats", "1"]
        + ["--ceiling-mib", "8", "--out", str(out)]
    )
    got = json.loads((out / "read_bench.json").read_text())
    runs = got["runs"]
    assert len(runs) == len(read_bench.READERS) * len(read_bench.CONDITIONS)
    assert {r["method"] for r in runs} == {"pinned", "mapped", "mapped_populate"}
    assert all(r["seconds"] > 0 and r["gb_s"] > 0 for r in runs)
    busy = [r for r in runs if r["condition"] != "alone"]
    assert all(r["busy_thread_slowed"] is not None for r in busy)
    assert all(r["busy_thread_slowed"] is None for r in runs if r["condition"] == "alone")
    assert got["ceiling_gb_s"] > 0
    for ext in ("csv", "md", "png"):
        assert (out / f"read_bench.{ext}").stat().st_size > 0


def test_busy_thread_counts_its_loops():
    assert read_bench.busy_rate(0.05) > 0


@pytest.mark.parametrize("bad", [["--repeats", "0"], ["--ceiling-mib", "0"]])
def test_bad_arguments_are_one_error(tmp_path, bad):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(4)}, str(path))
    with pytest.raises(SystemExit, match="must be >= 1"):
        read_bench.main(["--file", str(path), "--device", "cpu", *bad])
    with pytest.raises(SystemExit, match="is not a file"):
        read_bench.main(["--file", str(tmp_path / "none"), "--device", "cpu"])
