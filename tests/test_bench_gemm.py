"""kernel_benchmark.bench_gemm: the block GEMM shapes it times and its command line (the
timings themselves need a GPU: they are cuBLAS rates)."""

from __future__ import annotations

import pytest
import torch

from kernel_benchmark.bench_gemm import block_gemms, main
from nakta_model.config import ModelArgs, preset


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
