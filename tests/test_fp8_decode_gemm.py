"""``kernels/fp8_decode_gemm``: the FP8 x FP8 swap-AB GEMM of the decode step's linears at a few
rows, against its plain-PyTorch reference (exact fp64 sums, scaled and rounded as the kernel
does) on fresh random e4m3 inputs: rows 1..64, N and K off the block sizes, split-K on and off,
the residual epilogue (fresh and in place), strided operands, bf16 / fp16 / fp32 outputs, bad
arguments; its config table (defaults, tuned JSON, ``_TUNE``); and ``step_gemm``'s use of it
(``decode_gemm`` blocks and a whole FP8 decode step, against the cuBLASLt / reference path).

CPU runs use the Triton interpreter on small shapes (its fp8 ``tl.dot`` is exact); inputs are
built with torch's e4m3 cast (the interpreter's own fp32 -> e4m3 cast rounds wrongly).
"""

from __future__ import annotations

import json

import pytest
import torch
from test_step_gemm import equal_length_prompts, prefilled_step, tiny_model

from nakta_model.generation import step_gemm as sg
from nakta_model.kernels import fp8_decode_gemm as fdg
from nakta_model.kernels.fp8_decode_gemm import fp8_decode_gemm, fp8_decode_gemm_reference
from nakta_model.kernels.fp8_gemm import fp8_matmul, fp8_matmul_reference
from nakta_model.kernels.fp8_quant import FP8_DTYPE, QuantRows

ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
SMALL_TILES = dict(BLOCK_N=32, BLOCK_K=32)  # several tiles and K steps at test sizes


def e4m3(*shape, scale=4.0, device="cpu") -> torch.Tensor:
    return (torch.randn(*shape, device=device) * scale).to(FP8_DTYPE)


def make_inputs(rows: int, n: int, k: int, device):
    xq, wq = e4m3(rows, k, device=device), e4m3(n, k, scale=2.0, device=device)
    xs = torch.rand(rows, device=device) * 0.02 + 1e-3
    ws = torch.rand(n, device=device) * 0.02 + 1e-3
    return xq, xs, wq, ws


def error_bound(xq, xs, wq, ws, k: int, out_dtype) -> torch.Tensor:
    """Per element: an fp32 sum of ``k`` products in any order is within ``k * 2^-24`` of the
    sum of their magnitudes, plus one rounding of the result to ``out_dtype`` (and of the scale
    products): what a correct kernel can differ from the exact reference by."""
    mag = (xq.double().abs() @ wq.double().abs().t()) * xs.double()[:, None] * ws.double()[None]
    return (k * 2.0**-24 + 4 * 2.0**-24) * mag + ULP[out_dtype] * (mag + 1e-30)


def assert_close_to(got, want, bound) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.double() - want.double()).abs()
    slack = bound + ULP[got.dtype] * want.double().abs()
    assert torch.isfinite(got).all()
    assert (err <= slack).all(), f"max excess {(err - slack).max().item():.3g}"


@pytest.fixture
def tiles(monkeypatch):
    """Set the kernel's ``_TUNE`` for one test."""

    def set_tune(**cfg):
        monkeypatch.setattr(fdg, "_TUNE", {**SMALL_TILES, **cfg})

    return set_tune


@pytest.mark.parametrize("rows", [1, 3, 8, 17, 32, 64])
@pytest.mark.parametrize("split", [1, 3])
def test_matches_exact_reference(rows, split, device, tiles):
    """N = 70 and K = 200 are not multiples of the 32-wide tiles; split 3 of 7 K steps."""
    tiles(SPLIT_K=split)
    xq, xs, wq, ws = make_inputs(rows, 70, 200, device)
    got = fp8_decode_gemm(xq, xs, wq, ws, torch.bfloat16)
    want = fp8_decode_gemm_reference(xq, xs, wq, ws, torch.bfloat16)
    assert_close_to(got, want, error_bound(xq, xs, wq, ws, 200, torch.bfloat16))
    assert (got != want).float().mean() <= 0.02  # ties of the sums' rounding only


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("split", [1, 2])
def test_output_dtypes(out_dtype, split, device, tiles):
    tiles(SPLIT_K=split)
    xq, xs, wq, ws = make_inputs(5, 48, 96, device)
    got = fp8_decode_gemm(xq, xs, wq, ws, out_dtype)
    want = fp8_decode_gemm_reference(xq, xs, wq, ws, out_dtype)
    assert_close_to(got, want, error_bound(xq, xs, wq, ws, 96, out_dtype))
    exact = (xq.double() @ wq.double().t()) * xs.double()[:, None] * ws.double()[None]
    assert_close_to(want, exact.to(out_dtype), 4 * 2.0**-24 * exact.abs())  # exact, rounded


