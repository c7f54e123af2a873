"""``packed_attention``'s cached prefixes read from e4m3 pools (``kv_cache="fp8"``: prefill
continuing from cached pages): codes with one fp32 scale per (slot, KV head), dequantized in
registers. Against the fp64 loop over the dequantized prefix (``naive_with_prefix``) and the
module's reference; fp32 / bf16 / fp16, GQA, with a window; bad scales refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_packed_attention import TOL, naive_with_prefix, prefix_case

from nakta_model.kernels.fp8_quant import FP8_DTYPE, quantize_rows_reference
from nakta_model.kernels.packed_attention import packed_attention, packed_attention_reference


def fp8_prefix(prefix):
    """The same prefix with its pools quantized per (slot, KV head)."""
    qk, qv = quantize_rows_reference(prefix.k_pool), quantize_rows_reference(prefix.v_pool)
    shape, rows = prefix.k_pool.shape, prefix.k_pool.shape[:2]
    return dataclasses.replace(
        prefix, k_pool=qk.q.view(shape), v_pool=qv.q.view(shape), k_scale=qk.scale.view(rows),
        v_scale=qv.scale.view(rows),
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("hq", "hkv", "hd"), [(2, 1, 16), (6, 2, 24)])
def test_fp8_prefix_pages(dtype, hq, hkv, hd):
    qkv, seq_start, span_end, prefix = prefix_case(hq, hkv, hd, dtype, seed=2)
    p8 = fp8_prefix(prefix)
    got = packed_attention(qkv, seq_start, span_end, hq, hkv, hd, prefix=p8)
    want = naive_with_prefix(qkv, seq_start, span_end, p8, hq, hkv, hd)  # dequantized prefix
    assert (got.double() - want).norm() / want.norm() < TOL[dtype]
    ref = packed_attention_reference(qkv, seq_start, span_end, hq, hkv, hd, prefix=p8)
    assert (ref.double() - want).norm() / want.norm() < TOL[dtype]
    # quantization error against the unquantized prefix: small, but there
    full = naive_with_prefix(qkv, seq_start, span_end, prefix, hq, hkv, hd)
    rel = ((got.double() - full).norm() / full.norm()).item()
    assert rel < 0.05, rel
    none = prefix.token_entry == -1  # rows without a prefix: the plain kernel's bits
    plain = packed_attention(qkv, seq_start, span_end, hq, hkv, hd)
    torch.testing.assert_close(got[none], plain[none], rtol=0, atol=0)


def test_fp8_prefix_with_window():
    hq, hkv, hd = 4, 2, 16
    qkv, seq_start, span_end, prefix = prefix_case(hq, hkv, hd, torch.bfloat16, seed=4)
    p8 = fp8_prefix(prefix)
    # positions: the prefix's length plus the depth in the sequence (span_end None: causal)
    entry = p8.token_entry.long()
    plen = torch.where(entry >= 0, p8.lengths.long()[entry.clamp(min=0)], 0)
    pos = (plen + torch.arange(qkv.shape[0]) - seq_start.long()).to(torch.int32)
    kw = dict(prefix=p8, window=30, positions=pos)
    got = packed_attention(qkv, seq_start, None, hq, hkv, hd, **kw)
    ref = packed_attention_reference(qkv, seq_start, None, hq, hkv, hd, **kw)
    assert (got.float() - ref.float()).norm() / ref.float().norm() < TOL[torch.bfloat16]


def test_fp8_prefix_scales_are_checked():
    qkv, seq_start, span_end, prefix = prefix_case()
    p8 = fp8_prefix(prefix)
    assert p8.k_pool.dtype == FP8_DTYPE
    args = (qkv, seq_start, span_end, 2, 1, 16)
    for fn in (packed_attention, packed_attention_reference):
        with pytest.raises(ValueError, match="e4m3 pools need prefix.k_scale"):
            fn(*args, prefix=dataclasses.replace(p8, k_scale=None))
        with pytest.raises(ValueError, match=r"prefix.v_scale must be fp32 \[slots=256, 1\]"):
            fn(*args, prefix=dataclasses.replace(p8, v_scale=p8.v_scale[:3]))
        with pytest.raises(ValueError, match="go with e4m3 pools"):
            fn(*args, prefix=dataclasses.replace(prefix, k_scale=p8.k_scale))
        with pytest.raises(TypeError, match="must have one dtype"):
            fn(*args, prefix=dataclasses.replace(p8, v_pool=prefix.v_pool))
