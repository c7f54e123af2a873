"""One-pass logsumexp + argmax per row against fp64 PyTorch (Triton in interpreter mode on CPU).

Here too: on-device next-token sampling, and Llama-3's 128,256-token vocabulary through the LM
head, the log-prob kernel, the greedy step kernel and the sampler.
"""

from __future__ import annotations

import pytest
import torch

import nakta_model
from nakta_model.config import PRESETS
from nakta_model.generation.sampling import SamplingParams, sample_next
from nakta_model.kernels import logprobs
from nakta_model.kernels.greedy_advance import greedy_advance_, greedy_advance_reference
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


# ------------------------------------------------------------------------------------------------
# On-device next-token sampling: greedy rows, temperature, top-k and top-p, mixed per row.
# ------------------------------------------------------------------------------------------------


def rows(*params: SamplingParams):
    t = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
    p_ = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    return t, k, p_


def test_greedy_rows_take_the_argmax_even_beside_sampled_rows():
    logits = torch.randn(4, 50)
    t, k, p = rows(SamplingParams(), SamplingParams(1.0), SamplingParams(), SamplingParams(0.7))
    for _ in range(5):
        out = sample_next(logits, t, k, p)
        assert out.dtype == torch.int64 and out.shape == (4,)
        assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
    assert torch.equal(sample_next(logits, t, k, p, any_sampling=False), logits.argmax(-1))


def test_sampled_frequencies_follow_the_softmax_at_temperature():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 40000
    out = sample_next(logits.expand(n, 4), *rows(*[SamplingParams(0.5)] * n))
    freq = torch.bincount(out, minlength=4).float() / n
    want = torch.softmax(logits[0] / 0.5, -1)
    assert (freq - want).abs().max() < 0.01


def test_top_k_and_top_p_cut_the_tail():
    torch.manual_seed(1)
    logits = torch.tensor([[3.0, 2.9, 1.0, 0.5, 0.0]])
    n = 20000
    out = sample_next(logits.expand(n, 5), *rows(*[SamplingParams(1.0, top_k=2)] * n))
    assert set(out.tolist()) == {0, 1}
    probs = torch.softmax(logits[0], -1)  # ~[.46, .42, .06, .04, .02]
    # Meta's rule: token i stays while the mass before it <= p: p = 0.5 keeps tokens 0 and 1
    out = sample_next(logits.expand(n, 5), *rows(*[SamplingParams(1.0, top_p=0.5)] * n))
    assert set(out.tolist()) == {0, 1}
    freq0 = (out == 0).float().mean()
    assert abs(freq0 - probs[0] / probs[:2].sum()) < 0.02
    # a tiny top_p still keeps the most likely token
    out = sample_next(logits.expand(50, 5), *rows(*[SamplingParams(1.0, top_p=1e-6)] * 50))
    assert set(out.tolist()) == {0}


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=1.5), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
    ],
)
def test_bad_params(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


# ------------------------------------------------------------------------------------------------
# Llama-3's 128,256-token vocabulary through the LM head, the log-prob kernel, the greedy step
# kernel and the sampler (tiny width, few rows: interpreter-friendly), against fp64 PyTorch.
# ------------------------------------------------------------------------------------------------


VOCAB = PRESETS["llama3-8B"].vocab_size  # 128,256


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.slow
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


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.slow
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


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.slow
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


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.slow
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
