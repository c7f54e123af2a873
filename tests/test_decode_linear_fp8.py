"""``decode_linear`` with FP8 (e4m3) weights and fp32 per-row scales, every variant, against
``decode_linear_reference(..., weight_scale=...)`` (the same eager chain with the linear in fp32
on the dequantized weight ``wq.float() * ws[:, None]``, rounded once) and fp64.

The kernel multiplies each column's fp32 sum of ``x * code`` by the row's scale; the reference
sums ``x * (code * scale)``: the two differ by the rounding of the scale product and the order
of the fp32 sums only, so the tolerances of ``test_decode_linear.py`` apply unchanged. Weights
are quantized from the bf16 test weights by ``quantize_weight`` and stored as strided views
whose row padding holds e4m3 NaN codes (a read past K would show).

Its batch-1 ``PREFETCH`` launch knob (the e4m3 weight read as int32 words) is checked here too.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_decode_linear import (
    CASES,
    LLAMA7B,
    assert_matches_reference,
    assert_near_fp64,
    expected_fp64,
    make_case,
    run_both,
)
from tiers import slow_beyond

from nakta_model.kernels import decode_linear as dl
from nakta_model.kernels.decode_linear import decode_linear, decode_linear_reference
from nakta_model.kernels.fp8_quant import FP8_DTYPE, quantize_weight

NAN_E4M3 = 0x7F
FP8_DTYPE_NAME = "float8_e4m3fn"


def fp8_case(variant, batch, dtype, device, **kw):
    """``make_case`` with its weight quantized: (x, wq strided view, kw, ref_kw, dequantized
    fp32 weight for the fp64 check)."""
    x, w, kw_, ref_kw = make_case(variant, batch, dtype, device, **kw)
    q, scale = quantize_weight(w)
    base = torch.empty(q.shape[0], q.shape[1] + 7, dtype=FP8_DTYPE, device=device)
    base.view(torch.uint8).fill_(NAN_E4M3)
    base[:, : q.shape[1]] = q
    wq = base[:, : q.shape[1]]
    kw_["weight_scale"] = ref_kw["weight_scale"] = scale
    return x, wq, kw_, ref_kw, q.float() * scale[:, None]


@pytest.mark.parametrize("variant, dtype, batch", CASES)
def test_fp8_weights_match_reference_and_fp64(variant, dtype, batch, device):
    x, wq, kw, ref_kw, w_deq = fp8_case(variant, batch, dtype, device)
    got, ref = run_both(x, wq, kw, ref_kw)
    assert not torch.isnan(got).any()
    assert_matches_reference(got, ref, dtype)
    assert_near_fp64(got, expected_fp64(x, w_deq, {**kw, "weight_scale": None}), dtype)
    if variant == "norm_rope":
        r, rr = kw["rope"], ref_kw["rope"]
        for c, cr in ((r.k_cache, rr.k_cache), (r.v_cache, rr.v_cache)):
            torch.testing.assert_close(c, cr, equal_nan=True)


@pytest.mark.parametrize(
    "variant, batch, tune",
    [
        ("norm_swiglu", 1, {"USE_DOT": 1}),
        ("residual", 3, {"USE_DOT": 0}),
        ("norm", 2, {"BLOCK_K": 16}),
        ("plain", 4, {"BLOCK_N": 64, "BLOCK_K": 32}),
        ("norm_rope", 3, {"BLOCK_N": 2, "USE_DOT": 0}),
    ],
)
def test_fp8_launch_switches(variant, batch, tune, device, monkeypatch):
    monkeypatch.setattr(dl, "_TUNE", tune)
    k = 64 if tune.get("BLOCK_K") == 16 else 75
    x, wq, kw, ref_kw, _ = fp8_case(variant, batch, torch.bfloat16, device, k=k)
    got, ref = run_both(x, wq, kw, ref_kw)
    assert_matches_reference(got, ref, torch.bfloat16)


def test_fp8_scale_is_applied_before_rounding(device):
    """Scales far from 1 (1e-3, 1e3): a kernel that rounded before scaling would lose the
    product's low bits (bf16 of a sum ~1e4 vs ~10) or overflow fp16; fp32 logits show it."""
    x, wq, kw, ref_kw, _ = fp8_case("norm_logits", 3, torch.bfloat16, device)
    for factor in (1e-3, 1e3):
        kw["weight_scale"] = ref_kw["weight_scale"] = ref_kw["weight_scale"] * factor
        got, ref = run_both(x, wq, kw, ref_kw)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())


