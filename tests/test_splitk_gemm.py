"""splitk_gemm: ``round(x @ W^T)`` with K split over programs and the partial tiles summed by
each tile's last program, against the fp32 reference (Triton interpreter on the CPU): odd
shapes, 1..4 splits, every float dtype, strided inputs, the counters left zero, the same bits on
a second launch (the split order fixes the sum), bad input named."""

from __future__ import annotations

import pytest
import torch

from nakta_model.kernels import splitk_gemm as sk

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 1, "num_stages": 1}
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split", [1, 2, 3, 4])
@pytest.mark.parametrize("m, n, k", [(5, 37, 70), (33, 16, 129)])
def test_split_products_equal_the_reference(dtype, split, m, n, k, monkeypatch):
    monkeypatch.setattr(sk, "_TUNE", {**SMALL, "SPLIT_K": split})
    g = torch.Generator().manual_seed(m * n + k + split)
    x = torch.randn(m, k, generator=g).to(dtype).to(_device())
    w = torch.randn(n, k, generator=g).to(dtype).to(_device())
    y = sk.splitk_linear(x, w)
    want = sk.splitk_linear_reference(x, w)
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype] * 4)
    assert torch.equal(sk.splitk_linear(x, w), y)  # the same bits again: split order
    assert not sk._counters(x.device).any()  # every tile's counter back to zero
    exact = (x.double() @ w.double().T).float()
    err = (y.float() - exact).abs().max() / exact.abs().max()
    assert err < TOL[dtype]


def test_one_rounding_of_the_fp32_sum_in_bf16(monkeypatch):
    """bf16: each output is the fp32 sum rounded once (RNE), as F.linear's; no split's partial
    is rounded on its own (that would move some of these bits)."""
    monkeypatch.setattr(sk, "_TUNE", {**SMALL, "SPLIT_K": 4})
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 256, generator=g).bfloat16()
    w = torch.randn(24, 256, generator=g).bfloat16()
    y = sk.splitk_linear(x, w)
    parts = [(x[:, i : i + 64].float() @ w[:, i : i + 64].float().T) for i in range(0, 256, 64)]
    want = (((parts[0] + parts[1]) + parts[2]) + parts[3]).bfloat16()
    assert torch.equal(y, want)


def test_strided_inputs_and_the_default_config(monkeypatch):
    """Rows with padding (a view of a wider buffer), a transposed-view weight; the default
    launch values choose splits from the tiles and the SMs."""
    g = torch.Generator().manual_seed(3)
    buf = torch.randn(9, 200, generator=g)
    x = buf[:, 3:131]  # [9, 128], row stride 200
    w = torch.randn(128, 40, generator=g).T  # [40, 128], strides (1, 40)
    monkeypatch.setattr(sk, "_TUNE", {**SMALL, "SPLIT_K": 2})
    torch.testing.assert_close(sk.splitk_linear(x, w), sk.splitk_linear_reference(x, w))
    monkeypatch.setattr(sk, "_TUNE", {})
    cfg = sk._config(256, 4096, 4096, 132)
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["SPLIT_K"]) == (128, 128, 3)  # 64 tiles
    assert sk._config(512, 4096, 11008, 132)["SPLIT_K"] == 2
    assert sk._config(512, 22016, 4096, 132)["SPLIT_K"] == 1  # 688 tiles fill the SMs
    assert sk._config(48, 4096, 1024, 132)["SPLIT_K"] == 2  # at most K / 512 splits


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split", [1, 3])
def test_fp8_w8a8_with_row_and_column_scales(out_dtype, split, monkeypatch):
    """e4m3 x and weight with fp32 row / column scales (the step's W8A8 operands): the exact
    fp32 products summed, scaled x-then-w and rounded once, as fp8_matmul_reference."""
    from nakta_model.kernels.fp8_quant import quantize_rows_reference, quantize_weight

    monkeypatch.setattr(sk, "_TUNE", {**SMALL, "SPLIT_K": split})
    g = torch.Generator().manual_seed(11 + split)
    xq = quantize_rows_reference(torch.randn(7, 96, generator=g))
    wq, ws = quantize_weight(torch.randn(40, 96, generator=g))
    y = sk.splitk_linear(xq.q, wq, xq.scale, ws, out_dtype)
    want = sk.splitk_linear_reference(xq.q, wq, xq.scale, ws, out_dtype)
    assert y.dtype == out_dtype
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[out_dtype]
    torch.testing.assert_close(y.float(), want.float(), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="weight_scale must be a contiguous"):
        sk.splitk_linear(xq.q, wq, xq.scale, ws[:-1])
    with pytest.raises(TypeError, match="x_scale must be a torch.Tensor"):
        sk.splitk_linear(xq.q, wq, None, ws)
    with pytest.raises(TypeError, match="out_dtype"):
        sk.splitk_linear(xq.q, wq, xq.scale, ws, torch.int32)
    with pytest.raises(ValueError, match="go with FP8"):
        sk.splitk_linear(torch.randn(2, 8), torch.randn(3, 8), torch.ones(2), torch.ones(3))


