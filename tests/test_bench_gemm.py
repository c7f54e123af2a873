"""kernel_benchmark.bench_gemm: the block GEMM shapes it times and its command line (the
timings themselves need a GPU: they are cuBLAS rates).

Here too: the persistent TMA GEMM it times (``kernel_benchmark/bench_gemm.py``) against fp64, and
kernel_benchmark.bench_fp8's command line, CPU refusal and the files it writes.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from kernel_benchmark import bench_fp8
from kernel_benchmark import bench_gemm as gemm
from kernel_benchmark.bench_fp8 import GEMMS, SQUARE, parse_args, write_results
from kernel_benchmark.bench_gemm import block_gemms, linear_reference, main
from kernel_benchmark.bench_gemm import tma_linear as linear
from kernel_benchmark.bench_gemm import tma_supported as gemm_supported
from nakta_model.config import ModelArgs, preset
from nakta_model.kernels import swiglu as swiglu_kernels


def test_block_gemms_match_the_model_weights():
    from nakta_model.model import Transformer

    args = ModelArgs(dim=64, n_layers=1, n_heads=8, n_kv_heads=2, vocab_size=32, multiple_of=16)
    block = Transformer(args).layers[0]
    modules = {"wqkv": block.attention.wqkv, "wo": block.attention.wo,
               "w13": block.feed_forward.w13, "w2": block.feed_forward.w2}  # fmt: skip
    assert block_gemms(args).keys() == modules.keys()
    for name, (k, n) in block_gemms(args).items():
        assert tuple(modules[name].weight.shape) == (n, k), name
    assert block_gemms(preset("7B")) == {
        "wqkv": (4096, 12288), "wo": (4096, 4096), "w13": (4096, 22016), "w2": (11008, 4096)
    }  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path only")
def test_cpu_run_measures_nothing_and_says_so(capsys):
    assert main([]) == 1
    assert "nothing measured" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--tokens", "x"], "--tokens must be comma-separated ints"),
        (["--tokens", "0"], "--tokens needs at least one positive int"),
        (["--seconds", "0"], "--seconds must be > 0"),
    ],
)
def test_bad_arguments_are_refused(argv, why, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert why in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_gemm_matches_torch_on_odd_and_strided_inputs(dtype):
    """The benchmark's Triton peer computes ``x @ w.T`` (interpreter on the CPU: small
    blocks; odd sizes exercise every mask, a column slice of x a row stride > K)."""
    if not torch.cuda.is_available():
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton kernels run on the CPU only under TRITON_INTERPRET=1")
        if dtype != torch.float32:
            pytest.skip("the interpreter's half-precision dot is wrong: bf16 on a GPU only")
    from kernel_benchmark.bench_gemm import triton_linear

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(3)
    wide = torch.randn(37, 61, generator=g, device=device).to(dtype)
    x = wide[:, 5:58]  # [37, 53], row stride 61
    w = torch.randn(29, 53, generator=g, device=device).to(dtype)
    cfg = (16, 16, 16, 1, 1) if device == "cpu" else (64, 64, 32, 4, 2)
    got = triton_linear(x, w, cfg)
    want = x.double() @ w.double().T
    # fp32 dots are tf32 on the GPU's tensor cores (Triton's default), IEEE in the interpreter
    tol = (1e-5 if device == "cpu" else 2e-3) if dtype == torch.float32 else 1e-2
    assert (got.double() - want).norm() / want.norm() < tol
    with pytest.raises(ValueError, match="x \\[M, K\\]"):
        triton_linear(x, w[:, :7], cfg)
    with pytest.raises(TypeError, match="dtype"):
        triton_linear(x.float() if dtype != torch.float32 else x.double(), w, cfg)


# ------------------------------------------------------------------------------------------------
# The benchmark's persistent TMA GEMM (``kernel_benchmark/bench_gemm.py``) against fp64 matmuls,
# and its SwiGLU epilogue against the unfused path. CPU: the interpreter on small odd shapes (fp32
# too); GPU: bf16/fp16, 7B-like shapes.
# ------------------------------------------------------------------------------------------------


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
# fp32 runs in the interpreter only (on a GPU its tiles overflow shared memory: refused)
DTYPES = [torch.bfloat16, torch.float16] + ([torch.float32] if DEVICE == "cpu" else [])
FLOAT = torch.float32 if DEVICE == "cpu" else torch.bfloat16
needs_tma = pytest.mark.skipif(
    DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9, reason="TMA needs sm_90+"
)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


@needs_tma
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, n", [(37, 40, 24), (5, 64, 48), (70, 24, 40)])
def test_matches_fp64_matmul_on_odd_shapes(dtype, m, k, n):
    g = torch.Generator(device=DEVICE).manual_seed(m * k + n)
    x = torch.randn(m, k, generator=g, device=DEVICE).to(dtype)
    w = torch.randn(n, k, generator=g, device=DEVICE).to(dtype)
    assert gemm_supported(x, w)
    got = linear(x, w)
    assert got.shape == (m, n) and got.dtype == dtype
    assert rel(got, linear_reference(x.double(), w.double())) < TOL[dtype]


@needs_tma
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_epilogue_equals_the_unfused_kernels(dtype):
    """Fused: silu(gate) * up from the accumulators, rounded as swiglu.py rounds; equal bit
    for bit to this kernel's plain projection followed by the SwiGLU kernel (same K order)."""
    g = torch.Generator(device=DEVICE).manual_seed(7)
    m, k, f = 45, 48, 40  # F not a multiple of the tile: gate tiles reach into the up rows
    x = torch.randn(m, k, generator=g, device=DEVICE).to(dtype)
    w13 = torch.randn(2 * f, k, generator=g, device=DEVICE).to(dtype)
    fused = linear(x, w13, swiglu=True)
    assert fused.shape == (m, f)
    unfused = swiglu_kernels.swiglu(linear(x, w13))
    if DEVICE == "cpu":
        torch.testing.assert_close(fused, unfused, rtol=0, atol=0)
    else:  # the two tile widths may sum K in another order on the tensor cores
        assert rel(fused, unfused.double()) < TOL[dtype]
    want = linear_reference(x.double(), w13.double(), swiglu=True)
    assert rel(fused, want) < 2 * TOL[dtype]


