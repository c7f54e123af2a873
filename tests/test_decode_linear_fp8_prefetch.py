"""``decode_linear``'s ``PREFETCH`` launch knob (batch-1 FP8 GEMV, ``_fma_prefetch_loop``): the
e4m3 weight read as int32 words, each K tile loaded an iteration ahead. Through the
interpreter it returns ``PREFETCH=0``'s outputs bit for bit (same products, same order per K
lane, same reduction), so the CPU cases compare the two with ``torch.equal`` (rope caches too),
then against the reference and fp64 as ``test_decode_linear_fp8.py`` does. Compiled for a GPU
the two loops may sum a row's products in another order (an H100 gave outputs one bf16 ulp
apart at some 7B tiles, a few after SwiGLU's three roundings), so the GPU cases hold each to the
reference and the two to each other within a few bf16 ulps.

Weights are quantized and stored as row-padded views whose padding holds e4m3 NaN codes: a
word read past K would turn a sum to NaN. The padded row stride is a multiple of 4 (the int32
view exists) unless a case tests the fallback. A spy on ``weight_words`` proves which path ran.
"""

from __future__ import annotations

import pytest
import torch
from test_decode_linear import (
    assert_matches_reference,
    assert_near_fp64,
    expected_fp64,
    make_case,
    run_both,
)
from test_decode_linear_fp8 import NAN_E4M3, fp8_case
from tiers import slow_beyond

from nakta_model.kernels import decode_linear as dl
from nakta_model.kernels.fp8_quant import FP8_DTYPE, quantize_weight

KINDS = ["norm_rope", "residual", "norm_swiglu", "plain", "norm_logits"]


def word_case(variant, device, k, pad=8, offset=0, **kw):
    """``fp8_case`` at batch 1 with the weight's rows padded by ``pad`` NaN codes and starting
    ``offset`` codes into them (``pad``, ``offset`` and K multiples of 4: an int32 view), x a
    view 3 elements into a NaN-filled row (misaligned), the norm weight strided."""
    x, w, kw_, ref_kw = make_case(variant, 1, torch.bfloat16, device, k=k, **kw)
    x_base = torch.full((2, k + 3), float("nan"), dtype=x.dtype, device=device)
    x_base[1, 3:] = x[0]
    x = x_base[1:, 3:]  # x off its 16-byte alignment (a batch-1 row is always "contiguous")
    q, scale = quantize_weight(w)
    base = torch.empty(q.shape[0], offset + k + pad, dtype=FP8_DTYPE, device=device)
    base.view(torch.uint8).fill_(NAN_E4M3)
    wq = base[:, offset : offset + k]
    wq.copy_(q)
    kw_["weight_scale"] = ref_kw["weight_scale"] = scale
    return x, wq, kw_, ref_kw, q.float() * scale[:, None]


@pytest.fixture
def spy(monkeypatch):
    """Records, per launch asking PREFETCH, whether it got the int32 view (True) or fell back."""
    seen: list[bool] = []
    real = dl.weight_words

    def wrapped(weight):
        words = real(weight)
        seen.append(words is not None)
        return words

    monkeypatch.setattr(dl, "weight_words", wrapped)
    return seen


def run_pair(x, wq, kw, ref_kw, tune, monkeypatch):
    """(PREFETCH=0 output, PREFETCH=1 output, reference), each with its own rope caches."""
    import copy

    outs = []
    for prefetch in (0, 1):
        monkeypatch.setattr(dl, "_TUNE", {**tune, "USE_DOT": 0, "PREFETCH": prefetch})
        kw_i = {**kw, "rope": copy.deepcopy(kw["rope"])} if "rope" in kw else kw
        got, ref = run_both(x, wq, kw_i, ref_kw)
        outs.append((got, kw_i.get("rope")))
    return outs, ref


def assert_same_bits(outs):
    (a, rope_a), (b, rope_b) = outs
    assert torch.equal(a, b), "PREFETCH=1 differs from PREFETCH=0"
    if rope_a is not None:
        for name in ("k_cache", "v_cache"):
            ca, cb = getattr(rope_a, name), getattr(rope_b, name)
            assert torch.equal(ca.isnan(), cb.isnan()) and torch.equal(
                ca.nan_to_num(), cb.nan_to_num()
            )


