"""SwiGLU kernel vs PyTorch eager ``F.silu(a) * b`` (forward and autograd) and fp64 gradients.

On the GPU forward and backward must match eager bit for bit: fp16/fp32 use the same exp and
division as PyTorch's CUDA kernels, bf16 a faster pair that rounds the same on every gate
(checked over all 65,536 of them). On the CPU (Triton interpreter, numpy's exp vs
PyTorch's SLEEF exp) the fp32 silu can differ in its last bit, so there the bound is 1 ulp of
the dtype (4 ulp in fp32, where two fp32 roundings stack) with few differing elements.
"""

from __future__ import annotations

import pytest
import torch

from nakta_model.kernels import swiglu as swiglu_module
from nakta_model.kernels.swiglu import (
    silu_mul,
    silu_mul_backward,
    silu_mul_forward,
    silu_mul_reference,
    swiglu,
    swiglu_reference,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
GRAD_TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _assert_close_ulp(
    out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, grad: bool = False
) -> None:
    """Bit-exact on CUDA; on the CPU within 1 ulp of the dtype (4 in fp32) of ``ref``.

    fp32 gradients on the CPU are compared on the scale of the largest gradient: near
    silu's minimum (gate ~ -1.28) the factor ``1 + g * (1 - s)`` cancels, and a last-bit
    difference in ``exp`` becomes a large relative difference in a tiny value.
    """
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    if out.is_cuda:  # same math functions as PyTorch's CUDA kernels: bit for bit
        assert torch.equal(out, ref), f"{(out != ref).sum().item()} elements differ"
        return
    ulps = 4 if dtype == torch.float32 else 1
    o, r = out.double(), ref.double()
    floor = r.abs().max().item() if grad and dtype == torch.float32 else 1e-6
    tol = ulps * EPS[dtype] * (r.abs() + floor)
    assert not ((o - r).abs() > tol).any(), f"max diff {(o - r).abs().max().item():.3g}"
    if dtype != torch.float32:
        assert (out != ref).double().mean().item() < 0.01


def _rel_err(a: torch.Tensor, ref64: torch.Tensor) -> float:
    return ((a.double() - ref64).abs().max() / ref64.abs().max().clamp_min(1e-30)).item()


def _gate_up(rows: int, f: int, dtype, device) -> torch.Tensor:
    # scale 4 covers silu's curved region and its tails (large |gate| saturates sigmoid)
    return (4 * torch.randn(rows, 2 * f, device=device)).to(dtype)


# ----------------------------------------------------------------------------------------------
# forward


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("f", [64, 1000, 4097])
def test_swiglu_forward_matches_eager(device, dtype, f):
    gu = _gate_up(3, f, dtype, device)
    _assert_close_ulp(swiglu(gu), swiglu_reference(gu), dtype)
    gate, up = gu[:, :f], gu[:, f:]
    _assert_close_ulp(silu_mul(gate, up), silu_mul_reference(gate, up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_contiguous_and_leading_dims(device, dtype):
    gate = (4 * torch.randn(2, 3, 300, device=device)).to(dtype)
    up = torch.randn(2, 3, 300, device=device).to(dtype)
    out = silu_mul(gate, up)
    assert out.shape == (2, 3, 300)
    _assert_close_ulp(out, silu_mul_reference(gate, up), dtype)


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_special_values(device):
    """Large |gate| (sigmoid saturates), zeros and infinities behave like eager."""
    g = torch.tensor([0.0, -0.0, 30.0, -30.0, 88.0, -88.0, 100.0, -100.0, 1e-8], device=device)
    u = torch.tensor([1.0, 2.0, -1.0, 3.0, 0.5, 2.0, 1.0, 1.0, 5.0], device=device)
    for dtype in DTYPES:
        out = silu_mul(g.to(dtype), u.to(dtype))
        ref = silu_mul_reference(g.to(dtype), u.to(dtype))
        assert torch.allclose(out.double(), ref.double(), rtol=4 * EPS[dtype], atol=0)


def test_strided_views_without_copies(device):
    """Halves of a padded fused projection, and every other row, read in place."""
    base = _gate_up(12, 150, torch.bfloat16, device)  # [12, 300]
    wide = torch.zeros(12, 320, device=device, dtype=torch.bfloat16)
    wide[:, :300] = base
    gu = wide[::2, :300]  # non-contiguous rows, row stride 640
    assert not gu.is_contiguous()
    out = swiglu(gu)
    _assert_close_ulp(out, swiglu_reference(gu), torch.bfloat16)
    assert out.is_contiguous()


@pytest.mark.parametrize("block_m,block_n", [(1, 128), (4, 64), (2, 1024)])
def test_tile_configs(device, block_m, block_n, monkeypatch):
    gate = (4 * torch.randn(5, 333, device=device)).half()
    up = torch.randn(5, 333, device=device).half()
    monkeypatch.setattr(swiglu_module, "_TUNE", {"BLOCK_M": block_m, "BLOCK_N": block_n})
    out = silu_mul_forward(gate, up)
    _assert_close_ulp(out, silu_mul_reference(gate, up), torch.float16)


def test_empty(device):
    assert swiglu(torch.zeros(0, 8, device=device)).shape == (0, 4)


# ----------------------------------------------------------------------------------------------
# backward


def _check_grads(gu: torch.Tensor, dtype: torch.dtype, fused: bool) -> None:
    f = gu.shape[-1] // 2
    dout = torch.randn(*gu.shape[:-1], f, device=gu.device).to(dtype)
    # kernel
    a = gu.clone().requires_grad_()
    out = swiglu(a) if fused else silu_mul(a[..., :f], a[..., f:])
    out.backward(dout)
    # eager autograd in the same dtype: rounding replayed exactly on the GPU
    b = gu.clone().requires_grad_()
    swiglu_reference(b).backward(dout)
    _assert_close_ulp(a.grad[..., :f], b.grad[..., :f], dtype, grad=True)
    _assert_close_ulp(a.grad[..., f:], b.grad[..., f:], dtype, grad=True)
    # fp64 ground truth
    c = gu.double().requires_grad_()
    swiglu_reference(c).backward(dout.double())
    assert _rel_err(a.grad, c.grad) < GRAD_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fused", [True, False])
def test_backward_matches_autograd(device, dtype, fused):
    _check_grads(_gate_up(4, 500, dtype, device), dtype, fused)


def test_backward_separate_tensors_and_broadcast_grad(device):
    gate = (4 * torch.randn(3, 200, device=device)).requires_grad_()
    up = torch.randn(3, 200, device=device).requires_grad_()
    silu_mul(gate, up).sum().backward()  # stride-0 incoming gradient
    g2, u2 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    silu_mul_reference(g2, u2).sum().backward()
    assert _rel_err(gate.grad, g2.grad) < 1e-5 and _rel_err(up.grad, u2.grad) < 1e-5


def test_backward_only_up_requires_grad(device):
    gate = 4 * torch.randn(2, 64, device=device)
    up = torch.randn(2, 64, device=device, requires_grad=True)
    silu_mul(gate, up).sum().backward()
    assert _rel_err(up.grad, torch.nn.functional.silu(gate.double())) < 1e-6


def test_backward_launcher_strided_outputs(device):
    gu = _gate_up(4, 100, torch.float16, device)
    dout = torch.randn(4, 100, device=device).half()
    d = torch.full((4, 200), float("nan"), device=device, dtype=torch.float16)
    silu_mul_backward(dout, gu[:, :100], gu[:, 100:], d[:, :100], d[:, 100:])
    b = gu.clone().requires_grad_()
    swiglu_reference(b).backward(dout)
    _assert_close_ulp(d, b.grad, torch.float16, grad=True)


# ----------------------------------------------------------------------------------------------
# exact=False: the fast forward


def _within_ulps(out: torch.Tensor, ref: torch.Tensor, n: int = 1) -> torch.Tensor:
    """Per element: equal, both NaN, or at most ``n`` representable values apart."""
    bits = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}
    ib = bits[out.dtype]
    mag_mask = (1 << (8 * out.element_size() - 1)) - 1
    o = out.view(ib).long()
    r = ref.view(ib).long()
    same_sign = (o < 0) == (r < 0)
    mag_o, mag_r = o & mag_mask, r & mag_mask
    neighbours = same_sign & ((mag_o - mag_r).abs() <= n)
    tiny = (mag_o <= n) & (mag_r <= n)  # +-0 next to the smallest denormals of either sign
    return (out == ref) | (torch.isnan(out) & torch.isnan(ref)) | neighbours | tiny


# The hardware exp reduces its argument as x * log2(e) in fp32: the exponent carries 2^-24
# relative error, i.e. up to ~2^-17.5 relative in exp(-x) at |x| ~ 88 (the end of its range).
FAST_FP32_REL = 2.0**-16


def _fast_close(out: torch.Tensor, ref: torch.Tensor, n_ulps: int) -> bool:
    """Half dtypes: within ``n_ulps``; fp32: within FAST_FP32_REL (times ``n_ulps``) relative,
    plus one denormal step."""
    if out.dtype != torch.float32:
        return bool(_within_ulps(out, ref, n_ulps).all())
    if not torch.equal(torch.isnan(out), torch.isnan(ref)):
        return False
    ok = torch.isfinite(ref)
    err = (out[ok].double() - ref[ok].double()).abs()
    return bool((err <= n_ulps * FAST_FP32_REL * ref[ok].double().abs() + 2.0**-149).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_fast_forward_within_bound(device, dtype):
    """silu(gate) within 1 ulp of eager (up = 1), silu(gate) * up within 2; fp32 relative."""
    gu = _gate_up(5, 999, dtype, device)
    ones = torch.ones(5, 999, device=device, dtype=dtype)
    gate, up = gu[:, :999], gu[:, 999:]
    assert _fast_close(silu_mul(gate, ones, exact=False), silu_mul_reference(gate, ones), 1)
    assert _fast_close(swiglu(gu, exact=False), swiglu_reference(gu), 2)
    assert _fast_close(silu_mul(gate, up, exact=False), silu_mul_reference(gate, up), 2)


def test_fast_forward_gradients_are_the_exact_backward(device):
    gu = _gate_up(3, 100, torch.bfloat16, device).requires_grad_()
    dout = torch.randn(3, 100, device=device).bfloat16()
    (g_fast,) = torch.autograd.grad(swiglu(gu, exact=False), gu, dout)
    (g_exact,) = torch.autograd.grad(swiglu(gu), gu, dout)
    assert torch.equal(g_fast, g_exact)


def test_exact_must_be_bool(device):
    with pytest.raises(TypeError, match="exact must be a bool"):
        swiglu(torch.randn(2, 64, device=device), exact=1)


# ----------------------------------------------------------------------------------------------
# bad input


def test_bad_inputs_raise_clear_errors(device):
    g = torch.randn(2, 64, device=device)
    with pytest.raises(ValueError, match="same shape"):
        silu_mul(g, torch.randn(2, 65, device=device))
    with pytest.raises(TypeError, match="same dtype"):
        silu_mul(g, g.half())
    with pytest.raises(TypeError, match="gate must have dtype"):
        silu_mul(g.double(), g.double())
    with pytest.raises(TypeError, match="gate must have dtype"):
        silu_mul(g.to(torch.int32), g.to(torch.int32))
    with pytest.raises(TypeError, match="up must be a torch.Tensor"):
        silu_mul(g, 1.0)
    with pytest.raises(ValueError, match="even last dim"):
        swiglu(torch.randn(2, 63, device=device))
    with pytest.raises(ValueError, match="unit-stride"):
        silu_mul(torch.randn(64, 2, device=device).t(), torch.randn(64, 2, device=device).t())
    with pytest.raises(ValueError, match="cannot be viewed"):
        x = torch.randn(4, 6, 64, device=device)[:, :3]
        silu_mul(x, x)


def test_cpu_tensor_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        swiglu(torch.randn(2, 64))


# ----------------------------------------------------------------------------------------------
# GPU: LLaMA FFN sizes, bit-exact against eager


@pytest.mark.gpu
@pytest.mark.parametrize("f", [11008, 13824, 17920, 22016, 1000, 4097])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_llama_ffn_bit_exact(f, dtype):
    gu = _gate_up(257, f, dtype, "cuda")
    assert torch.equal(swiglu(gu), swiglu_reference(gu))
    _check_grads(gu, dtype, fused=True)


@pytest.mark.gpu
def test_gpu_large_row_offsets():
    """Row offsets beyond 2**31 elements (int64 addressing)."""
    gu = torch.randn(50000, 2 * 22016, device="cuda", dtype=torch.bfloat16)
    out = swiglu(gu)
    assert torch.equal(out[-3:], swiglu_reference(gu[-3:]))


def _every_half_gate(dtype: torch.dtype) -> torch.Tensor:
    """All 65,536 bit patterns of a half dtype (denormals, +-0, +-inf, NaN) as a 256 x 256 tensor."""
    gate = torch.arange(-(2**15), 2**15, device="cuda", dtype=torch.int32).to(torch.int16)
    return gate.view(dtype).reshape(256, 256)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_exact_forward_every_half_gate(dtype):
    """The default forward rounds silu like eager on every gate, sign of zero and NaN included.
    This is the proof behind bf16 running the fast arithmetic (FAST_IS_EXACT_DTYPES): with
    ``up = 1`` the output is the rounded silu itself, and the product with any other ``up`` is
    exact in fp32 before its rounding, so every (gate, up) pair then matches too."""
    gate = _every_half_gate(dtype)
    up = torch.ones_like(gate)
    out, ref = silu_mul(gate, up), silu_mul_reference(gate, up)
    same = (out == ref) & (torch.signbit(out) == torch.signbit(ref))
    same |= torch.isnan(out) & torch.isnan(ref)
    assert same.all(), f"gates {gate[~same][:8].tolist()} differ"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_fast_forward_every_half_gate_within_one_ulp(dtype):
    """All 65,536 gate bit patterns (denormals, +-0, +-inf, NaN): the fast silu is at most
    one ulp from eager's, and differs on few of them."""
    gate = _every_half_gate(dtype)
    up = torch.ones_like(gate)
    out, ref = silu_mul(gate, up, exact=False), silu_mul_reference(gate, up)
    assert _within_ulps(out, ref, 1).all()
    differ = ~((out == ref) | (torch.isnan(out) & torch.isnan(ref)))
    assert differ.double().mean().item() < 0.01


@pytest.mark.gpu
def test_gpu_fast_forward_fp32_relative_bound():
    """fp32: a 1-in-4099 sweep of all bit patterns, within FAST_FP32_REL of eager."""
    x = torch.arange(0, 2**32, 4099, device="cuda", dtype=torch.int64)
    x = (x - 2**31).to(torch.int32).view(torch.float32)
    x = x[torch.isfinite(x)]
    one = torch.ones_like(x)
    assert _fast_close(silu_mul(x, one, exact=False), silu_mul_reference(x, one), 1)