@needs_tma
def test_strided_rows_and_empty_inputs():
    g = torch.Generator(device=DEVICE).manual_seed(3)
    big = torch.randn(33, 64, generator=g, device=DEVICE).to(FLOAT)
    x = big[:, 8:40]  # row stride 64 elements (16-byte aligned rows), base 8 elements in
    w = torch.randn(24, 32, generator=g, device=DEVICE).to(FLOAT)
    assert not x.is_contiguous() and gemm_supported(x, w)
    torch.testing.assert_close(linear(x, w), linear(x.contiguous(), w), rtol=0, atol=0)
    assert linear(x[:0], w).shape == (0, 24)


@needs_tma
def test_bad_inputs_raise_naming_the_argument():
    x = torch.randn(8, 32, device=DEVICE).to(FLOAT)
    w = torch.randn(16, 32, device=DEVICE).to(FLOAT)
    with pytest.raises(TypeError, match="w must have x's dtype"):
        linear(x, w.double())
    with pytest.raises(ValueError, match="same K"):
        linear(x, w[:, :16].contiguous())
    with pytest.raises(ValueError, match="even row count"):
        linear(x, w[:15], swiglu=True)
    misaligned = torch.randn(8, 33, device=DEVICE).to(FLOAT)[:, :32]  # rows not 16-byte aligned
    assert not gemm_supported(misaligned, w)
    with pytest.raises(ValueError, match="x must have unit last stride and 16-byte aligned"):
        linear(misaligned, w)
    assert not gemm_supported(x, w.double())  # mixed dtypes
    if DEVICE == "cuda":
        xf, wf = x.float(), w.float()
        assert not gemm_supported(xf, wf)
        with pytest.raises(TypeError, match="bf16/fp16 on a GPU"):
            linear(xf, wf)
    with pytest.raises(TypeError):
        linear(x.int(), w)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a Hopper GPU",
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_7b_shapes_against_cublas(dtype):
    """The block shapes at a partial last tile of tokens: within rounding of cuBLAS and of
    fp64, the fused SwiGLU within rounding of the unfused path; no element left unwritten."""
    g = torch.Generator(device="cuda").manual_seed(1)
    m = 1000
    x = torch.randn(m, 4096, generator=g, device="cuda").to(dtype)
    for n in (12288, 4096):
        w = (torch.randn(n, 4096, generator=g, device="cuda") / 64).to(dtype)
        got = linear(x, w)
        assert torch.isfinite(got).all()
        assert rel(got, torch.nn.functional.linear(x, w).double()) < TOL[dtype]
        assert rel(got, linear_reference(x.double(), w.double())) < TOL[dtype]
    w13 = (torch.randn(2 * 11008, 4096, generator=g, device="cuda") / 64).to(dtype)
    fused = linear(x, w13, swiglu=True)
    ref = swiglu_kernels.swiglu(torch.nn.functional.linear(x, w13))
    assert torch.isfinite(fused).all() and rel(fused, ref.double()) < TOL[dtype]
    for kind in ("plain", "swiglu"):  # the GPU table, not the interpreter's
        assert gemm._config(kind)["BLOCK_M"] >= 64


# ------------------------------------------------------------------------------------------------
# kernel_benchmark.bench_fp8: its command line, the CPU refusal, and the tables, plot and summary
# it writes (from rows shaped as its sections produce them; the timings need a GPU).
# ------------------------------------------------------------------------------------------------


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
def test_bench_fp8_bad_arguments_are_refused(argv, why, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert why in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path only")
def test_bench_fp8_cpu_run_measures_nothing_and_says_so(capsys):
    assert bench_fp8.main([]) == 1
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
