"""``step_inputs``: a decode step's write slots, key counts and embedding rows in one launch,
against its PyTorch twin (the step's former gather / multiply / remainder / index-select) on
random page tables, positions and tokens; out-of-range positions and tokens give -1 / NaN
instead of a read past the table or the vocabulary; bad arguments are named.

Here too: ``greedy_advance_`` (the greedy step's argmax and bookkeeping in one launch), the
decode step's launches around the layers (``step_kernels``), and the batch-1 chain's dependent
launches compiled for sm_90 without a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
from test_step_gemm import equal_length_prompts, prefilled_step, tiny_model

from nakta_model.kernels.greedy_advance import greedy_advance_, greedy_advance_reference
from nakta_model.kernels.step_inputs import step_inputs, step_inputs_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def case(batch=4, width=5, page=16, vocab=50, dim=300, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    table = torch.stack([torch.randperm(40, generator=g)[:width] for _ in range(batch)])
    positions = torch.randint(0, width * page, (batch,), generator=g).to(torch.int32)
    positions[0] = width * page - 1  # the last slot of the table
    tokens = torch.randint(0, vocab, (batch,), generator=g)
    emb = torch.randn(vocab, dim + 7, generator=g).to(dtype)[:, 3 : dim + 3]  # strided rows
    return positions, table.to(torch.int32), page, tokens, emb


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, dim", [(1, 4096), (4, 300), (3, 1)])
def test_matches_the_pytorch_ops(batch, dim, dtype):
    positions, table, page, tokens, emb = case(batch, dim=dim, dtype=dtype, seed=dim)
    step_a, step_b = torch.tensor([3]), torch.tensor([3])
    got = step_inputs(positions, table, page, tokens, emb, step_a, advance_step=True)
    want = step_inputs_reference(positions, table, page, tokens, emb, step_b, advance_step=True)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)
    assert int(step_a) == int(step_b) == 4
    step_inputs(positions, table, page, tokens, emb, step_a)
    assert int(step_a) == 4  # only when asked


def test_out_of_range_positions_and_tokens_read_nothing():
    positions, table, page, tokens, emb = case(batch=4)
    positions[1] = 5 * page  # one past the table
    positions[2] = -1
    tokens[3] = 50  # the vocabulary's size
    slots, lens, h = step_inputs(
        positions, table, page, tokens, emb, torch.zeros(1, dtype=torch.int64)
    )
    assert slots[1] == -1 and slots[2] == -1 and slots[0] >= 0
    assert torch.isnan(h[3]).all() and not torch.isnan(h[:3]).any()
    assert torch.equal(lens, positions + 1)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(positions=torch.zeros(4, dtype=torch.int64)), "positions"),
        (dict(block_table=torch.zeros(3, 5, dtype=torch.int32)), "block_table must be"),
        (dict(block_table=torch.zeros(4, 5)), "block_table"),
        (dict(page=0), "page"),
        (dict(tokens=torch.zeros(4, dtype=torch.int32)), "tokens"),
        (dict(tokens=torch.zeros(3, dtype=torch.int64)), "tokens must have shape"),
        (dict(embedding=torch.zeros(8, 4, dtype=torch.int64)), "embedding"),
        (dict(embedding=torch.zeros(4, 8).t()), "unit-stride"),
        (dict(step=torch.zeros(2, dtype=torch.int64)), "step must have shape"),
    ],
)
def test_bad_input_is_named(change, message):
    positions, table, page, tokens, emb = case(batch=4)
    args = dict(positions=positions, block_table=table, page=page, tokens=tokens, embedding=emb,
                step=torch.zeros(1, dtype=torch.int64))  # fmt: skip
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=message):
        step_inputs(**args)


@pytest.mark.gpu
def test_gpu_matches_and_replays_in_a_graph():
    """Compiled for this GPU: the twin's bits, and a graph replay reads the new positions,
    tokens and step."""
    dev = torch.device("cuda")
    positions, table, page, tokens, emb = (
        t.to(dev) if isinstance(t, torch.Tensor) else t for t in case(batch=3, dim=4096)
    )
    step = torch.zeros(1, dtype=torch.int64, device=dev)
    out = step_inputs(positions, table, page, tokens, emb, step, advance_step=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step_inputs(positions, table, page, tokens, emb, step, advance_step=True)
    positions.copy_((positions + 7) % (5 * page))
    tokens.copy_((tokens + 11) % 50)
    graph.replay()
    want = step_inputs_reference(positions, table, page, tokens, emb, torch.zeros_like(step))
    for g, w in zip(out, want, strict=True):
        assert torch.equal(g, w)
    assert int(step) == 2  # the eager call and the replay (a capture runs nothing)


# ------------------------------------------------------------------------------------------------
# ``greedy_advance_``: the greedy decode step's argmax and bookkeeping in one launch, against its
# PyTorch twin (``logits.float().argmax``, the history / token / position updates) on fresh random
# logits: ties, NaN and -inf rows, odd vocabularies, strided rows, every float dtype.
# ------------------------------------------------------------------------------------------------


def buffers(batch: int, chunk: int = 5, step: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        history=torch.randint(0, 99, (batch, chunk), generator=g),
        step=torch.tensor([step]),
        tokens=torch.randint(0, 99, (batch,), generator=g),
        positions=torch.randint(0, 500, (batch,), generator=g).to(torch.int32),
    )


def run_both(logits, **bufs):
    a = {k: v.clone() for k, v in bufs.items()}
    b = {k: v.clone() for k, v in bufs.items()}
    greedy_advance_(logits, **a)
    greedy_advance_reference(logits, **b)
    for k in bufs:
        assert torch.equal(a[k], b[k]), k
    return a


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, vocab", [(1, 1000), (3, 777), (2, 32000), (1, 1)])
def test_matches_torch_on_random_logits(batch, vocab, dtype):
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    out = run_both(logits, **buffers(batch))
    assert torch.equal(out["history"][:, 2], logits.float().argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_nan_and_minus_inf_as_torch(dtype):
    v = 700  # several 256-column blocks under the interpreter
    logits = torch.zeros(5, v, dtype=dtype)
    logits[0, [10, 300, 650]] = 3.0  # a tie across blocks: the first index
    logits[1, :] = float("-inf")  # all -inf: index 0
    logits[2, [5, 400]] = float("nan")  # NaN is the largest: the first NaN
    logits[2, 100] = float("inf")
    logits[3, 699] = 1.0  # the last column
    logits[4, [257, 258]] = torch.tensor([2.0, 2.0], dtype=dtype)  # a tie inside a block
    out = run_both(logits, **buffers(5))
    assert out["tokens"].tolist() == [10, 0, 5, 699, 257]


def test_strided_rows_and_history_view():
    base = torch.randn(3, 1200, generator=torch.Generator().manual_seed(3))
    logits = base[:, 100:1100]  # rows 1200 apart, 1000 columns
    bufs = buffers(3, chunk=8, step=7)
    bufs["history"] = torch.zeros(3, 16, dtype=torch.int64)[:, ::2]  # a strided history
    out = run_both(logits, **bufs)
    assert torch.equal(out["history"][:, 7], logits.argmax(-1))
    assert torch.equal(out["positions"], bufs["positions"] + 1)


def test_step_offset_writes_the_previous_column():
    """``step_offset=-1``: the decode step has advanced ``step`` in its first launch."""
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(5))
    bufs = buffers(2, chunk=6, step=4)
    a = {k: v.clone() for k, v in bufs.items()}
    b = {k: v.clone() for k, v in bufs.items()}
    greedy_advance_(logits, **a, step_offset=-1)
    greedy_advance_reference(logits, **b, step_offset=-1)
    assert all(torch.equal(a[k], b[k]) for k in bufs)
    assert torch.equal(a["history"][:, 3], logits.argmax(-1))
    assert torch.equal(a["history"][:, 4], bufs["history"][:, 4]) and int(a["step"]) == 4
    with pytest.raises(TypeError, match="step_offset must be an int"):
        greedy_advance_(logits, **a, step_offset=1.0)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(logits=torch.zeros(2, 0)), "at least one column"),
        (dict(logits=torch.zeros(2, 8, dtype=torch.int64)), "logits"),
        (dict(step=torch.tensor([1, 2])), "step must have shape"),
        (dict(tokens=torch.zeros(3, dtype=torch.int64)), "tokens must have shape"),
        (dict(positions=torch.zeros(2, dtype=torch.int64)), "positions"),
        (dict(history=torch.zeros(3, 4, dtype=torch.int64)), "history must have 2 rows"),
        (dict(logits=torch.zeros(8, 2).t()), "unit-stride"),
    ],
)
def test_greedy_advance_bad_input_is_named(change, message):
    args = dict(logits=torch.zeros(2, 8), **buffers(2))
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=message):
        greedy_advance_(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("batch, vocab", [(1, 32000), (4, 32000), (2, 128256), (3, 1000)])
def test_gpu_matches_torch_and_replays_in_a_graph(batch, vocab):
    """Compiled for this GPU: the same bits as the PyTorch twin, also replayed from a CUDA
    graph (the step reads ``step`` on the device: a replay after ``step += 1`` writes the next
    history column)."""
    dev = torch.device("cuda")
    logits = torch.randn(batch, vocab, device=dev).to(torch.bfloat16)
    logits[0, vocab // 3] = logits[0, vocab // 2] = 9.0  # a tie: the first
    bufs = {k: v.to(dev) for k, v in buffers(batch).items()}
    run_both(logits, **bufs)
    a = {k: v.clone() for k, v in bufs.items()}
    greedy_advance_(logits, **a)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        greedy_advance_(logits, **a)
    a["step"].fill_(3)
    logits.copy_(torch.randn(batch, vocab, device=dev).to(torch.bfloat16))
    graph.replay()
    b = {k: v.clone() for k, v in a.items()}
    b["positions"] -= 1
    b["history"][:, 3] = -1
    greedy_advance_reference(logits, **b)  # the same update from the state before the replay
    assert torch.equal(a["history"][:, 3], logits.float().argmax(-1))
    assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["positions"], b["positions"])


# ------------------------------------------------------------------------------------------------
# The decode step's own launches around the layers (``step_kernels``: ``step_inputs`` first,
# ``greedy_advance_`` last on greedy steps) change no bit of what a step writes: three steps of a
# tiny model through the Triton kernels (interpreter) with them on and off give the same history,
# tokens, positions and step counter, greedy and sampling (seeded draws), batch 1 and 3.
# ------------------------------------------------------------------------------------------------


def three_steps(on: bool, batch: int, sampling: bool, n: int = 3) -> dict[str, torch.Tensor]:
    model = tiny_model(kernels="triton")
    step = prefilled_step(model, equal_length_prompts(batch, 6, seed=batch), chunk=4)
    assert step.step_kernels  # the default with kernels; off: the PyTorch ops it replaces
    step.step_kernels = on
    step.sampling = sampling
    if sampling:
        step.buffers.temperature[0] = 1.0  # row 0 draws, the others stay greedy
    torch.manual_seed(7)
    for _ in range(n):
        step()
    buf = step.buffers
    return {k: getattr(buf, k).clone() for k in ("history", "tokens", "positions", "step")}


@pytest.mark.usefixtures("one_torch_thread")
# batch 3 greedy adds no path that batch 1 greedy and batch 3 sampling leave out: slow tier
@pytest.mark.parametrize(
    "batch, sampling", [(1, False), pytest.param(3, False, marks=pytest.mark.slow), (3, True)]
)
def test_step_kernels_change_no_bit(batch, sampling):
    # one row decodes through the fused decode_linear launches (RoPE reads the positions the
    # step kernels advanced), ~7x the interpreter's time of 3 rows a step: 2 steps show it
    n = 2 if batch == 1 else 3
    off = three_steps(False, batch, sampling, n)
    on = three_steps(True, batch, sampling, n)
    for k in off:
        assert torch.equal(on[k], off[k]), k
    assert int(on["step"]) == n and torch.equal(on["history"][:, :n][:, -1], on["tokens"])


# ------------------------------------------------------------------------------------------------
# The batch-1 decode chain's dependent launches, compiled for sm_90 without a GPU.
#
# Programmatic dependent launch never runs on the CPU (not in the interpreter, not off Hopper), so
# what the GPU would run is checked in its PTX: a GEMV with ``EARLY_W`` issues its first weight
# loads before ``griddepcontrol.wait`` (and none without it); decode attention at batch 1 lets the
# next kernel launch at once (and never waits itself).
# ------------------------------------------------------------------------------------------------


BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
needs_ptxas = pytest.mark.skipif(
    not (BIN / "ptxas").exists(), reason="Triton's bundled ptxas is not installed"
)

# compiled in a fresh process: the test session runs Triton's interpreter (TRITON_INTERPRET=1),
# under which kernels are not compiled at all
_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

what, params = json.loads(sys.argv[1])
if what == "linear":
    from nakta_model.kernels.decode_linear import _decode_linear_kernel as kernel
    w_type, pdl, early, block_n, num_warps = params
    pointers = {
        "X": "*bf16", "W": w_type, "WS": "*fp32", "NW": "*bf16", "R": "*bf16", "OUT": "*bf16",
        "POS": "*i32", "COS": "*fp32", "SIN": "*fp32", "KC": "*bf16", "VC": "*bf16",
        "SLOT": "*i64",
    }
    const = dict(
        HEAD_DIM=2, NORM=False, RESIDUAL=True, SWIGLU=False, ROPE=False,
        W_FP8=w_type == "*fp8e4nv", USE_DOT=False, BLOCK_M=1, BLOCK_N=block_n, TILE_N=block_n,
        BLOCK_K=512, EVEN_K=True, PREC=None, UPCAST=False, FAST_SILU=False, ACCURATE=True,
        EMULATE_RNE=False, PDL=pdl, DOT_F16=False, PREFETCH=0, NORM_BLOCK=0, EARLY_W=early,
    )
    floats = ("eps", "inv_k")
else:
    from nakta_model.kernels.decode_attention import _attn_split_kernel as kernel
    (pdl,) = params
    num_warps = 4
    pointers = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "LENS": "*i32", "TABLE": "*i32",
                "PRE_ROWS": "*i32", "PRE_LENS": "*i32", "OUT": "*bf16", "WS": "*fp32"}
    const = dict(GROUP=1, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_S=64, USE_DOT=True,
                 SINGLE=True, PREC=None, UPCAST=False, EMULATE_RNE=False, HAS_TABLE=True,
                 HAS_PREFIX=False, CASCADE=False, LAUNCH_DEPENDENTS=pdl, WINDOW=0,
                 KV_FP8=False, KS=None, VS=None)
    floats = ("qk_scale",)
names = list(kernel.arg_names)
sig = {
    n: "constexpr" if n in const else pointers.get(n, "fp32" if n in floats else "i32")
    for n in names
}
src = ASTSource(kernel, sig, constexprs={(names.index(n),): v for n, v in const.items()})
opts = {"num_warps": num_warps, "num_stages": 3}
sys.stdout.write(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"])
"""


