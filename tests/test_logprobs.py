"""One-pass logsumexp + argmax per row against fp64 PyTorch (Triton in interpreter mode on CPU)."""

from __future__ import annotations

import pytest
import torch

from nakta_model.kernels import logprobs
from nakta_model.kernels.logprobs import (
    row_logsumexp_argmax,
    row_logsumexp_argmax_reference,
    target_logprobs,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_cols", [1, 255, 513, 1000])
def test_matches_fp64_on_random_rows(dtype, n_cols):
    x = (torch.randn(9, n_cols) * 6).to(dtype)
    lse, arg = row_logsumexp_argmax(x)
    want = torch.logsumexp(x.double(), -1)
    assert lse.dtype == torch.float32 and arg.dtype == torch.int32
    torch.testing.assert_close(lse.double(), want, rtol=0, atol=2e-5 * max(1, n_cols**0.5))
    assert torch.equal(arg.long(), x.double().argmax(-1))


def test_ties_take_the_first_index_and_minus_inf_is_fine():
    x = torch.randn(5, 700)
    x[0, 3] = x[0, 600] = 50.0  # tie across column blocks
    x[1] = 2.0  # every entry equal
    x[2, :690] = float("-inf")  # the max sits at the end
    x[3, 256] = x[3, 257] = 9.0  # tie inside one block
    lse, arg = row_logsumexp_argmax(x)
    ref_lse, ref_arg = row_logsumexp_argmax_reference(x)
    assert arg.tolist() == ref_arg.tolist() and arg[:4].tolist() == [3, 0, arg[2].item(), 256]
    assert 690 <= arg[2] < 700
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-5)


def test_launch_config_follows_the_row_width_and_the_tune_override(monkeypatch):
    """Under the interpreter every row takes 256-column blocks; ``_TUNE`` (as a bench would set
    it) overrides the block, and a narrow block walks a row of many blocks to the same result."""
    assert logprobs._config(32000) == {"BLOCK": 256, "num_warps": 4}
    monkeypatch.setattr(logprobs, "_TUNE", {"BLOCK": 32})
    assert logprobs._config(1000)["BLOCK"] == 32
    x = torch.randn(3, 1000)
    x[1, 999] = 40.0  # the max in the last of 32 blocks
    lse, arg = row_logsumexp_argmax(x)
    ref_lse, ref_arg = row_logsumexp_argmax_reference(x)
    assert torch.equal(arg, ref_arg)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-5)


def test_strided_rows_and_empty_input():
    big = torch.randn(6, 300)
    x = big[:, 10:290]  # row stride 300, unit column stride
    torch.testing.assert_close(row_logsumexp_argmax(x)[0], torch.logsumexp(x, -1))
    lse, arg = row_logsumexp_argmax(torch.empty(0, 50))
    assert lse.shape == (0,) and arg.shape == (0,)


def test_target_logprobs_equals_log_softmax_gather():
    x = torch.randn(4, 333, dtype=torch.bfloat16)
    src = torch.tensor([0, 0, 1, 3, 2, 3])
    target = torch.tensor([5, 7, x[1].float().argmax().item(), 0, 332, 100])
    for use_kernel in (True, False):
        lp, is_max = target_logprobs(x, src, target, use_kernel)
        want = torch.log_softmax(x.double(), -1)[src, target]
        torch.testing.assert_close(lp.double(), want, rtol=0, atol=1e-5)
        assert is_max.tolist() == (x.float().argmax(-1)[src] == target).tolist()
        assert is_max[2]


def test_bad_inputs():
    with pytest.raises(ValueError, match="2 dimensions"):
        row_logsumexp_argmax(torch.randn(10))
    with pytest.raises(TypeError, match="logits must have dtype"):
        row_logsumexp_argmax(torch.randn(2, 3).double())
    with pytest.raises(ValueError, match="unit-stride"):
        row_logsumexp_argmax(torch.randn(8, 6).t())
    with pytest.raises(ValueError, match="at least one column"):
        row_logsumexp_argmax(torch.randn(3, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_llama_vocab(dtype):
    x = (torch.randn(3000, 32000, device="cuda") * 4).to(dtype)
    lse, arg = row_logsumexp_argmax(x)
    torch.testing.assert_close(lse.double(), torch.logsumexp(x.double(), -1), rtol=0, atol=1e-4)
    assert torch.equal(arg.long(), x.argmax(-1))
