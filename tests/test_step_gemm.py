"""The decode step on its GEMM path (``step_gemm``): above 64 rows, and below where the crossover
is forced low, against Meta's loop (greedy tokens), the ``decode_linear`` path (logits), the
Triton kernels against the reference path, FP8 models against their W8A8 forward, and tensor
parallelism over two gloo ranks.

CPU: tiny models in fp32 (the reference path, and the Triton kernels in the interpreter at a few
rows); the step is built directly (the engine at more than 64 rows: test_generation_paged).

Here too: ``step_gemm.decode_gemm`` itself, the linears as GEMMs with the fused kernels around them.
"""

from __future__ import annotations

import random

import pytest
import torch
from checkpoint_factory import TINY_PARAMS, meta_state_dict
from test_decode_linear import (
    _padded,
    assert_matches_reference,
    assert_near_fp64,
    expected_fp64,
    make_case,
)
from tiers import slow_beyond

from nakta_model.config import ModelArgs
from nakta_model.generation import Generator, generate_tokens, greedy_requests
from nakta_model.generation import step_gemm as sg
from nakta_model.generation.step import MAX_ROWS, DecodeStep
from nakta_model.generation.step_gemm import decode_gemm, decode_gemm_reference
from nakta_model.kernels._checks import interpreter_enabled
from nakta_model.kernels.decode_linear import decode_linear_reference
from nakta_model.kernels.fp8_gemm import fp8_matmul_reference
from nakta_model.kernels.fp8_quant import QuantRows, quantize_rows_reference, quantize_weight
from nakta_model.kernels.rmsnorm import rms_norm_fp8_reference
from nakta_model.kernels.rope import apply_rope_qkv_reference
from nakta_model.kernels.swiglu import swiglu_fp8_reference
from nakta_model.loading import load, random_model
from nakta_model.sources import state_dict_source

MAX_SEQ = 32


def tiny_model(kernels="reference", quant=None, seed=3):
    args = ModelArgs.from_meta_params(TINY_PARAMS, max_seq_len=MAX_SEQ)
    if quant:
        return random_model(args, "cpu", torch.float32, seed=seed, kernels=kernels, quant=quant)
    return load(state_dict_source(meta_state_dict(TINY_PARAMS, seed=seed), args), "cpu",
                kernels=kernels)  # fmt: skip


def equal_length_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 300) for _ in range(length - 1)] for _ in range(n)]


def prefilled_step(model, ps: list[list[int]], chunk: int, graph_mode="eager") -> DecodeStep:
    """A step of ``len(ps)`` rows whose cache holds each prompt but its last token (prefilled
    by the model's forward: the same cache layout, row r at slots r * MAX_SEQ + position)."""
    b, length = len(ps), len(ps[0])
    model.setup_cache(b, MAX_SEQ)
    toks = torch.tensor(ps, device=model.device)
    model(toks[:, :-1], 0)
    step = DecodeStep(model, b, chunk, sampling=False, graph_mode=graph_mode)
    buf = step.buffers
    buf.tokens.copy_(toks[:, -1])
    buf.positions.fill_(length - 1)
    buf.block_table[:, 0].copy_(torch.arange(b, dtype=torch.int32, device=model.device))
    return step