@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_residual_epilogue_fresh_and_in_place(split, dtype, device, tiles):
    """``round(residual + round(y))``: a new tensor by default (the residual untouched), or
    written into ``residual`` with ``out=residual``."""
    tiles(SPLIT_K=split)
    rows, n, k = 9, 40, 160
    xq, xs, wq, ws = make_inputs(rows, n, k, device)
    res = torch.randn(rows, n, device=device).to(dtype)
    keep = res.clone()
    got = fp8_decode_gemm(xq, xs, wq, ws, residual=res)
    assert got.dtype == dtype and torch.equal(res, keep)
    want = fp8_decode_gemm_reference(xq, xs, wq, ws, residual=res)
    y = fp8_matmul_reference(xq, xs, wq, ws, dtype)
    assert torch.equal(want, res + y)  # step_gemm's ``y.add_(residual)``: the same roundings
    bound = error_bound(xq, xs, wq, ws, k, dtype) * 2 + ULP[dtype] * res.abs().double()
    assert_close_to(got, want, bound)
    same = fp8_decode_gemm(xq, xs, wq, ws, residual=res, out=res)
    assert same.data_ptr() == res.data_ptr() and torch.equal(res, got)


def test_strided_operands(device, tiles):
    """xq rows of a wider buffer, xq with K strided (a transposed view), a strided weight,
    scales and residual / out with gaps: strides are kernel arguments, no copies."""
    tiles(SPLIT_K=2)
    rows, n, k = 6, 36, 96
    big = e4m3(rows, k + 40, device=device)
    x_rows = big[:, 8 : 8 + k]
    x_cols = e4m3(k, rows, device=device).t()
    w = e4m3(2 * n, k, scale=2.0, device=device)[::2]
    xs = (torch.rand(rows * 2, device=device) * 0.01 + 1e-3)[::2]
    ws = (torch.rand(n * 3, device=device) * 0.01 + 1e-3)[::3]
    res = torch.randn(rows, n + 5, device=device).bfloat16()[:, :n]
    out = torch.empty(n, rows, device=device, dtype=torch.bfloat16).t()
    for xq in (x_rows, x_cols):
        got = fp8_decode_gemm(xq, xs, w, ws, residual=res, out=out)
        assert got is out
        want = fp8_decode_gemm_reference(xq.contiguous(), xs.contiguous(), w.contiguous(),
                                         ws.contiguous(), residual=res.contiguous())  # fmt: skip
        bound = error_bound(xq, xs, w, ws, k, torch.bfloat16) * 2 + ULP[torch.bfloat16] * res.abs()
        assert_close_to(got, want, bound.double())


def _rope_case(rows: int, device, *, n_q=3, n_kv=1, hd=16, n_pos=40, slots=50, k=96, seed=0):
    """A ``wqkv`` product's inputs (N = (n_q + 2 n_kv) * hd) and a RopeArgs over fresh caches
    (distinct random slots, positions inside the table)."""
    from nakta_model.kernels.decode_linear import RopeArgs
    from nakta_model.kernels.rope import build_rope_cache

    torch.manual_seed(seed)
    n = (n_q + 2 * n_kv) * hd
    xq, xs, wq, ws = make_inputs(rows, n, k, device)
    cos, sin = build_rope_cache(n_pos, hd, 10000.0, device=device)
    pos = torch.randint(0, n_pos, (rows,), device=device)
    slot = torch.randperm(slots, device=device)[:rows].to(torch.int32)

    def caches(dtype, gap=0):
        """Zeroed K/V caches; ``gap``: each head row padded (strided heads and slots)."""
        return tuple(
            torch.zeros(slots, n_kv, hd + gap, device=device, dtype=dtype)[..., :hd]
            for _ in range(2)
        )

    def args(kc, vc, positions=pos, cache_slots=slot):
        if kc.dtype != FP8_DTYPE:
            return RopeArgs(positions, cos, sin, n_q, n_kv, hd, kc, vc, cache_slots)
        ks, vs = (torch.zeros(slots, n_kv, device=device) for _ in range(2))
        return RopeArgs(positions, cos, sin, n_q, n_kv, hd, kc, vc, cache_slots, ks, vs)

    return (xq, xs, wq, ws), caches, args


