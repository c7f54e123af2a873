"""``step_inputs``: a decode step's write slots, key counts and embedding rows in one launch,
against its PyTorch twin (the step's former gather / multiply / remainder / index-select) on
random page tables, positions and tokens; out-of-range positions and tokens give -1 / NaN
instead of a read past the table or the vocabulary; bad arguments are named."""

from __future__ import annotations

import pytest
import torch

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