@pytest.mark.usefixtures("one_torch_thread")
def test_max_rows_and_the_batch_check():
    model = tiny_model()
    model.setup_cache(2, MAX_SEQ)
    assert MAX_ROWS == sg.MAX_ROWS == 1024
    for bad in (0, MAX_ROWS + 1):
        with pytest.raises(ValueError, match=r"decode batch must be in \[1, 1024\]"):
            DecodeStep(model, bad, 2, sampling=False, graph_mode="eager")
    assert not DecodeStep(model, 2, 2, sampling=False, graph_mode="eager").gemm
    assert DecodeStep(model, 65, 2, sampling=False, graph_mode="eager").gemm


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(("rows", "new", "seed"), [(80, 6, 1), (600, 3, 4)])
def test_gemm_path_rows_decode_meta_loop_greedy_tokens(rows, new, seed):
    """80 rows (beyond decode_linear's 64) and 600 (past the 512 a step used to stop at): the
    GEMM path's greedy tokens are Meta's loop's."""
    model = tiny_model()
    ps = equal_length_prompts(rows, 4 if rows < 512 else 3, seed=seed)
    want = generate_tokens(model, ps, new, eos_id=-1, pad_id=-1, max_seq_len=MAX_SEQ)
    model.clear_cache()
    step = prefilled_step(model, ps, new)
    assert step.gemm
    step.run(new)
    assert step.buffers.history.tolist() == [w[len(p) :] for w, p in zip(want, ps)]


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_forced_crossover_equals_the_decode_linear_path(kernels, monkeypatch):
    """A 3-row step on both paths (crossover forced to 1 / 65): same logits up to summation
    order (the reference chains are the same ops), same greedy tokens."""
    ps = equal_length_prompts(3, 5, seed=2)
    n = 4 if kernels == "reference" else 2  # the interpreter's steps are the cost: 2 show it
    out = {}
    for rows in (1, 65):
        monkeypatch.setattr(sg, "_TUNE", {"float32": rows})
        model = tiny_model(kernels)
        step = prefilled_step(model, ps, n)
        assert step.gemm == (rows == 1)
        logits = step.logits().clone()
        step.run(n)
        out[rows] = logits, step.buffers.history.clone()
    torch.testing.assert_close(out[1][0], out[65][0], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[1][1], out[65][1])


@pytest.mark.usefixtures("one_torch_thread")
def test_fp8_gemm_step_is_the_w8a8_forward(monkeypatch):
    """An FP8 model above the crossover decodes with the scorer's math (W8A8): the step's
    logits are the model's forward logits at that position; Triton kernels (interpreter) and
    the reference path agree."""
    monkeypatch.setattr(sg, "_TUNE", {"fp8": 1})
    ps = equal_length_prompts(3, 5, seed=3)
    logits = {}
    for kernels in ("reference", "triton"):
        model = tiny_model(kernels, quant="fp8", seed=5)
        step = prefilled_step(model, ps, 2)
        assert step.gemm
        logits[kernels] = step.logits().float()
        model.clear_cache()
    full = tiny_model("reference", quant="fp8", seed=5)(torch.tensor(ps))[:, -1]
    torch.testing.assert_close(logits["reference"], full, rtol=1e-4, atol=1e-4)
    err = (logits["triton"] - logits["reference"]).norm() / logits["reference"].norm()
    assert err < 1e-3


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(
    "dtype, quant, kernels",
    slow_beyond(
        {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None),
         "bf16-fp8": (torch.bfloat16, "fp8")},
        {"reference": "reference", "triton": "triton"},
        # the interpreter's steps take the time: the Triton path once, on FP8 weights
        fast={("fp32", "reference"), ("bf16", "reference"), ("bf16-fp8", "reference"),
              ("bf16-fp8", "triton")},
    ),
)  # fmt: skip
def test_residual_adds_made_by_the_next_norm_change_no_bit(kernels, dtype, quant, monkeypatch):
    """On the GEMM path the wo / w2 residual adds are made by the next RMSNorm kernel
    (``defer_residual``, the default on one rank): the logits and greedy tokens equal, bit for
    bit, those of a separate add after each product (the same rounding of the same sum)."""
    monkeypatch.setattr(sg, "_TUNE", {"float32": 1, "bfloat16": 1, "fp8": 1})
    args = ModelArgs.from_meta_params(TINY_PARAMS, max_seq_len=MAX_SEQ)
    ps = equal_length_prompts(3, 5, seed=4)
    out = {}
    for defer in (False, True):
        model = random_model(args, "cpu", dtype, seed=6, kernels=kernels, quant=quant)
        step = prefilled_step(model, ps, 3)
        assert step.gemm and step.defer_residual
        step.defer_residual = defer
        logits = step.logits().clone()
        step.run(3)
        out[defer] = logits, step.buffers.history.clone()
    assert torch.equal(out[True][0], out[False][0])
    assert torch.equal(out[True][1], out[False][1])


