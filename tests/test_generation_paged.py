"""The engine's paged KV pool and chunked prefill: greedy tokens equal Meta's loop (or the
engine with a pool that never runs short) when pages run out and admissions wait, when
prompts are split over several prefill chunks, with shared prefixes; every page goes back;
a request no pool can hold gets an error result while the others finish."""

from __future__ import annotations

import random

import pytest
import torch
from test_generation_engine import meta_greedy, shared_prompts, tiny_model

from llama_org import Llama
from nakta_model.generation import Generator, greedy_requests
from nakta_model.generation.engine import PREFILL_BURST, max_rows
from nakta_model.kv_pages import PAGE_SIZE, PagePool
from nakta_model.loading import load


def long_prompts(n, lo, hi, seed=0, vocab=300):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_page_pool_counts_references():
    pool = PagePool(5)
    assert (pool.free_pages, pool.used_pages, pool.capacity) == (4, 0, 4)
    a = pool.alloc(3)
    assert 0 not in a and pool.free_pages == 1
    pool.incref(a[:1])
    pool.free(a)
    assert pool.free_pages == 3 and pool.refs(a[0]) == 1  # still held once
    pool.free(a[:1])
    assert pool.free_pages == 4
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(a[:1])
    with pytest.raises(RuntimeError, match="5 pages asked"):
        pool.alloc(5)
    with pytest.raises(ValueError, match="n_pages must be an int >= 2"):
        PagePool(1)


