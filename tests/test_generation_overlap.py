"""Prefill beside decode (``Generator(overlap=...)``): the decode chunk of the running rows and
the prefill of newly admitted prompts launched together (two CUDA streams on a GPU, one after
the other elsewhere). The tokens must be the serial engine's, prompt by prompt; the newly
prefilled rows join the next chunk; every page goes back; bad settings fail by name."""

from __future__ import annotations

import pytest
import torch
from test_generation_engine import shared_prompts, tiny_model
from test_generation_paged import long_prompts

from nakta_model.generation import GenerationRequest, Generator, greedy_requests
from nakta_model.generation.engine import ENV_OVERLAP, OVERLAP_MODES


def _requests(ps, n_new):
    """Greedy requests; every third one wants a single token (it finishes at its prefill)."""
    return [GenerationRequest(p, 1 if i % 3 == 2 else n_new) for i, p in enumerate(ps)]


@pytest.mark.parametrize("mode", ["equal", "decode_first"])
def test_overlapped_prefill_decodes_the_serial_engines_tokens(mode):
    """Prompts of 10-30 tokens through 11-token prefill chunks and 3 rows: admissions and
    chunked prompts keep arriving while other rows decode, so most chunks overlap."""
    model = tiny_model()
    ps = long_prompts(8, 10, 30, seed=3)
    kw = dict(max_batch=3, max_seq_len=48, chunk=3, prefill_chunk=11)
    serial = Generator(model, overlap="off", **kw)
    want = serial.generate(_requests(ps, 7))
    gen = Generator(model, overlap=mode, **kw)
    got = gen.generate(_requests(ps, 7))
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert [r.finish for r in got] == [r.finish for r in want]
    assert serial.stats.overlapped_chunks == 0 and gen.stats.overlapped_chunks >= 4
    assert gen.stats.prefilled_tokens == sum(map(len, ps))
    assert gen.stats.generated_tokens == serial.stats.generated_tokens
    assert all(t >= 0 for t in gen.stats.first_token_s)
    assert gen.pool.free_pages == gen.pool.capacity - gen.held_pages


def test_rows_ending_in_a_chunk_hand_their_entries_to_prompts_prefilled_beside_it():
    """Rows that end together (same prompt length and budget): the next prompts are admitted
    and prefilled during the chunk that ends them, so every chunk decodes a full batch, as the
    serial engine's do, and every batch change overlaps a prefill."""
    model = tiny_model()
    ps = long_prompts(12, 9, 9, seed=4)
    kw = dict(max_batch=3, max_seq_len=48, chunk=3, prefill_chunk=64)
    serial = Generator(model, overlap="off", **kw)
    want = serial.generate(greedy_requests(ps, 7, None))
    gen = Generator(model, overlap="equal", **kw)
    got = gen.generate(greedy_requests(ps, 7, None))
    assert [r.tokens for r in got] == [r.tokens for r in want]

    def mean_rows(st):
        return (st.generated_tokens - len(ps)) / st.decode_steps  # the first token: prefill

    assert mean_rows(gen.stats) == mean_rows(serial.stats) == 3
    assert gen.stats.overlapped_chunks == 3  # each of the 3 batch changes
    assert gen.pool.free_pages == gen.pool.capacity - gen.held_pages


def test_overlap_with_held_prefixes_and_a_short_pool():
    """Shared few-shot prefixes (held pages, copy-on-write partial pages) and a pool that makes
    admissions wait: the tokens of a serial engine that shares nothing."""
    model = tiny_model()
    ps = shared_prompts(per=3)
    want = Generator(model, max_batch=4, max_seq_len=96, prefix_rows=0).generate(
        greedy_requests(ps, 5, None)
    )
    gen = Generator(
        model, max_batch=4, max_seq_len=96, pages=8, prefill_chunk=13, chunk=2, overlap="equal"
    )
    got = gen.generate(greedy_requests(ps, 5, None))
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert gen.stats.overlapped_chunks >= 1
    assert gen.pool.free_pages == gen.pool.capacity - gen.held_pages


def test_overlap_mode_from_the_environment_and_bad_values(monkeypatch):
    model = tiny_model()
    monkeypatch.setenv(ENV_OVERLAP, "decode_first")
    assert Generator(model, max_batch=2).overlap == "decode_first"
    assert Generator(model, max_batch=2, overlap="off").overlap == "off"  # the argument wins
    monkeypatch.setenv(ENV_OVERLAP, "")
    assert Generator(model, max_batch=2).overlap == "off"
    monkeypatch.setenv(ENV_OVERLAP, "yes")
    with pytest.raises(ValueError, match=f"{ENV_OVERLAP}.*{OVERLAP_MODES[1]}"):
        Generator(model, max_batch=2)
    with pytest.raises(ValueError, match="overlap"):
        Generator(model, max_batch=2, overlap=True)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["equal", "decode_first"])
def test_gpu_overlap_on_two_streams_equals_the_serial_engine(mode):
    """On a GPU the decode chunk (CUDA graphs) and the prefill run on two streams: greedy tokens
    equal the serial engine's. fp32: rows join other chunks, so other batch buckets (split
    counts, GEMV or GEMM) decode them; in bf16 that alone could flip a near-tie."""
    from nakta_model.config import ModelArgs
    from nakta_model.loading import random_model

    args = ModelArgs(dim=256, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=512, max_seq_len=160)
    model = random_model(args, "cuda", torch.float32, seed=2)
    ps = long_prompts(24, 20, 120, seed=5, vocab=512)
    kw = dict(max_batch=8, chunk=8, prefill_chunk=256)
    want = Generator(model, overlap="off", **kw).generate(_requests(ps, 24))
    gen = Generator(model, overlap=mode, **kw)
    got = gen.generate(_requests(ps, 24))
    assert gen._streams is not None and gen.stats.overlapped_chunks >= 3
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert gen.pool.free_pages == gen.pool.capacity - gen.held_pages
