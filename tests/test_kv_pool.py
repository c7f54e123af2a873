"""One KV pool per model: the scorer's prefix cache and the generation engine share it, each
touching only its own pages; a pool too small for a user grows and the others see it.

Here too: prefixes shared across requests are found, computed once, kept (LRU) and scored identically.
"""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch
from checkpoint_factory import TINY_PARAMS, meta_state_dict

from nakta_model import scoring
from nakta_model.config import ModelArgs
from nakta_model.generation import Generator, greedy_requests
from nakta_model.kv_pages import kv_pool
from nakta_model.loading import load
from nakta_model.prefix_cache import PrefixCache, shared_prefixes
from nakta_model.sources import state_dict_source


def tiny():
    args = ModelArgs.from_meta_params(TINY_PARAMS, max_seq_len=256)
    return load(state_dict_source(meta_state_dict(TINY_PARAMS, seed=5), args), "cpu")


def few_shot(prefix_len=80, n=3, seed=0):
    """Scoring requests that share one few-shot prefix (each question with 2 choices)."""
    rng = random.Random(seed)
    prefix = [1] + [rng.randrange(3, 300) for _ in range(prefix_len - 1)]
    reqs = []
    for _ in range(n):
        ctx = prefix + [rng.randrange(3, 300) for _ in range(rng.randint(4, 9))]
        reqs += [(ctx, [rng.randrange(3, 300)]) for _ in range(2)]
    return reqs


def prompts(seed=1):
    """Two prompts sharing a 70-token prefix (the engine holds it) and one of their own."""
    rng = random.Random(seed)
    shared = [1] + [rng.randrange(3, 300) for _ in range(69)]
    ps = [shared + [rng.randrange(3, 300) for _ in range(rng.randint(3, 7))] for _ in range(2)]
    return ps + [[1] + [rng.randrange(3, 300) for _ in range(9)]]


def engine(model, **kw):
    return Generator(model, max_batch=2, max_seq_len=160, chunk=4, prefix_rows=1,
                     graph_mode="eager", **kw)  # fmt: skip


_FRESH: dict[str, tuple] = {}


def fresh_results(reqs, ps, new_tokens=6):
    """Scores and greedy tokens on fresh models (no sharing); computed once per inputs for the
    module (three tests compare against the same ones)."""
    key = repr((reqs, ps, new_tokens))
    if key not in _FRESH:
        _FRESH[key] = _fresh_results(reqs, ps, new_tokens)
    scores, tokens = _FRESH[key]
    return list(scores), [list(t) for t in tokens]


def _fresh_results(reqs, ps, new_tokens):
    model = tiny()
    want_scores = scoring.score(model, reqs, prefix_cache=PrefixCache(model, 192))
    gen = engine(tiny())
    want_tokens = [r.tokens for r in gen.generate(greedy_requests(ps, new_tokens, None))]
    return want_scores, want_tokens


def test_scoring_and_generating_share_one_pool_without_rebuilds():
    reqs, ps = few_shot(), prompts()
    want_scores, want_tokens = fresh_results(reqs, ps)
    model = tiny()
    gen = engine(model)
    pool = model.kv_pool
    assert kv_pool(model) is pool and pool.n_pages == 10  # 1 + (2 rows + 1 prefix) x 3 pages
    epoch = pool.epoch
    cache = PrefixCache(model, budget_tokens=192)
    assert scoring.score(model, reqs, prefix_cache=cache) == want_scores
    assert cache.computed_tokens == 80 and cache.held_pages == 2
    free_scored = pool.free_pages
    assert free_scored == pool.capacity - 2

    res = gen.generate(greedy_requests(ps, 6, None))
    assert [r.tokens for r in res] == want_tokens
    assert gen.held_pages == 2 and pool.free_pages == free_scored - gen.held_pages  # no leak
    steps, held = dict(gen._steps), dict(gen.pages.held)
    assert steps and held
    assert model.kv_pool is pool and pool.epoch == epoch  # no rebuild

    assert scoring.score(model, reqs, prefix_cache=cache) == want_scores
    assert cache.computed_tokens == 80  # its entry stayed valid: not recomputed
    assert pool.free_pages == free_scored - gen.held_pages

    prefilled = gen.stats.prefilled_tokens
    res = gen.generate(greedy_requests(ps, 6, None))
    assert [r.tokens for r in res] == want_tokens
    assert gen.stats.prefilled_tokens < prefilled  # the held prefix was not computed again
    assert all(gen._steps[k] is v for k, v in steps.items())  # steps kept
    assert all(gen.pages.held[k] is v for k, v in held.items())  # held prefixes kept
    assert pool.epoch == epoch and pool.free_pages == free_scored - gen.held_pages