def test_fp8_config_rows(monkeypatch):
    """FP8 weights look up their own table rows: twice the bf16 BLOCK_K where the accumulator
    allows (tl.dot rows of batch >= 16 keep it: their x tile sets the shared memory), the bf16
    rows unchanged."""
    cpu = torch.device("cpu")
    bf16 = dl._config(torch.bfloat16, 1, 4096, 4096, "residual", cpu)
    fp8 = dl._config(torch.bfloat16, 1, 4096, 4096, "residual", cpu, FP8_DTYPE)
    assert fp8["BLOCK_K"] == 2 * bf16["BLOCK_K"] and fp8["BLOCK_N"] == bf16["BLOCK_N"]
    assert bf16 == dl._config(torch.bfloat16, 1, 4096, 4096, "residual", cpu, torch.bfloat16)
    for key in [k for k in dl._CONFIGS if k[0] == "bfloat16"]:
        assert ("float8_e4m3fn", *key[1:]) in dl._CONFIGS
    b32 = dl._config(torch.bfloat16, 32, 11008, 4096, "swiglu", cpu, FP8_DTYPE)
    b32_bf16 = dl._config(torch.bfloat16, 32, 11008, 4096, "swiglu", cpu)
    assert b32["USE_DOT"] == 1 and b32["BLOCK_K"] == b32_bf16["BLOCK_K"]
    b8 = dl._config(torch.bfloat16, 8, 11008, 4096, "swiglu", cpu, FP8_DTYPE)
    b8_bf16 = dl._config(torch.bfloat16, 8, 11008, 4096, "swiglu", cpu)
    assert b8["BLOCK_K"] == 2 * b8_bf16["BLOCK_K"]
    default = dl._config(torch.float16, 1, 777, 4096, "plain", cpu, FP8_DTYPE)
    assert default["TILE_N"] * default["BLOCK_K"] <= dl._FMA_TILE_ELEMS * 2


DOT_F16_CASES = [("norm_rope", 3), ("residual", 16), ("norm_swiglu", 33), ("norm_logits", 5)]


@pytest.mark.parametrize("variant, batch", DOT_F16_CASES)
def test_fp8_dot_f16_matches_reference_and_fp64(variant, batch, device, monkeypatch):
    """fp16 MMA operands (e4m3 and bf16 x both exact in fp16): the bf16 path's sums."""
    monkeypatch.setattr(dl, "_TUNE", {"USE_DOT": 1, "DOT_F16": 1})
    x, wq, kw, ref_kw, w_deq = fp8_case(variant, batch, torch.bfloat16, device)
    n_cols = wq.shape[0] // 2 if variant == "norm_swiglu" else wq.shape[0]
    variant_key = dl._variant(kw.get("residual"), bool(kw.get("swiglu")), kw.get("rope"))
    cfg = dl._config(x.dtype, batch, n_cols, x.shape[1], variant_key, device, FP8_DTYPE)
    assert cfg["DOT_F16"] == 1
    got, ref = run_both(x, wq, kw, ref_kw)
    assert_matches_reference(got, ref, torch.bfloat16)
    assert_near_fp64(got, expected_fp64(x, w_deq, {**kw, "weight_scale": None}), torch.bfloat16)


def test_fp8_dot_f16_only_where_it_is_exact(monkeypatch):
    """DOT_F16 resolves to 1 only for FP8 weights, bf16 x and the tl.dot path; a table row or
    _TUNE asking elsewhere gets 0, and _TUNE's DOT_F16=0 (the escape hatch) turns it off."""
    cpu = torch.device("cpu")

    def resolved(x_dtype=torch.bfloat16, w_dtype=FP8_DTYPE, **tune):
        monkeypatch.setattr(dl, "_TUNE", {"DOT_F16": 1, "USE_DOT": 1, **tune})
        return dl._config(x_dtype, 8, 4096, 4096, "residual", cpu, w_dtype)["DOT_F16"]

    assert resolved() == 1
    assert resolved(x_dtype=torch.float16) == 0  # e4m3 -> fp16 is the plain path there
    assert resolved(x_dtype=torch.float32) == 0
    assert resolved(w_dtype=torch.bfloat16) == 0
    assert resolved(USE_DOT=0) == 0
    assert resolved(DOT_F16=0) == 0


