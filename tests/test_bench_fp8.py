"""kernel_benchmark.bench_fp8: its command line, the CPU refusal, and the tables, plot and
summary it writes (from rows shaped as its sections produce them; the timings need a GPU)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from kernel_benchmark.bench_fp8 import GEMMS, SQUARE, main, parse_args, write_results


def test_arguments_parse():
    args = parse_args(["--tokens", "1024,16384", "--batches", "1,32", "--sections", "gemm"])
    assert args.tokens == [1024, 16384] and args.batches == [1, 32] and args.sections == ["gemm"]
    assert parse_args([]).sections == ["quant", "gemm", "decode"]


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--tokens", "x"], "--tokens must be comma-separated ints"),
        (["--tokens", "0"], "--tokens needs ints in"),
        (["--batches", "65"], "--batches needs ints in [1, 64]"),
        (["--sections", "quant,nope"], "--sections must be a subset"),
    ],
)
def test_bad_arguments_are_refused(argv, why, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert why in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path only")
def test_cpu_run_measures_nothing_and_says_so(capsys):
    assert main([]) == 1
    assert "nothing measured" in capsys.readouterr().err


def test_gemm_shapes_are_the_7b_block_gemms():
    from kernel_benchmark.bench_gemm import block_gemms
    from nakta_model.config import preset

    assert block_gemms(preset("7B")) == GEMMS


def _frames() -> dict[str, pd.DataFrame]:
    quant = pd.DataFrame(
        [
            {
                "op": op,
                "tokens": m,
                "path": p,
                "us": 10.0,
                "GB/s": 2500.0,
                "pct_copy_bw": 83.0,
                "MB": 25.0,
            }
            for op in ("rms_norm+res", "swiglu")
            for m in (1024, 4096)
            for p in ("nakta_fp8", "bf16_kernel+eager_quant")
        ]  # fmt: skip
    )
    gemm_rows = [{"shape": f"{SQUARE}^3", "M": SQUARE, "K": SQUARE, "N": SQUARE, "path": "bf16",
                  "ms": 1.4, "tflops": 780.0}]  # fmt: skip
    for shape in (*GEMMS, "layer"):
        for path, tf in (("bf16", 700.0), ("fp8_rowwise", 1200.0), ("fp8_tensorwise", 1350.0)):
            gemm_rows.append({"shape": shape, "M": 1024, "K": 4096, "N": 4096, "path": path,
                              "ms": 1.0, "tflops": tf, "of_bf16_peak": tf / 780,
                              "speedup_vs_bf16": tf / 700})  # fmt: skip
    decode = pd.DataFrame(
        [
            {
                "kind": k,
                "N": 4096,
                "K": 4096,
                "batch": b,
                "weights": w,
                "status": "ok",
                "us": 20.0,
                "GB/s": 2800.0,
                "pct_copy_bw": 85.0,
                "MB": 34.0,
                "config": "USE_DOT=0",
                "speedup_vs_bf16": 1.0 if w == "bf16" else 1.8,
            }
            for k in ("wo", "w2")
            for b in (1, 32)
            for w in ("bf16", "fp8")
        ]  # fmt: skip
    )
    return {"quant": quant, "gemm": pd.DataFrame(gemm_rows), "decode": decode}


def test_results_are_written(tmp_path):
    summary = write_results(_frames(), tmp_path, "test-device", 3000.0)
    for name in ("quant", "gemm", "decode"):
        assert (tmp_path / f"fp8_{name}.csv").stat().st_size > 0
        assert "copy bandwidth 3000 GB/s" in (tmp_path / f"fp8_{name}.md").read_text()
    assert (tmp_path / "fp8.png").stat().st_size > 0
    on_disk = json.loads((tmp_path / "fp8_summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    assert on_disk["decode_speedup_vs_bf16"]["wo b1"] == pytest.approx(1.8)
    assert on_disk["gemm_layer_speedup_vs_bf16"]["fp8_rowwise M1024"] == pytest.approx(1200 / 700)
    assert on_disk["quant_min_pct_copy_bw"]["swiglu nakta_fp8"] == pytest.approx(83.0)


def test_results_of_one_section(tmp_path):
    frames = {"gemm": _frames()["gemm"]}
    summary = write_results(frames, tmp_path, "test-device", 3000.0)
    assert "decode_speedup_vs_bf16" not in summary
    assert not (tmp_path / "fp8_quant.csv").exists()
    assert (tmp_path / "fp8.png").exists()
