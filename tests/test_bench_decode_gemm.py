"""``kernel_benchmark/bench_decode_gemm.py`` on the CPU (interpreter, toy shapes): both paths run
and the GEMM path agrees with its reference, the tables, plot and crossover JSON are written;
the crossover rule and the byte counts on their own."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from kernel_benchmark import bench_decode_gemm as bg
from kernel_benchmark.common import tuned
from kernel_benchmark.decode_shapes import MODELS, linear_shapes
from nakta_model.generation import step_gemm as sg

cpu_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU smoke run; on a GPU the benchmark is the full sweep"
)


@cpu_only
def test_smoke_blocks_both_quants_and_rows_above_64(tmp_path):
    res = bg.main(["--rows", "2,65", "--quants", "fp8", "--sections", "blocks",
                   "--out", str(tmp_path)])  # fmt: skip
    blocks = pd.read_csv(tmp_path / "decode_gemm_blocks.csv")
    assert (blocks["status"] == "ok").all() and (blocks["us"] > 0).all()
    assert set(blocks[blocks["rows"] == 65]["path"]) == {"gemm"}  # no GEMVs past 64
    assert set(blocks[blocks["rows"] == 2]["path"]) == {"decode_linear", "gemm", "triton_fp8"}
    gemm = blocks[blocks["path"].isin(bg.GEMM_PATHS)]
    assert (gemm["rel_err"] < 2e-2).all()  # FP8 SwiGLU codes compared dequantized
    cross = json.loads((tmp_path / "decode_gemm_crossover.json").read_text())
    assert set(cross["crossovers"]) == {"tiny/fp8"} == set(res["crossovers"])
    for name in ("decode_gemm_blocks_layer.md", "decode_gemm.png"):
        assert (tmp_path / name).stat().st_size > 0


@cpu_only
@pytest.mark.slow  # the step section runs in the default tier through the bf16 smoke below
def test_smoke_step_fp8_three_paths(tmp_path):
    """FP8 at 8 rows: the GEMVs, cuBLASLt's path and the fp8_decode_gemm path each decode."""
    bg.main(["--rows", "8", "--quants", "fp8", "--sections", "step", "--context", "4",
             "--out", str(tmp_path)])  # fmt: skip
    step = pd.read_csv(tmp_path / "decode_gemm_step.csv")
    assert set(step["path"]) == {"decode_linear", "gemm", "triton_fp8"}
    assert (step["tok_s"] > 0).all()


def test_paths_turn_the_fp8_kernel_off_and_on():
    assert bg.paths_at(8, "fp8") == ("decode_linear", "gemm", "triton_fp8")
    assert bg.paths_at(8) == ("decode_linear", "gemm") and bg.paths_at(65, "fp8")[0] == "gemm"
    with tuned(sg, **bg.PATH_TUNE["gemm"]):
        lo, hi = sg.fp8_kernel_rows()
        assert lo > hi
    with tuned(sg, **bg.PATH_TUNE["triton_fp8"]):
        assert sg.fp8_kernel_rows() == (1, 64)
    assert bg.paths_at(64) == ("decode_linear", "gemm")
    assert bg.paths_at(128) == ("gemm",) == bg.paths_at(128, "fp8")
    assert bg.paths_at(64, "fp8") == ("decode_linear", "gemm", "triton_fp8")


@cpu_only
def test_smoke_step_both_paths(tmp_path):
    bg.main(["--rows", "2", "--quants", "bf16", "--sections", "step", "--context", "4",
             "--out", str(tmp_path)])  # fmt: skip
    step = pd.read_csv(tmp_path / "decode_gemm_step.csv")
    assert set(step["path"]) == {"decode_linear", "gemm"} and (step["tok_s"] > 0).all()


def test_crossover_is_the_first_rows_from_which_gemm_always_wins():
    rows = []
    for r, dl_us, gemm_us in [(8, 1.0, 2.0), (16, 1.0, 0.9), (32, 1.0, 1.1), (64, 2.0, 1.0)]:
        rows += [{"model": "7B", "quant": "bf16", "rows": r, "path": "decode_linear",
                  "linears_us": dl_us},
                 {"model": "7B", "quant": "bf16", "rows": r, "path": "gemm",
                  "linears_us": gemm_us}]  # fmt: skip
    rows.append({"model": "7B", "quant": "bf16", "rows": 128, "path": "gemm", "linears_us": 2.0})
    cross = bg.crossovers(pd.DataFrame(rows))["7B/bf16"]
    assert cross["crossover_rows"] == 64  # 16 wins but 32 does not: from 64 on
    assert cross["gemm_speedup_by_rows"][64] == 2.0
    never = pd.DataFrame(rows[:2])
    assert bg.crossovers(never)["7B/bf16"]["crossover_rows"] == 65


def test_block_bytes_count_fp8_weights_once_and_their_scales():
    wqkv, wo, w13, w2, head = linear_shapes("7B", MODELS["7B"])
    assert bg.weight_bytes(w13, "bf16") == 2 * 22016 * 4096
    assert bg.weight_bytes(w13, "fp8") == 22016 * 4096 + 4 * 22016
    assert bg.weight_bytes(head, "fp8") == bg.weight_bytes(head, "bf16")  # the head stays bf16
    extra = bg.block_bytes(wqkv, 8, "bf16") - bg.weight_bytes(wqkv, "bf16")
    # x, norm weight, rotated Q out, K/V cache writes
    assert extra == 2 * (8 * 4096 + 4096 + 8 * 4096 + 2 * 8 * 32 * 128)


def test_bad_arguments_exit():
    for argv in (["--rows", "0"], ["--rows", "513"], ["--quants", "int4"], ["--models", "2B"]):
        with pytest.raises(SystemExit):
            bg.parse_args(argv)
