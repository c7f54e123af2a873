"""Prefixes shared across requests: found, computed once, kept (LRU), and scored identically."""

from __future__ import annotations

import random

import pytest
import torch
from checkpoint_factory import TINY_PARAMS, meta_state_dict

from nakta_model import scoring
from nakta_model.config import ModelArgs
from nakta_model.loading import load
from nakta_model.prefix_cache import PrefixCache, shared_prefixes
from nakta_model.sources import state_dict_source


def model_fp32(kernels="reference"):
    args = ModelArgs.from_meta_params(TINY_PARAMS, max_seq_len=256)
    return load(state_dict_source(meta_state_dict(TINY_PARAMS, seed=5), args), "cpu",
                kernels=kernels)  # fmt: skip


def mmlu_like(n_subjects=3, per_subject=5, prefix_len=80, seed=0):
    """Requests with MMLU's structure: per subject one shared few-shot prefix, then distinct
    questions, each with 4 one-token choices."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n_subjects):
        prefix = [1] + [rng.randrange(3, 300) for _ in range(prefix_len - 1)]
        for _ in range(per_subject):
            ctx = prefix + [rng.randrange(3, 300) for _ in range(rng.randint(5, 30))]
            reqs += [(ctx, [rng.randrange(3, 300)]) for _ in range(4)]
    return reqs


def test_shared_prefixes_cut_groups_at_short_common_beginnings():
    a = list(range(100))
    ctxs = [a + [7, 8], a + [9], a[:70] + [1, 2], [5] * 90 + [1], [5] * 90 + [2], [5] * 10]
    got = shared_prefixes(ctxs, min_tokens=64)
    assert got[:3] == [70, 70, 70]  # one group: its common prefix (70 shared by all three)
    assert got[3:5] == [90, 90] and got[5] == 0
    # capped one token short of the shortest context: its last token predicts the continuation
    assert shared_prefixes([a, a + [1]], 64) == [99, 99]
    assert shared_prefixes([a], 64) == [0]  # a lone context shares nothing
    with pytest.raises(ValueError, match="min_tokens"):
        shared_prefixes([a], 0)


# [triton] is slow-tier only: scoring's logic is [reference]'s, and the Triton prefill kernel that
# reads a cached prefix is checked in the default tier by test_packed_attention's
# test_cached_prefixes_are_attended_before_each_sequence (the interpreter made this one minutes)
@pytest.mark.parametrize("kernels", ["reference", pytest.param("triton", marks=pytest.mark.slow)])
def test_scores_equal_the_uncached_engine_and_prefixes_are_computed_once(kernels):
    model = model_fp32(kernels)
    reqs = mmlu_like(per_subject=4 if kernels == "triton" else 6)
    plain = scoring.score(model, reqs, prefix_cache=False)
    stats = scoring.ScoreStats()
    cached = scoring.score(model, reqs, stats=stats)
    assert [g for _, g in cached] == [g for _, g in plain]
    for (a, _), (b, _) in zip(cached, plain):
        assert a == pytest.approx(b, abs=1e-4)
    assert stats.prefixes == 3 and stats.prefix_tokens == 3 * 80  # each computed once
    quiet = scoring.ScoreStats(count_unique=False)  # same counts, no trie sort
    assert scoring.score(model, reqs, stats=quiet) == cached
    assert quiet.unique_tokens == 0 and quiet.computed_tokens == stats.computed_tokens
    assert stats.computed_tokens < 0.1 * stats.request_tokens
    assert stats.computed_tokens <= 1.2 * stats.unique_tokens
    assert stats.unique_tokens == scoring.unique_tokens(reqs) <= stats.computed_tokens
    assert model.max_seq_len == 0  # the temporary pool was freed


def test_a_kept_cache_reuses_prefixes_across_calls_and_evicts_lru():
    model = model_fp32()
    cache = PrefixCache(model, budget_tokens=192, page_size=64)  # 3 pages: one prefix at a time
    reqs = mmlu_like(n_subjects=2, prefix_len=80)
    first = scoring.score(model, reqs[:24], prefix_cache=cache)  # subject 0 only
    computed = cache.computed_tokens
    assert computed == 80
    again = scoring.score(model, reqs[:24], prefix_cache=cache)
    assert cache.computed_tokens == computed and again == first  # no recomputation
    scoring.score(model, reqs[24:], prefix_cache=cache)  # subject 1 evicts subject 0
    assert cache.computed_tokens == 2 * 80 and len(cache.entries) == 1
    scoring.score(model, reqs[:24], prefix_cache=cache)
    assert cache.computed_tokens == 3 * 80


def test_stories260k_fp32_prefix_cache_gives_the_same_loglikelihoods(shared_data):
    """The real checkpoint, a real tokenizer, a shared 5-shot-like prefix: identical scores."""
    from nakta_model import Tokenizer

    model = load(shared_data / "stories260K", "cpu", torch.float32)
    tok = Tokenizer(shared_data / "stories260K" / "tokenizer.model")
    shots = " ".join(f"Once upon a time there was a {w} who liked to play." for w in
                     ("cat", "dog", "girl", "boy", "bird", "fish", "king", "queen"))  # fmt: skip
    reqs = []
    for q in ("Lily went to the park", "Tom had a big red ball", "The sun was hot"):
        ctx = tok.encode(shots + " " + q, bos=True, eos=False)
        for c in (" and she was happy.", " and he cried.", " and it rained."):
            reqs.append((ctx, tok.encode(q + c, bos=False, eos=False)[-4:]))
    stats = scoring.ScoreStats()
    cached = scoring.score(model, reqs, stats=stats)
    plain = scoring.score(model, reqs, prefix_cache=False)
    assert stats.prefixes == 1
    assert [x[1] for x in cached] == [x[1] for x in plain]
    assert [x[0] for x in cached] == pytest.approx([x[0] for x in plain], abs=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_prefix_cache_scores_like_the_uncached_engine(dtype):
    """On CUDA (Triton kernels, the model dtype): the cached prefixes change nothing beyond
    rounding; in fp32 the log-likelihoods agree to 1e-4, in bf16 the greedy flags and the
    ranking of each question's four choices mostly agree."""
    args = ModelArgs.from_meta_params(TINY_PARAMS, max_seq_len=512)
    model = load(state_dict_source(meta_state_dict(TINY_PARAMS, seed=5), args), "cuda", dtype)
    reqs = mmlu_like(n_subjects=6, per_subject=8, prefix_len=200, seed=2)
    plain = scoring.score(model, reqs, prefix_cache=False)
    stats = scoring.ScoreStats()
    cached = scoring.score(model, reqs, stats=stats)
    assert stats.prefixes == 6 and stats.computed_tokens <= 1.2 * stats.unique_tokens
    a = torch.tensor([ll for ll, _ in cached], dtype=torch.float64)
    b = torch.tensor([ll for ll, _ in plain], dtype=torch.float64)
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
        assert [g for _, g in cached] == [g for _, g in plain]
    else:
        assert (a - b).abs().max() < 0.1 * b.abs().mean()
        same = (a.view(-1, 4).argmax(1) == b.view(-1, 4).argmax(1)).float().mean()
        assert same >= 0.9, same


def test_warm_up_runs_the_prefix_path_and_leaves_no_cache():
    """The warm-up compiles what a few-shot task's first batch runs (a prefix prefill, packed
    attention reading prefix pages) and gives the pool back: scores are unchanged after it."""
    model = model_fp32()
    reqs = mmlu_like(n_subjects=1, per_subject=3)
    before = scoring.score(model, reqs)
    calls = {"prefill": 0, "prefix": 0}
    prefill, packed = model.forward_prefill, model.forward_packed

    def counting_prefill(*a, **kw):
        calls["prefill"] += 1
        return prefill(*a, **kw)

    def counting_packed(*a, **kw):
        calls["prefix"] += kw.get("prefix") is not None
        return packed(*a, **kw)

    model.forward_prefill, model.forward_packed = counting_prefill, counting_packed
    assert scoring.warm_up(model) >= 0
    assert calls == {"prefill": 1, "prefix": 1}
    assert model.layers[0].attention.k_cache is None  # the temporary pool is gone
    calls.update(prefill=0, prefix=0)
    assert scoring.warm_up(model, prefix=False) >= 0 and calls == {"prefill": 0, "prefix": 0}
    model.forward_prefill, model.forward_packed = prefill, packed
    assert scoring.score(model, reqs) == before