@pytest.mark.parametrize("rows", [3, 17])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rope_epilogue_is_the_gemm_then_the_rope_kernel(rows, dtype, device, tiles):
    """The fused ROPE epilogue leaves what ``fp8_decode_gemm`` then ``apply_rope_qkv_`` leave,
    bit for bit (the same roundings, the same rotation): the matrix (Q, K rotated; V as is) and
    the K/V caches; and the reference chain within the sums' order. Tiles of 32 weight rows
    (two heads of 16) over N = 80: the last tile is partial. xq's rows are strided; at 3 rows
    so are the caches' heads and slots."""
    from nakta_model.kernels.rope import apply_rope_qkv_

    tiles(SPLIT_K=4)  # refused for rope: one split
    (xq, xs, wq, ws), caches, args = _rope_case(rows, device)
    wide = torch.stack([xq.view(torch.uint8)] * 2, 1).reshape(2 * rows, -1)
    xq = wide.view(FP8_DTYPE)[::2]  # every other row of a wider buffer
    rope_kw = args(*caches(dtype, gap=8 if rows == 3 else 0))
    got = fp8_decode_gemm(xq, xs, wq, ws, dtype, rope=rope_kw)
    kc, vc = caches(dtype)
    want = fp8_decode_gemm(xq, xs, wq, ws, dtype)
    r = rope_kw
    apply_rope_qkv_(want, r.positions, r.cos, r.sin, 3, 1, 16, interleaved=True, k_cache=kc,
                    v_cache=vc, cache_slots=r.cache_slots)  # fmt: skip
    assert torch.equal(got, want)
    assert torch.equal(r.k_cache, kc) and torch.equal(r.v_cache, vc)
    assert r.k_cache.abs().sum() > 0 and r.v_cache.abs().sum() > 0
    kr, vr = caches(dtype)
    ref = fp8_decode_gemm_reference(xq, xs, wq, ws, dtype, rope=args(kr, vr, r.positions,
                                                                       r.cache_slots))  # fmt: skip
    tol = dict(rtol=2**-7, atol=1e-3) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, ref, **tol)
    torch.testing.assert_close(r.k_cache, kr, **tol)
    torch.testing.assert_close(r.v_cache, vr, **tol)


@pytest.mark.parametrize(("rows", "hd"), [(5, 16), (17, 64)])
def test_rope_epilogue_into_an_e4m3_cache(rows, hd, device, tiles):
    """An e4m3 cache: codes and one scale per (row, KV head), bit for bit what the GEMM then
    the quantizing rope kernel write (from the fp32 rotated K and V); head 64 is wider than the
    32-row tiles asked for, so the tile is widened to whole heads."""
    from nakta_model.kernels.rope import apply_rope_qkv_

    tiles()
    (xq, xs, wq, ws), caches, args = _rope_case(rows, device, n_q=2, n_kv=2, hd=hd)
    rope = args(*caches(FP8_DTYPE))
    got = fp8_decode_gemm(xq, xs, wq, ws, rope=rope)
    want_rope = args(*caches(FP8_DTYPE))
    want = fp8_decode_gemm(xq, xs, wq, ws)
    r = want_rope
    apply_rope_qkv_(want, r.positions, r.cos, r.sin, 2, 2, hd, interleaved=True,
                    k_cache=r.k_cache, v_cache=r.v_cache, cache_slots=r.cache_slots,
                    k_scale=r.k_scale, v_scale=r.v_scale)  # fmt: skip
    assert torch.equal(got, want)
    for name in ("k_cache", "v_cache"):
        a, b = getattr(rope, name), getattr(want_rope, name)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for name in ("k_scale", "v_scale"):
        assert torch.equal(getattr(rope, name), getattr(want_rope, name))
    rows_written = torch.zeros(rope.k_scale.shape[0], dtype=torch.bool, device=device)
    rows_written[rope.cache_slots.long()] = True
    assert (rope.k_scale[rows_written] > 0).all() and (rope.k_scale[~rows_written] == 0).all()


