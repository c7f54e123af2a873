"""quant="fp8" on a GPU: the fused kernels and cuBLASLt's FP8 GEMM compute what the reference
path computes, decoding streams e4m3 weights inside captured graphs, and FP8 stays close to
bf16 on the same weights. (The CPU tests of tests/test_fp8_model.py pin the semantics.)"""

from __future__ import annotations

import pytest
import torch

from nakta_model.config import ModelArgs
from nakta_model.generation.engine import Generator, greedy_requests
from nakta_model.loading import random_model

pytestmark = pytest.mark.gpu

# dims multiples of 16 (cuBLASLt's FP8 GEMM); GQA; hidden 768 from multiple_of 256
ARGS = ModelArgs(
    dim=256, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=512, multiple_of=256, max_seq_len=160
)


def _fp8_capable() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


needs_fp8 = pytest.mark.skipif(not _fp8_capable(), reason="needs compute capability >= 8.9")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, ARGS.vocab_size, (length + i,), generator=g).tolist()
            for i in range(n)]  # fmt: skip


@needs_fp8
def test_gpu_fp8_kernels_path_equals_reference_path():
    """Triton norms / SwiGLU / row quantization + packed attention vs the PyTorch references
    (both through the same FP8 GEMMs): equal up to the attention's summation order."""
    model = random_model(ARGS, "cuda", torch.bfloat16, seed=3, quant="fp8")
    tokens = torch.randint(0, ARGS.vocab_size, (3, 37), device="cuda")
    fused = model(tokens)
    model.kernels = "reference"
    ref = model(tokens)
    model.kernels = "auto"
    assert torch.isfinite(fused).all()
    assert _rel(fused, ref) < 2e-2


@needs_fp8
def test_gpu_fp8_close_to_bf16_same_weights():
    bf = random_model(ARGS, "cuda", torch.bfloat16, seed=4)
    f8 = random_model(ARGS, "cuda", torch.bfloat16, seed=4, quant="fp8")
    tokens = torch.randint(0, ARGS.vocab_size, (2, 64), device="cuda")
    a, b = f8(tokens), bf(tokens)
    assert 0 < _rel(a, b) < 0.1
    assert f8.layers[0].attention.wqkv.weight.element_size() == 1


@needs_fp8
def test_gpu_fp8_decode_graphs_equal_eager_and_reference():
    """Decoding with e4m3 weights: captured graphs = eager kernels, and both within rounding of
    the reference step (W8A16: dequantized weights against bf16 activations)."""
    model = random_model(ARGS, "cuda", torch.bfloat16, seed=5, quant="fp8")
    ps = _prompts(3, 9, seed=7)
    graphed = Generator(model, max_batch=4, chunk=8).generate(greedy_requests(ps, 24, None))
    eager = Generator(model, max_batch=4, chunk=8, graphs=False).generate(
        greedy_requests(ps, 24, None)
    )
    assert [r.tokens for r in graphed] == [r.tokens for r in eager]
    model.kernels = "reference"
    ref = Generator(model, max_batch=4, chunk=8, graphs=False).generate(
        greedy_requests(ps, 24, None)
    )
    model.kernels = "auto"
    same = sum(a == b for x, y in zip(graphed, ref) for a, b in zip(x.tokens, y.tokens))
    assert same >= 0.9 * sum(len(r.tokens) for r in ref)
    assert all(x.tokens[:4] == y.tokens[:4] for x, y in zip(graphed, ref))


@needs_fp8
def test_gpu_fp8_7b_layer_shapes_run_through_scaled_mm():
    """The 7B block shapes take cuBLASLt's path (not the fp32 fallback) and stay finite."""
    from nakta_model.kernels.fp8_gemm import scaled_mm_supported

    args = ModelArgs(dim=4096, n_layers=1, n_heads=32, vocab_size=32000, multiple_of=256)
    model = random_model(args, "cuda", torch.bfloat16, seed=0, quant="fp8")
    for lin in (
        model.layers[0].attention.wqkv,
        model.layers[0].attention.wo,
        model.layers[0].feed_forward.w13,
        model.layers[0].feed_forward.w2,
    ):
        x = torch.empty(7, lin.in_features, dtype=torch.float8_e4m3fn, device="cuda")
        assert scaled_mm_supported(x, lin.weight, torch.bfloat16)
    tokens = torch.randint(0, args.vocab_size, (2, 100), device="cuda")
    bf = random_model(args, "cuda", torch.bfloat16, seed=0)
    assert _rel(model(tokens), bf(tokens)) < 0.1


@needs_fp8
@pytest.mark.parametrize("small_rows", [0, 64])
@pytest.mark.parametrize("rows", [1, 16, 64, 65])
def test_gpu_fp8_prefill_products_at_a_few_rows(rows, small_rows, monkeypatch):
    """With ``model.FP8_SMALL_GEMM_ROWS`` at 64, an ``Fp8Linear`` runs ``fp8_decode_gemm`` at up
    to 64 rows (a short prompt's prefill) and cuBLASLt above; at 0 (the default) cuBLASLt
    always. Either way what cuBLASLt computes, up to the fp32 summation order."""
    import nakta_model.model as nm
    from nakta_model.kernels import fp8_decode_gemm as fdg
    from nakta_model.kernels import fp8_gemm
    from nakta_model.kernels.fp8_quant import quantize_rows

    monkeypatch.setattr(nm, "FP8_SMALL_GEMM_ROWS", small_rows)
    args = ModelArgs(dim=4096, n_layers=1, n_heads=32, vocab_size=32000, multiple_of=256)
    model = random_model(args, "cuda", torch.bfloat16, seed=0, quant="fp8")
    calls = []
    small = fdg.fp8_decode_gemm
    monkeypatch.setattr(fdg, "fp8_decode_gemm", lambda *a, **k: calls.append(1) or small(*a, **k))
    for lin in (model.layers[0].attention.wqkv, model.layers[0].feed_forward.w2):
        x = torch.randn(rows, lin.in_features, device="cuda", dtype=torch.bfloat16)
        got = lin(x)
        xq = quantize_rows(x)
        want = fp8_gemm.fp8_matmul(xq.q, xq.scale, lin.weight, lin.weight_scale, torch.bfloat16)
        assert got.shape == want.shape and torch.isfinite(got).all()
        assert _rel(got, want) < 1e-2
    assert len(calls) == (2 if rows <= min(small_rows, fdg.MAX_ROWS) else 0)


def test_gpu_fp8_refused_below_capability_8_9(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    with pytest.raises(ValueError, match=r"capability >= 8.9.*8\.0"):
        random_model(ARGS, "cuda", torch.bfloat16, quant="fp8")
