"""On-device next-token sampling: greedy rows, temperature, top-k and top-p, mixed per row."""

from __future__ import annotations

import pytest
import torch

from nakta_model.generation.sampling import SamplingParams, sample_next


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