def test_fp8_dot_f16_overflow_caveat_and_escape_hatch(device, monkeypatch):
    """The documented cost of DOT_F16. A bf16 x beyond fp16's 65504 becomes inf (its row's
    outputs inf/NaN). Entries below fp16's normal range (6.1e-5) become fp16 subnormals, off
    by <= 2^-25 each: invisible in a row that also holds normal-sized entries (LLaMA's), and
    bounded by 2^-25 * sum |w| in a row of only tiny entries (where bf16 would keep ~3
    digits). With the escape hatch (``_TUNE`` DOT_F16=0) every row is the reference's."""
    monkeypatch.setattr(dl, "_TUNE", {"USE_DOT": 1, "DOT_F16": 1})
    x, wq, kw, ref_kw, w_deq = fp8_case("plain", 4, torch.bfloat16, device)
    x[0, 5] = 1e5  # beyond fp16
    x[1, ::2] = x[1, ::2] * 1e-6  # tiny entries beside normal ones
    x[2] = x[2] * 1e-6  # a row of tiny entries only
    got, ref = run_both(x, wq, kw, ref_kw)
    assert not torch.isfinite(got[0]).all() and torch.isfinite(ref[0]).all()
    assert_matches_reference(got[[1, 3]], ref[[1, 3]], torch.bfloat16)
    exact = x[2].double() @ w_deq.double().T
    bound = 2.0**-25 * w_deq.double().abs().sum(1) + 2.0**-8 * exact.abs()
    assert ((got[2].double() - exact).abs() <= bound).all()
    monkeypatch.setattr(dl, "_TUNE", {"USE_DOT": 1, "DOT_F16": 0})
    got, ref = run_both(x, wq, kw, ref_kw)
    assert_matches_reference(got, ref, torch.bfloat16)


def test_fp8_tuned_file_loads_and_rejects_bad_rows(tmp_path):
    """The tuner's JSON: absent -> no rows; its rows keyed as _config looks them up; a row
    with a missing knob or a bf16 key is an error naming the file."""
    from nakta_model.kernels import decode_linear as cfgs

    assert cfgs.load_fp8_tuned(tmp_path / "absent.json") == {}
    row = dict(USE_DOT=1, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=3, DOT_F16=1)
    key = cfgs.fp8_tuned_key(32, "swiglu", 11008, 4096)
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"devices": {"h100": {"entries": {key: row}}}}))
    loaded = {"h100": {(FP8_DTYPE_NAME, 32, "swiglu", 11008, 4096): {**row, "PREFETCH": 0}}}
    assert cfgs.load_fp8_tuned(path) == loaded  # a row without PREFETCH (older files): 0
    path.write_text(json.dumps({"devices": {"h100": {"entries": {key: {**row, "PREFETCH": 1}}}}}))
    assert cfgs.load_fp8_tuned(path)["h100"][(FP8_DTYPE_NAME, 32, "swiglu", 11008, 4096)] == {
        **row, "PREFETCH": 1
    }  # fmt: skip
    for bad in ({**row, "BLOCK_M": 16}, {k: v for k, v in row.items() if k != "DOT_F16"}):
        path.write_text(json.dumps({"devices": {"h100": {"entries": {key: bad}}}}))
        with pytest.raises(ValueError, match="tuned.json"):
            cfgs.load_fp8_tuned(path)
    bf16_key = key.replace(FP8_DTYPE_NAME, "bfloat16")
    path.write_text(json.dumps({"devices": {"h100": {"entries": {bf16_key: row}}}}))
    with pytest.raises(ValueError, match="tuned.json"):
        cfgs.load_fp8_tuned(path)
    path.write_text("[]")
    with pytest.raises(ValueError, match="tuned.json"):
        cfgs.load_fp8_tuned(path)