def test_rope_epilogue_out_of_range_row_is_nan_and_unwritten(device, tiles):
    """A position past the table: that row's Q/K are NaN and its cache slot stays untouched
    (the rope kernel's loud failure); the other rows are written. (On the CPU the check before
    the launch refuses it; the kernel's own guard is reached with the checks bypassed.)"""
    tiles()
    (xq, xs, wq, ws), caches, args = _rope_case(4, device, n_pos=8)
    kc, vc = caches(torch.bfloat16)
    pos = torch.tensor([1, 99, 3, 2], device=device)
    rope = args(kc, vc, positions=pos)
    with pytest.raises(ValueError, match="positions"):
        fp8_decode_gemm(xq, xs, wq, ws, rope=rope)
    out = torch.empty(4, wq.shape[0], dtype=torch.bfloat16, device=device)
    cfg = fdg._config(wq.shape[0], xq.shape[1], 4, xq.device)
    cfg["SPLIT_K"] = 1
    fdg._launch(xq, xs, wq, ws, None, out, cfg, rope)
    qk = out[:, : 5 * 16 - 16]
    assert torch.isnan(qk[1]).all() and not torch.isnan(qk[[0, 2, 3]]).any()
    assert not torch.isnan(out[:, 64:]).any()  # V: not rotated
    slots = rope.cache_slots.long()
    assert (kc[slots[1]] == 0).all() and (vc[slots[1]] == 0).all()
    assert (kc[slots[[0, 2, 3]]] != 0).any()


def test_rope_epilogue_refuses_what_it_does_not_do(device):
    (xq, xs, wq, ws), caches, args = _rope_case(4, device)
    kc, vc = caches(torch.bfloat16)
    res = torch.zeros(4, wq.shape[0], dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="residual and rope are exclusive"):
        fp8_decode_gemm(xq, xs, wq, ws, residual=res, rope=args(kc, vc))
    (xq6, xs6, wq6, ws6), caches6, args6 = _rope_case(4, device, hd=24)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        fp8_decode_gemm(xq6, xs6, wq6, ws6, rope=args6(*caches6(FP8_DTYPE)))
    k8, v8 = caches(FP8_DTYPE)
    no_scales = args(kc, vc)
    with pytest.raises(ValueError, match="k_scale"):  # an e4m3 cache needs its scales
        fp8_decode_gemm(xq, xs, wq, ws, rope=type(no_scales)(*[
            getattr(no_scales, f) for f in ("positions", "cos", "sin", "n_q_heads", "n_kv_heads",
                                            "head_dim")], k8, v8, no_scales.cache_slots))  # fmt: skip
    with pytest.raises(ValueError, match="columns"):
        fp8_decode_gemm(xq, xs, wq[:-16], ws[:-16], rope=args(kc, vc))


def _bad_cases():
    x, xs, w, ws = make_inputs(4, 16, 32, "cpu")
    res = torch.zeros(4, 16, dtype=torch.bfloat16)
    yield (x.float(), xs, w, ws), {}, TypeError, "xq must have dtype"
    yield (x, xs, w.bfloat16(), ws), {}, TypeError, "wq must have dtype"
    yield (x, xs.double(), w, ws), {}, TypeError, "x_scale must have dtype"
    yield (x, xs, w, ws.half()), {}, TypeError, "w_scale must have dtype"
    yield ("x", xs, w, ws), {}, TypeError, "xq must be a torch.Tensor"
    yield (x[0], xs, w, ws), {}, ValueError, "xq must have 2 dimensions"
    yield (e4m3(65, 32), torch.ones(65), w, ws), {}, ValueError, r"xq must have 1\.\.64 rows"
    yield (x, xs, w[:, :16], ws), {}, ValueError, "wq must be"
    yield (x, xs[:3], w, ws), {}, ValueError, "x_scale must have shape"
    yield (x, xs, w, ws[:5]), {}, ValueError, "w_scale must have shape"
    yield (x, xs, w, ws, torch.int8), {}, TypeError, "out_dtype"
    yield (x, xs, w, ws), {"residual": res[:, :8]}, ValueError, "residual must have shape"
    yield (x, xs, w, ws, torch.float16), {"residual": res}, TypeError, "residual must have"
    yield (x, xs, w, ws), {"out": torch.empty(4, 16)}, ValueError, "out must be"


@pytest.mark.parametrize("args, kwargs, exc, match", list(_bad_cases()))
def test_bad_arguments_name_what_is_wrong(args, kwargs, exc, match):
    for fn in (fp8_decode_gemm_reference, fp8_decode_gemm):
        with pytest.raises(exc, match=match):
            fn(*args, **kwargs)


def test_out_must_not_overlap_the_inputs():
    x, xs, w, ws = make_inputs(4, 16, 32, "cpu")
    out = torch.empty(4, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="out overlaps x_scale"):
        fp8_decode_gemm_reference(x, out[0, :4], w, ws, torch.float32, out=out)
    res = torch.zeros(4, 17, dtype=torch.float32)
    with pytest.raises(ValueError, match="out overlaps residual"):
        fp8_decode_gemm_reference(x, xs, w, ws, residual=res[:, :16], out=res[:, 1:])


