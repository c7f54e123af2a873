"""Llama-3's 128,256-token vocabulary through the LM head, the log-prob kernel, the greedy
step kernel and the sampler (tiny width, few rows: interpreter-friendly), against fp64 PyTorch."""

from __future__ import annotations

import pytest
import torch

import nakta_model
from nakta_model.config import PRESETS
from nakta_model.generation.sampling import sample_next
from nakta_model.kernels.greedy_advance import greedy_advance_, greedy_advance_reference
from nakta_model.kernels.logprobs import row_logsumexp_argmax, target_logprobs

VOCAB = PRESETS["llama3-8B"].vocab_size  # 128,256
pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logsumexp_argmax_over_128k_columns(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, VOCAB, generator=g) * 4).to(dtype)
    x[1, VOCAB - 1] = 60.0  # the maximum in the very last column
    x[2, 70000] = x[2, 128000] = 55.0  # a tie across far-apart blocks: the first wins
    lse, arg = row_logsumexp_argmax(x)
    want = torch.logsumexp(x.double(), -1)
    torch.testing.assert_close(lse.double(), want, rtol=0, atol=2e-5 * VOCAB**0.5)
    assert arg.tolist() == [int(x[0].float().argmax()), VOCAB - 1, 70000]
    src, target = torch.tensor([0, 1, 2]), torch.tensor([5, VOCAB - 1, 128255])
    lp, is_arg = target_logprobs(x, src, target, use_kernel=True)
    torch.testing.assert_close(lp.double(), x.double()[src, target] - want, rtol=0, atol=3e-3)
    assert is_arg.tolist() == [bool(x[0].float().argmax() == 5), True, False]


def test_greedy_step_kernel_over_128k_columns():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, VOCAB, generator=g).to(torch.bfloat16)
    logits[0, 128255] = 20.0
    bufs = dict(history=torch.zeros(2, 4, dtype=torch.int64), step=torch.tensor([1]),
                tokens=torch.zeros(2, dtype=torch.int64),
                positions=torch.zeros(2, dtype=torch.int32))  # fmt: skip
    a = {k: v.clone() for k, v in bufs.items()}
    b = {k: v.clone() for k, v in bufs.items()}
    greedy_advance_(logits, **a)
    greedy_advance_reference(logits, **b)
    assert all(torch.equal(a[k], b[k]) for k in bufs)
    assert a["tokens"][0] == 128255


def test_sampler_reaches_the_top_of_a_128k_vocabulary():
    """top-k 1 and temperature 0 pick the argmax wherever it is; with top-p a row whose mass
    sits on ids above 128,000 draws only from them."""
    logits = torch.full((3, VOCAB), -30.0)
    logits[:, 128100:128110] = torch.arange(10, dtype=torch.float32)  # mass up there only
    temp = torch.tensor([0.0, 1.0, 1.0])
    top_k = torch.tensor([0, 1, 0])
    top_p = torch.tensor([1.0, 1.0, 0.9])
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        out = sample_next(logits, temp, top_k, top_p, generator=gen)
        assert out[0] == out[1] == 128109
        assert 128100 <= out[2] < 128110


def test_lm_head_and_scoring_rows_at_128k_vocab():
    """A tiny-width model with the real vocabulary: full logits, the last-row head and the
    packed scorer's rows agree (the head's vocabulary split at tp 1, fp32)."""
    args = PRESETS["tiny"].replace(vocab_size=VOCAB, n_layers=1)
    model = nakta_model.random_model(args, "cpu", torch.float32, seed=4, kernels="reference")
    tokens = torch.tensor([[1, 128255, 70000, 5, 128000]])
    full = model(tokens)
    assert full.shape == (1, 5, VOCAB)
    torch.testing.assert_close(model.forward_last(tokens), full[:, -1], rtol=0, atol=1e-5)
    t = tokens[0]
    packed = model.forward_packed(t, torch.arange(5), torch.zeros(5, dtype=torch.long), None,
                                  torch.tensor([1, 4]))  # fmt: skip
    torch.testing.assert_close(packed, full[0, [1, 4]], rtol=0, atol=1e-5)
