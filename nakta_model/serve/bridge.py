"""The engine bridge: one background thread owns the model and runs the ``Generator`` for the
server's lifetime; the asyncio side submits requests and reads their tokens through it.

The thread runs ``Generator.generate(feed=bridge)``: between engine steps it takes the requests
submitted since (they join the running batch at once: online continuous batching), the
cancellations (a client that went away: its row and pages go back at once) and the calls that
must run on the model's thread (prompt logprobs), and hands the tokens decoded since to the
event loop in one batch per step. Under tensor parallelism (``lockstep``) every answer the
engine takes from it is also broadcast to the other ranks, which run the same steps
(:mod:`.lockstep`). A bounded number of requests may wait for their first token;
past it :meth:`EngineBridge.submit` refuses (the route answers 429 with ``Retry-After``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nakta_model.generation.engine import GenerationRequest, Generator
from nakta_model.serve.lockstep import (
    STOP,
    Lockstep,
    ModelCall,
    pending_message,
    poll_message,
    run_call,
)
from nakta_model.serve.metrics import Metrics

__all__ = ["EngineBridge", "Handle", "QueueFull", "ShuttingDown"]

log = logging.getLogger("nakta.serve")


class QueueFull(Exception):
    """The waiting queue is at its bound."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new requests."""


@dataclass
class Handle:
    """One submitted request as the asyncio side sees it. ``tokens`` grows as tokens arrive
    (the engine's own list, read up to ``n``); ``finish`` is ``"stop"``, ``"length"``,
    ``"cancelled"`` or ``"error"`` once it is done."""

    key: int
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    arrived: float
    event: asyncio.Event = field(default_factory=asyncio.Event)
    tokens: list[int] = field(default_factory=list)
    n: int = 0
    finish: str | None = None
    first_token_at: float | None = None
    taken: float = 0.0  # when the engine took it from the bridge's queue
    # engine-thread side
    _seen: int = 0
    _last: float = 0.0
    _started: bool = False  # it has left the waiting queue (a first token, or its end)
    _update: tuple | None = None

    async def wait(self) -> None:
        """Until something new arrived (or the request finished)."""
        await self.event.wait()
        self.event.clear()

    def text_tokens(self) -> list[int]:
        return self.tokens[: self.n]


MAX_DEFER_S = 0.1  # the longest a step's tokens are held back by ``defer_rows``
MAX_GATHER_S = 0.02  # the longest ``admit_gap_s`` holds arrivals back