# ------------------------------------------------------------------------------------- configs
@pytest.mark.parametrize(
    "n, k, bucket, block_n, split",
    [(12288, 4096, 32, 64, 1), (22016, 4096, 32, 128, 1), (4096, 4096, 32, 64, 4),
     (4096, 11008, 64, 64, 4)],
)  # fmt: skip
def test_default_config_fills_the_gpu(n, k, bucket, block_n, split):
    cfg = fdg._default_config(n, k, bucket, 132)
    assert (cfg["BLOCK_N"], cfg["SPLIT_K"]) == (block_n, split)
    per_stage = cfg["BLOCK_K"] * (cfg["BLOCK_N"] + max(16, bucket))
    assert cfg["num_stages"] * per_stage <= fdg.SMEM_BUDGET


def test_tuned_json_round_trip_and_precedence(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    cfg = dict(BLOCK_N=128, BLOCK_K=128, SPLIT_K=2, num_warps=8, num_stages=3)
    path.write_text(json.dumps({"devices": {"h200": {"entries": {"4096/4096/32": cfg}}}}))
    tables = fdg.load_tuned(path)
    assert tables == {"h200": {(4096, 4096, 32): cfg}}
    assert fdg.load_tuned(tmp_path / "absent.json") == {}
    path.write_text(json.dumps({"devices": {"h200": {"entries": {"1/2/3": {"BLOCK_N": 1}}}}}))
    with pytest.raises(ValueError, match="not a tuned fp8_decode_gemm config"):
        fdg.load_tuned(path)
    monkeypatch.setattr(fdg, "_CONFIGS", {(4096, 4096, 32): dict(SPLIT_K=8)})
    assert fdg._config(4096, 4096, 20, torch.device("cpu"))["SPLIT_K"] == 8
    monkeypatch.setattr(fdg, "_TUNE", dict(SPLIT_K=2, BLOCK_K=64))
    got = fdg._config(4096, 4096, 20, torch.device("cpu"))
    assert (got["SPLIT_K"], got["BLOCK_K"]) == (2, 64)
    assert fdg._config(40, 20, 3, torch.device("cpu"))["BLOCK_K"] == 32  # clipped to K


@pytest.mark.parametrize("tune", [dict(BLOCK_N=48), dict(BLOCK_K=8), dict(SPLIT_K=0),
                                  dict(num_warps=3)])  # fmt: skip
def test_unusable_config_raises(tune, monkeypatch):
    monkeypatch.setattr(fdg, "_TUNE", tune)
    with pytest.raises(ValueError, match="launch config"):
        fdg._config(64, 64, 4, torch.device("cpu"))


# ------------------------------------------------------------------------------ step_gemm use
def test_kernel_rows_defaults_and_overrides(monkeypatch):
    assert sg.fp8_kernel_rows() == sg.FP8_KERNEL_ROWS == (8, 64)
    monkeypatch.setattr(sg, "_TUNE", {"fp8_kernel_min": 16, "fp8_kernel_max": 32})
    assert sg.fp8_kernel_rows() == (16, 32)
    monkeypatch.setattr(sg, "_TUNE", {"fp8_kernel_min": 1, "fp8_kernel_max": 0})
    lo, hi = sg.fp8_kernel_rows()
    assert lo > hi  # never
    monkeypatch.setattr(sg, "_TUNE", {"fp8_kernel_max": 65})
    with pytest.raises(ValueError, match="<= 64"):
        sg.fp8_kernel_rows()
    monkeypatch.setattr(sg, "_TUNE", {"fp8_kernel_min": -1})
    with pytest.raises(ValueError, match="min must be an int >= 0"):
        sg.fp8_kernel_rows()


def _counting(monkeypatch) -> list[int]:
    """Count ``step_gemm``'s calls of ``fp8_decode_gemm`` (rows of each)."""
    calls: list[int] = []
    real = sg._fp8_small.fp8_decode_gemm

    def counted(xq, *a, **kw):
        calls.append(xq.shape[0])
        return real(xq, *a, **kw)

    monkeypatch.setattr(sg._fp8_small, "fp8_decode_gemm", counted)
    return calls


@pytest.mark.parametrize("variant", ["plain", "residual", "norm_swiglu", "norm_rope"])
def test_decode_gemm_blocks_take_the_kernel_in_range(variant, device, monkeypatch):
    """``decode_gemm`` with FP8 weights at 17 rows runs ``fp8_decode_gemm`` (counted) and gives
    the reference chain's result (``decode_gemm_reference``: cuBLASLt's math, exact sums)."""
    from test_decode_linear import assert_matches_reference
    from test_step_gemm import _fp8_case

    calls = _counting(monkeypatch)
    x, q, s, kw = _fp8_case(variant, 17, torch.bfloat16, device)
    got = sg.decode_gemm(x, q, weight_scale=s, **kw)
    ref = sg.decode_gemm_reference(x, q, weight_scale=s, **kw)
    assert calls == [17]
    if isinstance(ref, QuantRows):  # swiglu: an ulp of the sum may move an amax or a code
        torch.testing.assert_close(got.scale, ref.scale, rtol=1e-5, atol=0)
        assert (got.q.float() != ref.q.float()).float().mean() <= 0.02
    elif variant == "norm_rope":  # the interpreter's rope stores truncate (test_decode_gemm)
        torch.testing.assert_close(got, ref)
    else:
        assert_matches_reference(got, ref, torch.bfloat16)
    monkeypatch.setattr(sg, "_TUNE", {"fp8_kernel_min": 1, "fp8_kernel_max": 0})
    sg.decode_gemm(x, q, weight_scale=s, **kw)
    assert calls == [17]  # off: cuBLASLt / its reference


def test_fp8_decode_step_through_the_kernel_equals_the_reference_path(monkeypatch):
    """A whole FP8 decode step at 8 rows on the GEMM path: with ``fp8_decode_gemm`` (Triton
    kernels, interpreter) its logits are the reference path's (cuBLASLt's math) and the W8A8
    forward's, and the greedy tokens of a few steps are the same."""
    monkeypatch.setattr(sg, "_TUNE", {"fp8": 1})
    calls = _counting(monkeypatch)
    ps = equal_length_prompts(8, 5, seed=6)
    out = {}
    for kernels in ("reference", "triton"):
        model = tiny_model(kernels, quant="fp8", seed=7)
        step = prefilled_step(model, ps, 3)
        assert step.gemm
        logits = step.logits().float()
        step.run(3)
        out[kernels] = logits, step.buffers.history.clone()
    n_layers = len(model.layers)
    assert calls.count(8) >= 4 * n_layers  # wqkv, wo, w13 and w2 of every layer, each step
    full = tiny_model("reference", quant="fp8", seed=7)(torch.tensor(ps))[:, -1]
    torch.testing.assert_close(out["reference"][0], full, rtol=1e-4, atol=1e-4)
    ref = out["reference"][0]
    assert (out["triton"][0] - ref).norm() / ref.norm() < 1e-3
    assert torch.equal(out["triton"][1], out["reference"][1])


@pytest.mark.parametrize("kv_cache", ["bf16", "fp8"])
def test_fp8_step_writes_kv_in_the_wqkv_epilogue(kv_cache, monkeypatch):
    """An FP8 step at 8 rows (GEMM path, Meta's pairs): no rope launch of its own, RoPE and the
    K/V write (e4m3 + scales with an FP8 cache) in ``fp8_decode_gemm``'s epilogue; its logits
    and greedy tokens are the reference path's (which rotates with the rope reference)."""
    from nakta_model.kernels import rope as rope_mod

    monkeypatch.setattr(sg, "_TUNE", {"fp8": 1})
    ropes = []
    real = rope_mod.apply_rope_qkv_
    monkeypatch.setattr(
        rope_mod, "apply_rope_qkv_", lambda *a, **k: ropes.append(1) or real(*a, **k)
    )
    ps = equal_length_prompts(8, 5, seed=2)
    out = {}
    for kernels in ("reference", "triton"):
        model = tiny_model(kernels, quant="fp8", seed=4)
        model.set_kv_cache(kv_cache)
        step = prefilled_step(model, ps, 3)
        ropes.clear()
        logits = step.logits().float()
        step.run(3)
        out[kernels] = logits, step.buffers.history.clone(), len(ropes)
    assert out["triton"][2] == 0  # every layer's K/V written by the GEMM's epilogue
    monkeypatch.setattr(sg, "_TUNE", {"fp8": 1, "fp8_kernel_min": 1, "fp8_kernel_max": 0})
    step = prefilled_step(model, ps, 1)
    ropes.clear()
    step.logits()  # the other GEMMs: the rope kernel writes K/V
    assert len(ropes) == len(model.layers)
    ref = out["reference"][0]
    assert (out["triton"][0] - ref).norm() / ref.norm() < 1e-3
    assert torch.equal(out["triton"][1], out["reference"][1])


_COMPILE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nakta_model.kernels.fp8_decode_gemm import _fp8_decode_gemm_kernel as kernel

kv_fp8, block_n = sys.argv[1] == "1", int(sys.argv[2])
cache = "*fp8e4nv" if kv_fp8 else "*bf16"
pointers = {"X": "*fp8e4nv", "W": "*fp8e4nv", "XS": "*fp32", "WS": "*fp32", "R": "*bf16",
            "OUT": "*bf16", "PART": "*bf16", "POS": "*i32", "COS": "*fp32", "SIN": "*fp32",
            "KC": cache, "VC": cache, "SLOT": "*i32", "KS": "*fp32", "VS": "*fp32"}
const = dict(RESIDUAL=False, SPLIT=False, BLOCK_N=block_n, BLOCK_R=16, BLOCK_K=256, EVEN_K=True,
             PROMOTE=128, NUM_STAGES=3, EMULATE_RNE=False, ROPE=True, HEAD_DIM=128,
             KV_FP8=kv_fp8)
names = list(kernel.arg_names)
sig = {n: "constexpr" if n in const else pointers.get(n, "i32") for n in names}
src = ASTSource(kernel, sig, constexprs={(names.index(n),): v for n, v in const.items()})
out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
sys.stdout.write(out.asm["ptx"])
"""


@pytest.mark.slow
@pytest.mark.parametrize(("kv_fp8", "block_n"), [(False, 64), (True, 128)])
def test_rope_epilogue_compiles_for_hopper(kv_fp8, block_n):
    """The ROPE epilogue's register reshapes (pairs of the MMA's rows, heads of a tile) go
    through Triton's GPU compiler for sm_90 without a GPU: wgmma kept, e4m3 stores with an e4m3
    cache."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    ptxas = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("Triton's bundled ptxas is not installed")
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE, "1" if kv_fp8 else "0", str(block_n)],
        env={**os.environ, "TRITON_INTERPRET": "0"}, cwd=Path(__file__).resolve().parents[1],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wgmma" in proc.stdout
    assert ("cvt.rn.satfinite.e4m3x2" in proc.stdout) == kv_fp8


