"""The decode step's own launches around the layers (``step_kernels``: ``step_inputs`` first,
``greedy_advance_`` last on greedy steps) change no bit of what a step writes: three steps of a
tiny model through the Triton kernels (interpreter) with them on and off give the same history,
tokens, positions and step counter, greedy and sampling (seeded draws), batch 1 and 3."""

from __future__ import annotations

import pytest
import torch
from test_decode_step_gemm import equal_length_prompts, prefilled_step, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


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


@pytest.mark.parametrize("batch, sampling", [(1, False), (3, False), (3, True)])
def test_step_kernels_change_no_bit(batch, sampling):
    # one row decodes through the fused decode_linear launches (RoPE reads the positions the
    # step kernels advanced), ~7x the interpreter's time of 3 rows a step: 2 steps show it
    n = 2 if batch == 1 else 3
    off = three_steps(False, batch, sampling, n)
    on = three_steps(True, batch, sampling, n)
    for k in off:
        assert torch.equal(on[k], off[k]), k
    assert int(on["step"]) == n and torch.equal(on["history"][:, :n][:, -1], on["tokens"])