def test_a_pool_too_small_grows_and_the_other_user_rebuilds():
    reqs, ps = few_shot(), prompts()
    want_scores, want_tokens = fresh_results(reqs, ps)
    model = tiny()
    gen = engine(model, pages=4)  # room for 3 pages: one row at a time
    pool = model.kv_pool
    assert pool.n_pages == 4
    res = gen.generate(greedy_requests(ps, 6, None))
    assert [r.tokens for r in res] == want_tokens and gen.held_pages == 2
    epoch = pool.epoch

    # the scorer needs 3 pages besides the engine's held prefix (2 of 3): the pool grows
    cache = PrefixCache(model, budget_tokens=192)
    assert scoring.score(model, reqs, prefix_cache=cache) == want_scores
    assert model.kv_pool is pool and pool.epoch == epoch + 1 and pool.n_pages == 6
    assert pool.used_pages == cache.held_pages == 2

    # the engine sees the new epoch: steps and held prefixes of the old pool are dropped
    res = gen.generate(greedy_requests(ps, 6, None))
    assert [r.tokens for r in res] == want_tokens
    assert pool.epoch == epoch + 1 and gen.pages._epoch == pool.epoch
    assert pool.used_pages == cache.held_pages + gen.held_pages  # the scorer's pages kept
    assert scoring.score(model, reqs, prefix_cache=cache) == want_scores
    assert cache.computed_tokens == 80

    # a larger engine on the same model grows the pool again: the scorer recomputes
    big = engine(model, pages=12)
    assert pool.epoch == epoch + 2 and pool.n_pages == 12 and pool.used_pages == 0
    assert scoring.score(model, reqs, prefix_cache=cache) == want_scores
    assert cache.computed_tokens == 160
    assert [r.tokens for r in big.generate(greedy_requests(ps, 6, None))] == want_tokens
    assert pool.epoch == epoch + 2
    assert pool.used_pages == cache.held_pages + big.held_pages
    # the first engine reads the new epoch too, and a smaller ask never shrinks the pool
    assert [r.tokens for r in gen.generate(greedy_requests(ps, 6, None))] == want_tokens
    assert pool.n_pages == 12 and pool.epoch == epoch + 2


def test_a_cache_replaced_behind_the_pools_back_is_detected():
    model = tiny()
    reqs = few_shot()
    cache = PrefixCache(model, budget_tokens=192)
    first = scoring.score(model, reqs, prefix_cache=cache)
    epoch = model.kv_pool.epoch
    model.clear_cache()  # e.g. Meta's loop or a bench set up a cache of their own
    model.setup_cache(2, 64)
    assert scoring.score(model, reqs, prefix_cache=cache) == first
    assert model.kv_pool.epoch == epoch + 1 and cache.computed_tokens == 160
    with pytest.raises(ValueError, match="pages"):
        model.kv_pool.make_room(0)
    with pytest.raises(ValueError, match="page_size"):
        PrefixCache(model, budget_tokens=64, page_size=32)


# ------------------------------------------------------------------ the cap while scoring
def cache_positions(model):
    """Positions of the model's KV cache (its memory, in units of one position's K/V)."""
    k = model.layers[0].attention.k_cache
    return 0 if k is None else k.shape[0]


def test_scoring_trims_a_pool_grown_for_generation_and_cycles_do_not_ratchet():
    reqs, ps = few_shot(), prompts()
    want_scores, want_tokens = fresh_results(reqs, ps)
    model = tiny()
    pool = kv_pool(model)
    assert pool.scoring_cap_pages() is None  # the CPU default: no cap
    pool.scoring_cap = 5
    gen = engine(model)
    gen_ref = weakref.ref(gen)
    cache = PrefixCache(model, budget_tokens=192)  # 3 pages
    seen = []
    for _ in range(3):
        res = gen.generate(greedy_requests(ps, 6, None))
        assert [r.tokens for r in res] == want_tokens
        assert pool.n_pages == 10 and cache_positions(model) == 10 * 64  # the engine's size
        assert pool.used_pages == gen.held_pages == 2  # no leak: only its held prefix
        assert gen._steps
        epoch = pool.epoch

        assert scoring.score(model, reqs, prefix_cache=cache) == want_scores
        # freed (a new epoch: the engine dropped its steps and held prefix at once, their
        # pages are gone), then made at the scorer's need (1 scratch + 3 pages <= cap 5)
        assert pool.n_pages == 4 and cache_positions(model) == 4 * 64
        assert pool.epoch == epoch + 2 and cache.limit == 3
        assert not gen._steps and not gen.pages.held and gen.held_pages == 0
        assert pool.used_pages == cache.held_pages == 2
        assert scoring.score(model, reqs, prefix_cache=cache) == want_scores  # within the cap
        assert pool.epoch == epoch + 2 and pool.n_pages == 4
        seen.append((pool.n_pages, pool.epoch - epoch, cache.computed_tokens))
    # every cycle the same sizes (no ratchet); the scorer computes its prefix once per cycle
    assert [s[:2] for s in seen] == [(4, 2)] * 3
    assert [s[2] for s in seen] == [80, 160, 240]
    del gen, res
    gc.collect()
    assert gen_ref() is None  # the pool's rebuild callback does not keep the engine alive
    assert scoring.score(model, reqs, prefix_cache=cache) == want_scores


