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
    assert (written["us_blocks"].str.count("/") == 2).all()  # three blocks
    assert "alternating rounds" in (tmp_path / "swiglu_head_to_head.md").read_text()


@cpu_only
def test_head_to_head_rows_fresh_inputs_per_block_and_both_orders():
    """Each block asks for fresh calls; the second block runs the paths in reverse order."""
    order, blocks = [], []

    def make_calls(block):
        blocks.append(block)
        return {p: [lambda p=p: order.append((block, p))] for p in ("a", "b")}

    rows = head_to_head_rows(make_calls, torch.device("cpu"), 1, float("nan"), mode="fwd")
    assert blocks == [0, 1, 2] and [r["path"] for r in rows] == ["a", "b"]
    firsts = [next(p for b, p in order if b == block) for block in blocks]
    assert firsts == ["a", "b", "a"]
    assert all(r["mode"] == "fwd" and r["us"] > 0 for r in rows)