@pytest.mark.usefixtures("one_torch_thread")
def test_norm_residual_is_checked_and_returns_the_sum():
    x, r = torch.randn(3, 64), torch.randn(3, 64)
    w, nw = torch.randn(8, 64), torch.rand(64) + 0.5
    y, h = sg.decode_gemm_reference(x, w, norm_weight=nw, eps=1e-5, norm_residual=r)
    assert torch.equal(h, x + r)
    torch.testing.assert_close(y, sg.decode_gemm_reference(x + r, w, norm_weight=nw, eps=1e-5))
    with pytest.raises(ValueError, match="norm_residual needs norm_weight"):
        sg.decode_gemm_reference(x, w, norm_residual=r)
    with pytest.raises(ValueError, match="norm_residual must have x's shape"):
        sg.decode_gemm_reference(x, w, norm_weight=nw, eps=1e-5, norm_residual=r[:2])


@pytest.mark.usefixtures("one_torch_thread")
def test_fp8_below_the_crossover_keeps_the_w8a16_gemvs(monkeypatch):
    monkeypatch.setattr(sg, "_TUNE", {"fp8": 65})
    model = tiny_model(quant="fp8")
    model.setup_cache(2, MAX_SEQ)
    assert not DecodeStep(model, 2, 2, sampling=False, graph_mode="eager").gemm


def _tp_worker(rank: int, world: int, init_file: str, ps: list, out_file: str) -> None:
    import torch.distributed as dist

    from nakta_model.parallel import ParallelContext

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        sg._TUNE["float32"] = 1  # every bucket on the GEMM path
        args = ModelArgs.from_meta_params(TINY_PARAMS, max_seq_len=MAX_SEQ)
        model = load(
            state_dict_source(meta_state_dict(TINY_PARAMS, seed=3), args), "cpu", None,
            ParallelContext(rank, world), kernels="reference",
        )  # fmt: skip
        res = Generator(model, max_batch=3, max_seq_len=MAX_SEQ, chunk=3).generate(
            greedy_requests(ps, 6, None)
        )
        if rank == 0:
            torch.save([r.tokens for r in res], out_file)
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.slow  # two fresh interpreters: a few seconds
def test_tensor_parallel_gemm_path_two_gloo_ranks_equals_one_process(tmp_path, monkeypatch):
    """tp=2 on the GEMM path: the all-reduce sits before the residual add, as on the GEMV path."""
    import torch.multiprocessing as mp

    ps = [[1, 7, 9], [1, 200, 3, 4, 5], [1, 33]]
    out = tmp_path / "tp.pt"
    mp.start_processes(
        _tp_worker, args=(2, str(tmp_path / "rdv"), ps, str(out)), nprocs=2, join=True,
        start_method="spawn",
    )  # fmt: skip
    monkeypatch.setattr(sg, "_TUNE", {"float32": 1})
    want = Generator(tiny_model(), max_batch=3, max_seq_len=MAX_SEQ, chunk=3).generate(
        greedy_requests(ps, 6, None)
    )
    assert torch.load(out) == [r.tokens for r in want]


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.gpu
@pytest.mark.parametrize("quant", [None, "fp8"])
def test_gpu_captured_gemm_step_equals_eager(quant):
    """On the GPU the GEMM path (cuBLAS / cuBLASLt) is captured in the step's CUDA graph: 80
    rows replayed give the eager step's tokens."""
    if quant and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9")
    args = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512,
                     multiple_of=64, max_seq_len=64)  # fmt: skip
    model = random_model(args, "cuda", torch.bfloat16, seed=2, quant=quant)
    ps = equal_length_prompts(80, 6, seed=4)
    out = []
    for graph in (False, True):
        step = prefilled_step(model, ps, 8, "cuda_graph" if graph else "eager")
        assert step.gemm
        if graph:
            step.capture()
        step.run(8)
        out.append(step.buffers.history.clone())
        model.clear_cache()
    assert torch.equal(out[0], out[1])


# ------------------------------------------------------------------------------------------------
# ``step_gemm.decode_gemm``: the decode step's linears as GEMMs with the fused RMSNorm / SwiGLU /
# RoPE kernels around them, against ``decode_gemm_reference`` (plain PyTorch), against
# ``decode_linear_reference`` (the same rounding points: bit for bit in the reference chain) and
# an fp64 computation; FP8 weights as W8A8 against the scorer's chain (quantizing norm / SwiGLU,
# ``fp8_matmul_reference``); the crossover rule and its overrides.
#
# CPU runs use the Triton interpreter on tiny odd shapes (strided inputs from
# ``test_decode_linear.make_case``), with rows on both sides of ``decode_linear.MAX_BATCH``.
# ------------------------------------------------------------------------------------------------


