"""FP8 KV cache on the GPU at LLaMA-7B's attention shape (32 heads of 128, 64-position pages):
the RoPE kernel's quantizing write and decode attention over e4m3 pages (paged, the cascade)
against their references, and the engine (CUDA graphs, bf16 weights) with an fp8 cache close
to the bf16 one. Run on the GPU machine: ``pytest -m gpu tests/test_kv_cache_fp8_gpu.py``."""

from __future__ import annotations

import pytest
import torch
from test_decode_attention import dequantized, quantized

from nakta_model.kernels.decode_attention import decode_attention, decode_attention_reference
from nakta_model.kernels.fp8_quant import FP8_DTYPE
from nakta_model.kernels.rope import apply_rope_qkv_, apply_rope_qkv_reference, build_rope_cache

pytestmark = pytest.mark.gpu
HQ, HKV, HD, PAGE = 32, 32, 128, 64


def test_rope_fp8_write_at_7b_shape():
    tokens, slots_n = 300, 4096
    cos, sin = build_rope_cache(4096, HD, device="cuda")
    qkv = torch.randn(tokens, (HQ + 2 * HKV) * HD, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 4096, (tokens,), device="cuda")
    slots = torch.randperm(slots_n, device="cuda")[:tokens]
    outs = []
    for fn in (apply_rope_qkv_, apply_rope_qkv_reference):
        kc = torch.zeros(slots_n, HKV, HD, dtype=FP8_DTYPE, device="cuda")
        vc, ks = kc.clone(), torch.zeros(slots_n, HKV, device="cuda")
        vs = ks.clone()
        fn(qkv.clone(), pos, cos, sin, HQ, HKV, HD, interleaved=True, k_cache=kc, v_cache=vc,
           cache_slots=slots, k_scale=ks, v_scale=vs)  # fmt: skip
        outs.append((kc, vc, ks, vs))
    (kc, vc, ks, vs), (rk, rv, rks, rvs) = outs
    torch.testing.assert_close(ks, rks, rtol=1e-6, atol=0)
    torch.testing.assert_close(vs, rvs, rtol=0, atol=0)
    for a, b in ((kc, rk), (vc, rv)):  # FMA in the GPU's rotation: a rare one-step difference
        diff = (a.float() - b.float()).abs()
        assert (diff > 0).float().mean() < 0.01
        assert (diff <= b.float().abs() / 8 + 2**-9).all()


@pytest.mark.parametrize("cascade", [False, True])
def test_decode_attention_fp8_at_7b_shape(cascade):
    """32 rows of ~4,000 keys (the long-context benchmark's shape) over e4m3 pages."""
    batch, width = 32, 64
    n_pages = batch * width + 8
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(n_pages, PAGE, HKV, HD, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(n_pages, PAGE, HKV, HD, device="cuda", generator=g).to(torch.bfloat16)
    (kc, ks), (vc, vs) = quantized(k), quantized(v)
    table = (1 + torch.arange(batch * width, device="cuda")).view(batch, width).to(torch.int32)
    lens = torch.randint(3900, width * PAGE + 1, (batch,), device="cuda", generator=g)
    kw = dict(block_table=table, k_scale=ks, v_scale=vs)
    if cascade:  # every row shares the first 12 pages (a 768-token prefix)
        table[:, :12] = table[0, :12]
        kw.update(
            block_table=table, prefix_rows=table[:, 0].clone(),
            prefix_lens=torch.full((batch,), 768, dtype=torch.int32, device="cuda"),
            prefix_slots=(table[:1, :12].contiguous(), torch.tensor([768], device="cuda")),
        )  # fmt: skip
    q = torch.randn(batch, HQ, HD, device="cuda", dtype=torch.bfloat16)
    got = decode_attention(q, kc, vc, lens, **kw)
    ref = decode_attention_reference(q, kc, vc, lens, **kw)
    err = (got.float() - ref.float()).abs().max().item()
    assert err < 1e-2 * dequantized(vc, vs).abs().max().item() + 2e-2, err


def test_engine_fp8_kv_close_to_bf16_on_gpu():
    from nakta_model.config import ModelArgs
    from nakta_model.generation import GenerationRequest, Generator
    from nakta_model.kv_pages import kv_pool
    from nakta_model.loading import random_model

    args = ModelArgs(dim=1024, n_layers=4, n_heads=8, n_kv_heads=8, vocab_size=512,
                     multiple_of=256, max_seq_len=1024)  # fmt: skip
    m = random_model(args, "cuda", torch.bfloat16, seed=3)
    reqs = [GenerationRequest([1 + i % 500 for i in range(n)], 32) for n in (7, 130, 600, 64)]
    out = {}
    for kv in ("bf16", "fp8"):
        gen = Generator(m, max_batch=8, max_seq_len=1024, kv_cache=kv)
        out[kv] = [r.tokens for r in gen.generate(reqs)]
        assert kv_pool(m).used_pages == 0
    # the first token comes from the prefill's own K/V (in registers, never the cache): equal
    assert all(x[0] == y[0] for x, y in zip(out["bf16"], out["fp8"])), out
    # Greedy sequences of a random model part for good at their first flip, so agreement is a
    # coarse measure: an H100 gives 74 of 128 tokens (58%), the same at fd779c1 and after the
    # merges that followed it; a wrong cache (scales, pages, the quantizing write) keeps only the
    # first token and chance after it (1/512 a token), far below the bound.
    same = sum(a == b for x, y in zip(out["bf16"], out["fp8"]) for a, b in zip(x, y))
    assert same >= 0.45 * 4 * 32, out
