"""An FP8 model's W8A8 products at a few rows (a short prompt's prefill, a batch-1 call):
``_Ops.fp8_matmul`` runs the decode step's ``fp8_decode_gemm`` up to its ``MAX_ROWS`` and
cuBLASLt (``fp8_matmul``) above; the reference mode never takes the Triton kernel. Same function
either way (exact e4m3 products, fp32 sums, the same scales and rounding): summation order only."""

from __future__ import annotations

import pytest
import torch

from nakta_model.config import ModelArgs
from nakta_model.kernels import fp8_decode_gemm as fdg
from nakta_model.kernels import fp8_gemm
from nakta_model.kernels.fp8_gemm import fp8_matmul_reference
from nakta_model.kernels.fp8_quant import FP8_DTYPE
from nakta_model.loading import random_model
from nakta_model.model import _Ops

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=16)


def _inputs(rows: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    xq = (torch.randn(rows, k, generator=g) * 4).to(FP8_DTYPE)
    wq = (torch.randn(n, k, generator=g) * 2).to(FP8_DTYPE)
    xs = torch.rand(rows, generator=g) * 0.02 + 1e-3
    ws = torch.rand(n, generator=g) * 0.02 + 1e-3
    return xq, xs, wq, ws


@pytest.fixture
def spy(monkeypatch):
    """Counts the calls of ``fp8_decode_gemm`` and of cuBLASLt's ``fp8_matmul``."""
    calls = {"triton": 0, "cublaslt": 0}
    small, big = fdg.fp8_decode_gemm, fp8_gemm.fp8_matmul

    def small_spy(*a, **kw):
        calls["triton"] += 1
        return small(*a, **kw)

    def big_spy(*a, **kw):
        calls["cublaslt"] += 1
        return big(*a, **kw)

    monkeypatch.setattr(fdg, "fp8_decode_gemm", small_spy)
    monkeypatch.setattr(fp8_gemm, "fp8_matmul", big_spy)
    monkeypatch.setattr(fdg, "_TUNE", dict(BLOCK_N=32, BLOCK_K=32))  # several tiles, K steps
    return calls


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_few_rows_take_the_decode_gemm(rows, out_dtype, spy):
    """N = 70 and K = 100 are not multiples of the tiles; a non-contiguous x (every other row
    of a wider buffer)."""
    xq, xs, wq, ws = _inputs(2 * rows, 70, 100)
    xq, xs = xq[::2], xs[::2]
    got = _Ops("triton", "fp8").fp8_matmul(xq, xs, wq, ws, out_dtype)
    want = fp8_matmul_reference(xq, xs, wq, ws, out_dtype)
    assert spy == {"triton": 1, "cublaslt": 0}
    assert got.dtype == out_dtype and got.shape == (rows, 70)
    tol = 2.0**-7 if out_dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max())


def test_more_rows_and_the_reference_mode_keep_the_gemm(spy):
    xq, xs, wq, ws = _inputs(fdg.MAX_ROWS + 1, 48, 64)
    got = _Ops("triton", "fp8").fp8_matmul(xq, xs, wq, ws, torch.bfloat16)
    assert spy == {"triton": 0, "cublaslt": 1}
    torch.testing.assert_close(got, fp8_matmul_reference(xq, xs, wq, ws, torch.bfloat16))
    few = _inputs(4, 48, 64)
    _Ops("reference", "fp8").fp8_matmul(*few, torch.bfloat16)
    assert spy == {"triton": 0, "cublaslt": 2}


def test_model_prefill_at_a_few_tokens_runs_the_decode_gemm(spy):
    """The packed forward of a 7-token prompt: every block matrix through ``fp8_decode_gemm``
    (4 a layer), logits as the reference path's up to summation order."""
    f8 = random_model(ARGS, "cpu", torch.float32, seed=6, kernels="triton", quant="fp8")
    tokens = torch.randint(0, ARGS.vocab_size, (7,), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(7)
    start = torch.zeros(7, dtype=torch.long)
    fused = f8.forward_packed(tokens, pos, start, None, pos)
    assert spy == {"triton": 4 * ARGS.n_layers, "cublaslt": 0}
    f8.kernels = "reference"
    ref = f8.forward_packed(tokens, pos, start, None, pos)
    assert (fused - ref).norm() / ref.norm() < 1e-3
