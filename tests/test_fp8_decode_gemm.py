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
