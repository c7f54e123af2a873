"""Batched generation with continuous batching: prefill, graph-replayed decode, stops.

The engine owns the model's KV cache as ``max_batch`` rows of ``max_seq_len`` positions (plus
one scratch row for idle batch entries). Requests wait in a queue; whenever rows are free, the
next prompts are prefilled together (one packed forward on the fused kernels writes their K/V)
and their first tokens chosen; then every active row decodes in chunks: the decode step of the
smallest captured batch bucket that covers the active rows is replayed ``chunk`` times with no
host synchronisation, and only then does the host read the chunk's tokens (one copy), apply
EOS, ``max_new_tokens`` and stop strings, free the rows that finished and admit new prompts.
A row that finishes inside a chunk decodes at most ``chunk - 1`` tokens nobody reads; the chunk
is shortened so that no row runs past its token budget or the cache.

Greedy decoding gives, per prompt, the tokens Meta's loop gives (``meta_loop``): the same model
math on each row, just not padded to the batch's shortest prompt.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from nakta_model.generation.sampling import SamplingParams, sample_next
from nakta_model.generation.step import DecodeStep
from nakta_model.generation.stops import StopStrings

__all__ = ["GenerationRequest", "GenerationResult", "Generator"]

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class GenerationRequest:
    """One prompt (token ids, BOS included) and how to continue it."""

    prompt: Sequence[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: Sequence[int] = ()
    stop: StopStrings | None = None


@dataclass
class GenerationResult:
    """The continuation: ``tokens`` cut before a stop token (or the stop string's tokens are
    kept and ``text`` is cut before the stop string), ``finish`` = ``"stop"`` or ``"length"``."""

    tokens: list[int]
    text: str | None
    finish: str


@dataclass
class _Row:
    index: int  # position of the request in the caller's list
    request: GenerationRequest
    tokens: list[int] = field(default_factory=list)
    text: str | None = None
    finished: str | None = None


@dataclass
class GenerationStats:
    """Counters of the last :meth:`Generator.generate` call (benchmarks report them)."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0  # graph replays (each decodes one token for every row of its bucket)
    generated_tokens: int = 0  # tokens kept in results
    prefilled_tokens: int = 0


