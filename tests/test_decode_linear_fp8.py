"""``decode_linear`` with FP8 (e4m3) weights and fp32 per-row scales, every variant, against
``decode_linear_reference(..., weight_scale=...)`` (the same eager chain with the linear in fp32
on the dequantized weight ``wq.float() * ws[:, None]``, rounded once) and fp64.

The kernel multiplies each column's fp32 sum of ``x * code`` by the row's scale; the reference
sums ``x * (code * scale)``: the two differ by the rounding of the scale product and the order
of the fp32 sums only, so the tolerances of ``test_decode_linear.py`` apply unchanged. Weights
are quantized from the bf16 test weights by ``quantize_weight`` and stored as strided views
whose row padding holds e4m3 NaN codes (a read past K would show).
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