# ------------------------------------------------------------------------------------------ GPU
SHAPES_7B = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)]


def _gpu_fp8():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tl.dot needs compute capability 8.9")


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", SHAPES_7B)
@pytest.mark.parametrize("rows", [1, 8, 32, 64])
def test_gpu_llama7b_shapes(n, k, rows):
    """The 7B linears on the GPU with the table's config (tuned where the tuner ran): within
    the exact reference's bound, as cuBLASLt (fp8_matmul) is; the residual epilogue too."""
    _gpu_fp8()
    xq, xs, wq, ws = make_inputs(rows, n, k, "cuda")
    want = fp8_decode_gemm_reference(xq, xs, wq, ws)
    bound = error_bound(xq, xs, wq, ws, k, torch.bfloat16)
    assert_close_to(fp8_decode_gemm(xq, xs, wq, ws), want, bound)
    assert_close_to(fp8_matmul(xq, xs, wq, ws), want, bound)
    res = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    got = fp8_decode_gemm(xq, xs, wq, ws, residual=res)
    want = fp8_decode_gemm_reference(xq, xs, wq, ws, residual=res)
    assert_close_to(got, want, 2 * bound + ULP[torch.bfloat16] * res.abs().double())


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tune",
    [dict(SPLIT_K=1), dict(SPLIT_K=2, BLOCK_K=128), dict(SPLIT_K=8, BLOCK_N=128, num_warps=8),
     dict(SPLIT_K=4, BLOCK_K=512, num_stages=3)],
)  # fmt: skip
def test_gpu_forced_configs(tune, monkeypatch):
    """wo at 32 rows under other tiles and split counts: the same result within the bound."""
    _gpu_fp8()
    monkeypatch.setattr(fdg, "_TUNE", tune)
    xq, xs, wq, ws = make_inputs(32, 4096, 4096, "cuda")
    want = fp8_decode_gemm_reference(xq, xs, wq, ws)
    assert_close_to(fp8_decode_gemm(xq, xs, wq, ws), want, error_bound(xq, xs, wq, ws, 4096,
                                                                        torch.bfloat16))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("split", [1, 4])