VARIANTS = ["plain", "norm", "residual", "norm_swiglu", "norm_rope"]


def _gemm_kw(kw: dict) -> dict:
    return {k: v for k, v in kw.items() if k != "out_dtype"}


CASES = [(v, torch.bfloat16, b) for v in VARIANTS for b in (3, 70)]
CASES += [(v, dt, 5) for v in VARIANTS for dt in (torch.float32, torch.float16)]


@pytest.mark.parametrize("variant, dtype, rows", CASES)
def test_blocks_match_reference_and_fp64(variant, dtype, rows, device):
    """Every block and dtype, rows below and above decode_linear's 64: kernels vs reference,
    the reference vs decode_linear_reference bit for bit (the same chain), both vs fp64."""
    x, w, kw, ref_kw = make_case(variant, rows, dtype, device)
    kw, ref_kw = _gemm_kw(kw), _gemm_kw(ref_kw)
    got = decode_gemm(x, w, **kw)
    ref = decode_gemm_reference(x, w, **ref_kw)
    assert not torch.isnan(got).any()
    if variant == "norm_rope" and interpreter_enabled():
        # the interpreter stores the rope kernel's fp32 -> bf16/fp16 by truncation (the GPU
        # rounds to nearest, as the reference): an ulp apart here
        torch.testing.assert_close(got, ref)
    else:
        assert_matches_reference(got, ref, dtype)
    assert_near_fp64(got, expected_fp64(x, w, kw), dtype)
    if variant == "norm_rope":
        r, rr = kw["rope"], ref_kw["rope"]
        for c, cr in ((r.k_cache, rr.k_cache), (r.v_cache, rr.v_cache)):
            torch.testing.assert_close(c, cr, equal_nan=True)  # untouched slots stay NaN
    if rows <= 64:  # (rope: writes the same K/V into the reference's caches again)
        want = decode_linear_reference(x, w, **ref_kw)
        assert torch.equal(ref, want)


def _fp8_case(variant: str, rows: int, dtype, device):
    x, w, kw, _ = make_case(variant, rows, dtype, device)
    q, s = quantize_weight(w)
    kw = _gemm_kw(kw)
    return x, q, s, kw


def _fp8_want(x, q, s, kw):
    """The scorer's W8A8 chain in plain PyTorch: quantizing norm (or quantize_rows), the exact
    fp32 FP8 GEMM, then the residual add / quantizing SwiGLU / rope."""
    dtype = x.dtype
    if kw.get("norm_weight") is not None:
        xq = rms_norm_fp8_reference(x, kw["norm_weight"], kw["eps"])
    else:
        xq = quantize_rows_reference(x)
    y = fp8_matmul_reference(xq.q, xq.scale, q, s, dtype)
    if kw.get("residual") is not None:
        return kw["residual"] + y
    if kw.get("swiglu"):
        return swiglu_fp8_reference(y)
    if kw.get("rope") is not None:
        r = kw["rope"]
        apply_rope_qkv_reference(
            y, r.positions, r.cos, r.sin, r.n_q_heads, r.n_kv_heads, r.head_dim,
            interleaved=True, k_cache=r.k_cache.clone(), v_cache=r.v_cache.clone(),
            cache_slots=r.cache_slots,
        )  # fmt: skip
        return y[:, : r.n_q_heads * r.head_dim]
    return y


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype, rows", [(torch.bfloat16, 67), (torch.float32, 4)])
def test_fp8_blocks_are_the_scorers_w8a8_chain(variant, dtype, rows, device):
    """FP8 weights: quantized activations and the exact FP8 GEMM (emulated off the GPU); the
    SwiGLU block hands back QuantRows, and a QuantRows x (w2's) is taken as is."""
    x, q, s, kw = _fp8_case(variant, rows, dtype, device)
    got = decode_gemm(x, q, weight_scale=s, **kw)
    ref = decode_gemm_reference(x, q, weight_scale=s, **kw)
    want = _fp8_want(x, q, s, kw)
    if variant == "norm_swiglu":
        assert isinstance(got, QuantRows) and isinstance(ref, QuantRows)
        assert torch.equal(ref.scale, want.scale) and torch.equal(ref.q, want.q)
        # the kernel path: an ulp of silu (fp32) or of the GEMM's sum may move an amax or a code
        torch.testing.assert_close(got.scale, want.scale, rtol=1e-5, atol=0)
        assert (got.q.float() != want.q.float()).float().mean() <= 0.02
        return
    assert torch.equal(ref, want)
    if variant == "norm_rope" and interpreter_enabled():  # truncating stores, see above
        torch.testing.assert_close(got, ref)
    else:
        assert_matches_reference(got, ref, dtype)


