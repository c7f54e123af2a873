"""``greedy_advance_``: the greedy decode step's argmax and bookkeeping in one launch, against
its PyTorch twin (``logits.float().argmax``, the history / token / position updates) on fresh
random logits: ties, NaN and -inf rows, odd vocabularies, strided rows, every float dtype."""

from __future__ import annotations

import pytest
import torch

from nakta_model.kernels.greedy_advance import greedy_advance_, greedy_advance_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


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
def test_bad_input_is_named(change, message):
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