def test_gpu_cuda_graph_replay_follows_new_inputs(split, monkeypatch):
    """Captured once (split-K workspace from the graph's pool), replayed on new inputs."""
    _gpu_fp8()
    monkeypatch.setattr(fdg, "_TUNE", dict(SPLIT_K=split))
    xq, xs, wq, ws = make_inputs(32, 4096, 4096, "cuda")
    res = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16)
    fp8_decode_gemm(xq, xs, wq, ws, residual=res)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = fp8_decode_gemm(xq, xs, wq, ws, residual=res)
    for seed in range(2):
        torch.manual_seed(seed)
        new = make_inputs(32, 4096, 4096, "cuda")
        for t, v in zip((xq, xs, wq, ws), new):
            t.copy_(v)
        res.normal_()
        graph.replay()
        torch.cuda.synchronize()
        want = fp8_decode_gemm_reference(xq, xs, wq, ws, residual=res)
        bound = 2 * error_bound(xq, xs, wq, ws, 4096, torch.bfloat16)
        assert_close_to(out, want, bound + ULP[torch.bfloat16] * res.abs().double())


@pytest.mark.gpu
def test_gpu_captured_fp8_step_at_32_rows(monkeypatch):
    """An FP8 step of 32 rows on the GEMM path, through ``fp8_decode_gemm`` (counted): its CUDA
    graph replays give the eager step's tokens, and its logits are cuBLASLt's (kernel off) up
    to summation order."""
    from nakta_model.config import ModelArgs
    from nakta_model.loading import random_model

    _gpu_fp8()
    args = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512,
                     multiple_of=64, max_seq_len=64)  # fmt: skip
    model = random_model(args, "cuda", torch.bfloat16, seed=2, quant="fp8")
    ps = equal_length_prompts(32, 6, seed=4)
    calls = _counting(monkeypatch)
    out = {}
    for name, graph, tune in (("eager", False, {}), ("graph", True, {}),
                              ("cublaslt", False, {"fp8_kernel_max": 0})):  # fmt: skip
        monkeypatch.setattr(sg, "_TUNE", {"fp8": 8, **tune})
        step = prefilled_step(model, ps, 8, "cuda_graph" if graph else "eager")
        assert step.gemm
        logits = step.logits().float()
        if graph:
            step.capture()
        step.run(8)
        out[name] = logits, step.buffers.history.clone()
        model.clear_cache()
    assert calls and set(calls) == {32}
    assert torch.equal(out["eager"][1], out["graph"][1])
    ref = out["cublaslt"][0]
    assert (out["eager"][0] - ref).norm() / ref.norm() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [8, 32, 64])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_gpu_rope_epilogue_llama7b(rows, kv):
    """wqkv of the 7B (32 heads of 128, the table's tiles) with the ROPE epilogue: what the
    GEMM then the rope kernel leave, the matrix and the caches (e4m3: codes and scales), up to
    the rotation's rounding (the two kernels may contract its products differently)."""
    from nakta_model.kernels.rope import apply_rope_qkv_

    _gpu_fp8()
    (xq, xs, wq, ws), caches, args = _rope_case(rows, "cuda", n_q=32, n_kv=32, hd=128,
                                                n_pos=4096, slots=4096, k=4096)  # fmt: skip
    dtype = FP8_DTYPE if kv == "fp8" else torch.bfloat16
    rope, ref = args(*caches(dtype)), args(*caches(dtype))
    got = fp8_decode_gemm(xq, xs, wq, ws, rope=rope)
    want = fp8_decode_gemm(xq, xs, wq, ws)
    apply_rope_qkv_(want, ref.positions, ref.cos, ref.sin, 32, 32, 128, interleaved=True,
                    k_cache=ref.k_cache, v_cache=ref.v_cache, cache_slots=ref.cache_slots,
                    k_scale=ref.k_scale, v_scale=ref.v_scale)  # fmt: skip
    assert torch.isfinite(got).all()
    tol = dict(rtol=2**-7, atol=1e-3 * want.abs().max().item())
    torch.testing.assert_close(got, want, **tol)
    for name in ("k_cache", "v_cache"):
        a, b = getattr(rope, name).float(), getattr(ref, name).float()
        if kv == "fp8":  # an ulp of a rotated value may move a code by one step (2^-3)
            torch.testing.assert_close(a, b, rtol=2**-3, atol=2**-9)
        else:
            torch.testing.assert_close(a, b, **tol)
    if kv == "fp8":
        torch.testing.assert_close(rope.k_scale, ref.k_scale, rtol=2**-7, atol=0)
        assert torch.equal(rope.v_scale, ref.v_scale)  # V: the same rounded product