@pytest.mark.parametrize(
    "k, tune, variant",
    slow_beyond(
        {
            "k96": (96, {"BLOCK_K": 32}),  # EVEN_K, three tiles: prologue, one loop trip, tail
            "k100": (100, {"BLOCK_K": 32}),  # K % (4 BLOCK_K) != 0: a masked last tile
            "k36": (36, {"BLOCK_K": 64, "BLOCK_N": 8}),  # one partial tile: the loop never runs
            "k128": (128, {"BLOCK_K": 16, "num_warps": 2}),  # eight tiles of four words
        },
        {v: v for v in KINDS},
        # every tile shape once and every epilogue once
        fast={
            ("k36", "norm_rope"),
            ("k96", "residual"),
            ("k128", "norm_swiglu"),
            ("k100", "plain"),
            ("k96", "norm_logits"),
        },
    ),
)
def test_prefetch_bit_identical_and_matches_reference(variant, k, tune, spy, monkeypatch):
    device = torch.device("cpu") if not torch.cuda.is_available() else torch.device("cuda")
    x, wq, kw, ref_kw, w_deq = word_case(variant, device, k)
    assert (
        x.storage_offset() % 8 and kw.get("norm_weight", x).stride(-1) != 1 or "norm" not in variant
    )
    outs, ref = run_pair(x, wq, kw, ref_kw, tune, monkeypatch)
    assert spy == [True]  # only PREFETCH=1 asks for the int32 view, and got it
    assert_same_bits(outs)
    got = outs[1][0]
    assert not torch.isnan(got).any()
    assert_matches_reference(got, ref, torch.bfloat16)
    assert_near_fp64(got, expected_fp64(x, w_deq, {**kw, "weight_scale": None}), torch.bfloat16)


@pytest.mark.parametrize(
    "case",
    ["k_not_multiple_of_4", "row_stride_not_multiple_of_4", "start_not_multiple_of_4"],
)
def test_prefetch_falls_back_where_no_int32_view_exists(case, spy, monkeypatch, device):
    """No int32 view (K = 75, a row stride of K + 7 codes, a view starting at code 2): the
    launch runs PREFETCH=0, and says so only through the result being the same."""
    if case == "k_not_multiple_of_4":
        x, wq, kw, ref_kw, _ = word_case("norm_swiglu", device, 75, pad=5)
    elif case == "row_stride_not_multiple_of_4":
        x, wq, kw, ref_kw, _ = fp8_case("residual", 1, torch.bfloat16, device, k=64)
    else:
        x, wq, kw, ref_kw, _ = word_case("norm_rope", device, 64, offset=2, pad=6)
    assert dl.weight_words(wq) is None
    spy.clear()
    outs, ref = run_pair(x, wq, kw, ref_kw, {"BLOCK_K": 32}, monkeypatch)
    assert spy == [False]
    assert_same_bits(outs)
    assert_matches_reference(outs[1][0], ref, torch.bfloat16)


def test_weight_words_is_the_codes_little_endian():
    """The int32 view's word i of a row holds codes 4i..4i+3, code j in byte j: the order
    ``_e4m3x4`` unpacks (a big-endian host would need the other order)."""
    codes = torch.arange(24, dtype=torch.uint8).reshape(2, 12)
    words = dl.weight_words(codes.view(FP8_DTYPE))
    assert words.shape == (2, 3) and words.dtype == torch.int32
    for r in range(2):
        for i in range(3):
            c = [int(v) for v in codes[r, 4 * i : 4 * i + 4]]
            assert int(words[r, i]) == c[0] | c[1] << 8 | c[2] << 16 | c[3] << 24


def test_prefetch_resolves_only_for_fp8_batch1_cuda_cores(monkeypatch):
    """A table row or ``_TUNE`` asking PREFETCH gets it only where ``_fma_prefetch_loop``
    runs: FP8 weight, CUDA-core path, batch bucket 1; elsewhere it resolves to 0."""
    cpu = torch.device("cpu")

    def resolved(batch=1, w_dtype=FP8_DTYPE, **tune):
        monkeypatch.setattr(dl, "_TUNE", {"PREFETCH": 1, "USE_DOT": 0, **tune})
        return dl._config(torch.bfloat16, batch, 4096, 4096, "residual", cpu, w_dtype)["PREFETCH"]

    assert resolved() == 1
    assert resolved(w_dtype=torch.bfloat16) == 0
    assert resolved(batch=2) == 0  # CUDA cores at batch 2: BLOCK_M = 2, the 3-D loop
    assert resolved(USE_DOT=1, BLOCK_N=16, BLOCK_K=128) == 0
    assert resolved(PREFETCH=0) == 0
    monkeypatch.setattr(dl, "_TUNE", {})
    assert dl._config(torch.bfloat16, 1, 4096, 4096, "residual", cpu, FP8_DTYPE)["PREFETCH"] == 0


# ----------------------------------------------------------------------------------------- GPU

# (variant, N, K) of LLaMA-7B's FP8 decode GEMVs and the tuned tiles (weight rows a program,
# BLOCK_K, warps)
GPU_KINDS = [("norm_rope", 12288, 4096), ("residual", 4096, 4096), ("norm_swiglu", 22016, 4096),
             ("residual", 4096, 11008)]  # fmt: skip
GPU_TILES = [(8, 1024, 4), (8, 256, 2), (8, 512, 4)]  # the H200 rows of wo/w2, wqkv, w13