def test_chunked_prefill_splits_prompts_and_decodes_metas_tokens():
    """Prompts of 20-45 tokens through 9-token prefill chunks: each prompt's later pieces
    attend to its earlier pages; tokens equal Meta's loop."""
    model = tiny_model()
    ps = long_prompts(5, 20, 40, seed=1)
    want = meta_greedy(model, ps, 6)
    gen = Generator(model, max_batch=3, max_seq_len=48, chunk=3, prefill_chunk=9)
    got = gen.generate(greedy_requests(ps, 6, eos_id=2))
    assert [r.tokens for r in got] == want
    assert gen.stats.prefill_chunks >= -(-sum(map(len, ps)) // 9)
    assert gen.stats.prefilled_tokens == sum(map(len, ps))
    ttft = gen.stats.first_token_s
    assert len(ttft) == 5 and all(0 <= t <= 60 for t in ttft)


# [triton] is slow-tier only: the engine's logic is [reference]'s, and held prefixes decoded
# through the Triton kernels stay in the default tier in test_generation_engine's
# test_shared_prompt_prefixes_prefill_once_and_decode_the_same[triton]
@pytest.mark.parametrize("kernels", ["reference", pytest.param("triton", marks=pytest.mark.slow)])
def test_shared_prefixes_with_chunks_and_a_short_pool(kernels):
    """Shared 70-token prefixes (one full page shared by reference, 6 positions copied), prompts
    split over 13-token chunks, a pool too small for every row at once: the tokens of an
    engine that never waits, and every page back afterwards but the held prefixes'."""
    model = tiny_model(kernels=kernels)
    ps = shared_prompts(per=3 if kernels == "reference" else 2)
    n_new = 5 if kernels == "reference" else 2
    want = Generator(model, max_batch=4, max_seq_len=96, prefix_rows=0).generate(
        greedy_requests(ps, n_new, None)
    )
    # each row: 2 pages (76 + 5 positions); the held prefixes 2 each: 7 usable pages
    gen = Generator(model, max_batch=4, max_seq_len=96, pages=8, prefill_chunk=13, chunk=2)
    got = gen.generate(greedy_requests(ps, n_new, None))
    assert [r.tokens for r in got] == [r.tokens for r in want]  # 6 rows x 2 + 2 x 2 > 7 pages
    assert gen.pool.free_pages == gen.pool.capacity - gen.held_pages
    again = gen.generate(greedy_requests(ps, n_new, None))  # the prefixes are still held
    assert [r.tokens for r in again] == [r.tokens for r in want]
    assert gen.pool.free_pages == gen.pool.capacity - gen.held_pages


def test_pages_running_out_make_admissions_wait():
    """A pool of 2 usable pages for rows of one page each: two rows in flight at most, not
    max_batch = 4; same tokens as Meta's loop."""
    model = tiny_model()
    ps = long_prompts(5, 30, 45, seed=3)
    want = meta_greedy(model, ps, 8)
    in_flight = []
    gen = Generator(model, max_batch=4, max_seq_len=48, pages=3, chunk=4)
    running = set()

    def on_tokens(i, tokens, finish):
        running.add(i)
        if finish is not None:
            running.discard(i)
        in_flight.append(len(running))

    got = gen.generate(greedy_requests(ps, 8, eos_id=2), on_tokens=on_tokens)
    assert [r.tokens for r in got] == want
    assert max(in_flight) == 2 and gen.stats.peak_pages == 2
    assert gen.pool.free_pages == gen.pool.capacity


def test_a_request_no_pool_can_hold_gets_an_error_and_the_rest_finish():
    model = tiny_model()
    ps = long_prompts(3, 3, 8, seed=4)
    too_long = [1] + [7] * 70  # 71 prompt + 30 new positions: 2 pages; the pool holds 1
    gen = Generator(model, max_batch=2, max_seq_len=128, pages=2)
    before = gen.pool.free_pages
    res = gen.generate(greedy_requests(ps[:1] + [too_long] + ps[1:], 30, None))
    assert res[1].finish == "error" and res[1].tokens == []
    assert "requests[1] needs 2 KV pages" in res[1].error and "pool holds 1" in res[1].error
    assert gen.pool.free_pages == before
    # (a larger engine on the same model grows the model's one pool: checked after the leak)
    want = Generator(model, max_batch=2, max_seq_len=128).generate(greedy_requests(ps, 30, None))
    assert [r.tokens for r in res[:1] + res[2:]] == [r.tokens for r in want]


def test_every_page_goes_back_after_an_error_midway():
    """A caller's callback raising mid-run (an early stop): the rows' pages are freed."""
    model = tiny_model()
    gen = Generator(model, max_batch=3, max_seq_len=48, chunk=2)
    before = gen.pool.free_pages

    def stop(i, tokens, finish):
        if len(tokens) >= 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        gen.generate(greedy_requests(long_prompts(4, 3, 9), 10, None), on_tokens=stop)
    assert gen.pool.free_pages == before == gen.pool.capacity
    res = gen.generate(greedy_requests(long_prompts(4, 3, 9), 4, None))  # still usable
    assert all(len(r.tokens) == 4 for r in res) and gen.pool.free_pages == before


def test_rows_past_a_page_and_past_twice_the_models_max_seq_len():
    """Rows of 150 positions (3 pages; the model's max_seq_len is 48): the step's write slots
    and reads cross pages; the engine with 8-token prefill chunks equals the one-chunk one."""
    model = tiny_model()
    ps = long_prompts(3, 60, 100, seed=5)
    one = Generator(model, max_batch=3, max_seq_len=160, chunk=8).generate(
        greedy_requests(ps, 40, None)
    )
    chunked = Generator(model, max_batch=2, max_seq_len=160, chunk=8, prefill_chunk=8, pages=7)
    got = chunked.generate(greedy_requests(ps, 40, None))
    assert [r.tokens for r in got] == [r.tokens for r in one]
    assert all(len(r.tokens) == 40 for r in got)


def test_stories260k_chunked_and_paged_equals_llama_org(shared_data):
    ckpt = shared_data / "stories260K"
    llama = Llama.build(
        str(ckpt), str(ckpt / "tokenizer.model"), 128, 4, device="cpu", dtype=torch.float32
    )
    ps = [[1, 403, 407, 261, 378, 432, 383, 286, 261, 376], [1], [1, 376, 403, 407]]
    want = [llama.generate([p], 40, temperature=0.0, eos_id=2)[0][0] for p in ps]
    model = load(ckpt, "cpu", torch.float32)
    gen = Generator(model, max_batch=2, max_seq_len=128, chunk=8, prefill_chunk=3, pages=3)
    got = gen.generate(greedy_requests(ps, 40, eos_id=2))
    assert [r.tokens for r in got] == want
    assert gen.pool.free_pages == gen.pool.capacity


@pytest.mark.skipif(
    max_rows() < 128,
    reason=f"the decode step takes at most {max_rows()} rows (decode_linear.MAX_BATCH); the "
    "large-batch linear path raises it",
)
def test_more_than_64_rows_decode_the_same_tokens():
    model = tiny_model()
    ps = long_prompts(130, 0, 6, seed=6)
    want = Generator(model, max_batch=8, max_seq_len=48, chunk=4).generate(
        greedy_requests(ps, 3, None)
    )
    gen = Generator(model, max_batch=128, max_seq_len=48, chunk=4)
    assert 128 in gen.buckets
    got = gen.generate(greedy_requests(ps, 3, None))
    assert [r.tokens for r in got] == [r.tokens for r in want]


@pytest.mark.parametrize(
    ("rows", "max_batch", "tail", "new", "seed"),
    [(300, 384, [128, 256, 384], 3, 8), (600, 640, [384, 512, 640], 2, 9)],
)
def test_hundreds_of_rows_run_one_large_bucket_and_decode_the_same_tokens(
    rows, max_batch, tail, new, seed
):
    """300 rows at once (bucket 384: 84 idle entries on the scratch page) and 600 (bucket 640,
    past the step's old 512 limit): each prompt's tokens are those of an 8-row engine."""
    model = tiny_model()
    ps = long_prompts(rows, 0, 4, seed=seed)
    want = Generator(model, max_batch=8, max_seq_len=16, chunk=2).generate(
        greedy_requests(ps, new, None)
    )
    gen = Generator(model, max_batch=max_batch, max_seq_len=16, chunk=2)
    assert gen.buckets[-3:] == tail
    got = gen.generate(greedy_requests(ps, new, None))
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert [b for b, *_ in gen._steps] == [max_batch]


def test_page_size_and_buckets_stay_within_the_step():
    gen = Generator(tiny_model(), max_batch=max_rows(), max_seq_len=48)
    assert gen.buckets[-1] == max_rows() and PAGE_SIZE == 64
    assert gen.buckets == [
        b
        for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024)
        if b <= max_rows()
    ]


