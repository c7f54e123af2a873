"""RMSNorm kernel vs Meta's formula (same rounding order) and vs fp64 autograd for gradients.

CPU runs use the Triton interpreter on small shapes; ``gpu`` tests use LLaMA hidden sizes.
Tolerances: outputs within 2 ulp of the same-dtype reference (the row sum is reduced in a
different order, so an fp32 1/rms can differ in its last bit), with few such elements (on
the GPU at most 1e-3 of them; about 2e-6 measured at LLaMA widths in bf16);
gradients within a small multiple of the dtype's epsilon of the fp64 gradient.
"""

from __future__ import annotations

import pytest
import torch

from nakta_model.kernels import rmsnorm
from nakta_model.kernels.rmsnorm import (
    LOOPED_THREE_CHUNK_BLOCK,
    MAX_SINGLE_BLOCK,
    _fwd_layout,
    column_chunks,
    rms_norm,
    rms_norm_backward,
    rms_norm_forward,
    rms_norm_reference,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
GRAD_TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _assert_close_ulp(out: torch.Tensor, ref: torch.Tensor, ulps: float, max_frac: float) -> None:
    """Each element within ``ulps`` ulp of ``ref``; at most ``max_frac`` of them differ at all."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    o, r = out.double(), ref.double()
    tol = ulps * EPS[ref.dtype] * r.abs() + 1e-30
    bad = (o - r).abs() > tol
    assert not bad.any(), f"max diff {(o - r).abs().max().item():.3g} beyond {ulps} ulp"
    frac = (out != ref).double().mean().item()
    assert frac <= max_frac, f"{frac:.4f} of elements differ from the reference"


def _rel_err(a: torch.Tensor, ref64: torch.Tensor) -> float:
    return ((a.double() - ref64).abs().max() / ref64.abs().max().clamp_min(1e-30)).item()


def _inputs(rows, n, dtype, device, residual: bool, wdtype=None):
    x = torch.randn(rows, n, dtype=dtype, device=device)
    w = (1 + 0.2 * torch.randn(n, device=device)).to(wdtype or dtype)
    r = torch.randn(rows, n, dtype=dtype, device=device) if residual else None
    return x, w, r


def _ulps(dtype: torch.dtype) -> float:
    """fp32: a few ulp. Half types: a last-bit change of 1/rms can flip the rounding of the
    normalized value (Meta rounds it before the weight multiply), and the product with the
    weight can carry that to 2 ulp of the output; such elements are rare (see _frac)."""
    return 4 if dtype == torch.float32 else 2


def _frac(dtype: torch.dtype) -> float:
    return 1.0 if dtype == torch.float32 else 0.01


# ----------------------------------------------------------------------------------------------
# forward


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 1000, 4097])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("cast", ["meta", "fp32"])
def test_forward_matches_reference(device, dtype, n, residual, cast):
    x, w, r = _inputs(3, n, dtype, device, residual)
    out = rms_norm(x, w, 1e-6, r, cast)
    ref = rms_norm_reference(x, w, 1e-6, r, cast)
    if residual:
        (y, h), (y_ref, h_ref) = out, ref
        assert torch.equal(h, h_ref)  # x + residual rounded to x's dtype, exactly
    else:
        y, y_ref = out, ref
    _assert_close_ulp(y, y_ref, _ulps(dtype), _frac(dtype))


@pytest.mark.filterwarnings("ignore:divide by zero", "ignore:invalid value")  # padded tile rows
def test_forward_leading_dims_and_eps(device):
    x = torch.randn(2, 3, 5, 96, device=device, dtype=torch.bfloat16) * 1e-3
    w = torch.randn(96, device=device, dtype=torch.bfloat16)
    for eps in (1e-6, 1e-5, 0.0):
        y = rms_norm(x, w, eps)
        assert y.shape == x.shape
        _assert_close_ulp(y, rms_norm_reference(x, w, eps), 2, 0.01)


def test_meta_and_fp32_cast_differ_as_documented(device):
    """Meta rounds the normalized row before the weight multiply; fp32 rounds once."""
    x, w, _ = _inputs(8, 512, torch.bfloat16, device, False)
    meta, fp32 = rms_norm(x, w, cast="meta"), rms_norm(x, w, cast="fp32")
    assert not torch.equal(meta, fp32)
    n = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    _assert_close_ulp(fp32, (w.float() * n).bfloat16(), 1, 0.01)
    _assert_close_ulp(meta, (n.bfloat16().float() * w.float()).bfloat16(), 2, 0.01)


@pytest.mark.parametrize(
    "xdtype,wdtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]
)
@pytest.mark.parametrize("cast", ["meta", "fp32"])
def test_mixed_weight_dtype_promotes_like_pytorch(device, xdtype, wdtype, cast):
    """Output dtype = promote_types(x, weight): bf16 x with an fp32 weight gives fp32."""
    x, w, r = _inputs(4, 320, xdtype, device, True, wdtype=wdtype)
    y, h = rms_norm(x, w, 1e-6, r, cast)
    y_ref, h_ref = rms_norm_reference(x, w, 1e-6, r, cast)
    assert y.dtype == torch.float32 == y_ref.dtype and h.dtype == xdtype
    assert torch.equal(h, h_ref)
    _assert_close_ulp(y, y_ref, 4, 1.0)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_column_loop_path(device, dtype, residual, monkeypatch):
    """Rows wider than one block loop over column blocks (forced small block here)."""
    x, w, r = _inputs(5, 300, dtype, device, residual)
    monkeypatch.setattr(rmsnorm, "_TUNE", {"BLOCK_N": 128})
    y, h, _ = rms_norm_forward(x, w, 1e-6, r)
    ref = rms_norm_reference(x, w, 1e-6, r)
    y_ref = ref[0] if residual else ref
    _assert_close_ulp(y, y_ref, _ulps(dtype), _frac(dtype))
    if residual:
        assert torch.equal(h, ref[1])


def test_column_chunks_cover_rows_with_little_padding():
    """Non-power-of-2 widths split into at most three power-of-2 chunks, largest first."""
    assert column_chunks(5120) == (4096, 1024, 0)
    assert column_chunks(6656) == (4096, 2048, 512)
    assert column_chunks(4096) == (4096, 0, 0)
    assert column_chunks(100) == (128, 0, 0)
    for n in range(1, 16385, 37):
        c = column_chunks(n)
        assert sum(c) >= n and all(x == 0 or x & (x - 1) == 0 for x in c)
        assert list(c) == sorted(c, reverse=True)
        assert sum(c) < 2 * n + 256


def test_forward_layout_loops_three_chunk_rows_without_residual():
    """6656 without residual loops over 2048-column blocks (measured faster); with the residual,
    and rows of one or two chunks, the row stays in registers; explicit block_n wins."""
    assert _fwd_layout(6656, None, False) == ((LOOPED_THREE_CHUNK_BLOCK, 0, 0), False)
    assert _fwd_layout(6656, None, True) == ((4096, 2048, 512), True)
    assert _fwd_layout(5120, None, False) == ((4096, 1024, 0), True)
    assert _fwd_layout(4096, None, False) == ((4096, 0, 0), True)
    assert _fwd_layout(6656, 8192, False) == ((8192, 0, 0), True)


@pytest.mark.parametrize("n", [5120, 6656, 4097])
@pytest.mark.parametrize("residual", [False, True])
def test_chunked_rows_forward_and_backward(device, n, residual):
    """Rows held as 2 or 3 column chunks (LLaMA-13B/30B widths; 6656 without residual takes
    the column loop): forward, and gradients through autograd and through the backward
    launcher (which holds these rows in one padded block)."""
    x, w, r = _inputs(3, n, torch.bfloat16, device, residual)
    out, ref = rms_norm(x, w, 1e-6, r), rms_norm_reference(x, w, 1e-6, r)
    if residual:
        assert torch.equal(out[1], ref[1])
        out, ref = out[0], ref[0]
    _assert_close_ulp(out, ref, 2, 0.01)
    _grads_vs_fp64(x, w, r, "meta", torch.bfloat16)
    # the backward launcher on its own against fp64 autograd
    h = x + r if residual else x
    _, _, rstd = rms_norm_forward(h, w, 1e-6, store_rstd=True)
    dy = torch.randn_like(x)
    dx, _, dw = rms_norm_backward(dy, h, w, rstd)
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    (rms_norm_reference(h64, w64, 1e-6) * dy.double()).sum().backward()
    assert _rel_err(dx, h64.grad) < GRAD_TOL[torch.bfloat16]
    assert _rel_err(dw, w64.grad) < GRAD_TOL[torch.bfloat16]


def test_widest_row_uses_column_loop(device):
    n = MAX_SINGLE_BLOCK + 3000
    x, w, r = _inputs(2, n, torch.bfloat16, device, True)
    y, h = rms_norm(x, w, 1e-6, r)
    y_ref, h_ref = rms_norm_reference(x, w, 1e-6, r)
    assert torch.equal(h, h_ref)
    _assert_close_ulp(y, y_ref, 2, 0.01)


@pytest.mark.parametrize("block_m", [1, 2, 4])
@pytest.mark.parametrize("n", [200, 1280])
def test_row_tiles(device, block_m, n, monkeypatch):
    """One row per program (1-D vectors) or several (a 2-D tile, partial last tile); 1280
    columns are held as two chunks (1024 + 256); rstd is stored as the backward needs it."""
    x, w, r = _inputs(7, n, torch.float16, device, True)
    monkeypatch.setattr(rmsnorm, "_TUNE", {"BLOCK_M": block_m})
    y, h, rstd = rms_norm_forward(x, w, 1e-6, r, store_rstd=True)
    y_ref, h_ref = rms_norm_reference(x, w, 1e-6, r)
    assert torch.equal(h, h_ref)
    _assert_close_ulp(y, y_ref, 2, 0.01)
    want = torch.rsqrt(h_ref.float().pow(2).mean(-1) + 1e-6)
    torch.testing.assert_close(rstd, want, rtol=1e-5, atol=0)


def test_non_contiguous_rows(device):
    """Row slices of wider tensors run in place: the row stride is a kernel argument."""
    base = torch.randn(2, 6, 200, device=device, dtype=torch.bfloat16)
    x = base[:, :, :136]  # padded rows
    rbase = torch.randn(24, 300, device=device, dtype=torch.bfloat16)
    r = rbase[::2, 50:186].view(2, 6, 136)  # every other row, offset columns
    w = torch.randn(136, device=device, dtype=torch.bfloat16)
    assert not x.is_contiguous() and not r.is_contiguous()
    y, h = rms_norm(x, w, 1e-6, r)
    y_ref, h_ref = rms_norm_reference(x, w, 1e-6, r)
    assert torch.equal(h, h_ref)
    _assert_close_ulp(y, y_ref, 2, 0.01)


def test_empty_rows(device):
    x = torch.randn(0, 64, device=device)
    w = torch.ones(64, device=device)
    assert rms_norm(x, w).shape == (0, 64)


# ----------------------------------------------------------------------------------------------
# backward


def _grads_vs_fp64(x, w, r, cast, dtype, use_h: bool = True):
    """Gradients of <y, dy> (+ <h, dh>) from the kernel and from fp64 autograd on the reference."""
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    r = r.clone().requires_grad_() if r is not None else None
    out = rms_norm(x, w, 1e-6, r, cast)
    y = out[0] if r is not None else out
    torch.manual_seed(1)
    dy = torch.randn_like(y)
    dh = torch.randn_like(x) if r is not None and use_h else None
    loss = (y.float() * dy.float()).sum()
    if dh is not None:
        loss = loss + (out[1].float() * dh.float()).sum()
    loss.backward()

    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    r64 = r.detach().double().requires_grad_() if r is not None else None
    out64 = rms_norm_reference(x64, w64, 1e-6, r64, cast)
    y64 = out64[0] if r is not None else out64
    loss64 = (y64 * dy.double()).sum()
    if dh is not None:
        loss64 = loss64 + (out64[1] * dh.double()).sum()
    loss64.backward()
    tol = GRAD_TOL[dtype]
    assert x.grad.dtype == x.dtype and w.grad.dtype == w.dtype
    assert _rel_err(x.grad, x64.grad) < tol
    assert _rel_err(w.grad, w64.grad) < tol
    if r is not None:
        assert r.grad.dtype == r.dtype
        assert torch.equal(r.grad, x.grad)  # d(x + r) flows equally to both
    return x.grad, w.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("cast", ["meta", "fp32"])
def test_backward_matches_fp64_autograd(device, dtype, residual, cast):
    x, w, r = _inputs(6, 1000, dtype, device, residual)
    _grads_vs_fp64(x, w, r, cast, dtype)


@pytest.mark.parametrize("residual", [False, True])
def test_backward_column_loop_and_uneven_programs(device, residual, monkeypatch):
    """Column-block backward (forced small block) with rows not divisible by programs."""
    dtype = torch.float32
    x, w, r = _inputs(7, 300, dtype, device, residual)
    h = x + r if residual else x
    monkeypatch.setattr(rmsnorm, "_TUNE", {"BLOCK_N": 128, "PROGRAMS": 3})
    _, _, rstd = rms_norm_forward(x, w, 1e-6, r, store_rstd=True)
    dy = torch.randn_like(x)
    dh_out = torch.randn_like(x) if residual else None
    dx, dr, dw = rms_norm_backward(dy, h, w, rstd, dh_out, need_dr=residual)
    h64 = h.double().requires_grad_()
    w64 = w.double().requires_grad_()
    y64 = rms_norm_reference(h64, w64, 1e-6)
    loss = (y64 * dy.double()).sum() + ((h64 * dh_out.double()).sum() if residual else 0)
    loss.backward()
    assert _rel_err(dx, h64.grad) < 1e-5
    assert _rel_err(dw, w64.grad) < 1e-5
    if residual:
        assert torch.equal(dr, dx)
    # Same result through the single-block path with another program count.
    for block_m, programs in ((1, 2), (2, 3), (4, 5)):
        monkeypatch.setattr(rmsnorm, "_TUNE", {"BLOCK_M": block_m, "PROGRAMS": programs})
        dx1, _, dw1 = rms_norm_backward(dy, h, w, rstd, dh_out)
        assert _rel_err(dx1, h64.grad) < 1e-5 and _rel_err(dw1, w64.grad) < 1e-5


def test_backward_is_deterministic(device):
    x, w, r = _inputs(9, 256, torch.bfloat16, device, True)
    g1 = _grads_vs_fp64(x, w, r, "meta", torch.bfloat16)
    g2 = _grads_vs_fp64(x, w, r, "meta", torch.bfloat16)
    assert torch.equal(g1[0], g2[0]) and torch.equal(g1[1], g2[1])


def test_backward_mixed_dtypes_and_partial_grads(device):
    x, w, r = _inputs(4, 128, torch.bfloat16, device, True, wdtype=torch.float32)
    r.requires_grad_()
    y, h = rms_norm(x, w, 1e-6, r)  # only the residual needs a gradient
    (y.sum() + h.sum()).backward()  # broadcast (stride-0) incoming gradients
    r64 = r.detach().double().requires_grad_()
    y64, h64 = rms_norm_reference(x.double(), w.double(), 1e-6, r64)
    (y64.sum() + h64.sum()).backward()
    assert r.grad.dtype == torch.bfloat16
    assert _rel_err(r.grad, r64.grad) < GRAD_TOL[torch.bfloat16]


def test_backward_only_h_used(device):
    x, w, r = _inputs(3, 64, torch.float32, device, True)
    x.requires_grad_()
    _, h = rms_norm(x, w, 1e-6, r)
    h.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_no_grad_path_matches_autograd_path(device):
    x, w, r = _inputs(3, 64, torch.float16, device, True)
    y0, h0 = rms_norm(x, w, 1e-6, r)
    y1, h1 = rms_norm(x.requires_grad_(), w, 1e-6, r)
    assert torch.equal(y0, y1) and torch.equal(h0, h1)


# ----------------------------------------------------------------------------------------------
# bad input


def test_bad_inputs_raise_clear_errors(device, monkeypatch):
    x = torch.randn(2, 64, device=device)
    w = torch.ones(64, device=device)
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(x, torch.ones(63, device=device))
    with pytest.raises(TypeError, match="x must have dtype"):
        rms_norm(x.double(), w)
    with pytest.raises(TypeError, match="weight must have dtype"):
        rms_norm(x, w.to(torch.int32))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        rms_norm([1.0], w)
    with pytest.raises(ValueError, match="residual must have the shape"):
        rms_norm(x, w, residual=torch.randn(3, 64, device=device))
    with pytest.raises(TypeError, match="residual must have the dtype"):
        rms_norm(x, w, residual=x.half())
    with pytest.raises(ValueError, match="cast must be one of"):
        rms_norm(x, w, cast="hf")
    with pytest.raises(ValueError, match="eps must be"):
        rms_norm(x, w, eps=-1.0)
    with pytest.raises(ValueError, match="unit-stride"):
        rms_norm(torch.randn(64, 2, device=device).t(), w)
    with pytest.raises(ValueError, match="cannot be viewed"):
        rms_norm(torch.randn(4, 6, 64, device=device)[:, :3], w)
    with pytest.raises(ValueError, match=r"x last dim must be in \[1, 65536\]"):
        rms_norm(torch.randn(1, 65537, device=device), torch.ones(65537, device=device))


def test_cpu_tensor_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        rms_norm(torch.randn(2, 64), torch.ones(64))


# ----------------------------------------------------------------------------------------------
# GPU: LLaMA shapes


@pytest.mark.gpu
@pytest.mark.parametrize("n", [4096, 5120, 6656, 8192, 65536])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_gpu_llama_widths_forward(n, dtype, residual):
    rows = 64 if n == 65536 else 512
    x, w, r = _inputs(rows, n, dtype, "cuda", residual)
    out = rms_norm(x, w, 1e-6, r)
    ref = rms_norm_reference(x, w, 1e-6, r)
    if residual:
        assert torch.equal(out[1], ref[1])
        out, ref = out[0], ref[0]
    _assert_close_ulp(out, ref, _ulps(dtype), 1.0 if dtype == torch.float32 else 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [4096, 5120, 6656, 8192, 20000])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_gpu_llama_widths_backward(n, dtype, residual):
    x, w, r = _inputs(1031, n, dtype, "cuda", residual)  # rows not a multiple of programs
    g1 = _grads_vs_fp64(x, w, r, "meta", dtype)
    g2 = _grads_vs_fp64(x, w, r, "meta", dtype)
    assert torch.equal(g1[0], g2[0]) and torch.equal(g1[1], g2[1])  # deterministic
