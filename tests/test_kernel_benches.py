"""CPU smoke runs of the kernel benchmarks (interpreter, tiny shapes): every path runs, the
result files are written, and the head-to-head timer measures every path in each mode."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from kernel_benchmark import bench_rmsnorm, bench_rope, bench_swiglu
from kernel_benchmark.common import head_to_head_rows, write_head_to_head

# On a GPU the benchmarks run their full sweeps (minutes each): scripts/gpu_kernels.sh runs them.
cpu_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU smoke run; on a GPU the benchmark is the full sweep"
)


@cpu_only
@pytest.mark.parametrize(
    "bench,stem", [(bench_rmsnorm, "rmsnorm"), (bench_swiglu, "swiglu"), (bench_rope, "rope")]
)
def test_bench_smoke_writes_results(bench, stem, tmp_path):
    bench.main(["--out", str(tmp_path)])
    for ext in ("csv", "md", "png"):
        assert (tmp_path / f"{stem}.{ext}").stat().st_size > 0
    df = pd.read_csv(tmp_path / f"{stem}.csv")
    assert len(df) and "nakta" in set(df["path"])
    if stem == "rope" and bench_rope._te() is None:  # a missing peer is said, not dropped
        assert "TransformerEngine is not importable here" in (tmp_path / "rope.md").read_text()


@cpu_only
def test_head_to_head_covers_every_mode_and_path(tmp_path):
    cpu = torch.device("cpu")
    rms = bench_rmsnorm.head_to_head(torch.float32, cpu, float("nan"), m=2, n=128)
    assert set(rms["mode"]) == set(bench_rmsnorm.MODES) and set(rms["path"]) == {"nakta"}
    sw = bench_swiglu.head_to_head(torch.float32, cpu, float("nan"), m=2, f=128)
    assert set(sw["mode"]) == set(bench_swiglu.MODES)
    assert {"nakta", "nakta_fast", "nakta_silu_mul"} <= set(sw["path"])
    assert (sw["us"] > 0).all() and (rms["us"] > 0).all()
    write_head_to_head(sw, tmp_path, "swiglu", "SwiGLU", "cpu", "float32", float("nan"))
    written = pd.read_csv(tmp_path / "swiglu_head_to_head.csv")
    cols = ["tokens", "ffn", "mode", "path", "us", "pct_copy_bw", "spread", "us_blocks"]
    assert list(written.columns) == cols
    n_paths = written["path"].nunique()
    assert (written["us_blocks"].str.count("/") == 2 * n_paths - 1).all()  # 2P blocks
    assert "alternating rounds" in (tmp_path / "swiglu_head_to_head.md").read_text()


@cpu_only
def test_head_to_head_rows_rotates_allocations_and_orders():
    """2P blocks: each path runs on every path's inputs (refilled in place per block, so the
    same tensors), first in the given order, then reversed."""
    runs = []  # (block, path, id of the tensor it read, its first value)
    made = []

    def make_sets(seed):
        made.append(seed)
        return [{"x": torch.full((4,), float(seed))}]

    def make_calls(path, sets):
        t = sets[0]["x"]
        return [lambda: runs.append((len(made), path, id(t), float(t[0])))]

    rows = head_to_head_rows(["a", "b"], make_sets, make_calls, torch.device("cpu"), 1, 1.0, m=1)
    assert [r["path"] for r in rows] == ["a", "b"] and all(r["us"] > 0 for r in rows)
    assert all(r["us_blocks"].count("/") == 3 for r in rows)  # 2P = 4 blocks
    assert made == [0, 1, 2, 3, 4, 5, 6, 7]  # two groups, then refills per block
    blocks = sorted({b for b, _, _, _ in runs})
    first = [next(p for b, p, _, _ in runs if b == blk) for blk in blocks]
    assert first == ["a", "a", "b", "b"]
    tensors = {p: {i for _, q, i, _ in runs if q == p} for p in ("a", "b")}
    assert tensors["a"] == tensors["b"] and len(tensors["a"]) == 2
    values = [v for b, p, _, v in runs if b == blocks[1] and p == "a"]
    assert values[0] == 3.0  # block 1, group 1 refilled from seed 1 + 2 * 1