def _agree_worker(rank: int, world: int, init_file: str, out_file: str) -> None:
    import types

    import torch.distributed as dist

    from nakta_model.kv_pages import _agreed_over_tp
    from nakta_model.parallel import ParallelContext

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = types.SimpleNamespace(
            parallel=ParallelContext(rank, world), device=torch.device("cpu")
        )
        got = _agreed_over_tp(model, 100 + 7 * rank)  # free memory differs between GPUs
        torch.save(got, f"{out_file}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two fresh interpreters: a few seconds
def test_pool_size_is_the_smallest_over_tensor_parallel_ranks(tmp_path):
    """Every rank of a replica admits the same rows at the same steps only with one pool size:
    the ranks' own sizes (from their free memory) agree on the smallest."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "pages")
    mp.start_processes(
        _agree_worker, args=(2, str(tmp_path / "rdv"), out), nprocs=2, join=True,
        start_method="spawn",
    )  # fmt: skip
    assert [torch.load(f"{out}.{r}") for r in range(2)] == [100, 100]


def test_partial_prefix_pages_are_copied_in_one_go_per_admission(monkeypatch):
    """Rows admitted together queue their copy-on-write page copies and one flush makes them
    all (two index ops per cache tensor, not one copy per row and layer); the tokens equal an
    engine that shares nothing, and nothing is left queued."""
    from nakta_model.generation.row_pages import RowPages

    model = tiny_model()
    ps = shared_prompts(per=3)
    want = Generator(model, max_batch=6, max_seq_len=96, prefix_rows=0).generate(
        greedy_requests(ps, 4, None)
    )
    flushed: list[int] = []
    real = RowPages.flush_copies

    def spy(self):
        if self._copies:
            flushed.append(len(self._copies))
        real(self)

    monkeypatch.setattr(RowPages, "flush_copies", spy)
    gen = Generator(model, max_batch=6, max_seq_len=96)
    got = gen.generate(greedy_requests(ps, 4, None))
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert max(flushed) >= 2 and sum(flushed) == len(ps)  # a partial page each, batched
    assert gen.pages._copies == []


def test_a_draining_batch_stays_on_its_captured_bucket():
    """Rows finishing one by one (nothing left to admit) do not step the decode down into
    buckets not built yet (each would compile and capture for a short tail); the tokens equal
    Meta's loop; a later call of one row builds its own small bucket."""
    model = tiny_model()
    ps = long_prompts(8, 3, 9, seed=4)
    budgets = [2, 3, 5, 7, 9, 11, 13, 15]
    gen = Generator(model, max_batch=8, max_seq_len=32, chunk=2)
    reqs = [r for p, n in zip(ps, budgets) for r in greedy_requests([p], n, eos_id=None)]
    got = gen.generate(reqs)
    assert [r.tokens for r in got] == [meta_greedy(model, [p], n)[0] for p, n in zip(ps, budgets)]
    assert {key[0] for key in gen._steps} == {8}
    one = gen.generate(greedy_requests(ps[:1], 4, eos_id=None))
    assert one[0].tokens == meta_greedy(model, ps[:1], 4)[0]
    assert 1 in {key[0] for key in gen._steps}


def test_every_prefill_chunk_runs_the_page_reading_attention():
    """A chunk of fresh prompts only passes one empty prefix entry that no token reads: the
    packed attention compiled for continued pieces serves every chunk (one compile, not two);
    a continued piece gets an entry of its own."""
    from nakta_model.generation.prefill_stream import PrefillStream

    class Capture:
        device = torch.device("cpu")

        def forward_prefill(self, tokens, positions, seq_start, slots, last, prefix=None):
            self.prefix, self.slots = prefix, slots

    fresh, model = PrefillStream(), Capture()
    fresh.add([1, 5, 6, 7], 0, 4, [3])
    fresh.run(model)
    assert model.prefix.token_entry.tolist() == [-1] * 4
    assert model.prefix.lengths.tolist() == [0] and model.prefix.page_size == PAGE_SIZE
    assert model.slots.dtype == torch.int32  # as the decode step's: one RoPE kernel for both
    assert model.slots.tolist() == [3 * PAGE_SIZE + i for i in range(4)]
    cont = PrefillStream()
    cont.add([1, 5, 6, 7], 0, 2, [3])
    cont.add([1, 5, 6, 7], 2, 2, [4])
    cont.run(model)
    assert model.prefix.lengths.tolist() == [2] and model.prefix.page_table.tolist() == [[4]]
    assert model.prefix.token_entry.tolist()[:2] == [-1, -1] and 0 in model.prefix.token_entry


def test_pieces_reading_one_held_prefix_share_a_segment():
    """Rows continuing the same held prefix (same pages, same start) pack back to back under
    one entry; a piece of another prefix, or one reading its own pages, opens an aligned
    segment of its own (and only the stream's end is padded after it)."""
    from nakta_model.generation.prefill_stream import PrefillStream
    from nakta_model.kernels.packed_attention import PREFIX_ALIGN

    s = PrefillStream()
    held = [5, 6]  # a held prefix of 70 positions: two pages
    s.add(list(range(80)), 70, 10, [5, 9], read_pages=held)
    s.add(list(range(83)), 70, 13, [5, 11], read_pages=held)
    assert s.lengths == [70] and s.tables == [held] and s.entry == [0] * 23
    assert s.seq_start == [0] * 10 + [10] * 13 and len(s.tokens) == 23  # no padding between
    s.add(list(range(80)), 70, 10, [5, 12])  # its own pages: an entry and segment of its own
    assert s.lengths == [70, 70] and s.tables[1] == [5, 12]
    assert len(s.tokens) == PREFIX_ALIGN + 10 and s.entry[-10:] == [1] * 10


# [triton] is slow-tier only: the engine's logic is [reference]'s, and held prefixes decoded
# through the Triton kernels stay in the default tier in test_generation_engine's
# test_shared_prompt_prefixes_prefill_once_and_decode_the_same[triton]
@pytest.mark.parametrize("kernels", ["reference", pytest.param("triton", marks=pytest.mark.slow)])
def test_rows_of_a_held_prefix_prefill_in_one_segment(kernels, monkeypatch):
    """Prompts of two 70-token shared prefixes: the rows' first pieces after their held prefix
    share its entry (fewer stream tokens than one aligned segment per row); the tokens equal
    an engine holding no prefixes."""
    from nakta_model.generation import prefill_stream

    model = tiny_model(kernels=kernels)
    ps = shared_prompts(per=3)
    want = Generator(model, max_batch=6, max_seq_len=96, prefix_rows=0).generate(
        greedy_requests(ps, 3, None)
    )
    shared, real_run = [], prefill_stream.PrefillStream.run

    def spy(self, m):
        shared.append((len(self.last), len(self.lengths)))  # pieces, prefix entries
        return real_run(self, m)

    monkeypatch.setattr(prefill_stream.PrefillStream, "run", spy)
    got = Generator(model, max_batch=6, max_seq_len=96).generate(greedy_requests(ps, 3, None))
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert (6, 2) in shared  # six rows' pieces in one chunk, under their two prefixes' entries


def test_prefill_burst_fills_the_batch_before_it_decodes(monkeypatch):
    """prefill_burst=16: the admitted prompts (several forwards of 16 tokens) all prefill
    before the first decode chunk, so it runs every row; tokens equal Meta's and the
    one-forward-per-chunk engine's, in fewer decode steps. Bad values name the argument."""
    model = tiny_model()
    ps = long_prompts(12, 12, 30, seed=11)
    want = meta_greedy(model, ps, 7)
    batches: dict[int, list[int]] = {}
    steps = {}
    for burst in (1, 16):
        gen = Generator(model, max_batch=6, max_seq_len=48, chunk=3, prefill_chunk=16,
                        prefill_burst=burst)  # fmt: skip
        seen = batches[burst] = []
        run = gen._decode_chunk

        def spy(active, slots, *rest, run=run, seen=seen):
            seen.append(len(active))
            return run(active, slots, *rest)

        monkeypatch.setattr(gen, "_decode_chunk", spy)
        got = gen.generate(greedy_requests(ps, 7, eos_id=None))
        assert [r.tokens for r in got] == want, burst
        steps[burst] = gen.stats.decode_steps
    assert batches[1][0] < 6 and batches[16][0] == 6
    assert steps[16] < steps[1]
    with pytest.raises(ValueError, match="prefill_burst"):
        Generator(model, prefill_burst=0)
    monkeypatch.setenv("NAKTA_PREFILL_BURST", "many")
    with pytest.raises(ValueError, match="NAKTA_PREFILL_BURST"):
        Generator(model)
    monkeypatch.delenv("NAKTA_PREFILL_BURST")
    assert Generator(model).prefill_burst == PREFILL_BURST == 8
    monkeypatch.setenv("NAKTA_PREFILL_BURST", "3")
    assert Generator(model).prefill_burst == 3