def assert_within_a_few_ulps(outs, ulps: int = 4):
    """The two launches' outputs (and rope caches, NaN where unwritten) at most ``ulps`` bf16
    ulps apart: the same sums in another order (one ulp once rounded; SwiGLU rounds gate, up,
    silu and the product, so a gate one ulp off moves its output by a few)."""
    (a, rope_a), (b, rope_b) = outs
    pairs = [(a, b)]
    if rope_a is not None:
        pairs += [(getattr(rope_a, n), getattr(rope_b, n)) for n in ("k_cache", "v_cache")]
    for u, v in pairs:
        assert torch.equal(u.isnan(), v.isnan())
        u, v = u.float().nan_to_num(), v.float().nan_to_num()
        ulp = torch.maximum(u.abs(), v.abs()) * 2.0**-7 + 1e-30  # bf16: 8 significant bits
        assert ((u - v).abs() <= ulps * ulp).all(), f"PREFETCH=1 > {ulps} ulps from PREFETCH=0"


@pytest.mark.gpu
@pytest.mark.parametrize("variant, n, k", GPU_KINDS)
@pytest.mark.parametrize("tile_rows, block_k, warps", GPU_TILES)
def test_gpu_prefetch_matches_reference_llama7b(variant, n, k, tile_rows, block_k, warps, spy,
                                                monkeypatch):  # fmt: skip
    """Compiled for this GPU (the inline-asm unpacking, the layouts): PREFETCH=1 within a few
    bf16 ulps of PREFETCH=0 at 7B shapes, batch 1, and both match the reference."""
    device = torch.device("cuda")
    x, wq, kw, ref_kw, w_deq = word_case(variant, device, k, n=n, heads=(32, 32, 128))
    bn = max(2, tile_rows // (2 if variant == "norm_swiglu" else 1))
    tune = dict(BLOCK_N=bn, BLOCK_K=block_k, num_warps=warps, num_stages=3)
    outs, ref = run_pair(x, wq, kw, ref_kw, tune, monkeypatch)
    assert spy == [True]
    assert_within_a_few_ulps(outs)
    assert_matches_reference(outs[0][0], ref, torch.bfloat16)
    assert_matches_reference(outs[1][0], ref, torch.bfloat16)
    assert_near_fp64(outs[1][0], expected_fp64(x, w_deq, {**ref_kw, "weight_scale": None}),
                     torch.bfloat16)  # fmt: skip


@pytest.mark.gpu
def test_gpu_prefetch_under_graph_replay(monkeypatch):
    """A captured PREFETCH launch reads the new x and scales at replay (the int32 view is
    of the same storage, so a weight updated in place is read too)."""
    monkeypatch.setattr(dl, "_TUNE", {"USE_DOT": 0, "PREFETCH": 1})
    device = torch.device("cuda")
    x, wq, kw, ref_kw, _ = word_case("norm_swiglu", device, 4096, n=22016)
    out = torch.empty(1, 11008, dtype=x.dtype, device=device)
    dl.decode_linear(x, wq, **kw, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dl.decode_linear(x, wq, **kw, out=out)
    x.copy_(torch.randn_like(x))
    kw["weight_scale"].mul_(2.0)
    wq.view(torch.uint8).copy_(wq.view(torch.uint8).flip(1))
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_reference(out, dl.decode_linear_reference(x, wq, **ref_kw), torch.bfloat16)


@pytest.mark.parametrize(
    "variant, k, prefetch, w_dtype",
    slow_beyond(
        {"norm_rope-96": ("norm_rope", 96), "residual-100": ("residual", 100),
         "norm_swiglu-36": ("norm_swiglu", 36)},
        {"0": 0, "1": 1},
        {"fp8": "fp8", "bf16": "bf16"},
        fast={("norm_rope-96", "1", "fp8"), ("residual-100", "0", "bf16"),
              ("norm_swiglu-36", "1", "bf16")},
    ),
)  # fmt: skip
def test_first_weight_tile_loaded_early_matches_the_reference(variant, k, prefetch, w_dtype,
                                                             monkeypatch):  # fmt: skip
    """``EARLY_W`` (the first K tile loaded before the dependent launch's wait: batch 1 on the
    CUDA cores, whose launches all take it) over K tiles that do not divide K, with and
    without the FP8 prefetch: the reference's result."""
    device = torch.device("cpu") if not torch.cuda.is_available() else torch.device("cuda")
    if w_dtype == "fp8":
        x, w, kw, ref_kw, _ = word_case(variant, device, k)
    else:
        x, w, kw, ref_kw = make_case(variant, 1, torch.bfloat16, device, k=k)
    monkeypatch.setattr(dl, "_TUNE", {"BLOCK_K": 32, "USE_DOT": 0, "PREFETCH": prefetch})
    got, ref = run_both(x, w, kw, ref_kw)
    assert_matches_reference(got, ref, torch.bfloat16)