class EngineBridge:
    """The generator's thread and the thread-safe hand-over around it (module docstring).
    ``max_queue``: requests that may wait for their first token before ``submit`` refuses.

    ``defer_rows`` (0: off): a step's tokens for at least that many rows are held back while
    the GPU has no work queued (a step the engine could not pipeline: rows ended, prompts are
    admitted and prefilled next), and handed over at the next host check that finds the GPU
    busy (at most :data:`MAX_DEFER_S` later, or before the engine waits idle). The event
    loop's turn over many streams then runs beside the GPU's next chunk, not while the engine
    thread needs the GIL to launch the prefill with the GPU idle. Costs those rows a chunk of
    latency; never defers on the CPU.

    ``pipeline_rows`` (0: always): decode chunks are pipelined (the next enqueued before this
    one is read) only while at least that many rows run. A light batch reads each chunk before
    it launches the next, so an arrival waits for the rest of the chunk on the GPU, not for
    that chunk and the one queued behind it too; the GPU idles for the host's short check
    between chunks instead, which a light batch's few rows make cheap.

    ``admit_gap_s`` (0: off): while the batch is light (as for ``pipeline_rows``), arrivals
    that keep coming less than this apart are gathered (at most :data:`MAX_GATHER_S`) and
    handed to the engine together: a burst of prompts (an unbounded client's first second)
    is admitted and prefilled in a few large groups, as the offline call's bulk start is,
    not in many small ones whose rows then end, and get refilled, at different steps.

    ``lockstep`` (tensor parallel, rank 0): every ``poll`` and ``pending`` answer and every
    model call is broadcast to the other ranks before the engine acts on it; an idle wait
    answers an empty poll at least every ``lockstep.heartbeat_s``."""

    def __init__(
        self,
        generator: Generator,
        metrics: Metrics,
        max_queue: int,
        defer_rows: int = 0,
        pipeline_rows: int = 0,
        admit_gap_s: float = 0.0,
        lockstep: Lockstep | None = None,
    ):
        self.generator = generator
        self.lockstep = lockstep
        self.metrics = metrics
        self.max_queue = max_queue
        self.defer_rows = defer_rows
        self.pipeline_rows = pipeline_rows
        self.admit_gap_s = admit_gap_s
        self._stream = None  # the engine thread's CUDA stream (set on that thread)
        self._dirty_since = 0.0  # when the oldest update not yet handed over came
        self._cv = threading.Condition()
        self._new: list[Handle] = []
        self._cancel: list[int] = []
        self._calls: list[tuple[ModelCall, concurrent.futures.Future]] = []
        self._live: dict[int, Handle] = {}  # submitted, not finished (engine-thread view)
        self._dirty: list[Handle] = []
        self._waiting = 0  # live handles with no token yet (guarded by _cv)
        self._next_key = 0
        self._stop = False
        self._draining = False
        self.error: BaseException | None = None
        # engine-thread bookkeeping, settled under the lock once per flush (not once per row)
        self._started_n = 0  # rows that left the waiting queue since the last flush
        self._ended: list[int] = []  # keys of rows that finished since the last flush
        self._new_tokens = 0
        self.clock = EngineClock()
        self._thread = threading.Thread(target=self._run, name="nakta-engine", daemon=True)
        metrics.kv_total.set(generator.pool.capacity)
        metrics.registry.register(_EngineCollector(self))

    # ------------------------------------------------------------------ asyncio side
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, request: GenerationRequest) -> Handle:
        """Queue a request for the engine (call on the event loop)."""
        loop = asyncio.get_running_loop()
        with self._cv:
            if self._draining or not self.alive:
                raise ShuttingDown()
            if self._waiting >= self.max_queue:
                raise QueueFull()
            key = self._next_key
            self._next_key += 1
            h = Handle(key, request, loop, time.perf_counter())
            self._live[key] = h
            self._waiting += 1
            self._new.append(h)
            self._cv.notify()
        self.metrics.queue_depth.set(self._waiting)
        return h

    def cancel(self, h: Handle) -> None:
        """Drop a request (its client went away); a finished one is left alone."""
        with self._cv:
            if h.key in self._live and h.finish is None:
                self._cancel.append(h.key)
                self._cv.notify()

    def call(self, fn: Callable[..., object], *args: object) -> asyncio.Future:
        """Run ``fn(model, *args)`` on the engine thread between two engine steps; its result
        awaited. Under tensor parallelism every rank runs it (on its shard) at the same point:
        ``fn`` must be a module-level function and ``args`` picklable."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if not self.alive:
                raise ShuttingDown()
            self._calls.append(((fn, args), fut))
            self._cv.notify()
        return asyncio.wrap_future(fut)

    def live(self) -> int:
        with self._cv:
            return len(self._live)

    def stop(self, drain_s: float = 30.0) -> None:
        """Take no new requests, let the running ones finish for up to ``drain_s`` seconds,
        cancel what is left, and end the engine thread (blocking; call off the event loop)."""
        with self._cv:
            self._draining = True
        deadline = time.monotonic() + drain_s
        while self.live() and time.monotonic() < deadline and self.alive:
            time.sleep(0.02)
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=60)

    # --------------------------------------------------------------- engine thread
    def _run(self) -> None:
        import torch

        dev = self.generator.device
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            self._stream = torch.cuda.current_stream(dev)
        try:
            with torch.inference_mode():
                self.generator.generate([], on_tokens=self._on_tokens, feed=self)
        except BaseException as e:  # the server answers 503 from now on
            self.error = e
            log.exception("engine thread failed")
            for h in list(self._live.values()):
                self._on_tokens(h.key, h.tokens, "error")
        finally:
            for _fn, fut in self._take_calls():
                fut.set_exception(RuntimeError("the engine stopped"))
            self._flush()

    def pending(self) -> bool:  # Feed
        value = self._pending()
        if self.lockstep is not None:
            self.lockstep.send(pending_message(value))
        return value

    def _pending(self) -> bool:
        if self._new or self._cancel or self._calls or self._stop:
            return True
        # a light batch: no chunk queued behind the running one (read without the lock: a
        # count a step old only moves the switch by a step)
        return len(self._live) - self._waiting < self.pipeline_rows

    def poll(self, idle: bool):  # Feed
        self.clock.stop()
        if idle:
            self._flush()
        else:
            self.flush()
        self._note_pool()  # before a wait: the gauges show the pool as it is while idle
        # the followers wait in a collective meanwhile: answer them before the group's timeout
        beat = time.monotonic() + self.lockstep.heartbeat_s if self.lockstep else None
        with self._cv:
            while idle and not (self._new or self._cancel or self._calls or self._stop):
                wait = 1.0 if beat is None else beat - time.monotonic()
                if wait <= 0:
                    break  # an empty poll: the engine asks again
                self._cv.wait(timeout=min(wait, 1.0))
            if self._new and self.admit_gap_s:
                self._gather()
            stop = self._stop
            if not stop:
                handles, self._new = self._new, []
                cancel, self._cancel = self._cancel, []
        if stop:
            if self.lockstep is not None:  # outside the lock: the event loop goes on meanwhile
                self.lockstep.send(STOP)
            return None
        now = time.perf_counter()
        new = []
        for h in handles:
            h.taken = now
            new.append((h.key, h.request))
        calls = self._take_calls()
        if self.lockstep is not None:
            self.lockstep.send(poll_message(new, cancel, [c for c, _ in calls]))
        for call, fut in calls:
            try:
                fut.set_result(run_call(self.generator.model, call))
            except BaseException as e:  # the caller's error, not the engine's
                fut.set_exception(e)
        if new or not idle:
            self.clock.start()
        return new, cancel

    def _gather(self) -> None:
        """Under the lock, with arrivals waiting: while the batch is light, wait for the next
        arrival as long as they keep coming ``admit_gap_s`` apart (``admit_gap_s`` above)."""
        if len(self._live) - self._waiting >= self.pipeline_rows:
            return
        deadline = time.perf_counter() + MAX_GATHER_S
        while not self._stop:
            wait = min(self._new[-1].arrived + self.admit_gap_s, deadline) - time.perf_counter()
            if wait <= 0:
                return
            self._cv.wait(wait)

    def _note_pool(self) -> None:
        pool = self.generator.pool
        self.metrics.kv_used.set(pool.used_pages)
        self.metrics.kv_usage.set(pool.used_pages / max(1, pool.capacity))

    def _take_calls(self) -> list:
        with self._cv:
            calls, self._calls = self._calls, []
        return calls

    def _on_tokens(self, key: int, tokens: list[int], finish: str | None) -> None:
        """The engine's report for one row (its thread, once per row and host check): kept
        light, the shared counts settle once per flush."""
        h = self._live.get(key)
        if h is None:
            return
        n = len(tokens)
        now = time.perf_counter()
        new = n - h._seen
        if new > 0:
            if h._seen == 0:
                self.metrics.ttft.observe(now - h.arrived)
                self.metrics.ttft_queue.observe(h.taken - h.arrived)
                self.metrics.ttft_engine.observe(now - h.taken)
            else:
                self.metrics.itl.observe((now - h._last) / new)
            self._new_tokens += new
            h._last, h._seen = now, n
        if h._update is None:
            if not self._dirty:
                self._dirty_since = now
            self._dirty.append(h)
        h._update = (tokens, n, finish, now)
        if (finish is not None or new > 0) and not h._started:
            h._started = True
            self._started_n += 1
        if finish is not None:
            self._ended.append(key)
            self.metrics.e2e.observe(now - h.arrived)

    def flush(self) -> None:  # Feed
        if (
            self.defer_rows
            and self._stream is not None
            and len(self._dirty) >= self.defer_rows
            and time.perf_counter() - self._dirty_since < MAX_DEFER_S
            and self._stream.query()  # nothing queued on the GPU: hold them back
        ):
            self.clock.deferred += 1
            return
        self._flush()

    def _flush(self) -> None:
        """Hand the updates since the last step to the event loop, one call for all."""
        if not self._dirty:
            return
        t0 = time.perf_counter()
        batch, self._dirty = self._dirty, []
        updates = []
        for h in batch:
            updates.append((h, h._update))
            h._update = None
        with self._cv:
            self._waiting -= self._started_n
            for key in self._ended:
                self._live.pop(key, None)
            waiting, running = self._waiting, len(self._live) - self._waiting
        self._started_n, self._ended = 0, []
        self.metrics.queue_depth.set(waiting)
        self.metrics.running.set(running)
        if self._new_tokens:
            self.metrics.generation_tokens.inc(self._new_tokens)
            self._new_tokens = 0
        self.clock.flushes += 1
        loop = batch[0].loop
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody reads them
            loop.call_soon_threadsafe(_deliver, updates, time.perf_counter(), self.metrics)
        self.clock.flush_s += time.perf_counter() - t0


class EngineClock:
    """Where the engine thread's time goes while it has work (``/metrics``, read by
    serve_bench): ``busy_s`` wall time between its polls, ``cpu_s`` the thread's CPU time over
    the same spans. The difference is time the thread was runnable but not running: waiting
    for the GIL (the event loop held it), or for a core. A GPU sync spins on the CPU by default
    (one context, many cores), so waiting for the GPU counts as CPU time here."""

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.cpu_s = 0.0
        self.flushes = 0
        self.flush_s = 0.0
        self.deferred = 0
        self._wall0: float | None = None
        self._cpu0 = 0.0

    def start(self) -> None:
        self._wall0, self._cpu0 = time.perf_counter(), time.thread_time()

    def stop(self) -> None:
        if self._wall0 is not None:
            self.busy_s += time.perf_counter() - self._wall0
            self.cpu_s += time.thread_time() - self._cpu0
            self._wall0 = None


class _EngineCollector:
    """The engine's own counters (``Generator.stats`` of its one online call, and the
    bridge's :class:`EngineClock`), read when ``/metrics`` is scraped."""

    def __init__(self, bridge: EngineBridge):
        self.bridge = bridge

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        st, c = self.bridge.generator.stats, self.bridge.clock
        for name, doc, value in (
            ("engine_busy_seconds", "engine thread wall time while it had work", c.busy_s),
            ("engine_cpu_seconds", "engine thread CPU time over the same spans", c.cpu_s),
            ("engine_flushes", "host checks that handed tokens to the event loop", c.flushes),
            ("engine_flush_seconds", "engine thread time handing tokens over", c.flush_s),
            ("engine_deferred_flushes", "hand-overs held back while the GPU idled",
             c.deferred),
            ("engine_prefill_seconds", "wall time in prefill forwards", st.prefill_s),
            ("engine_prefill_forwards", "packed prefill forwards", st.prefill_chunks),
            ("engine_prefilled_tokens", "prompt tokens run through the model", st.prefilled_tokens),
            ("engine_decode_seconds", "wall from a chunk's launch to its read", st.decode_s),
            ("engine_decode_steps", "decode steps (graph replays)", st.decode_steps),
            ("engine_continued_chunks", "chunks enqueued before the last was read",
             st.continued_chunks),
        ):  # fmt: skip
            yield CounterMetricFamily(f"nakta_{name}", doc, value=float(value))
        # /metrics is served on the event loop's thread: its CPU time so far (the HTTP side's
        # whole cost: parsing, routes, streaming)
        yield CounterMetricFamily(
            "nakta_loop_cpu_seconds", "event-loop thread CPU time", value=time.thread_time()
        )


def _deliver(updates: list, sent: float, metrics: Metrics) -> None:
    """On the event loop: the latest tokens of each request, and wake its reader."""
    metrics.deliver_lag.observe(time.perf_counter() - sent)
    for h, (tokens, n, finish, now) in updates:
        h.tokens, h.n = tokens, n
        if n and h.first_token_at is None:
            h.first_token_at = now
        if finish is not None:
            h.finish = finish
        h.event.set()