def _ptx(what: str, *params) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE, json.dumps([what, list(params)])], env=env, cwd=root,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    body = proc.stdout
    return body[body.index(".entry") :]


def _first(body: str, *needles: str) -> int:
    return min(body.index(n) for n in needles if n in body)


@needs_ptxas
@pytest.mark.parametrize(("w_type", "block_n"), [("*fp8e4nv", 8), ("*bf16", 16)])
def test_first_weight_tile_is_asked_for_before_the_wait(w_type, block_n):
    body = _ptx("linear", w_type, True, 1, block_n, 4)
    assert body.index("griddepcontrol.launch_dependents") < body.index("griddepcontrol.wait")
    assert _first(body, "ld.global") < body.index("griddepcontrol.wait")
    late = _ptx("linear", w_type, True, 0, block_n, 4)  # without EARLY_W every load waits
    assert late.index("griddepcontrol.wait") < _first(late, "ld.global")


@needs_ptxas
def test_no_dependent_prologue_without_pdl():
    body = _ptx("linear", "*fp8e4nv", False, 1, 8, 4)
    assert "griddepcontrol" not in body


@needs_ptxas
@pytest.mark.parametrize("trigger", [True, False])
def test_attention_lets_the_next_kernel_launch_only_when_asked(trigger):
    body = _ptx("attention", trigger)
    assert ("griddepcontrol.launch_dependents" in body) == trigger
    assert "griddepcontrol.wait" not in body  # an ordinary launch itself
