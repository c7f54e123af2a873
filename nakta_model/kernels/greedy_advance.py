"""Greedy decoding's end of step in one launch: each row's argmax written into the history and
the next token, its position advanced.

A greedy decode step ended in five small PyTorch launches after the LM head (an fp32 copy of
the logits, ``argmax``, ``index_copy_`` into the history, the token copy, the position add):
launch time a batch-1 token waits for. This kernel reads each row's logits
once in their own dtype (fp32 compares: the same order as ``logits.float().argmax``), keeps per
lane the first index of its running max and of its first NaN (``torch.argmax`` takes a NaN as
the largest value: the first NaN wins), and writes ``history[row, step]``, ``tokens[row]`` and
``positions[row] + 1``. The shared ``step`` counter is left to the caller (every row program
reads it; none may advance it): the decode step advances it in its first launch
(``step_inputs``) and writes the history at ``step - 1`` (``step_offset``).

Forward only; ``greedy_advance_reference`` is the PyTorch twin (CPU fallback, tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nakta_model.kernels._checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_ndim,
    check_tensor,
    check_triton_device,
    interpreter_enabled,
)

__all__ = ["greedy_advance_", "greedy_advance_reference"]


@triton.jit
def _greedy_advance_kernel(
    X, HIST, STEP, TOKENS, POS, n_cols, stride_x, stride_hb, stride_hs, step_offset,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """One program per row: first argmax (NaN first) over column blocks, then the row's
    history entry, token and position."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)  # per-lane running max (no NaN)
    best = tl.zeros([BLOCK], dtype=tl.int32)  # per-lane first index of the lane's max
    nan_at = tl.zeros([BLOCK], dtype=tl.int32) + n_cols  # per-lane first NaN (n_cols: none)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        x = tl.load(X + row * stride_x + cols, mask=cols < n_cols, other=float("-inf"))
        x = x.to(tl.float32)
        is_nan = x != x
        nan_at = tl.minimum(nan_at, tl.where(is_nan, cols, n_cols))
        x = tl.where(is_nan, float("-inf"), x)
        better = x > m  # strictly greater: the earlier index wins ties, as torch.argmax
        best = tl.where(better, cols, best)
        m = tl.maximum(m, x)
    row_max = tl.max(m, 0)
    arg = tl.min(tl.where(m == row_max, best, n_cols), 0)  # the smallest index holding it
    first_nan = tl.min(nan_at, 0)
    token = tl.where(first_nan < n_cols, first_nan, arg).to(tl.int64)
    step = tl.load(STEP) + step_offset
    tl.store(HIST + row * stride_hb + step * stride_hs, token)
    tl.store(TOKENS + row, token)
    tl.store(POS + row, tl.load(POS + row) + 1)


# The whole row in one or two blocks (16K columns, 16 warps: 32 a thread); 256 under the
# interpreter (CPU tests: several blocks a row).
_MAX_BLOCK = 16384


def _config(n_cols: int) -> dict[str, int]:
    if interpreter_enabled():
        return {"BLOCK": 256, "num_warps": 4}
    block = min(_MAX_BLOCK, triton.next_power_of_2(n_cols))
    return {"BLOCK": block, "num_warps": max(4, min(16, block // 1024))}


def _check_args(logits, history, step, tokens, positions, kernel: bool) -> None:
    logits = check_tensor("logits", logits)
    check_dtype("logits", logits, FLOAT_DTYPES if kernel else (*FLOAT_DTYPES, torch.float64))
    check_ndim("logits", logits, 2)
    n, v = logits.shape
    if v == 0:
        raise ValueError("logits must have at least one column")
    if logits.stride(1) != 1:
        raise ValueError(f"logits must be unit-stride along columns, got strides {logits.stride()}")
    for name, t, dtype, shape in (
        ("history", history, torch.int64, None), ("step", step, torch.int64, (1,)),
        ("tokens", tokens, torch.int64, (n,)), ("positions", positions, torch.int32, (n,)),
    ):  # fmt: skip
        t = check_tensor(name, t)
        check_dtype(name, t, (dtype,))
        if shape is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
        if t.device != logits.device:
            raise ValueError(f"{name} must be on {logits.device}, got {t.device}")
    check_ndim("history", history, 2)
    if history.shape[0] != n:
        raise ValueError(f"history must have {n} rows (one per logits row), got {history.shape[0]}")
    if tokens.stride(0) != 1 or positions.stride(0) != 1:
        raise ValueError("tokens and positions must be contiguous")


def _check_offset(step_offset: object) -> None:
    if isinstance(step_offset, bool) or not isinstance(step_offset, int):
        raise TypeError(f"step_offset must be an int, got {type(step_offset).__name__}")


def greedy_advance_(
    logits: torch.Tensor,
    history: torch.Tensor,
    step: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    step_offset: int = 0,
) -> torch.Tensor:
    """For every row b of ``logits [B, V]``: ``t = argmax(logits[b])`` (first maximum; a NaN
    counts as the largest value, as ``torch.argmax``), ``history[b, step + step_offset] = t``
    (int64 ``[B, C]``, ``step`` int64 ``[1]`` on the device: no host sync), ``tokens[b] = t``
    (int64 ``[B]``), ``positions[b] += 1`` (int32 ``[B]``). ``step`` itself is not advanced.
    Returns ``tokens``. CUDA-graph capturable."""
    _check_args(logits, history, step, tokens, positions, kernel=True)
    _check_offset(step_offset)
    check_triton_device("logits", logits)
    n, v = logits.shape
    if n == 0:
        return tokens
    cfg = _config(v)
    _greedy_advance_kernel[(n,)](
        logits, history, step, tokens, positions, v, logits.stride(0), history.stride(0),
        history.stride(1), step_offset, BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"],
    )  # fmt: skip
    return tokens


def greedy_advance_reference(
    logits: torch.Tensor,
    history: torch.Tensor,
    step: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    step_offset: int = 0,
) -> torch.Tensor:
    """PyTorch twin of :func:`greedy_advance_` (what the decode step ran before it)."""
    _check_args(logits, history, step, tokens, positions, kernel=False)
    _check_offset(step_offset)
    x = logits if logits.dtype == torch.float64 else logits.float()
    nxt = x.argmax(dim=-1)
    history.index_copy_(1, step + step_offset, nxt[:, None])
    tokens.copy_(nxt)
    positions.add_(1)
    return tokens
