"""The model's fused RoPE path: ``build_rope_cache``, ``apply_rope_qkv_`` and its reference.

The expected values are computed here in fp64 from the original input, independently of both
the kernel and ``apply_rope_qkv_reference``; both are checked against them with
``torch.testing.assert_close``'s default tolerances for the dtype.

Here too: the write into an e4m3 KV cache (``kv_cache="fp8"``) and Llama-3.1 RoPE scaling in the
cos/sin tables against Meta's and transformers' own code.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from nakta_model.config import META_LLAMA3_SCALING, PRESETS, ModelArgs, RopeScaling
from nakta_model.kernels import rope as rope_module
from nakta_model.kernels.fp8_quant import FP8_DTYPE
from nakta_model.kernels.rope import (
    apply_rope_qkv_,
    apply_rope_qkv_reference,
    build_rope_cache,
    rope_frequencies,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def expected_qkv(x, positions, cos, sin, nq, nkv, hd, interleaved, rotary_dim=None):
    """fp64 rotation of the Q and K heads of ``x`` (a copy), cast back to ``x.dtype``."""
    r = rotary_dim or hd
    h = x.double().unflatten(1, (nq + 2 * nkv, hd)).clone()
    c = cos.double()[positions.long()][:, None, :]
    s = sin.double()[positions.long()][:, None, :]
    part = h[:, : nq + nkv, :r]
    if interleaved:
        a, b = part[..., 0::2].clone(), part[..., 1::2].clone()
        part[..., 0::2] = a * c - b * s
        part[..., 1::2] = b * c + a * s
    else:
        a, b = part[..., : r // 2].clone(), part[..., r // 2 :].clone()
        part[..., : r // 2] = a * c - b * s
        part[..., r // 2 :] = b * c + a * s
    return h.flatten(1).to(x.dtype)


def make_qkv(tokens, nq, nkv, hd, dtype, device, row_pad=0):
    """A qkv matrix, optionally a view with a row stride larger than its width."""
    width = (nq + 2 * nkv) * hd
    base = torch.randn(tokens, width + row_pad, dtype=torch.float32, device=device).to(dtype)
    return base[:, :width], base


# ---------------------------------------------------------------------------- build_rope_cache


def test_build_rope_cache_formula():
    cos, sin = build_rope_cache(37, 10, base=500.0)
    assert cos.shape == sin.shape == (37, 5) and cos.dtype == sin.dtype == torch.float32
    p = torch.arange(37, dtype=torch.float64)[:, None]
    i = torch.arange(5, dtype=torch.float64)[None, :]
    ang = p * 500.0 ** (-2 * i / 10)
    torch.testing.assert_close(cos, torch.cos(ang).float(), rtol=0, atol=1e-7)
    torch.testing.assert_close(sin, torch.sin(ang).float(), rtol=0, atol=1e-7)


def test_build_rope_cache_accurate_near_2_pow_20():
    """fp32 angles would be off by up to ~0.06 rad here; fp64 angles round once."""
    n = (1 << 20) + 3
    cos, sin = build_rope_cache(n, 8)
    p = torch.arange(n - 5, n, dtype=torch.float64)[:, None]
    ang = p * 10000.0 ** (-2 * torch.arange(4, dtype=torch.float64)[None, :] / 8)
    assert (cos[-5:].double() - torch.cos(ang)).abs().max() < 1e-7
    assert (sin[-5:].double() - torch.sin(ang)).abs().max() < 1e-7


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_positions=0, rotary_dim=8), "max_positions"),
        (dict(max_positions=4, rotary_dim=7), "rotary_dim"),
        (dict(max_positions=4, rotary_dim=8, base=0.0), "base"),
    ],
)
def test_build_rope_cache_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_rope_cache(**kwargs)


# ---------------------------------------------------------------------------- forward


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_forward_matches_fp64(dtype, interleaved, head_dim, device):
    nq, nkv, tokens = 4, 2, 5
    cos, sin = build_rope_cache(64, head_dim, device=device)
    qkv, _ = make_qkv(tokens, nq, nkv, head_dim, dtype, device)
    pos = torch.randint(0, 64, (tokens,), device=device)
    want = expected_qkv(qkv, pos, cos, sin, nq, nkv, head_dim, interleaved)
    for fn in (apply_rope_qkv_, apply_rope_qkv_reference):
        x = qkv.clone()
        out = fn(x, pos, cos, sin, nq, nkv, head_dim, interleaved=interleaved)
        assert out is x  # in place
        torch.testing.assert_close(x, want)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("nq, nkv", [(8, 1), (6, 3), (4, 4)])
@pytest.mark.parametrize("rotary_dim", [16, 32])
def test_gqa_partial_rotary_strided_rows(interleaved, nq, nkv, rotary_dim, device):
    """GQA (incl. one KV head), partial rotary, rows wider than qkv: V, pass-through and the
    padding columns stay bit-identical."""
    hd, tokens = 32, 7
    cos, sin = build_rope_cache(40, rotary_dim, device=device)
    qkv, base = make_qkv(tokens, nq, nkv, hd, torch.bfloat16, device, row_pad=24)
    before = base.clone()
    pos = torch.randint(0, 40, (tokens,), dtype=torch.int32, device=device)
    want = expected_qkv(qkv, pos, cos, sin, nq, nkv, hd, interleaved, rotary_dim)
    apply_rope_qkv_(qkv, pos, cos, sin, nq, nkv, hd, interleaved=interleaved, rotary_dim=rotary_dim)
    torch.testing.assert_close(qkv, want)
    width = qkv.shape[1]
    assert torch.equal(base[:, width:], before[:, width:])
    h, h0 = qkv.unflatten(1, (nq + 2 * nkv, hd)), before[:, :width].unflatten(1, (nq + 2 * nkv, hd))
    assert torch.equal(h[:, nq + nkv :], h0[:, nq + nkv :])  # V
    assert torch.equal(h[:, :, rotary_dim:], h0[:, :, rotary_dim:])  # pass-through


def test_positions_near_2_pow_20(device):
    n = (1 << 20) + 16
    cos, sin = build_rope_cache(n, 16, device=device)
    nq, nkv, hd = 2, 1, 16
    pos = torch.tensor([n - 1, n - 2, (1 << 20) - 1, 1 << 20, 3], device=device)
    qkv, _ = make_qkv(5, nq, nkv, hd, torch.float32, device)
    want = expected_qkv(qkv, pos, cos, sin, nq, nkv, hd, True)
    apply_rope_qkv_(qkv, pos, cos, sin, nq, nkv, hd, interleaved=True)
    torch.testing.assert_close(qkv, want)


@pytest.mark.parametrize(
    "tune",
    [
        dict(BLOCK_M=4, TARGET=32),
        dict(BLOCK_M=1, TARGET=16, num_warps=2),
        dict(BLOCK_M=2, JOINT=True),
        dict(BLOCK_M=2, JOINT=False),
        dict(BLOCK_M=4, TARGET=32, HEADS_FASTEST=False),  # 2-D grid, tokens fastest
        dict(BLOCK_M=2, BLOCK_H=4, HEADS_FASTEST=True),  # 1-D grid, heads fastest
    ],
)
@pytest.mark.parametrize("interleaved", [False, True])
def test_block_configs(tune, interleaved, monkeypatch, device):
    """Token blocks that overhang the end and head blocks that straddle Q/K/V boundaries."""
    monkeypatch.setattr(rope_module, "_TUNE", tune)
    nq, nkv, hd, tokens, rd = 6, 3, 24, 7, 20  # rotary half 10: padded to 16
    cos, sin = build_rope_cache(30, rd, device=device)
    qkv, _ = make_qkv(tokens, nq, nkv, hd, torch.float32, device)
    pos = torch.randint(0, 30, (tokens,), device=device)
    want = expected_qkv(qkv, pos, cos, sin, nq, nkv, hd, interleaved, rd)
    k_cache = torch.zeros(tokens, nkv, hd, device=device)
    v_cache = torch.zeros(tokens, nkv, hd, device=device)
    slots = torch.randperm(tokens, device=device)
    apply_rope_qkv_(qkv, pos, cos, sin, nq, nkv, hd, interleaved=interleaved, rotary_dim=rd,
                    k_cache=k_cache, v_cache=v_cache, cache_slots=slots)  # fmt: skip
    torch.testing.assert_close(qkv, want)
    h = want.unflatten(1, (nq + 2 * nkv, hd))
    torch.testing.assert_close(k_cache[slots], h[:, nq : nq + nkv])
    torch.testing.assert_close(v_cache[slots], h[:, nq + nkv :])


# ---------------------------------------------------------------------------- cache writes


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [None, 16])
@pytest.mark.parametrize("fn", [apply_rope_qkv_, apply_rope_qkv_reference])
def test_cache_writes(interleaved, rotary_dim, fn, device):
    nq, nkv, hd, tokens, batch, max_seq = 4, 2, 32, 6, 2, 8
    cos, sin = build_rope_cache(32, rotary_dim or hd, device=device)
    qkv, _ = make_qkv(tokens, nq, nkv, hd, torch.float16, device)
    pos = torch.randint(0, 32, (tokens,), device=device)
    # The model's cache is [batch, max_seq, n_kv, head_dim]; the kernel sees slots.
    k_store = torch.zeros(batch, max_seq, nkv, hd, dtype=torch.float16, device=device)
    v_store = torch.zeros_like(k_store)
    slots = torch.tensor([0, 3, 8, 9, 15, 5], device=device)
    want = expected_qkv(qkv, pos, cos, sin, nq, nkv, hd, interleaved, rotary_dim)
    fn(
        qkv,
        pos,
        cos,
        sin,
        nq,
        nkv,
        hd,
        interleaved=interleaved,
        rotary_dim=rotary_dim,
        k_cache=k_store.view(-1, nkv, hd),
        v_cache=v_store.view(-1, nkv, hd),
        cache_slots=slots,
    )
    torch.testing.assert_close(qkv, want)
    h = want.unflatten(1, (nq + 2 * nkv, hd))
    k_flat, v_flat = k_store.view(-1, nkv, hd), v_store.view(-1, nkv, hd)
    assert torch.equal(k_flat[slots], qkv.unflatten(1, (nq + 2 * nkv, hd))[:, nq : nq + nkv])
    torch.testing.assert_close(k_flat[slots], h[:, nq : nq + nkv])
    assert torch.equal(v_flat[slots], h[:, nq + nkv :])
    untouched = torch.ones(batch * max_seq, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert not k_flat[untouched].any() and not v_flat[untouched].any()


def test_cache_strided_view(device):
    """Caches that are strided views (e.g. a head-major cache permuted) are written correctly."""
    nq, nkv, hd, tokens = 2, 2, 16, 4
    cos, sin = build_rope_cache(16, hd, device=device)
    qkv, _ = make_qkv(tokens, nq, nkv, hd, torch.float32, device)
    k_hm = torch.zeros(nkv, 10, hd, device=device)  # [heads, slots, hd] storage
    v_hm = torch.zeros(nkv, 10, hd, device=device)
    slots = torch.tensor([9, 1, 4, 2], device=device)
    pos = torch.arange(tokens, device=device)
    ref_k, ref_v = k_hm.clone(), v_hm.clone()
    x_ref = qkv.clone()
    apply_rope_qkv_reference(
        x_ref,
        pos,
        cos,
        sin,
        nq,
        nkv,
        hd,
        interleaved=False,
        k_cache=ref_k.transpose(0, 1),
        v_cache=ref_v.transpose(0, 1),
        cache_slots=slots,
    )
    apply_rope_qkv_(
        qkv,
        pos,
        cos,
        sin,
        nq,
        nkv,
        hd,
        interleaved=False,
        k_cache=k_hm.transpose(0, 1),
        v_cache=v_hm.transpose(0, 1),
        cache_slots=slots,
    )
    torch.testing.assert_close(k_hm, ref_k)
    torch.testing.assert_close(v_hm, ref_v)
    torch.testing.assert_close(qkv, x_ref)


# ---------------------------------------------------------------------------- backward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [None, 16])
@pytest.mark.parametrize("grad_kind", ["full", "expanded"])
def test_backward_matches_autograd_on_reference(dtype, interleaved, rotary_dim, grad_kind, device):
    nq, nkv, hd, tokens = 4, 1, 32, 6
    cos, sin = build_rope_cache(20, rotary_dim or hd, device=device)
    leaf = torch.randn(tokens, (nq + 2 * nkv) * hd + 8, device=device).to(dtype).requires_grad_()
    pos = torch.randint(0, 20, (tokens,), device=device)
    grads, outs = [], []
    for fn in (apply_rope_qkv_, apply_rope_qkv_reference):
        x = (leaf * 1)[:, 8:]  # a non-leaf view with a row stride wider than its width
        y = fn(x, pos, cos, sin, nq, nkv, hd, interleaved=interleaved, rotary_dim=rotary_dim)
        loss = y.sum() * 2 if grad_kind == "expanded" else (y * torch.ones_like(y)).sum()
        (g,) = torch.autograd.grad(loss, leaf)
        grads.append(g)
        outs.append(y.detach())
    torch.testing.assert_close(outs[0], outs[1])
    torch.testing.assert_close(grads[0], grads[1])


def test_backward_is_inverse_rotation(device):
    """d(sum(y * g))/dx for y = R(theta) x is R(-theta) g: checked in fp64 on an fp32 grad."""
    nq, nkv, hd, tokens = 2, 2, 16, 3
    cos, sin = build_rope_cache(10, hd, device=device)
    x = torch.randn(tokens, (nq + 2 * nkv) * hd, device=device, requires_grad=True)
    g = torch.randn(tokens, (nq + 2 * nkv) * hd, device=device)
    pos = torch.tensor([0, 5, 9], device=device)
    y = apply_rope_qkv_(x * 1, pos, cos, sin, nq, nkv, hd, interleaved=False)
    (dx,) = torch.autograd.grad(y, x, g)
    want = expected_qkv(g, pos, cos, -sin, nq, nkv, hd, False)
    torch.testing.assert_close(dx, want)


# ---------------------------------------------------------------------------- bad input


def _args(device, tokens=3, nq=2, nkv=1, hd=8):
    cos, sin = build_rope_cache(16, hd, device=device)
    qkv = torch.randn(tokens, (nq + 2 * nkv) * hd, device=device)
    pos = torch.arange(tokens, device=device)
    return qkv, pos, cos, sin


@pytest.mark.parametrize("fn", [apply_rope_qkv_, apply_rope_qkv_reference])
def test_positions_past_table_raise(fn, device, monkeypatch):
    monkeypatch.setenv("NAKTA_DEBUG", "1")  # CUDA checks bounds on the host only then
    qkv, pos, cos, sin = _args(device)
    pos[1] = 16
    with pytest.raises(ValueError, match="positions must lie in"):
        fn(qkv, pos, cos, sin, 2, 1, 8, interleaved=False)
    pos[1] = -1
    with pytest.raises(ValueError, match="positions must lie in"):
        fn(qkv, pos, cos, sin, 2, 1, 8, interleaved=False)


@pytest.mark.parametrize("fn", [apply_rope_qkv_, apply_rope_qkv_reference])
def test_bad_arguments_raise(fn, device, monkeypatch):
    monkeypatch.setenv("NAKTA_DEBUG", "1")  # CUDA checks bounds on the host only then
    qkv, pos, cos, sin = _args(device)
    kw = dict(interleaved=False)
    with pytest.raises(ValueError, match="qkv must have 2 dimensions"):
        fn(qkv[None], pos, cos, sin, 2, 1, 8, **kw)
    with pytest.raises(ValueError, match="qkv must have .* 32 columns"):
        fn(qkv[:, :-8], pos, cos, sin, 2, 1, 8, **kw)
    with pytest.raises(ValueError, match="n_kv_heads .* must divide"):
        fn(torch.randn(3, 56, device=device), pos, cos, sin, 3, 2, 8, **kw)
    with pytest.raises(ValueError, match="rotary_dim must be an even int"):
        fn(qkv, pos, cos, sin, 2, 1, 8, rotary_dim=5, **kw)
    with pytest.raises(ValueError, match="rotary_dim must be an even int"):
        fn(qkv, pos, cos, sin, 2, 1, 8, rotary_dim=10, **kw)
    with pytest.raises(ValueError, match="unit column stride"):
        fn(torch.randn(32, 3, device=device).t(), pos, cos, sin, 2, 1, 8, **kw)
    with pytest.raises(TypeError, match="positions must have dtype"):
        fn(qkv, pos.float(), cos, sin, 2, 1, 8, **kw)
    with pytest.raises(ValueError, match="positions must have 3 entries"):
        fn(qkv, pos[:2], cos, sin, 2, 1, 8, **kw)
    with pytest.raises(TypeError, match="qkv must have dtype"):
        fn(qkv.long(), pos, cos, sin, 2, 1, 8, **kw)
    with pytest.raises(TypeError, match="cos must have dtype"):
        fn(qkv, pos, cos.double(), sin, 2, 1, 8, **kw)
    with pytest.raises(ValueError, match="cos must have rotary_dim // 2 = 4 columns"):
        fn(qkv, pos, cos[:, :2], sin[:, :2], 2, 1, 8, **kw)
    kc = torch.zeros(4, 1, 8, device=device)
    with pytest.raises(ValueError, match="must be given together"):
        fn(qkv, pos, cos, sin, 2, 1, 8, k_cache=kc, **kw)
    with pytest.raises(TypeError, match="k_cache must have qkv's dtype"):
        fn(qkv, pos, cos, sin, 2, 1, 8, k_cache=kc.half(), v_cache=kc, cache_slots=pos, **kw)
    with pytest.raises(ValueError, match=r"v_cache must have shape \[num_slots, n_kv_heads=1"):
        fn(qkv, pos, cos, sin, 2, 1, 8, k_cache=kc, v_cache=kc[:, :, :4], cache_slots=pos, **kw)
    with pytest.raises(ValueError, match="cache_slots must lie in"):
        fn(qkv, pos, cos, sin, 2, 1, 8, k_cache=kc, v_cache=kc, cache_slots=pos + 2, **kw)


def test_cache_with_grad_raises(device):
    qkv, pos, cos, sin = _args(device)
    kc = torch.zeros(4, 1, 8, device=device)
    x = qkv.requires_grad_() * 1
    with pytest.raises(ValueError, match="inference-only"):
        apply_rope_qkv_(
            x, pos, cos, sin, 2, 1, 8, interleaved=False, k_cache=kc, v_cache=kc, cache_slots=pos
        )


def test_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    qkv, pos, cos, sin = _args("cpu")
    with pytest.raises(ValueError, match="qkv is on cpu"):
        apply_rope_qkv_(qkv, pos, cos, sin, 2, 1, 8, interleaved=False)


# ---------------------------------------------------------------------------- GPU, large


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("nq, nkv, hd", [(32, 32, 128), (64, 8, 128), (52, 52, 128), (40, 40, 128)])
def test_gpu_large(dtype, interleaved, nq, nkv, hd):
    tokens = 3000
    cos, sin = build_rope_cache(8192, hd, device="cuda")
    qkv, _ = make_qkv(tokens, nq, nkv, hd, dtype, "cuda")
    pos = torch.randint(0, 8192, (tokens,), device="cuda")
    want = expected_qkv(qkv, pos, cos, sin, nq, nkv, hd, interleaved)
    apply_rope_qkv_(qkv, pos, cos, sin, nq, nkv, hd, interleaved=interleaved)
    torch.testing.assert_close(qkv, want)


@pytest.mark.gpu
def test_gpu_out_of_range_position_poisons_with_nan():
    """On CUDA (no debug flag) a bad position is not synchronised on: that token becomes NaN."""
    qkv, pos, cos, sin = _args("cuda")
    pos[1] = 100
    v_before = qkv.unflatten(1, (4, 8))[:, 3].clone()
    apply_rope_qkv_(qkv, pos, cos, sin, 2, 1, 8, interleaved=False)
    h = qkv.unflatten(1, (4, 8))
    assert torch.isnan(h[1, :3]).all() and not torch.isnan(h[[0, 2]]).any()
    assert torch.equal(h[:, 3], v_before)
    assert not math.isnan(float(h[0, 0, 0]))


# ------------------------------------------------------------------------------------------------
# ``apply_rope_qkv_``'s write into an e4m3 KV cache (``kv_cache="fp8"``): each (token, KV head)
# row quantized with one fp32 scale ``amax / 448``, kernel against its reference (the same rule:
# ``quantize_rows_reference`` of the fp32 values) and against fp64 truth within e4m3's rounding;
# odd sizes, partial rotary, strided qkv rows, every qkv dtype; bad scales refused.
# ------------------------------------------------------------------------------------------------


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


# ------------------------------------------------------------------------------------------------
# Llama-3.1 RoPE scaling in the cos/sin tables, against Meta's and transformers' own code.
#
# ``kernels/rope.rope_frequencies`` is checked against llama_models' ``apply_scaling`` (Meta's
# reference) and transformers' ``_compute_llama3_parameters``; the tables the model builds grow
# with the positions a run reaches, not with the config's context.
# ------------------------------------------------------------------------------------------------


def _hf_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(
        hidden_size=head_dim * 2, num_attention_heads=2, max_position_embeddings=1 << 17,
        rope_parameters={"rope_type": "llama3", "rope_theta": theta, "factor": scaling.factor,
                         "low_freq_factor": scaling.low_freq_factor,
                         "high_freq_factor": scaling.high_freq_factor,
                         "original_max_position_embeddings":
                             scaling.original_max_position_embeddings},
    )  # fmt: skip
    return ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")[0].double()


@pytest.mark.parametrize("head_dim", [64, 128, 6])
@pytest.mark.parametrize("theta", [5e5, 1e4])
def test_scaled_frequencies_equal_meta_and_transformers(head_dim, theta):
    pytest.importorskip("fairscale")
    from llama_models.llama3.model import apply_scaling

    inv = rope_frequencies(head_dim, theta, META_LLAMA3_SCALING)
    plain = rope_frequencies(head_dim, theta)
    base32 = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    meta = apply_scaling(base32).double()  # Meta's constants: factor 8, low 1, high 4, 8192
    torch.testing.assert_close(inv, meta, rtol=1e-6, atol=0)
    torch.testing.assert_close(inv, _hf_inv_freq(head_dim, theta, META_LLAMA3_SCALING),
                               rtol=1e-6, atol=0)  # fmt: skip
    # the three bands are all exercised at head_dim 128, theta 5e5: kept, divided, blended
    wavelen = 2 * math.pi / plain
    if head_dim == 128 and theta == 5e5:
        assert (wavelen < 2048).any() and (wavelen > 8192).any()
        assert ((wavelen > 2048) & (wavelen < 8192)).any()
    torch.testing.assert_close(inv[wavelen < 2048], plain[wavelen < 2048], rtol=0, atol=0)
    torch.testing.assert_close(inv[wavelen > 8192], plain[wavelen > 8192] / 8, rtol=1e-15, atol=0)


def test_llama32_factor_and_tiny_original_context_match_transformers():
    scaling = RopeScaling(32.0, 1.0, 4.0, 16)  # a tiny original context: every band at hd 16
    inv = rope_frequencies(16, 5e5, scaling)
    torch.testing.assert_close(inv, _hf_inv_freq(16, 5e5, scaling), rtol=1e-6, atol=0)
    assert not torch.equal(inv, rope_frequencies(16, 5e5))


def test_rope_cache_uses_the_scaled_frequencies():
    cos, sin = build_rope_cache(300, 16, 5e5, scaling=RopeScaling(8.0, 1.0, 4.0, 16))
    inv = rope_frequencies(16, 5e5, RopeScaling(8.0, 1.0, 4.0, 16))
    ang = torch.arange(300, dtype=torch.float64)[:, None] * inv[None, :]
    torch.testing.assert_close(cos, torch.cos(ang).float(), rtol=0, atol=1e-7)
    torch.testing.assert_close(sin, torch.sin(ang).float(), rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="rotary_dim must be a positive even int"):
        rope_frequencies(7, 1e4)
    with pytest.raises(ValueError, match="high_freq_factor > low_freq_factor"):
        bad = SimpleNamespace(
            factor=8.0,
            low_freq_factor=4.0,
            high_freq_factor=1.0,
            original_max_position_embeddings=16,
        )  # what RopeScaling itself refuses: the kernel-side function checks it too
        rope_frequencies(8, 1e4, bad)


def test_model_rope_tables_grow_on_demand_with_the_configs_scaling():
    """A 128K-context config allocates what a run reaches (power-of-two growth), never
    max_seq_len rows up front; the tables carry the config's theta and scaling."""
    from nakta_model.model import Transformer

    args = PRESETS["tiny"].replace(max_seq_len=131072, rope_theta=5e5,
                                   rope_scaling=RopeScaling(32.0, 1.0, 4.0, 16))  # fmt: skip
    with torch.device("meta"):
        model = Transformer(args, kernels="reference")
    model.output.weight = torch.nn.Parameter(torch.zeros(args.vocab_size, args.dim))
    cos, sin = model._rope_tables(10)
    assert cos.shape == (256, args.head_dim // 2)  # 256-row floor, not 2 x 131072
    ref_cos, _ = build_rope_cache(256, args.head_dim, 5e5, scaling=args.rope_scaling)
    assert torch.equal(cos, ref_cos)
    assert model._rope_tables(200)[0] is cos  # no rebuild while it is long enough
    assert model._rope_tables(1000)[0].shape[0] == 1024
    assert model._rope_tables(5)[0].shape[0] == 1024  # never shrinks


def test_te_rotary_embedding_takes_the_scaling():
    from nakta_model.kernels.rope_te import RotaryPositionEmbedding

    scaling = RopeScaling(8.0, 1.0, 4.0, 16)
    emb = RotaryPositionEmbedding(16, rotary_base=5e5, device="cpu", rope_scaling=scaling)
    freqs = emb(40)[:, 0, 0, :8].double()
    want = torch.arange(40, dtype=torch.float64)[:, None] * rope_frequencies(16, 5e5, scaling)
    torch.testing.assert_close(freqs, want, rtol=1e-6, atol=1e-5)
    plain = RotaryPositionEmbedding(16, rotary_base=5e5, device="cpu")
    assert not torch.allclose(plain(40), emb(40))


def test_args_from_every_format_build_the_same_tables():
    """A Llama-3.1 folder saved by transformers 5 (rope_parameters) and by 4 (rope_theta +
    rope_scaling) give one ModelArgs, hence one table (the silent-default bug of issue 40)."""
    base = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "vocab_size": 10, "intermediate_size": 32}  # fmt: skip
    sc = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
    a = ModelArgs.from_hf_config({**base, "rope_parameters": {**sc, "rope_theta": 5e5}})
    b = ModelArgs.from_hf_config({**base, "rope_theta": 5e5, "rope_scaling": sc})
    ta = build_rope_cache(64, a.head_dim, a.rope_theta, scaling=a.rope_scaling)
    tb = build_rope_cache(64, b.head_dim, b.rope_theta, scaling=b.rope_scaling)
    assert torch.equal(ta[0], tb[0]) and a == b
    plain = build_rope_cache(64, a.head_dim, 1e4)
    assert not torch.allclose(ta[0], plain[0])
