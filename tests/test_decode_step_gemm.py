"""The decode step on its GEMM path (``step_gemm``): above 64 rows, and below where the crossover
is forced low, against Meta's loop (greedy tokens), the ``decode_linear`` path (logits), the
Triton kernels against the reference path, FP8 models against their W8A8 forward, and tensor
parallelism over two gloo ranks.

CPU: tiny models in fp32 (the reference path, and the Triton kernels in the interpreter at a few
rows); the step is built directly (the engine at more than 64 rows: test_generation_paged).
"""

from __future__ import annotations

import random

import pytest
import torch
from checkpoint_factory import TINY_PARAMS, meta_state_dict
from tiers import slow_beyond

from nakta_model.config import ModelArgs
from nakta_model.generation import Generator, generate_tokens, greedy_requests
from nakta_model.generation import step_gemm as sg
from nakta_model.generation.step import MAX_ROWS, DecodeStep
from nakta_model.loading import load, random_model
from nakta_model.sources import state_dict_source

MAX_SEQ = 32
pytestmark = pytest.mark.usefixtures("one_torch_thread")


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


def test_max_rows_and_the_batch_check():
    model = tiny_model()
    model.setup_cache(2, MAX_SEQ)
    assert MAX_ROWS == sg.MAX_ROWS == 512
    for bad in (0, MAX_ROWS + 1):
        with pytest.raises(ValueError, match=r"decode batch must be in \[1, 512\]"):
            DecodeStep(model, bad, 2, sampling=False, graph_mode="eager")
    assert not DecodeStep(model, 2, 2, sampling=False, graph_mode="eager").gemm
    assert DecodeStep(model, 65, 2, sampling=False, graph_mode="eager").gemm


def test_80_rows_decode_meta_loop_greedy_tokens():
    """80 rows (beyond decode_linear's 64): the GEMM path's greedy tokens are Meta's loop's."""
    model = tiny_model()
    ps = equal_length_prompts(80, 4, seed=1)
    want = generate_tokens(model, ps, 6, eos_id=-1, pad_id=-1, max_seq_len=MAX_SEQ)
    model.clear_cache()
    step = prefilled_step(model, ps, 6)
    assert step.gemm
    step.run(6)
    assert step.buffers.history.tolist() == [w[len(p) :] for w, p in zip(want, ps)]


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