def test_the_scorer_never_grows_the_pool_past_the_cap():
    reqs = few_shot()
    model = tiny()
    want = scoring.score(model, reqs, prefix_cache=PrefixCache(model, 192))
    model.kv_pool.release()

    # cap 3: the budget of 3 pages is clipped to 2 (the 80-token prefix still fits)
    model.kv_pool.scoring_cap = 3
    cache = PrefixCache(model, budget_tokens=192)
    assert scoring.score(model, reqs, prefix_cache=cache) == want
    assert cache.limit == 2 and model.kv_pool.n_pages == 3 and cache.computed_tokens == 80

    # cap 2: one page, the prefix does not fit: computed in the stream, the pool not grown
    model.kv_pool.scoring_cap = 2
    got = scoring.score(model, reqs, prefix_cache=cache)
    assert [g for _, g in got] == [g for _, g in want]
    assert [x for x, _ in got] == pytest.approx([x for x, _ in want], rel=1e-5, abs=1e-5)
    assert cache.limit == 1 and model.kv_pool.n_pages == 2 and cache.computed_tokens == 80
    assert model.kv_pool.used_pages == cache.held_pages == 0

    # another user's pages within the cap: the pool is rebuilt within it (no further)
    ps = prompts()
    model.kv_pool.scoring_cap = None
    gen = engine(model, pages=4)
    gen.generate(greedy_requests(ps, 6, None))
    assert model.kv_pool.n_pages == 4 and gen.held_pages == 2
    model.kv_pool.scoring_cap = 6
    epoch = model.kv_pool.epoch
    assert scoring.score(model, reqs, prefix_cache=cache) == want
    assert model.kv_pool.n_pages == 6 and model.kv_pool.epoch == epoch + 1
    assert model.kv_pool.used_pages == cache.held_pages == 2


def test_scoring_without_a_prefix_cache_frees_a_pool_over_the_cap():
    reqs, ps = few_shot(), prompts()
    want_scores, want_tokens = fresh_results(reqs, ps)
    model = tiny()
    gen = engine(model)
    gen.generate(greedy_requests(ps, 6, None))
    pool = model.kv_pool
    epoch, pool.scoring_cap = pool.epoch, 10  # the engine's size: within the cap, kept
    plain = scoring.score(model, reqs, prefix_cache=False)
    assert pool.n_pages == 10 and pool.epoch == epoch and gen.held_pages == 2
    pool.scoring_cap = 9
    assert scoring.score(model, reqs, prefix_cache=False) == plain
    assert pool.n_pages == 0 and cache_positions(model) == 0 and pool.epoch == epoch + 1
    assert not gen._steps and not gen.pages.held
    assert [x for x, _ in plain] == pytest.approx([x for x, _ in want_scores], abs=1e-5)
    res = gen.generate(greedy_requests(ps, 6, None))  # the engine makes it again
    assert [r.tokens for r in res] == want_tokens
    assert pool.n_pages == 10 and pool.epoch == epoch + 2 and pool.used_pages == gen.held_pages


@pytest.mark.parametrize("cap", ["4", True, 2.5])
def test_a_bad_scoring_cap_is_refused(cap):
    model = tiny()
    model.kv_pool = None
    pool = kv_pool(model)
    pool.scoring_cap = cap
    with pytest.raises(ValueError, match="scoring_cap"):
        pool.room_for_scoring(3)
    with pytest.raises(ValueError, match="scoring_cap"):
        scoring.score(model, few_shot(), prefix_cache=False)


# ------------------------------------------------------------------------------------------------
# Prefixes shared across requests: found, computed once, kept (LRU), and scored identically.
# ------------------------------------------------------------------------------------------------


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