class Generator:
    """Continuous-batching generation on one model (see the module docstring).

    ``max_batch`` rows decode at once (<= 64); ``max_seq_len`` bounds prompt + continuation per
    row (default: the model's); ``chunk`` tokens are decoded between host checks; ``graphs``
    captures the decode step per batch bucket in CUDA graphs (default: on CUDA).
    """

    def __init__(
        self,
        model,
        *,
        max_batch: int = 32,
        max_seq_len: int | None = None,
        chunk: int = 16,
        graphs: bool | None = None,
    ):
        if not isinstance(max_batch, int) or not 1 <= max_batch <= BUCKETS[-1]:
            raise ValueError(f"max_batch must be an int in [1, {BUCKETS[-1]}], got {max_batch!r}")
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be a positive int, got {chunk!r}")
        max_seq_len = max_seq_len or model.args.max_seq_len
        if not isinstance(max_seq_len, int) or max_seq_len < 2:
            raise ValueError(f"max_seq_len must be an int >= 2, got {max_seq_len!r}")
        self.model, self.max_batch, self.max_seq_len, self.chunk = (
            model,
            max_batch,
            max_seq_len,
            chunk,
        )
        self.device = model.device
        self.graphs = self.device.type == "cuda" if graphs is None else bool(graphs)
        model.setup_cache(max_batch + 1, max_seq_len)  # the last row: scratch for idle entries
        self.scratch = max_batch
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self._steps: dict[tuple[int, bool], DecodeStep] = {}
        self.stats = GenerationStats()

    # ---------------------------------------------------------------------------- steps
    def _step(self, bucket: int, sampling: bool) -> DecodeStep:
        key = (bucket, sampling)
        if key not in self._steps:
            step = DecodeStep(self.model, bucket, self.chunk, sampling=sampling)
            self._idle(step, range(bucket))
            if self.graphs:
                step.capture()
            self._steps[key] = step
        return self._steps[key]

    def _idle(self, step: DecodeStep, entries) -> None:
        """Point batch entries at the scratch row (their writes and reads go nowhere useful)."""
        idx = torch.tensor(list(entries), dtype=torch.long, device=self.device)
        if idx.numel():
            step.buffers.rows[idx] = self.scratch
            step.buffers.positions[idx] = 0
            step.buffers.tokens[idx] = 0
            step.buffers.temperature[idx] = 0.0

    # --------------------------------------------------------------------------- public
    def generate(
        self, requests: Sequence[GenerationRequest], progress: bool = False
    ) -> list[GenerationResult]:
        """Generate every request; results in request order."""
        self._validate(requests)
        self.stats = GenerationStats()
        queue = deque(
            _Row(i, r) for i, r in sorted(enumerate(requests), key=lambda x: -len(x[1].prompt))
        )
        slots: list[_Row | None] = [None] * self.max_batch
        done: list[_Row] = []
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), disable=not progress, desc="generate", unit="req")
        while queue or any(slots):
            free = [s for s in range(self.max_batch) if slots[s] is None]
            admit = [queue.popleft() for _ in free[: len(queue)]]
            if admit:
                self._prefill(admit, free[: len(admit)], slots)
                for r in admit:
                    if r.finished:
                        self._release(r, slots, done, bar)
            active = [s for s in range(self.max_batch) if slots[s] is not None]
            if not active:
                continue
            self._decode_chunk(active, slots)
            for s in active:
                if slots[s].finished:
                    self._release(slots[s], slots, done, bar)
        bar.close()
        out: list[GenerationResult | None] = [None] * len(requests)
        for r in done:
            out[r.index] = GenerationResult(r.tokens, r.text, r.finished)
            self.stats.generated_tokens += len(r.tokens)
        return out  # type: ignore[return-value]

    # ---------------------------------------------------------------------------- phases
    def _prefill(self, rows: list[_Row], cache_rows: list[int], slots) -> None:
        """One packed forward over the admitted prompts; their first tokens on the device."""
        t0 = time.perf_counter()
        toks, pos, start, cslots, last = [], [], [], [], []
        for r, c in zip(rows, cache_rows):
            p = list(r.request.prompt)
            s0 = len(toks)
            toks += p
            pos += range(len(p))
            start += [s0] * len(p)
            cslots += [c * self.max_seq_len + i for i in range(len(p))]
            last.append(len(toks) - 1)
        dev = self.device
        as_t = lambda xs, dt=torch.int64: torch.tensor(xs, dtype=dt, device=dev)  # noqa: E731
        logits = self.model.forward_prefill(
            as_t(toks), as_t(pos, torch.int32), as_t(start, torch.int32), as_t(cslots), as_t(last)
        )
        params = [r.request.sampling for r in rows]
        first = sample_next(
            logits,
            as_t([p.temperature for p in params], torch.float32),
            as_t([p.top_k for p in params]),
            as_t([p.top_p for p in params], torch.float32),
            any_sampling=not all(p.greedy for p in params),
        ).tolist()
        for r, c, t in zip(rows, cache_rows, first):
            slots[c] = r
            self._accept(r, [t])
        self.stats.prefill_s += time.perf_counter() - t0
        self.stats.prefilled_tokens += len(toks)

    def _decode_chunk(self, active: list[int], slots) -> None:
        """Replay the decode step for the active rows, then read and apply the new tokens."""
        t0 = time.perf_counter()
        need = max(active) + 1
        bucket = next(b for b in self.buckets if b >= need)
        sampling = any(not slots[s].request.sampling.greedy for s in active)
        step = self._step(bucket, sampling)
        steps = self.chunk
        for s in active:
            r = slots[s]
            left = r.request.max_new_tokens - len(r.tokens)
            room = self.max_seq_len - (len(r.request.prompt) + len(r.tokens))
            steps = max(1, min(steps, left, room))
        self._load(step, active, slots, bucket)
        step.run(steps)
        history = step.buffers.history[:, :steps].tolist()  # the one host sync per chunk
        for s in active:
            self._accept(slots[s], history[s])
        self.stats.decode_s += time.perf_counter() - t0
        self.stats.decode_steps += steps

    def _load(self, step: DecodeStep, active: list[int], slots, bucket: int) -> None:
        """Write the active rows' state into the step's buffers (entry s = cache row s)."""
        buf = step.buffers
        tokens, positions, rows = [0] * bucket, [0] * bucket, [self.scratch] * bucket
        temp, top_k, top_p = [0.0] * bucket, [0] * bucket, [1.0] * bucket
        for s in active:
            r = slots[s]
            tokens[s] = r.tokens[-1]
            positions[s] = len(r.request.prompt) + len(r.tokens) - 1
            rows[s] = s
            sp = r.request.sampling
            temp[s], top_k[s], top_p[s] = sp.temperature, sp.top_k, sp.top_p
        for t, v in (
            (buf.tokens, tokens),
            (buf.positions, positions),
            (buf.rows, rows),
            (buf.temperature, temp),
            (buf.top_k, top_k),
            (buf.top_p, top_p),
        ):
            t.copy_(torch.tensor(v, dtype=t.dtype), non_blocking=False)
        buf.step.zero_()

    def _accept(self, r: _Row, new: list[int]) -> None:
        """Append decoded tokens to a row until it finishes (stop token, budget, stop string)."""
        req = r.request
        stop_ids = set(req.stop_token_ids)
        for t in new:
            if r.finished:
                return
            if t in stop_ids:
                r.finished = "stop"
                break
            r.tokens.append(t)
            if (
                len(r.tokens) >= req.max_new_tokens
                or len(req.prompt) + len(r.tokens) >= self.max_seq_len
            ):
                r.finished = "length"
        if req.stop is not None:
            r.text, hit = req.stop.cut(r.tokens)
            if hit:
                r.finished = "stop"

    def _release(self, r: _Row, slots, done: list[_Row], bar) -> None:
        for s, x in enumerate(slots):
            if x is r:
                slots[s] = None
        done.append(r)
        bar.update(1)

    def _validate(self, requests: Sequence[GenerationRequest]) -> None:
        vocab = self.model.args.vocab_size
        for i, r in enumerate(requests):
            if not isinstance(r, GenerationRequest):
                raise TypeError(f"requests[{i}] must be a GenerationRequest")
            p = list(r.prompt)
            if not p:
                raise ValueError(f"requests[{i}] has an empty prompt (pass at least BOS)")
            if any(type(t) is not int or not 0 <= t < vocab for t in p):
                raise ValueError(f"requests[{i}] prompt holds a token outside [0, {vocab})")
            if len(p) >= self.max_seq_len:
                raise ValueError(
                    f"requests[{i}] prompt has {len(p)} tokens; max_seq_len={self.max_seq_len} "
                    "leaves no room to generate"
                )
            if not isinstance(r.max_new_tokens, int) or r.max_new_tokens < 1:
                raise ValueError(f"requests[{i}].max_new_tokens must be an int >= 1")
            if not isinstance(r.sampling, SamplingParams):
                raise TypeError(f"requests[{i}].sampling must be a SamplingParams")


def greedy_requests(
    prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_id: int | None
) -> list[GenerationRequest]:
    """Greedy requests that stop at ``eos_id`` (None: only at the budget)."""
    stop = () if eos_id is None else (eos_id,)
    return [GenerationRequest(p, max_new_tokens, stop_token_ids=stop) for p in prompts]


Decoder = Callable[[list[int]], str]
