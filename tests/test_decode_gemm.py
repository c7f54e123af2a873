"""``step_gemm.decode_gemm``: the decode step's linears as GEMMs with the fused RMSNorm / SwiGLU /
RoPE kernels around them, against ``decode_gemm_reference`` (plain PyTorch), against
``decode_linear_reference`` (the same rounding points: bit for bit in the reference chain) and
an fp64 computation; FP8 weights as W8A8 against the scorer's chain (quantizing norm / SwiGLU,
``fp8_matmul_reference``); the crossover rule and its overrides.

CPU runs use the Triton interpreter on tiny odd shapes (strided inputs from
``test_decode_linear.make_case``), with rows on both sides of ``decode_linear.MAX_BATCH``.
"""

from __future__ import annotations

import pytest
import torch
from test_decode_linear import (
    _padded,
    assert_matches_reference,
    assert_near_fp64,
    expected_fp64,
    make_case,
)

from nakta_model.generation import step_gemm as sg
from nakta_model.generation.step_gemm import decode_gemm, decode_gemm_reference
from nakta_model.kernels._checks import interpreter_enabled
from nakta_model.kernels.decode_linear import decode_linear_reference
from nakta_model.kernels.fp8_gemm import fp8_matmul_reference
from nakta_model.kernels.fp8_quant import QuantRows, quantize_rows_reference, quantize_weight
from nakta_model.kernels.rmsnorm import rms_norm_fp8_reference
from nakta_model.kernels.rope import apply_rope_qkv_reference
from nakta_model.kernels.swiglu import swiglu_fp8_reference

VARIANTS = ["plain", "norm", "residual", "norm_swiglu", "norm_rope"]


def _gemm_kw(kw: dict) -> dict:
    return {k: v for k, v in kw.items() if k != "out_dtype"}


CASES = [(v, torch.bfloat16, b) for v in VARIANTS for b in (3, 70)]
CASES += [(v, dt, 5) for v in VARIANTS for dt in (torch.float32, torch.float16)]


@pytest.mark.parametrize("variant, dtype, rows", CASES)
def test_blocks_match_reference_and_fp64(variant, dtype, rows, device):
    """Every block and dtype, rows below and above decode_linear's 64: kernels vs reference,
    the reference vs decode_linear_reference bit for bit (the same chain), both vs fp64."""
    x, w, kw, ref_kw = make_case(variant, rows, dtype, device)
    kw, ref_kw = _gemm_kw(kw), _gemm_kw(ref_kw)
    got = decode_gemm(x, w, **kw)
    ref = decode_gemm_reference(x, w, **ref_kw)
    assert not torch.isnan(got).any()
    if variant == "norm_rope" and interpreter_enabled():
        # the interpreter stores the rope kernel's fp32 -> bf16/fp16 by truncation (the GPU
        # rounds to nearest, as the reference): an ulp apart here
        torch.testing.assert_close(got, ref)
    else:
        assert_matches_reference(got, ref, dtype)
    assert_near_fp64(got, expected_fp64(x, w, kw), dtype)
    if variant == "norm_rope":
        r, rr = kw["rope"], ref_kw["rope"]
        for c, cr in ((r.k_cache, rr.k_cache), (r.v_cache, rr.v_cache)):
            torch.testing.assert_close(c, cr, equal_nan=True)  # untouched slots stay NaN
    if rows <= 64:  # (rope: writes the same K/V into the reference's caches again)
        want = decode_linear_reference(x, w, **ref_kw)
        assert torch.equal(ref, want)


def _fp8_case(variant: str, rows: int, dtype, device):
    x, w, kw, _ = make_case(variant, rows, dtype, device)
    q, s = quantize_weight(w)
    kw = _gemm_kw(kw)
    return x, q, s, kw