def test_quant_rows_input_with_residual_and_out_dtype(device):
    """w2 after the FP8 SwiGLU: QuantRows in, the residual's dtype out (or out_dtype given)."""
    dtype = torch.bfloat16
    x, q, s, kw = _fp8_case("residual", 6, dtype, device)
    xq = quantize_rows_reference(x)
    got = decode_gemm(xq, q, weight_scale=s, residual=kw["residual"])
    want = kw["residual"] + fp8_matmul_reference(xq.q, xq.scale, q, s, dtype)
    assert_matches_reference(got, want, dtype)
    plain = decode_gemm_reference(xq, q, weight_scale=s, out_dtype=dtype)
    assert torch.equal(plain, fp8_matmul_reference(xq.q, xq.scale, q, s, dtype))
    with pytest.raises(TypeError, match="out_dtype"):
        decode_gemm_reference(xq, q, weight_scale=s)
    with pytest.raises(ValueError, match="already normalized"):
        decode_gemm_reference(xq, q, weight_scale=s, out_dtype=dtype,
                              norm_weight=torch.ones(x.shape[1], dtype=dtype), eps=1e-5)  # fmt: skip
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        decode_gemm_reference(xq, q.to(dtype), out_dtype=dtype)


def test_bad_arguments_name_what_is_wrong():
    x = torch.randn(3, 8)
    w = torch.randn(5, 8)
    with pytest.raises(ValueError, match=r"1\.\.1024 rows"):
        decode_gemm_reference(torch.randn(1025, 8), w)
    with pytest.raises(ValueError, match="weight must have shape"):
        decode_gemm_reference(x, torch.randn(5, 7))
    with pytest.raises(TypeError, match="out_dtype"):
        decode_gemm_reference(x, w, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="exclusive"):
        decode_gemm_reference(x, w, residual=torch.randn(3, 5), swiglu=True)
    with pytest.raises(ValueError, match="weight_scale"):
        decode_gemm_reference(x, w, weight_scale=torch.ones(5))


def test_crossover_defaults_overrides_and_limits(monkeypatch):
    assert sg.crossover(torch.bfloat16) == sg.CROSSOVER["bfloat16"]
    assert sg.crossover(torch.bfloat16, "fp8") == sg.CROSSOVER["fp8"]
    assert sg.use_gemm(65, torch.float32) and not sg.use_gemm(1, torch.float32)
    monkeypatch.setattr(sg, "_TUNE", {"float32": 3, "fp8": 2})
    assert sg.crossover(torch.float32) == 3 and sg.crossover(torch.float16, "fp8") == 2
    assert sg.crossover(torch.float16) == sg.CROSSOVER["float16"]
    monkeypatch.setattr(sg, "_TUNE", {"bfloat16": 66})
    with pytest.raises(ValueError, match=r"\[1, 65\]"):
        sg.crossover(torch.bfloat16)


def test_rows_above_decode_linear_limit_are_rejected_there_not_here(device):
    """The reason the GEMM path exists: decode_linear stops at 64 rows."""
    x = _padded(65, 16, torch.float32, device)
    w = torch.randn(8, 16, device=device)
    with pytest.raises(ValueError, match=r"1\.\.64 rows"):
        decode_linear_reference(x, w)
    torch.testing.assert_close(decode_gemm(x, w), x @ w.T)
