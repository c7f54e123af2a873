"""Batched generation with continuous batching over a paged KV cache: chunked prefill,
graph-replayed decode, stops.

The engine takes its pages from the model's one KV pool (``nakta_model.kv_pages``: ``PAGE_SIZE``
positions each; shared with the scorer's prefix cache, each touching only its own pages; made
or grown to ``pages=`` or what fits in free device memory). A row holds a block table of the
pages it has written; pages are handed out as it grows and go back when it finishes.
Requests wait in a queue; one is admitted (FIFO) into a free batch entry while the pool can
cover its prompt + ``max_new_tokens`` (pages are counted as reserved at admission and handed
out lazily, so an admitted row never runs out: no preemption is needed). A request that could
never fit (more pages than the whole pool) finishes at once with ``finish="error"`` and a
message naming it; the others run.

Every engine step runs one packed prefill forward of at most ``prefill_chunk`` prompt tokens
(``prefill_stream``: the admitted prompts' next pieces; a long prompt is split over several
steps, each piece attending to the row's earlier positions through its pages), then decodes
every row whose prompt is in: the decode step of the smallest captured batch bucket that
covers the active rows is replayed ``chunk`` times with no host synchronisation, and only then
does the host read the chunk's tokens (one copy), apply EOS, ``max_new_tokens`` and stop
strings, free the rows that finished and admit new prompts. A row that finishes inside a chunk
decodes at most ``chunk - 1`` tokens nobody reads; the chunk is shortened so that no row runs
past its token budget. Up to ``prefill_burst`` prefill forwards run back to back while admitted
prompts wait (so a batch fills before it decodes), then the running rows decode again: a long
prompt delays them by a bounded number of prefill forwards, never by its whole length. While
nothing waits to be admitted or prefilled, ``pipeline`` enqueues the next chunk of the same rows
before the host reads this one's tokens. Per request, the time to its first token is in
``stats.first_token_s`` (and ``on_tokens`` reports it as it happens). Which pages a row
holds and may still take is ``row_pages.RowPages`` (``Generator.pages``); this file keeps the
scheduling: admission, the prefill forwards and the decode chunks (which captured step runs the
active rows, how a chunk is enqueued, how its tokens come back to the rows).

Prompts that share a long prefix (a few-shot prompt: ``prefix_cache.shared_prefixes``) prefill
it once into pages of its own, held for later admissions (at most ``prefix_rows`` prefixes,
least recently used first out). A row then holds the prefix's full pages by reference (a
reference count, no copy) and a copy of its partial last page, which it goes on writing
(copy-on-write); only the rest of its prompt runs through the model. With ``cascade`` each
decode step computes every held prefix once for all the rows that read it (one tensor-core
tile of their queries against the prefix's pages, ``decode_attention``'s ``prefix_slots``)
before each row's own keys; a row whose prefix was evicted reads the same pages through its
own block table (they stay while any row holds them).

Greedy decoding gives, per prompt, the tokens Meta's loop gives (``meta_loop``): the same model
math on each row, just not padded to the batch's shortest prompt.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from nakta_model import knobs
from nakta_model.fp8 import Precision, check_kv_cache
from nakta_model.generation.prefill_stream import PrefillStream
from nakta_model.generation.requests import (
    GenerationRequest,
    GenerationResult,
    GenerationStats,
    _Row,
    check_int,
    check_requests,
    greedy_requests,
)
from nakta_model.generation.row_pages import RowPages
from nakta_model.generation.sampling import sample_next
from nakta_model.generation.step import (
    DecodeStep,
    EntryState,
    batch_limit,
    check_graph_mode,
    step_tokens,
)
from nakta_model.kv_pages import PAGE_SIZE, kv_pool, pages_for, pool_pages

__all__ = [
    "Feed",
    "GenerationRequest",
    "GenerationResult",
    "GenerationStats",
    "Generator",
    "greedy_requests",
    "max_rows",
]

# Above 256 rows the buckets step by 128: there a step's GEMMs are compute-bound (7B: ~256 rows
# reach the bf16 ridge point), so a padded row costs as much as a real one. Past 512 rows only
# where the pool holds them (an e4m3 KV cache, a GQA model, a 141 GB card).
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024)
# Prompt tokens of one prefill forward. Rows enter the batch only as fast as their prompts
# prefill: with ``chunk`` decode steps between two prefill forwards, at most
# ``PREFILL_CHUNK / prompt length`` rows start per ``chunk`` steps, so rows that live ``n`` new
# tokens stay at ``n / chunk * PREFILL_CHUNK / prompt`` in flight: a smaller chunk caps the
# batch below ``max_batch`` (docs/experiments.md). 8,192 admits 64 prompts of 128 tokens per
# chunk in one forward, then the chunk's decode steps, so a long prompt still never stalls the
# running rows for longer.
PREFILL_CHUNK = 8192
# Prefill forwards that may run back to back before the running rows' next decode chunk. One
# per chunk fills a 384-row batch only ~6 chunks after its rows start (64 prompts of 128 tokens
# a forward), so short-lived rows decode in a batch that is never full; 8 admit the whole batch
# before it decodes (docs/experiments.md). The running rows then wait at most 8 forwards (64k
# prompt tokens) between two chunks.
PREFILL_BURST = 8
ENV_BURST = "NAKTA_PREFILL_BURST"
TokenCallback = Callable[[int, list[int], "str | None"], None]


class Feed(Protocol):
    """Requests that arrive while :meth:`Generator.generate` runs (an online server's queue).

    ``poll(idle)`` is called between engine steps (never inside a chunk) and returns
    ``(new, cancel)``: new ``(key, request)`` pairs to queue (the key is the index ``on_tokens``
    reports; unique among live requests) and the keys of requests to drop (queued or running:
    their pages go back at once and ``on_tokens`` reports ``"cancelled"``); or None to stop
    (rows still running are cancelled). ``idle``: nothing is queued or running, so the call may
    block until something arrives. ``pending()``: something waits, so a pipelined run of decode
    chunks ends at the next read instead of running on to a row's end. ``flush()``: the tokens
    ``on_tokens`` reported since the last call may go out now (called after every prefill
    forward and every decode chunk read, so a stream never waits for a run of chunks)."""

    def poll(self, idle: bool) -> tuple[list[tuple[int, GenerationRequest]], list[int]] | None: ...

    def pending(self) -> bool: ...

    def flush(self) -> None: ...


def max_rows() -> int:
    """The most rows the engine decodes at once: the largest bucket the decode step takes."""
    return max(b for b in BUCKETS if b <= batch_limit())


class Generator:
    """Continuous-batching generation on one model over a paged KV cache (module docstring).

    ``max_batch`` rows decode at once (at most :func:`max_rows`, the decode step's limit);
    ``max_seq_len`` bounds prompt + continuation per row (default: the model's); ``chunk``
    tokens are decoded between host checks; ``prefill_chunk`` bounds the prompt tokens of one
    prefill forward (:data:`PREFILL_CHUNK`). ``pages``: the pages of ``PAGE_SIZE`` positions it
    asks of the model's KV pool (a larger pool is used as it is; default: enough for
    ``max_batch`` full rows and the held prefixes, on CUDA at most what fits in
    ``memory_fraction`` of the free memory). ``prefix_rows``: how many shared prefixes
    are held at once. ``graphs`` captures the decode step per batch bucket in CUDA graphs
    (default: on CUDA); ``graph_mode`` (instead of ``graphs``) names how the step runs:
    ``"cuda_graph"``, ``"compile"`` (``torch.compile(mode="reduce-overhead")``) or ``"eager"``.
    ``cascade`` (default on): each decode step computes every held prefix once for all the rows
    that read it instead of row by row. ``prefill_burst``: prefill
    forwards that may run back to back while admitted prompts wait, before the running rows
    decode their next chunk (default ``NAKTA_PREFILL_BURST``, else :data:`PREFILL_BURST`; 1: one
    forward per chunk, the least wait for the running rows). More fills the batch sooner (a
    full batch decodes at the least cost per token) at the price of the running rows waiting up
    to that many forwards between chunks. ``pipeline`` (default on): while nothing waits to be
    admitted or prefilled, the next decode chunk of the same rows is enqueued before this
    chunk's tokens are read, so the host's reading and bookkeeping overlap the GPU's next chunk
    (``_decode_chunk``; off: each chunk read before the next is enqueued, the simpler order
    tests compare against). ``min_chunk`` (default ``chunk``): with a ``feed`` (online), a
    chunk shrinks toward it while few rows run (``_chunk_for``): an arrival waits
    for the chunk in flight before its prefill, and a light batch's host check costs little;
    a full batch decodes ``chunk`` steps between checks. Offline calls always run ``chunk``.
    ``kv_cache`` (``"bf16"``/``"fp8"`` or a parsed ``Precision``;
    None: the model's as loaded) sets the model's KV cache dtype (``Precision.kv_cache``).
    """

    def __init__(
        self,
        model,
        *,
        max_batch: int = 32,
        max_seq_len: int | None = None,
        chunk: int = 16,
        graphs: bool | None = None,
        prefix_rows: int = 2,
        graph_mode: str | None = None,
        cascade: bool = True,
        pages: int | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        memory_fraction: float = 0.8,
        prefill_burst: int | None = None,
        pipeline: bool = True,
        min_chunk: int | None = None,
        kv_cache: Precision | str | None = None,
    ):
        if kv_cache is not None:  # the model's KV dtype for every user of its pool from now on
            kv = kv_cache.kv_cache if isinstance(kv_cache, Precision) else check_kv_cache(kv_cache)
            model.set_kv_cache(kv)
        check_int("max_batch", max_batch, 1, max_rows(), " (the decode step's limit)")
        check_int("chunk", chunk, 1)
        self.min_chunk = chunk if min_chunk is None else check_int("min_chunk", min_chunk, 1)
        if self.min_chunk > chunk:
            raise ValueError(f"min_chunk must be <= chunk ({chunk}), got {min_chunk}")
        max_seq_len = check_int("max_seq_len", max_seq_len or model.args.max_seq_len, 2)
        check_int("prefix_rows", prefix_rows, 0)
        check_int("prefill_chunk", prefill_chunk, 1)
        if pages is not None:
            check_int("pages", pages, 2, why=" (page 0 is scratch)")
        if not 0.0 < memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must lie in (0, 1], got {memory_fraction!r}")
        if prefill_burst is None:
            prefill_burst = knobs.get_int(ENV_BURST)
        self.prefill_burst = check_int(f"prefill_burst (or {ENV_BURST})", prefill_burst, 1)
        if not isinstance(pipeline, bool):
            raise TypeError(f"pipeline must be a bool, got {pipeline!r}")
        self.pipeline = pipeline
        self._last_read = 0.0  # when the host last read a chunk's tokens (decode_s accounting)
        self.model, self.max_batch = model, max_batch
        self.max_seq_len, self.chunk = max_seq_len, chunk
        self.prefill_chunk = prefill_chunk
        self.device = model.device
        if graph_mode is None:
            graphs = self.device.type == "cuda" if graphs is None else bool(graphs)
            graph_mode = "cuda_graph" if graphs else "eager"
        elif graphs is not None:
            raise ValueError(
                f"give graphs or graph_mode, not both (got {graphs!r}, {graph_mode!r})"
            )
        self.graph_mode = check_graph_mode(graph_mode)
        self.cascade = bool(cascade)
        self.n_prefixes = prefix_rows
        self.row_pages = pages_for(max_seq_len)  # block-table width
        full = 1 + (max_batch + prefix_rows) * self.row_pages
        self.pages = RowPages(
            model, row_pages=self.row_pages, max_seq_len=max_seq_len, prefix_rows=prefix_rows,
            n_pages=pages or pool_pages(model, cap=full, fraction=memory_fraction),
        )  # fmt: skip
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        # the decode step per (bucket, sampling, cascade), captured on first use
        self._steps: dict[tuple[int, bool, bool], DecodeStep] = {}
        self.stats = GenerationStats()
        self._admitted = 0  # admissions so far (a row's ``seq``: prefill pieces oldest first)
        self._call_bucket: int | None = None  # the bucket this call's last chunk ran
        self._on_tokens: TokenCallback | None = None
        self._feed: Feed | None = None
        self._begin()

    @property
    def pool(self):
        """The model's KV pool the rows take their pages from."""
        return self.pages.pool

    @property
    def held_pages(self) -> int:
        """Pages the held shared prefixes hold (the pool's only pages in use between calls)."""
        return self.pages.held_pages

    def _begin(self) -> None:
        """The pool ready for a call (``RowPages.begin``); the captured steps go when the
        pool's cache is replaced (they hold its addresses)."""
        kv_pool(self.model).on_rebuild(self._drop_steps)
        if self.pages.begin(self.stats):
            self._drop_steps()

    def _drop_steps(self) -> None:
        self._steps.clear()

    # --------------------------------------------------------------------------- public
    def generate(
        self,
        requests: Sequence[GenerationRequest],
        progress: bool = False,
        on_tokens: TokenCallback | None = None,
        feed: Feed | None = None,
    ) -> list[GenerationResult]:
        """Generate every request; results in request order.

        ``on_tokens(index, tokens, finish)``, when given, is called at every host check for each
        request that took new tokens (after its prefill, then once per decoded chunk) with the
        request's position, its tokens so far (as the result will hold them) and its finish
        reason (None while it runs): what a caller streams text from as it is decoded. Every
        page a row took is back in the pool when this returns (or raises); only the held
        prefixes keep theirs.

        ``feed`` (a :class:`Feed`): the call also takes requests as they arrive, between engine
        steps, until ``feed.poll`` returns None (online serving; their results are reported
        through ``on_tokens`` only, and ``first_token_s`` is keyed by their keys while they
        run)."""
        check_requests(requests, self.model.args.vocab_size, self.max_seq_len)
        self.stats = GenerationStats(first_token_s=[float("nan")] * len(requests))
        self._feed = feed
        if feed is not None:
            self.stats.first_token_s = {}  # type: ignore[assignment]  # keyed, not listed
        self._begin()
        self._on_tokens = on_tokens
        self._t0 = time.perf_counter()
        self._call_bucket = None
        shared = [0] * len(requests)
        if self.n_prefixes:
            from nakta_model.prefix_cache import shared_prefixes

            shared = shared_prefixes([list(r.prompt) for r in requests])
        # longest first; prompts of one shared prefix next to each other
        order = sorted(
            range(len(requests)),
            key=lambda i: (tuple(requests[i].prompt[: shared[i]]), -len(requests[i].prompt)),
        )
        queue = deque(_Row(i, requests[i], shared[i]) for i in order)
        slots: list[_Row | None] = [None] * self.max_batch
        done: list[_Row] = []
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), disable=not progress, desc="generate", unit="req")
        burst = 0  # prefill forwards since the last decode chunk
        try:
            while queue or any(slots) or feed is not None:
                if feed is not None and not self._poll(feed, queue, slots, done, bar):
                    break
                self._admit(queue, slots, done, bar)
                prefilling = [r for r in slots if r is not None and not r.prompt_in]
                draining = not queue
                if prefilling:
                    self._prefill_chunk(sorted(prefilling, key=lambda r: r.seq))
                    for r in prefilling:
                        if r.finished:
                            self._release(r, slots, done, bar)
                    burst += 1
                    if burst < self.prefill_burst and any(not r.prompt_in for r in prefilling):
                        continue  # the rest of the admitted prompts before the next chunk
                active = [s for s, r in enumerate(slots) if r is not None and r.prompt_in]
                if not active:
                    if not prefilling and queue and not any(slots):
                        raise RuntimeError("generation engine: a request could not be admitted")
                    continue
                # nothing to admit or prefill before the next chunk: it may be enqueued early
                waiting = any(r is not None and not r.prompt_in for r in slots)
                free = queue and None in slots
                self._decode_chunk(active, slots, draining, not (waiting or free))
                burst = 0
                for s in active:
                    if slots[s].finished:
                        self._release(slots[s], slots, done, bar)
        finally:
            for r in slots:
                if r is not None:
                    self.pages.free_row(r)
                    if feed is not None and not r.finished:
                        r.finished = "cancelled"
                        if on_tokens is not None:
                            on_tokens(r.index, r.tokens, r.finished)
            self._feed = None
            bar.close()
        if feed is not None:
            return []  # every result went out through on_tokens
        out: list[GenerationResult | None] = [None] * len(requests)
        for r in done:
            out[r.index] = GenerationResult(r.tokens, r.text, r.finished, r.error)
            self.stats.generated_tokens += len(r.tokens)
        return out  # type: ignore[return-value]

    # ----------------------------------------------------------------------- online feed
    def _poll(self, feed: Feed, queue: deque, slots: list, done: list, bar) -> bool:
        """Take the feed's new requests and cancellations (``generate``'s ``feed``); False when
        the feed says stop. Finished rows are reported already: they are not kept."""
        for r in done:
            self.stats.generated_tokens += len(r.tokens)
            self.stats.first_token_s.pop(r.index, None)  # type: ignore[call-overload]
        done.clear()
        idle = not queue and not any(slots)
        got = feed.poll(idle)
        if got is None:
            return False
        new, cancel = got
        for key in cancel:
            self._cancel(key, queue, slots, done, bar)
        fresh = []
        for key, req in new:
            try:
                check_requests([req], self.model.args.vocab_size, self.max_seq_len)
            except (TypeError, ValueError) as e:
                r = _Row(key, req, finished="error", error=str(e).replace("requests[0]", "request"))
                if self._on_tokens is not None:
                    self._on_tokens(key, r.tokens, r.finished)
                continue
            fresh.append(_Row(key, req))
        if fresh:
            self._share_online(fresh)
            queue.extend(fresh)
        return True

    def _share_online(self, rows: list[_Row]) -> None:
        """Shared prefixes of arriving prompts: a held prefix they begin with, else one they
        share with each other (``prefix_cache.shared_prefixes``)."""
        if not self.n_prefixes:
            return
        from nakta_model.prefix_cache import shared_prefixes

        among = shared_prefixes([list(r.request.prompt) for r in rows])
        for r, n in zip(rows, among):
            p = tuple(r.request.prompt)
            held = [len(k) for k in self.pages.held if len(k) < len(p) and p[: len(k)] == k]
            r.shared = max(held + [n])

    def _cancel(self, key: int, queue: deque, slots: list, done: list, bar) -> None:
        """Drop request ``key`` wherever it is; its pages go back to the pool now."""
        for r in list(queue):
            if r.index == key:
                queue.remove(r)
                break
        else:
            r = next((x for x in slots if x is not None and x.index == key), None)
            if r is None:
                return  # finished already
            self._release(r, slots, done, bar)
        r.finished = "cancelled"
        if self._on_tokens is not None:
            self._on_tokens(key, r.tokens, r.finished)

    # ------------------------------------------------------------------------ admission
    def _admit(self, queue: deque, slots: list, done: list, bar) -> None:
        """Move queued requests into free batch entries, in order, while the pool covers them
        beside the running rows; a request that could never fit finishes with an error result."""
        free = [s for s in range(self.max_batch) if slots[s] is None]

        def place(r: _Row) -> None:
            slots[free.pop(0)] = r

        running = [x for x in slots if x is not None]
        self._admit_rows(queue, done, bar, len(free), place, running)

    def _admit_rows(self, queue: deque, done: list, bar, n: int, place, running) -> None:
        """Admit up to ``n`` queued requests (``place`` each, in order) while the pool covers
        them; queued copy-on-write page copies are made in one go at the end."""
        try:
            while queue and n > 0:
                r = queue[0]
                need = pages_for(self.pages.positions(r))
                if need > self.pages.room:  # the pool's pages but the other users'
                    queue.popleft()
                    r.finished = "error"
                    r.error = (
                        f"requests[{r.index}] needs {need} KV pages ({len(r.request.prompt)} "
                        f"prompt tokens + max_new_tokens={r.request.max_new_tokens}, pages of "
                        f"{PAGE_SIZE} positions) but the pool holds {self.pages.room} for it"
                    )
                    self.stats.first_token_s[r.index] = time.perf_counter() - self._t0
                    if self._on_tokens is not None:
                        self._on_tokens(r.index, r.tokens, r.finished)
                    done.append(r)
                    bar.update(1)
                    continue
                if not self.pages.reserve(r, running):
                    return
                queue.popleft()
                self._admitted += 1
                r.seq = self._admitted
                place(r)
                running.append(r)
                n -= 1
        finally:
            self.pages.flush_copies()  # the admitted rows' partial prefix pages, in one go

    # ---------------------------------------------------------------------------- phases
    def _prefill_chunk(self, rows: list[_Row]) -> None:
        """One packed forward over the next pieces of the admitted prompts (at most
        ``prefill_chunk`` tokens, oldest admission first); the rows whose prompt is then in
        get their first token."""
        t0 = time.perf_counter()
        stream, pieces, budget = PrefillStream(), [], self.prefill_chunk
        for r in rows:
            if budget <= 0:
                break
            prompt = list(r.request.prompt)
            n = min(len(prompt) - r.done, budget)
            self.pages.grow(r, r.done + n)
            # a row's first piece after a held prefix reads the prefix's own pages (the keys
            # of its copy-on-write page too): the rows of one prefix share a segment
            held = r.done == r.shared and self.pages.reads_held(r)
            stream.add(prompt, r.done, n, r.pages, r.held.pages if held else None)
            pieces.append(r)
            r.done += n
            budget -= n
        logits = stream.run(self.model)
        self.stats.prefill_chunks += 1
        self.stats.prefilled_tokens += self.prefill_chunk - budget
        ready = [i for i, r in enumerate(pieces) if r.done == len(r.request.prompt)]
        if ready:
            params = [pieces[i].request.sampling for i in ready]
            dev = self.device
            first = sample_next(
                logits[torch.tensor(ready, device=dev)],
                torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
                torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev),
                torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
                any_sampling=not all(p.greedy for p in params),
            ).tolist()
            now = time.perf_counter() - self._t0
            for i, t in zip(ready, first):
                r = pieces[i]
                self.stats.prompt_tokens += len(r.request.prompt)
                self.stats.first_token_s[r.index] = now
                self._accept(r, [t])
        self.stats.prefill_s += time.perf_counter() - t0
        if self._feed is not None:
            self._feed.flush()

    # ----------------------------------------------------------------------- decode chunks
    def _decode_chunk(
        self, active: list[int], slots, draining: bool = False, may_continue: bool = False
    ) -> None:
        """Replay the decode step for the active rows, then read and apply the new tokens.
        With ``pipeline`` and ``may_continue`` (nothing to admit or prefill first), the next
        chunk of the same rows is enqueued before this one's tokens are read, and so on until
        a row ends (its budget: known ahead, no continuation past it; a stop: seen when its
        chunk is read, after which the chunk already enqueued is read and its tokens for that
        row dropped, as for a row that stops inside a chunk). A continuation needs no host
        write: the step advances its tokens and positions on the device, and the rows' pages
        for every position they may write are handed out at the launch."""
        may_continue = may_continue and self.pipeline
        pending = self._launch_decode(active, slots, draining, whole_budget=may_continue)
        while True:
            nxt = self._continuation(pending, active, slots) if may_continue else None
            self._finish_decode(pending, active, slots)
            if nxt is None:
                return
            pending = nxt
            may_continue = not any(slots[s].finished for s in active)

    def _launch_decode(
        self, active: list[int], slots, draining: bool, whole_budget: bool = False
    ) -> tuple:
        """Enqueue the chunk's step replays (no host sync); what ``_finish_decode`` reads.
        ``whole_budget``: hand out the rows' pages for every position they may still write
        (already reserved for them: the pool's room is the same), for continuations."""
        t0 = time.perf_counter()
        sampling = any(not slots[s].request.sampling.greedy for s in active)
        shared = any(self.pages.reads_held(slots[s]) for s in active)
        variant = (sampling, self.cascade and shared and self.n_prefixes > 0)
        bucket = self._bucket(max(active) + 1, variant, draining)
        self._call_bucket = bucket
        step = self._step(bucket, *variant)
        steps = self._chunk_steps(active, slots)
        for s in active:  # pages for the positions this chunk (or its continuations) writes
            r = slots[s]
            self.pages.grow(r, r.position + (self._left(r) if whole_budget else steps))
        self._load(step, active, slots)
        step.run(steps)
        return step, steps, t0, step.read_out(steps)

    def _continuation(self, pending: tuple, active: list[int], slots) -> tuple | None:
        """Enqueue the chunk after ``pending`` for the same rows (what ``_finish_decode``
        reads), or None when a row's budget ends with ``pending`` or the feed has something
        waiting (the run of chunks ends at the next read)."""
        if self._feed is not None and self._feed.pending():
            return None
        step, steps = pending[0], pending[1]
        left = min(self._left(slots[s]) for s in active) - steps
        if left < 1:
            return None
        t0 = time.perf_counter()
        self.stats.continued_chunks += 1
        step.restart()  # after the copy of pending's tokens, in stream order
        steps = min(self._chunk_for(len(active)), left)
        step.run(steps)
        return step, steps, t0, step.read_out(steps)

    def _finish_decode(self, pending: tuple, active: list[int], slots) -> None:
        """Read a chunk's tokens (the one host sync per chunk) into its rows; a feed may send
        them out now."""
        _, steps, t0, out = pending
        history = step_tokens(out)
        for s in active:
            if not slots[s].finished:  # a row that stopped in the chunk before: dropped
                self._accept(slots[s], history[s])
        now = time.perf_counter()
        self.stats.decode_s += now - max(t0, self._last_read)  # continuations overlap
        self._last_read = now
        self.stats.decode_steps += steps
        if self._feed is not None:
            self._feed.flush()

    def _step(self, bucket: int, sampling: bool, cascade: bool = False) -> DecodeStep:
        """The step of a bucket, captured on first use; ``cascade``: the variant whose
        attention computes held prefixes once for all their rows (its own graph: a batch with
        no shared prefix runs the step without the cascade's two extra launches per layer)."""
        key = (bucket, sampling, cascade)
        if key not in self._steps:
            step = DecodeStep(
                self.model, bucket, self.chunk, sampling=sampling, graph_mode=self.graph_mode,
                prefix_slots=self.n_prefixes if cascade else 0, row_pages=self.row_pages,
            )  # fmt: skip
            if self.graph_mode == "cuda_graph":
                step.capture()  # idle entries: every table entry is the scratch page
            self._steps[key] = step
        return self._steps[key]

    def _bucket(self, need: int, variant: tuple, draining: bool) -> int:
        """The smallest bucket holding ``need`` entries, but a call whose batch drains (nothing
        left to admit) does not step down into a bucket not captured yet: it stays on the
        smallest captured one that holds the rows. A new bucket compiles its kernels (the
        GEMVs of buckets up to 64 are Triton kernels of their own; on a machine's first run the
        Triton cache is empty) and captures its graph, for a tail of at most
        ``max_new_tokens`` steps that a bigger step runs nearly as fast (a step reads the
        weights whatever its rows)."""
        fit = [b for b in self.buckets if b >= need]
        last = self._call_bucket
        if draining and last in fit and (fit[0], *variant) not in self._steps:
            return next(b for b in fit if b == last or (b, *variant) in self._steps)
        return fit[0]

    def _chunk_steps(self, active: list[int], slots) -> int:
        """The next chunk's steps: ``_chunk_for`` the active rows, shortened so that no row
        runs past its budget."""
        return max(1, min([self._chunk_for(len(active))] + [self._left(slots[s]) for s in active]))

    def _chunk_for(self, rows: int) -> int:
        """Steps between host checks for ``rows`` active rows. Offline: ``chunk``. Online (a
        feed): the least power-of-two multiple of ``min_chunk`` that covers ``chunk`` scaled by
        the batch's fill, so that a light batch reads its tokens (and lets an arrival prefill)
        every few steps while a full one keeps the long chunk's low host cost per token. A
        shorter chunk changes when tokens are read, never which (the step is the same)."""
        if self._feed is None or self.min_chunk >= self.chunk:
            return self.chunk
        want, steps = self.chunk * rows / self.max_batch, self.min_chunk
        while steps < want:
            steps *= 2
        return min(steps, self.chunk)

    def _left(self, r: _Row) -> int:
        """Tokens row r may still take (its budget, the cache's room)."""
        return min(r.request.max_new_tokens - len(r.tokens), self.max_seq_len - (r.position + 1))

    def _load(self, step: DecodeStep, active: list[int], slots) -> None:
        """The active rows' state into the step's buffers (entry s = batch slot s)."""
        cascade = step.buffers.slot_table.numel() > 0
        entries = {}
        for s in active:
            r = slots[s]
            held = cascade and self.pages.reads_held(r)  # the cascade reads the held prefix's pages
            entries[s] = EntryState(
                r.tokens[-1], r.position, r.pages, r.request.sampling,
                r.held.pages[0] if held else 0, r.held.length if held else 0,
            )  # fmt: skip
        step.load(entries, [(h.slot, h.pages, h.length) for h in self.pages.held.values()])

    def _accept(self, r: _Row, new: list[int]) -> None:
        """Append decoded tokens to a row (``_Row.accept``) and report them."""
        r.accept(new, self.max_seq_len)
        if self._on_tokens is not None:
            self._on_tokens(r.index, r.tokens, r.finished)

    def _release(self, r: _Row, slots, done: list[_Row], bar) -> None:
        """A finished row out of its batch entry; its pages back to the pool."""
        self.pages.free_row(r)
        for s, x in enumerate(slots):
            if x is r:
                slots[s] = None
        done.append(r)
        bar.update(1)
