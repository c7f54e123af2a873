"""The generation engine's decode chunks: which captured step runs the active rows, how a
chunk is enqueued (continued before its tokens are read with ``pipeline``) and how its tokens
come back to the rows.

A mixin of :class:`~nakta_model.generation.engine.Generator`, as ``row_pages.RowPages`` is: it
reads the engine's settings and state (annotated below) and calls its page keeping
(``_grow``, ``_reads_held``) and its prefill (``_prefill_chunk``); the scheduling loop that
decides when a chunk runs stays in engine.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from nakta_model.generation.requests import GenerationStats, _Row
from nakta_model.generation.step import DecodeStep, EntryState, step_tokens

__all__ = ["DecodeChunks"]


class DecodeChunks:
    """Decode chunks for the generation engine (module docstring)."""

    model: object
    device: torch.device
    chunk: int
    min_chunk: int
    max_batch: int
    _feed: object
    graph_mode: str
    cascade: bool
    n_prefixes: int
    row_pages: int
    max_seq_len: int
    buckets: list[int]
    pipeline: bool
    stats: GenerationStats
    _steps: dict
    _call_bucket: int | None
    _last_read: float
    _on_tokens: Callable | None
    _held: dict
    _grow: Callable[[_Row, int], None]
    _reads_held: Callable[[_Row], bool]
    _prefill_chunk: Callable[[list[_Row]], None]

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

    def _continuation(self, pending: tuple, active: list[int], slots) -> tuple | None:
        """Enqueue the chunk after ``pending`` for the same rows (what ``_finish_decode``
        reads), or None when a row's budget ends with ``pending``."""
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

    def _launch_decode(
        self, active: list[int], slots, draining: bool, whole_budget: bool = False
    ) -> tuple:
        """Enqueue the chunk's step replays (no host sync); what ``_finish_decode`` reads.
        ``whole_budget``: hand out the rows' pages for every position they may still write
        (already reserved for them: the pool's room is the same), for continuations."""
        t0 = time.perf_counter()
        sampling = any(not slots[s].request.sampling.greedy for s in active)
        shared = any(self._reads_held(slots[s]) for s in active)
        variant = (sampling, self.cascade and shared and self.n_prefixes > 0)
        bucket = self._bucket(max(active) + 1, variant, draining)
        self._call_bucket = bucket
        step = self._step(bucket, *variant)
        steps = self._chunk_steps(active, slots)
        for s in active:  # pages for the positions this chunk (or its continuations) writes
            r = slots[s]
            self._grow(r, r.position + (self._left(r) if whole_budget else steps))
        self._load(step, active, slots)
        step.run(steps)
        return step, steps, t0, step.read_out(steps)

    def _left(self, r: _Row) -> int:
        """Tokens row r may still take (its budget, the cache's room)."""
        return min(r.request.max_new_tokens - len(r.tokens), self.max_seq_len - (r.position + 1))

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

    def _finish_decode(self, pending: tuple, active: list[int], slots) -> None:
        _, steps, t0, out = pending
        history = step_tokens(out)  # the one host sync per chunk
        for s in active:
            if not slots[s].finished:  # a row that stopped in the chunk before: dropped
                self._accept(slots[s], history[s])
        now = time.perf_counter()
        self.stats.decode_s += now - max(t0, self._last_read)  # continuations overlap
        self._last_read = now
        self.stats.decode_steps += steps

    def _load(self, step: DecodeStep, active: list[int], slots) -> None:
        """The active rows' state into the step's buffers (entry s = batch slot s)."""
        cascade = step.buffers.slot_table.numel() > 0
        entries = {}
        for s in active:
            r = slots[s]
            held = cascade and self._reads_held(r)  # the cascade reads the held prefix's pages
            entries[s] = EntryState(
                r.tokens[-1], r.position, r.pages, r.request.sampling,
                r.held.pages[0] if held else 0, r.held.length if held else 0,
            )  # fmt: skip
        step.load(entries, [(h.slot, h.pages, h.length) for h in self._held.values()])

    def _accept(self, r: _Row, new: list[int]) -> None:
        """Append decoded tokens to a row (``_Row.accept``) and report them."""
        r.accept(new, self.max_seq_len)
        if self._on_tokens is not None:
            self._on_tokens(r.index, r.tokens, r.finished)