def test_fp8_tuned_rows_apply_on_their_device_family(monkeypatch):
    """A tuned-file row in _DEVICE_CONFIGS[family] is what _config returns there (every knob,
    DOT_F16 included), and other families keep the derived row."""
    cpu = torch.device("cpu")
    row = dict(USE_DOT=1, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=2, DOT_F16=1)
    key = (FP8_DTYPE_NAME, 32, "residual", 4096, 11008)
    monkeypatch.setitem(dl._DEVICE_CONFIGS, "testgpu", {key: row})
    derived = dl._config(torch.bfloat16, 32, 4096, 11008, "residual", cpu, FP8_DTYPE)
    monkeypatch.setattr(dl, "device_family", lambda device: "testgpu")
    cfg = dl._config(torch.bfloat16, 32, 4096, 11008, "residual", cpu, FP8_DTYPE)
    assert {k: cfg[k] for k in row} == row and cfg != derived


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (lambda kw: kw.pop("weight_scale"), ValueError, "pass weight_scale"),
        (lambda kw: kw.update(weight_scale=kw["weight_scale"].double()), TypeError, "float32"),
        (lambda kw: kw.update(weight_scale=kw["weight_scale"][:-1]), ValueError, r"shape \[45\]"),
        (lambda kw: kw.update(weight=kw["weight"].float()), ValueError, "only for an FP8"),
        (lambda kw: kw.update(weight=kw["weight"].view(torch.float8_e5m2)), TypeError, "weight"),
    ],
)
def test_fp8_bad_inputs_raise(change, exc, match, device):
    x, wq, kw, _, _ = fp8_case("plain", 2, torch.float32, device)
    kw["weight"] = wq
    change(kw)
    for fn in (decode_linear, decode_linear_reference):
        with pytest.raises(exc, match=match):
            fn(x, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("variant, n, k", LLAMA7B)
@pytest.mark.parametrize("batch", [1, 4, 32, 64])
def test_gpu_fp8_llama7b_shapes(variant, n, k, batch):
    device = torch.device("cuda")
    x, wq, kw, ref_kw, w_deq = fp8_case(
        variant, batch, torch.bfloat16, device, k=k, n=n, heads=(32, 32, 128)
    )
    got, ref = run_both(x, wq, kw, ref_kw)
    expected = expected_fp64(x, w_deq, {**ref_kw, "weight_scale": None})
    assert_near_fp64(got, expected, torch.bfloat16)
    assert_matches_reference(got, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("variant, n, k", LLAMA7B)
@pytest.mark.parametrize("batch, dot_f16", [(4, 1), (32, 1), (32, 0), (64, 1)])
def test_gpu_fp8_dot_paths_llama7b_shapes(variant, n, k, batch, dot_f16, monkeypatch):
    """Both tl.dot operand conversions (fp16 MMA, e4m3 -> bf16) compiled for sm90."""
    monkeypatch.setattr(dl, "_TUNE", {"USE_DOT": 1, "DOT_F16": dot_f16})
    test_gpu_fp8_llama7b_shapes(variant, n, k, batch)


@pytest.mark.gpu
def test_gpu_fp8_cuda_graph_replay_follows_new_inputs():
    device = torch.device("cuda")
    x, wq, kw, ref_kw, _ = fp8_case("norm_swiglu", 4, torch.bfloat16, device, k=4096, n=22016)
    out = torch.empty(4, 11008, dtype=x.dtype, device=device)
    decode_linear(x, wq, **kw, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_linear(x, wq, **kw, out=out)
    x.copy_(torch.randn_like(x))
    kw["weight_scale"].mul_(2.0)  # scales read at replay, not baked in
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_reference(out, decode_linear_reference(x, wq, **ref_kw), torch.bfloat16)


# ------------------------------------------------------------------------------------------------
# ``decode_linear``'s ``PREFETCH`` launch knob (batch-1 FP8 GEMV, ``_fma_prefetch_loop``): the
# e4m3 weight read as int32 words, each K tile loaded an iteration ahead. Through the interpreter
# it returns ``PREFETCH=0``'s outputs bit for bit (same products, same order per K lane, same
# reduction), so the CPU cases compare the two with ``torch.equal`` (rope caches too), then
# against the reference and fp64 as ``test_decode_linear_fp8.py`` does. Compiled for a GPU the two
# loops may sum a row's products in another order (an H100 gave outputs one bf16 ulp apart at some
# 7B tiles, a few after SwiGLU's three roundings), so the GPU cases hold each to the reference and
# the two to each other within a few bf16 ulps.
#
# Weights are quantized and stored as row-padded views whose padding holds e4m3 NaN codes: a word
# read past K would turn a sum to NaN. The padded row stride is a multiple of 4 (the int32 view
# exists) unless a case tests the fallback. A spy on ``weight_words`` proves which path ran.
# ------------------------------------------------------------------------------------------------


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
