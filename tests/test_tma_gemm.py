"""The benchmark's persistent TMA GEMM (``kernel_benchmark/bench_gemm.py``) against fp64
matmuls, and its SwiGLU epilogue against the unfused path. CPU: the interpreter on small odd
shapes (fp32 too); GPU: bf16/fp16, 7B-like shapes."""

from __future__ import annotations

import pytest
import torch

from kernel_benchmark import bench_gemm as gemm
from kernel_benchmark.bench_gemm import linear_reference
from kernel_benchmark.bench_gemm import tma_linear as linear
from kernel_benchmark.bench_gemm import tma_supported as gemm_supported
from nakta_model.kernels import swiglu as swiglu_kernels

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