def _fp8_want(x, q, s, kw):
    """The scorer's W8A8 chain in plain PyTorch: quantizing norm (or quantize_rows), the exact
    fp32 FP8 GEMM, then the residual add / quantizing SwiGLU / rope."""
    dtype = x.dtype
    if kw.get("norm_weight") is not None:
        xq = rms_norm_fp8_reference(x, kw["norm_weight"], kw["eps"])
    else:
        xq = quantize_rows_reference(x)
    y = fp8_matmul_reference(xq.q, xq.scale, q, s, dtype)
    if kw.get("residual") is not None:
        return kw["residual"] + y
    if kw.get("swiglu"):
        return swiglu_fp8_reference(y)
    if kw.get("rope") is not None:
        r = kw["rope"]
        apply_rope_qkv_reference(
            y, r.positions, r.cos, r.sin, r.n_q_heads, r.n_kv_heads, r.head_dim,
            interleaved=True, k_cache=r.k_cache.clone(), v_cache=r.v_cache.clone(),
            cache_slots=r.cache_slots,
        )  # fmt: skip
        return y[:, : r.n_q_heads * r.head_dim]
    return y


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype, rows", [(torch.bfloat16, 67), (torch.float32, 4)])
def test_fp8_blocks_are_the_scorers_w8a8_chain(variant, dtype, rows, device):
    """FP8 weights: quantized activations and the exact FP8 GEMM (emulated off the GPU); the
    SwiGLU block hands back QuantRows, and a QuantRows x (w2's) is taken as is."""
    x, q, s, kw = _fp8_case(variant, rows, dtype, device)
    got = decode_gemm(x, q, weight_scale=s, **kw)
    ref = decode_gemm_reference(x, q, weight_scale=s, **kw)
    want = _fp8_want(x, q, s, kw)
    if variant == "norm_swiglu":
        assert isinstance(got, QuantRows) and isinstance(ref, QuantRows)
        assert torch.equal(ref.scale, want.scale) and torch.equal(ref.q, want.q)
        # the kernel path: an ulp of silu (fp32) or of the GEMM's sum may move an amax or a code
        torch.testing.assert_close(got.scale, want.scale, rtol=1e-5, atol=0)
        assert (got.q.float() != want.q.float()).float().mean() <= 0.02
        return
    assert torch.equal(ref, want)
    if variant == "norm_rope" and interpreter_enabled():  # truncating stores, see above
        torch.testing.assert_close(got, ref)
    else:
        assert_matches_reference(got, ref, dtype)


def test_quant_rows_input_with_residual_and_out_dtype(device):
    """w2 after the FP8 SwiGLU: QuantRows in, the residual's dtype out (or out_dtype given)."""
    dtype = torch.bfloat16
    x, q, s, kw = _fp8_case("residual", 6, dtype, device)
    xq = quantize_rows_reference(x)
    got = decode_gemm(xq, q, weight_scale=s, residual=kw["residual"])
    want = kw["residual"] + fp8_matmul_reference(xq.q, xq.scale, q, s, dtype)
    assert_matches_reference(got, want, dtype)
    plain = decode_gemm_reference(xq, q, weight_scale=s, out_dtype=dtype)
    assert torch.equal(plain, fp8_matmul_reference(xq.q, xq.scale, q, s, dtype))
    with pytest.raises(TypeError, match="out_dtype"):
        decode_gemm_reference(xq, q, weight_scale=s)
    with pytest.raises(ValueError, match="already normalized"):
        decode_gemm_reference(xq, q, weight_scale=s, out_dtype=dtype,
                              norm_weight=torch.ones(x.shape[1], dtype=dtype), eps=1e-5)  # fmt: skip
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        decode_gemm_reference(xq, q.to(dtype), out_dtype=dtype)


def test_bad_arguments_name_what_is_wrong():
    x = torch.randn(3, 8)
    w = torch.randn(5, 8)
    with pytest.raises(ValueError, match=r"1\.\.512 rows"):
        decode_gemm_reference(torch.randn(513, 8), w)
    with pytest.raises(ValueError, match="weight must have shape"):
        decode_gemm_reference(x, torch.randn(5, 7))
    with pytest.raises(TypeError, match="out_dtype"):
        decode_gemm_reference(x, w, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="exclusive"):
        decode_gemm_reference(x, w, residual=torch.randn(3, 5), swiglu=True)
    with pytest.raises(ValueError, match="weight_scale"):
        decode_gemm_reference(x, w, weight_scale=torch.ones(5))


def test_crossover_defaults_overrides_and_limits(monkeypatch):
    assert sg.crossover(torch.bfloat16) == sg.CROSSOVER["bfloat16"]
    assert sg.crossover(torch.bfloat16, "fp8") == sg.CROSSOVER["fp8"]
    assert sg.use_gemm(65, torch.float32) and not sg.use_gemm(1, torch.float32)
    monkeypatch.setattr(sg, "_TUNE", {"float32": 3, "fp8": 2})
    assert sg.crossover(torch.float32) == 3 and sg.crossover(torch.float16, "fp8") == 2
    assert sg.crossover(torch.float16) == sg.CROSSOVER["float16"]
    monkeypatch.setattr(sg, "_TUNE", {"bfloat16": 66})
    with pytest.raises(ValueError, match=r"\[1, 65\]"):
        sg.crossover(torch.bfloat16)


def test_rows_above_decode_linear_limit_are_rejected_there_not_here(device):
    """The reason the GEMM path exists: decode_linear stops at 64 rows."""
    x = _padded(65, 16, torch.float32, device)
    w = torch.randn(8, 16, device=device)
    with pytest.raises(ValueError, match=r"1\.\.64 rows"):
        decode_linear_reference(x, w)
    torch.testing.assert_close(decode_gemm(x, w), x @ w.T)
