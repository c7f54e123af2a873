"""A decode step's inputs in one launch: each row's KV-cache write slot through its page table,
its key count, and its token's embedding row; the step counter advanced.

A decode step began with eight small PyTorch launches before the first layer (the page of the
position, its cast, the table gather, the slot's multiply, remainder and add, the length, the
embedding's index select: launch time a batch-1 token waits for), and ended with the step
counter's add. One program per
row here: ``slots[b] = table[b, pos // page] * page + pos % page``, ``lens[b] = pos + 1``,
``h[b] = embedding[tokens[b]]`` (a copy: the same bits), and with ``advance_step`` program 0
adds one to ``step`` (the step's history entry is then ``step - 1``: ``greedy_advance_``'s
``step_offset``). A position outside the table gets slot -1 (the RoPE epilogue then writes no
K/V and NaN queries), a token outside the vocabulary a NaN row: never a read past either.

Forward only; ``step_inputs_reference`` is the PyTorch twin (the step's former ops).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nakta_model.kernels._checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_ndim,
    check_positive_int,
    check_tensor,
    check_triton_device,
    interpreter_enabled,
)

__all__ = ["step_inputs", "step_inputs_reference"]


@triton.jit
def _step_inputs_kernel(
    POS, TABLE, TOKENS, EMB, SLOTS, LENS, H, STEP, page, n_pages, vocab, dim, stride_tb,
    stride_e, stride_h, ADVANCE_STEP: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program per row: its slot and length, then its embedding row in ``BLOCK_D`` steps."""
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + row)
    idx = pos // page
    ok = (pos >= 0) & (idx < n_pages)
    pg = tl.load(TABLE + row * stride_tb + tl.where(ok, idx, 0))
    tl.store(SLOTS + row, tl.where(ok, pg * page + pos % page, -1))
    tl.store(LENS + row, pos + 1)
    tok = tl.load(TOKENS + row)
    tok_ok = (tok >= 0) & (tok < vocab)
    src = EMB + tl.where(tok_ok, tok, 0).to(tl.int64) * stride_e
    offs = tl.arange(0, BLOCK_D)
    for d0 in range(0, dim, BLOCK_D):
        d = d0 + offs
        e = tl.load(src + d, mask=d < dim)
        e = tl.where(tok_ok, e, float("nan")).to(H.dtype.element_ty)
        tl.store(H + row * stride_h + d, e, mask=d < dim)
    if ADVANCE_STEP:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if row == 0:
            tl.store(STEP, tl.load(STEP) + 1)


def _check_args(positions, block_table, page, tokens, embedding, step) -> tuple[int, int]:
    positions = check_tensor("positions", positions)
    check_dtype("positions", positions, (torch.int32,))
    check_ndim("positions", positions, 1)
    b = positions.shape[0]
    block_table = check_tensor("block_table", block_table)
    check_dtype("block_table", block_table, (torch.int32,))
    check_ndim("block_table", block_table, 2)
    if block_table.shape[0] != b or block_table.shape[1] < 1 or block_table.stride(1) != 1:
        raise ValueError(
            f"block_table must be [B={b}, pages >= 1] with unit-stride columns, got "
            f"{tuple(block_table.shape)} strides {block_table.stride()}"
        )
    check_positive_int("page", page)
    tokens = check_tensor("tokens", tokens)
    check_dtype("tokens", tokens, (torch.int64,))
    if tuple(tokens.shape) != (b,):
        raise ValueError(f"tokens must have shape [{b}], got {list(tokens.shape)}")
    embedding = check_tensor("embedding", embedding)
    check_dtype("embedding", embedding, FLOAT_DTYPES)
    check_ndim("embedding", embedding, 2)
    if embedding.stride(1) != 1:
        raise ValueError(f"embedding must be unit-stride along dim, got {embedding.stride()}")
    step = check_tensor("step", step)
    check_dtype("step", step, (torch.int64,))
    if tuple(step.shape) != (1,):
        raise ValueError(f"step must have shape [1], got {list(step.shape)}")
    for name, t in (("block_table", block_table), ("tokens", tokens),
                    ("embedding", embedding), ("step", step)):  # fmt: skip
        if t.device != positions.device:
            raise ValueError(f"{name} must be on {positions.device}, got {t.device}")
    if positions.stride(0) != 1 or tokens.stride(0) != 1:
        raise ValueError("positions and tokens must be contiguous")
    return b, embedding.shape[1]


def step_inputs(
    positions: torch.Tensor,
    block_table: torch.Tensor,
    page: int,
    tokens: torch.Tensor,
    embedding: torch.Tensor,
    step: torch.Tensor,
    advance_step: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(slots, lens, h)`` for a decode step's rows: int32 ``[B]`` write slots
    (``block_table[b, pos // page] * page + pos % page``; -1 past the table), int32 ``[B]``
    key counts (``pos + 1``), and ``embedding[tokens]`` ``[B, dim]`` (a NaN row for a token
    outside the vocabulary). ``positions`` int32 ``[B]``, ``block_table`` int32 ``[B, W]``,
    ``tokens`` int64 ``[B]``, ``step`` int64 ``[1]`` (``advance_step``: ``step += 1``, on the
    device). One launch, CUDA-graph capturable."""
    b, dim = _check_args(positions, block_table, page, tokens, embedding, step)
    check_triton_device("positions", positions)
    slots = torch.empty(b, dtype=torch.int32, device=positions.device)
    lens = torch.empty(b, dtype=torch.int32, device=positions.device)
    h = torch.empty(b, dim, dtype=embedding.dtype, device=positions.device)
    if b == 0:
        if advance_step:
            step.add_(1)
        return slots, lens, h
    block_d = 256 if interpreter_enabled() else min(4096, triton.next_power_of_2(dim))
    _step_inputs_kernel[(b,)](
        positions, block_table, tokens, embedding, slots, lens, h, step, page,
        block_table.shape[1], embedding.shape[0], dim, block_table.stride(0),
        embedding.stride(0), h.stride(0), ADVANCE_STEP=bool(advance_step), BLOCK_D=block_d,
        num_warps=4,
    )  # fmt: skip
    return slots, lens, h


def step_inputs_reference(
    positions: torch.Tensor,
    block_table: torch.Tensor,
    page: int,
    tokens: torch.Tensor,
    embedding: torch.Tensor,
    step: torch.Tensor,
    advance_step: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch twin of :func:`step_inputs` for in-range positions and tokens (the step's
    former ops; out of range they fail or read garbage, where the kernel writes -1 / NaN)."""
    _check_args(positions, block_table, page, tokens, embedding, step)
    page_of = block_table.gather(1, (positions // page).long()[:, None])[:, 0]
    slots = page_of * page + positions % page
    lens = positions + 1
    h = torch.nn.functional.embedding(tokens, embedding)
    if advance_step:
        step.add_(1)
    return slots, lens, h
