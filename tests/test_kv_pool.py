"""One KV pool per model: the scorer's prefix cache and the generation engine share it, each
touching only its own pages; a pool too small for a user grows and the others see it."""

from __future__ import annotations

import gc
import random
import weakref

import pytest
from checkpoint_factory import TINY_PARAMS, meta_state_dict

from nakta_model import scoring
from nakta_model.config import ModelArgs
from nakta_model.generation import Generator, greedy_requests
from nakta_model.kv_pages import kv_pool
from nakta_model.loading import load
from nakta_model.prefix_cache import PrefixCache
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
