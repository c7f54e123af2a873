"""``decode_attention`` over e4m3 KV caches (``kv_cache="fp8"``): codes plus one fp32 scale
per (key, KV head), dequantized in registers. The kernel against its reference (which
dequantizes first, then the fp32 softmax) with ``test_decode_attention.py``'s tolerances, in the
row form, paged, through the cascade over held prefixes, with a sliding window; fp32 / fp16 /
bf16 queries, GQA and MHA, one split and several. The quantization's own error is judged
against the unquantized cache (a loose bound: e4m3 keeps 3 mantissa bits)."""

from __future__ import annotations

import pytest
import torch
from test_decode_attention import assert_matches_reference
from test_decode_attention_paged import _cascade_case, paged_case

from nakta_model.kernels.decode_attention import decode_attention, decode_attention_reference
from nakta_model.kernels.fp8_quant import FP8_DTYPE, quantize_rows_reference


def quantized(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes of ``cache [P, page, n_kv, hd]`` and their scales ``[P, page, n_kv]``."""
    qr = quantize_rows_reference(cache)
    return qr.q.view(cache.shape), qr.scale.view(cache.shape[:3])


def dequantized(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale[..., None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("n_q", "n_kv", "batch", "n_splits"), [(6, 2, 3, 1), (4, 4, 4, 3)])
@pytest.mark.parametrize("window", [None, 70])
def test_paged_fp8_matches_reference(dtype, n_q, n_kv, batch, n_splits, window):
    q, k, v, table, lens = paged_case(batch, n_q, n_kv, dtype, hd=24)
    (kc, ks), (vc, vs) = quantized(k), quantized(v)
    kw = dict(block_table=table, window=window, k_scale=ks, v_scale=vs)
    got = decode_attention(q, kc, vc, lens, n_splits=n_splits, **kw)
    ref = decode_attention_reference(q, kc, vc, lens, **kw)
    assert_matches_reference(got, ref, dequantized(vc, vs))
    # against the unquantized cache: e4m3's relative step is 1/16 at worst, 1/32 on average
    full = decode_attention_reference(q, k, v, lens, block_table=table, window=window)
    err = (got.float() - full.float()).abs().max().item()
    assert err < 0.15, err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 120])
def test_cascade_fp8_matches_reference(dtype, n_splits, window):
    q, k, v, lens, slots, kw = _cascade_case(7, 8, 2, dtype)
    (kc, ks), (vc, vs) = quantized(k), quantized(v)
    kw = dict(kw, window=window, k_scale=ks, v_scale=vs)
    got = decode_attention(q, kc, vc, lens, n_splits=n_splits, prefix_slots=slots, **kw)
    ref = decode_attention_reference(q, kc, vc, lens, prefix_slots=slots, **kw)
    plain = decode_attention(
        q, kc, vc, lens, n_splits=n_splits, block_table=kw["block_table"], window=window,
        k_scale=ks, v_scale=vs,
    )  # fmt: skip
    vd = dequantized(vc, vs)
    assert_matches_reference(got, ref, vd)
    assert_matches_reference(plain, ref, vd)


def test_row_form_with_prefix_rows_fp8():
    """The row form (one page a row) reading a shared prefix row in place, odd S_max."""
    g = torch.Generator().manual_seed(4)
    k = torch.randn(5, 37, 2, 16, generator=g).to(torch.bfloat16)
    v = torch.randn(5, 37, 2, 16, generator=g).to(torch.bfloat16)
    q = torch.randn(3, 4, 16, generator=g).to(torch.bfloat16)
    (kc, ks), (vc, vs) = quantized(k), quantized(v)
    lens = torch.tensor([37, 1, 20])
    kw = dict(
        rows=torch.tensor([4, 0, 2], dtype=torch.int32),
        prefix_rows=torch.tensor([1, 1, 3], dtype=torch.int32),
        prefix_lens=torch.tensor([10, 0, 20], dtype=torch.int32), k_scale=ks, v_scale=vs,
    )  # fmt: skip
    got = decode_attention(q, kc, vc, lens, n_splits=2, **kw)
    ref = decode_attention_reference(q, kc, vc, lens, **kw)
    assert_matches_reference(got, ref, dequantized(vc, vs))


@pytest.mark.parametrize("fn", [decode_attention, decode_attention_reference])
def test_fp8_scales_are_checked(fn):
    q, k, v, table, lens = paged_case(2, 4, 2, torch.bfloat16)
    (kc, ks), (vc, vs) = quantized(k), quantized(v)
    with pytest.raises(ValueError, match="e4m3 caches need k_scale"):
        fn(q, kc, vc, lens, block_table=table)
    with pytest.raises(ValueError, match=r"v_scale must be fp32 of shape \(11, 64, 2\)"):
        fn(q, kc, vc, lens, block_table=table, k_scale=ks, v_scale=vs[:, :3])
    with pytest.raises(TypeError, match="k_scale must have dtype"):
        fn(q, kc, vc, lens, block_table=table, k_scale=ks.half(), v_scale=vs)
    with pytest.raises(TypeError, match="k_cache and v_cache must have one dtype"):
        fn(q, kc, v, lens, block_table=table, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match="k_scale and v_scale go with e4m3"):
        fn(q, k, v, lens, block_table=table, k_scale=ks, v_scale=vs)
    assert kc.dtype == FP8_DTYPE
