"""``apply_rope_qkv_``'s write into an e4m3 KV cache (``kv_cache="fp8"``): each (token, KV
head) row quantized with one fp32 scale ``amax / 448``, kernel against its reference (the same
rule: ``quantize_rows_reference`` of the fp32 values) and against fp64 truth within e4m3's
rounding; odd sizes, partial rotary, strided qkv rows, every qkv dtype; bad scales refused."""

from __future__ import annotations

import pytest
import torch
from test_rope_qkv import expected_qkv, make_qkv

from nakta_model.kernels.fp8_quant import FP8_DTYPE
from nakta_model.kernels.rope import apply_rope_qkv_, apply_rope_qkv_reference, build_rope_cache


def _truth(x, pos, cos, sin, nq, nkv, hd, interleaved, rotary_dim):
    """fp64 heads ``[tokens, nq + 2 nkv, hd]``: Q and K rotated from ``x``, V as read."""
    x64 = x.double()
    return expected_qkv(x64, pos, cos, sin, nq, nkv, hd, interleaved, rotary_dim).unflatten(
        1, (nq + 2 * nkv, hd)
    )


def _caches(slots_n, nkv, hd, device):
    k = torch.zeros(slots_n, nkv, hd, dtype=FP8_DTYPE, device=device)
    ks = torch.full((slots_n, nkv), -1.0, device=device)
    return k, k.clone(), ks, ks.clone()


def _run(fn, qkv, pos, cos, sin, nq, nkv, hd, interleaved, rotary_dim, slots, n_slots):
    kc, vc, ks, vs = _caches(n_slots, nkv, hd, qkv.device)
    fn(
        qkv, pos, cos, sin, nq, nkv, hd, interleaved=interleaved, rotary_dim=rotary_dim,
        k_cache=kc, v_cache=vc, cache_slots=slots, k_scale=ks, v_scale=vs,
    )  # fmt: skip
    return kc, vc, ks, vs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(("hd", "rotary_dim"), [(32, None), (40, 24)])
def test_fp8_cache_write_matches_reference_and_truth(dtype, interleaved, hd, rotary_dim, device):
    torch.manual_seed(3)
    nq, nkv, tokens, n_slots = 6, 2, 7, 21
    cos, sin = build_rope_cache(64, rotary_dim or hd, device=device)
    qkv, _ = make_qkv(tokens, nq, nkv, hd, dtype, device, row_pad=5)  # strided rows
    qkv[2, nq * hd : (nq + 1) * hd] = 0  # an all-zero K row: finite scale, zero codes
    qkv[4] *= 40  # a large token
    pos = torch.randint(0, 64, (tokens,), device=device)
    slots = torch.tensor([0, 3, 8, 20, 15, 5, 11], device=device)
    qkv_ref, orig = qkv.clone(), qkv.clone()
    got = _run(apply_rope_qkv_, qkv, pos, cos, sin, nq, nkv, hd, interleaved, rotary_dim, slots,
               n_slots)  # fmt: skip
    want = _run(apply_rope_qkv_reference, qkv_ref, pos, cos, sin, nq, nkv, hd, interleaved,
                rotary_dim, slots, n_slots)  # fmt: skip
    torch.testing.assert_close(qkv, qkv_ref)
    kc, vc, ks, vs = got
    # the kernel's codes and scales are the reference's (one e4m3 step where the fp32 rotation
    # rounded the other way at a midpoint)
    for a, b in ((kc, want[0]), (vc, want[1])):
        diff = (a.float() - b.float()).abs()
        assert (diff > 0).float().mean() < 0.01
        assert (diff <= b.float().abs() / 8 + 2**-9).all()
    torch.testing.assert_close(ks, want[2], rtol=1e-6, atol=0)
    torch.testing.assert_close(vs, want[3], rtol=0, atol=0)
    untouched = torch.ones(n_slots, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert (ks[untouched] == -1).all() and not kc[untouched].float().any()
    # against fp64 truth: K rotated from the input, V as read, within e4m3's half step
    h = _truth(orig, pos, cos, sin, nq, nkv, hd, interleaved, rotary_dim)
    for cache, scale, ref in ((kc, ks, h[:, nq : nq + nkv]), (vc, vs, h[:, nq + nkv :])):
        deq = cache[slots].double() * scale[slots].double()[..., None]
        amax = ref.abs().amax(-1, keepdim=True)
        assert torch.allclose(scale[slots].double(), amax[..., 0] / 448, rtol=2e-2, atol=1e-12)
        assert ((deq - ref).abs() <= ref.abs() / 15 + amax * 2**-9 + 1e-3 * amax).all()
    assert not kc[slots[2], 0].float().any() and torch.isfinite(ks).all()


def test_bf16_cache_write_unchanged_by_the_fp8_path(device):
    """A cache in qkv's dtype takes no scales and is written as before."""
    nq, nkv, hd = 4, 2, 16
    cos, sin = build_rope_cache(16, hd, device=device)
    qkv, _ = make_qkv(3, nq, nkv, hd, torch.float32, device)
    pos, slots = torch.tensor([1, 2, 3], device=device), torch.tensor([0, 1, 2], device=device)
    kc = torch.zeros(3, nkv, hd, device=device)
    vc = torch.zeros_like(kc)
    apply_rope_qkv_(qkv, pos, cos, sin, nq, nkv, hd, interleaved=False, k_cache=kc, v_cache=vc,
                    cache_slots=slots)  # fmt: skip
    assert torch.equal(kc, qkv.unflatten(1, (nq + 2 * nkv, hd))[:, nq : nq + nkv])
    with pytest.raises(ValueError, match="k_scale and v_scale go with an e4m3"):
        apply_rope_qkv_(qkv, pos, cos, sin, nq, nkv, hd, interleaved=False, k_cache=kc,
                        v_cache=vc, cache_slots=slots, k_scale=torch.zeros(3, nkv))  # fmt: skip


@pytest.mark.parametrize("fn", [apply_rope_qkv_, apply_rope_qkv_reference])
def test_fp8_cache_bad_scales_raise(fn, device):
    nq, nkv, hd = 2, 1, 8
    cos, sin = build_rope_cache(8, hd, device=device)
    qkv, _ = make_qkv(2, nq, nkv, hd, torch.float32, device)
    pos = slots = torch.tensor([0, 1], device=device)
    kc, vc, ks, vs = _caches(4, nkv, hd, device)
    kw = dict(interleaved=False, k_cache=kc, v_cache=vc, cache_slots=slots)
    with pytest.raises(ValueError, match="an e4m3 cache needs k_scale"):
        fn(qkv, pos, cos, sin, nq, nkv, hd, **kw)
    with pytest.raises(ValueError, match=r"k_scale must be a fp32 \[num_slots=4, n_kv_heads=1\]"):
        fn(qkv, pos, cos, sin, nq, nkv, hd, **kw, k_scale=ks[:3], v_scale=vs)
    with pytest.raises(TypeError, match="v_scale must have dtype"):
        fn(qkv, pos, cos, sin, nq, nkv, hd, **kw, k_scale=ks, v_scale=vs.double())
    with pytest.raises(TypeError, match="k_cache and v_cache must have one dtype"):
        fn(qkv, pos, cos, sin, nq, nkv, hd, **{**kw, "v_cache": vc.float()}, k_scale=ks,
           v_scale=vs)  # fmt: skip
