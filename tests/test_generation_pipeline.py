"""Pipelined decode chunks (``Generator(pipeline=True)``, the default): the next chunk of the
same rows is enqueued before the previous chunk's tokens are read. The tokens, finishes and
texts must be those of the one-chunk-at-a-time engine (and Meta's loop) whatever ends the rows
(budgets, stop tokens inside a chunk, stop strings, the cache's room), every page goes back,
and the continuations happen only while nothing waits to be admitted or prefilled."""

from __future__ import annotations

import random

import pytest
import torch
from test_generation_engine import MAX_SEQ, meta_greedy, prompts, tiny_model

from nakta_model.generation import GenerationRequest, Generator, StopStrings, greedy_requests


def _mixed_requests(free, ps):
    """Per prompt: a budget, a stop token or a stop string taken from its free run, so rows
    end at different steps, inside and at the end of chunks."""
    rng = random.Random(5)
    decode = lambda toks: " ".join(str(t) for t in toks)  # noqa: E731
    reqs = []
    for p, f in zip(ps, free):
        kind = rng.choice(["budget", "token", "string"])
        if kind == "budget":
            reqs.append(GenerationRequest(p, rng.randint(1, 14)))
        elif kind == "token":
            reqs.append(GenerationRequest(p, 14, stop_token_ids=(f.tokens[rng.randint(2, 9)],)))
        else:
            stop = StopStrings([" " + str(f.tokens[rng.randint(3, 9)])], decode)
            reqs.append(GenerationRequest(p, 14, stop=stop))
    return reqs


@pytest.mark.parametrize("max_batch", [1, 3, 16])
def test_pipelined_chunks_give_the_serial_engines_results(max_batch):
    model = tiny_model()
    ps = prompts(300, 9, seed=12)
    free = Generator(model, max_batch=4, max_seq_len=MAX_SEQ, chunk=3, pipeline=False).generate(
        greedy_requests(ps, 14, None)
    )
    assert [r.tokens for r in free] == meta_greedy(model, ps, 14)
    reqs = _mixed_requests(free, ps)
    got = {}
    for pipeline in (False, True):
        gen = Generator(model, max_batch=max_batch, max_seq_len=MAX_SEQ, chunk=3,
                        pipeline=pipeline)  # fmt: skip
        before = gen.pool.free_pages
        res = gen.generate(reqs)
        got[pipeline] = [(r.tokens, r.finish, r.text) for r in res]
        assert gen.pool.free_pages == before == gen.pool.capacity
        assert (gen.stats.continued_chunks > 0) == pipeline, gen.stats
    assert got[True] == got[False]
    assert {f for _, f, _ in got[True]} >= {"length", "stop"}


def test_continuations_wait_for_admissions_and_stop_at_the_cache_room(monkeypatch):
    """A prompt still prefilling (pieces of 4 tokens, one forward per chunk) stops the
    pipelining until it is in; the cache's room bounds a continuation as a budget does."""
    model = tiny_model()
    gen = Generator(model, max_batch=2, max_seq_len=MAX_SEQ, chunk=2, prefill_chunk=4,
                    prefill_burst=1)  # fmt: skip
    calls = []
    run = gen._decode_chunk

    def spy(active, slots, draining=False, may_continue=False):
        calls.append((len(active), may_continue))
        return run(active, slots, draining, may_continue)

    monkeypatch.setattr(gen, "_decode_chunk", spy)
    # a 2-token row ends first; the 20-token prompt that takes its entry prefills over five
    # engine steps, beside which the long row decodes without continuations
    ps = [[1, 7, 9], [1, 4], [1] + [6] * 19]
    reqs = [GenerationRequest(ps[0], 2), GenerationRequest(ps[1], 16),
            GenerationRequest(ps[2], 12)]  # fmt: skip
    got = gen.generate(reqs)
    want = Generator(model, max_batch=2, max_seq_len=MAX_SEQ, chunk=2, pipeline=False)
    assert [r.tokens for r in got] == [r.tokens for r in want.generate(reqs)]
    assert (1, False) in calls and (2, True) in calls
    assert gen.stats.continued_chunks > 0
    # the cache's room ends the rows: prompt + tokens == max_seq_len, pages back
    long = [1] + [5] * 40
    (res,) = gen.generate(greedy_requests([long], 30, None))
    assert len(long) + len(res.tokens) == MAX_SEQ and res.finish == "length"
    assert gen.pool.free_pages == gen.pool.capacity


def test_bad_pipeline_values():
    model = tiny_model()
    with pytest.raises(TypeError, match="pipeline must be a bool"):
        Generator(model, pipeline="yes")
    assert Generator(model).pipeline is True  # the default


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_pipelined_graphs_equal_the_serial_engine():
    """CUDA graphs, fp32: the continuations' tokens copied through pinned memory and events
    are the serial engine's."""
    model = tiny_model(kernels="triton", device="cuda")  # the reference kernels sync
    ps = prompts(300, 9, seed=12)
    free = Generator(model, max_batch=4, max_seq_len=MAX_SEQ, chunk=3, pipeline=False).generate(
        greedy_requests(ps, 14, None)
    )
    reqs = _mixed_requests(free, ps)
    got = {}
    for pipeline in (False, True):
        gen = Generator(model, max_batch=4, max_seq_len=MAX_SEQ, chunk=3, pipeline=pipeline)
        got[pipeline] = [(r.tokens, r.finish, r.text) for r in gen.generate(reqs)]
        assert (gen.stats.continued_chunks > 0) == pipeline
    assert got[True] == got[False]