@pytest.mark.parametrize(
    "x, w, exc, msg",
    [
        (torch.randn(2, 8), torch.randn(3, 7), ValueError, "weight must be"),
        (torch.randn(2, 8), torch.randn(3, 8).double(), TypeError, "weight must have x's dtype"),
        (torch.randn(2, 8).double(), torch.randn(3, 8).double(), TypeError, "x"),
        (torch.randn(8), torch.randn(3, 8), ValueError, "x must have 2"),
        (torch.randn(0, 8), torch.randn(3, 8), ValueError, "empty"),
        ("x", torch.randn(3, 8), TypeError, "x"),
    ],
)
def test_bad_input_is_named(x, w, exc, msg):
    with pytest.raises(exc, match=msg):
        sk.splitk_linear(x, w)


def test_bad_tune_values_are_named(monkeypatch):
    monkeypatch.setattr(sk, "_TUNE", {"BLOCK_N": 24})
    with pytest.raises(ValueError, match="BLOCK_N must be a power of two"):
        sk.splitk_linear(torch.randn(2, 8), torch.randn(3, 8))
    monkeypatch.setattr(sk, "_TUNE", {"SPLIT_K": 0})
    with pytest.raises(ValueError, match="SPLIT_K must be >= 1"):
        sk.splitk_linear(torch.randn(2, 8), torch.randn(3, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(256, 4096, 4096), (384, 4096, 11008), (130, 5120, 5120)])
def test_gpu_decode_shapes_in_a_cuda_graph(m, n, k):
    """The 7B / 13B narrow linears at decode rows, default launch values (splits from the
    SMs): close to the fp32 reference, the same bits on every graph replay (the counters'
    reset and the split order), counters zero after."""
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) / k**0.5
    want = sk.splitk_linear_reference(x, w).float()
    eager = sk.splitk_linear(x, w)
    torch.testing.assert_close(eager.float(), want, rtol=1e-2, atol=1e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sk.splitk_linear(x, w)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    assert not sk._counters(x.device).any()


@pytest.mark.gpu
@pytest.mark.parametrize("m, k", [(256, 4096), (512, 11008)])
def test_gpu_fp8_decode_shapes(m, k):
    """W8A8 at the 7B narrow shapes (e4m3 from the model's quantizers): close to the exact
    fp32 reference, the same bits twice."""
    from nakta_model.kernels.fp8_quant import quantize_rows, quantize_weight

    g = torch.Generator(device="cuda").manual_seed(m + k)
    xq = quantize_rows(torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16))
    wq, ws = quantize_weight(torch.randn(4096, k, device="cuda", generator=g) / k**0.5)
    y = sk.splitk_linear(xq.q, wq, xq.scale, ws, torch.bfloat16)
    want = sk.splitk_linear_reference(xq.q, wq, xq.scale, ws, torch.float32)
    torch.testing.assert_close(y.float(), want, rtol=1e-2, atol=1e-2)
    assert torch.equal(sk.splitk_linear(xq.q, wq, xq.scale, ws, torch.bfloat16), y)
    assert not sk._counters(xq.q.device).any()
