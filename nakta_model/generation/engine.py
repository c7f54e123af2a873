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

Prompts that share a long prefix (a few-shot prompt: ``prefix_cache.shared_prefixes``) prefill
it once: its K/V is computed into one of ``prefix_rows`` spare cache rows (kept, least recently
used first out, for later admissions) and copied into each prompt's row; only the rest of each
prompt runs through the model, attending to the copied prefix. Decoding then reads the prefix
from the prefix row itself while it is held there (``decode_attention``'s ``prefix_rows``),
and with ``cascade`` the attention computes each held prefix once per step for all its rows
(one tensor-core tile of their queries against the prefix keys) before each row's own keys; a
row whose prefix was evicted reads its own copy.

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
from nakta_model.generation.step import MAX_ROWS, DecodeStep, check_graph_mode
from nakta_model.generation.stops import StopStrings
from nakta_model.kernels.packed_attention import PREFIX_ALIGN

__all__ = ["GenerationRequest", "GenerationResult", "Generator", "fitting_batch"]

BUCKETS = tuple(1 << i for i in range(MAX_ROWS.bit_length()))  # 1, 2, 4, ..., MAX_ROWS
TokenCallback = Callable[[int, list[int], "str | None"], None]


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
    shared: int = 0  # length of the prefix it shares with other requests (0: none)
    prefix: tuple[int, ...] = ()  # the prefix held in a prefix row that decode reads in place
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
    prefilled_tokens: int = 0  # prompt tokens run through the model (shared prefixes once)
    prompt_tokens: int = 0  # prompt tokens asked for


class Generator:
    """Continuous-batching generation on one model (see the module docstring).

    ``max_batch`` rows decode at once (<= 64); ``max_seq_len`` bounds prompt + continuation per
    row (default: the model's); ``chunk`` tokens are decoded between host checks; ``graphs``
    captures the decode step per batch bucket in CUDA graphs (default: on CUDA). ``graph_mode``
    (instead of ``graphs``) names how the step runs: ``"cuda_graph"`` (captured), ``"compile"``
    (``torch.compile(mode="reduce-overhead")``, to compare with the capture) or ``"eager"``.
    ``cascade`` (default on): each decode step computes every held prefix once for all the rows
    that read it (``decode_attention``'s ``prefix_slots``) instead of row by row through L2.
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
    ):
        if not isinstance(max_batch, int) or not 1 <= max_batch <= BUCKETS[-1]:
            raise ValueError(f"max_batch must be an int in [1, {BUCKETS[-1]}], got {max_batch!r}")
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be a positive int, got {chunk!r}")
        max_seq_len = max_seq_len or model.args.max_seq_len
        if not isinstance(max_seq_len, int) or max_seq_len < 2:
            raise ValueError(f"max_seq_len must be an int >= 2, got {max_seq_len!r}")
        if not isinstance(prefix_rows, int) or prefix_rows < 0:
            raise ValueError(f"prefix_rows must be an int >= 0, got {prefix_rows!r}")
        self.model, self.max_batch, self.max_seq_len, self.chunk = (
            model,
            max_batch,
            max_seq_len,
            chunk,
        )
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
        # cache rows: max_batch for requests, one scratch row for idle batch entries, then the
        # shared-prefix rows; each row's length a multiple of 64 (the prefix pages' size rule)
        self.scratch = max_batch
        self.prefix_rows = list(range(max_batch + 1, max_batch + 1 + prefix_rows))
        self.row_len = -(-max_seq_len // 64) * 64
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self._steps: dict[tuple[int, bool], DecodeStep] = {}
        self._prefixes: dict[tuple[int, ...], int] = {}  # cached prefix -> its row (LRU order)
        self._cache_ptr: int | None = None
        self._ensure_cache()
        self.stats = GenerationStats()
        self._on_tokens: TokenCallback | None = None

    # ---------------------------------------------------------------------------- steps
    def _ensure_cache(self) -> None:
        """The model's KV cache as this engine laid it out. Anyone else may have replaced it
        (the scorer's prefix pool does): then it is set up again, and the captured steps (which
        hold the old cache's addresses) and the cached prefixes are dropped."""
        m = self.model
        rows = self.max_batch + 1 + len(self.prefix_rows)
        k0 = m.layers[0].attention.k_cache
        if (
            k0 is not None
            and k0.data_ptr() == self._cache_ptr
            and (m.max_batch_size, m.max_seq_len) == (rows, self.row_len)
        ):
            return
        m.clear_cache()
        m.setup_cache(rows, self.row_len)
        self._cache_ptr = m.layers[0].attention.k_cache.data_ptr()
        self._steps.clear()
        self._prefixes.clear()

    def _step(self, bucket: int, sampling: bool, cascade: bool = False) -> DecodeStep:
        """The step of a bucket, captured on first use; ``cascade``: the variant whose
        attention computes held prefixes once for all their rows (its own graph: a batch with
        no shared prefix runs the step without the cascade's two extra launches per layer)."""
        key = (bucket, sampling, cascade)
        if key not in self._steps:
            slots = len(self.prefix_rows) if cascade else 0
            step = DecodeStep(
                self.model, bucket, self.chunk, sampling=sampling, graph_mode=self.graph_mode,
                prefix_slots=slots,
            )  # fmt: skip
            self._idle(step, range(bucket))
            if slots:  # the prefix rows never move; what they hold is written per chunk
                step.buffers.slot_rows.copy_(torch.tensor(self.prefix_rows, dtype=torch.int32))
            if self.graph_mode == "cuda_graph":
                step.capture()
            self._steps[key] = step
        return self._steps[key]

    def _idle(self, step: DecodeStep, entries) -> None:
        """Point batch entries at the scratch row (their writes and reads go nowhere useful)."""
        idx = torch.tensor(list(entries), dtype=torch.long, device=self.device)
        if idx.numel():
            step.buffers.rows[idx] = self.scratch
            step.buffers.prefix_lens[idx] = 0
            step.buffers.positions[idx] = 0
            step.buffers.tokens[idx] = 0
            step.buffers.temperature[idx] = 0.0

    # --------------------------------------------------------------------------- public
    def generate(
        self,
        requests: Sequence[GenerationRequest],
        progress: bool = False,
        on_tokens: TokenCallback | None = None,
    ) -> list[GenerationResult]:
        """Generate every request; results in request order.

        ``on_tokens(index, tokens, finish)``, when given, is called at every host check for each
        request that took new tokens (after its prefill, then once per decoded chunk) with the
        request's position, its tokens so far (as the result will hold them) and its finish
        reason (None while it runs): what a caller streams text from as it is decoded."""
        self._validate(requests)
        self._ensure_cache()
        self.stats = GenerationStats()
        self._on_tokens = on_tokens
        shared = [0] * len(requests)
        if self.prefix_rows:
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
        """One packed forward over the admitted prompts; their first tokens on the device.

        A prefix shared by several prompts (or already in a prefix row) is computed once into
        a prefix row, copied into each prompt's cache row, and only the rest of each prompt runs
        here, attending to it (one ``PREFIX_ALIGN``-aligned segment per such prompt)."""
        t0 = time.perf_counter()
        prompts = [list(r.request.prompt) for r in rows]
        shared = self._shared(prompts, [r.shared for r in rows])
        toks, pos, start, cslots, last, entry = [], [], [], [], [], []
        prefix_rows_used: list[int] = []
        lengths: list[int] = []
        current = -1
        for p, c, n in zip(prompts, cache_rows, shared):
            e = -1
            if n:
                self._copy_prefix(self._prefixes[tuple(p[:n])], c, n)
                e = len(lengths)
                prefix_rows_used.append(c)
                lengths.append(n)
            if e != current or e >= 0:  # a prompt with a prefix: a segment of its own
                self._pad(toks, pos, start, cslots, entry, current)
                current = e
            s0 = len(toks)
            toks += p[n:]
            pos += range(n, len(p))
            start += [s0] * (len(p) - n)
            cslots += [c * self.row_len + i for i in range(n, len(p))]
            entry += [e] * (len(p) - n)
            last.append(len(toks) - 1)
        if lengths:
            self._pad(toks, pos, start, cslots, entry, current)
        dev = self.device
        as_t = lambda xs, dt=torch.int64: torch.tensor(xs, dtype=dt, device=dev)  # noqa: E731
        prefix = None
        if lengths:
            from nakta_model.model import PrefixPages

            prefix = PrefixPages(
                as_t([[r] for r in prefix_rows_used], torch.int32), as_t(lengths, torch.int32),
                as_t(entry, torch.int32), self.row_len,
            )  # fmt: skip
        logits = self.model.forward_prefill(
            as_t(toks), as_t(pos, torch.int32), as_t(start, torch.int32), as_t(cslots),
            as_t(last), prefix=prefix,
        )  # fmt: skip
        params = [r.request.sampling for r in rows]
        first = sample_next(
            logits,
            as_t([p.temperature for p in params], torch.float32),
            as_t([p.top_k for p in params]),
            as_t([p.top_p for p in params], torch.float32),
            any_sampling=not all(p.greedy for p in params),
        ).tolist()
        for r, c, t, p, n in zip(rows, cache_rows, first, prompts, shared):
            slots[c] = r
            r.prefix = tuple(p[:n])
            self._accept(r, [t])
        self.stats.prefill_s += time.perf_counter() - t0
        self.stats.prefilled_tokens += sum(len(p) - n for p, n in zip(prompts, shared))
        self.stats.prompt_tokens += sum(map(len, prompts))

    def _shared(self, prompts: list[list[int]], lengths: list[int]) -> list[int]:
        """Per prompt, the length of its shared prefix, now held in a prefix row (0: none):
        missing prefixes are computed into prefix rows first, without evicting one that
        another prompt of this admission still needs (such a prompt prefills in full)."""
        out, wave = [], set()
        for p, n in zip(prompts, lengths):
            key = tuple(p[:n])
            if n and key not in self._prefixes:
                if len(wave | {key}) > len(self.prefix_rows):
                    n = 0
                else:
                    self._compute_prefix(key, keep=wave)
            if n:
                wave.add(key)
                self._prefixes[key] = self._prefixes.pop(key)  # most recently used
            out.append(n)
        return out

    def _compute_prefix(self, key: tuple[int, ...], keep: set) -> None:
        """Prefill ``key`` into a free prefix row, else the least recently used one not in
        ``keep`` (the prefixes this admission still copies)."""
        used = set(self._prefixes.values())
        free = [r for r in self.prefix_rows if r not in used]
        if not free:
            oldest = next(k for k in self._prefixes if k not in keep)
            free = [self._prefixes.pop(oldest)]
        row = free[0]
        n = len(key)
        i64 = dict(dtype=torch.int64, device=self.device)
        self.model.forward_prefill(
            torch.tensor(key, **i64), torch.arange(n, **i64), torch.zeros(n, **i64),
            torch.arange(n, **i64) + row * self.row_len, torch.tensor([n - 1], **i64),
        )  # fmt: skip
        self._prefixes[key] = row
        self.stats.prefilled_tokens += n

    def _copy_prefix(self, src: int, dst: int, n: int) -> None:
        """K/V of positions ``[0, n)`` of cache row ``src`` into row ``dst``, every layer."""
        a, b = src * self.row_len, dst * self.row_len
        for layer in self.model.layers:
            att = layer.attention
            att.k_cache[b : b + n].copy_(att.k_cache[a : a + n])
            att.v_cache[b : b + n].copy_(att.v_cache[a : a + n])

    def _pad(self, toks, pos, start, cslots, entry, e: int) -> None:
        """Pad the stream to a ``PREFIX_ALIGN`` boundary with tokens of entry ``e`` (the
        segment they close): each its own sequence, its K/V written into the scratch row."""
        n = -len(toks) % PREFIX_ALIGN
        start.extend(range(len(toks), len(toks) + n))
        toks.extend([0] * n)
        pos.extend([0] * n)
        cslots.extend([self.scratch * self.row_len] * n)
        entry.extend([e] * n)

    def _decode_chunk(self, active: list[int], slots) -> None:
        """Replay the decode step for the active rows, then read and apply the new tokens."""
        t0 = time.perf_counter()
        need = max(active) + 1
        bucket = next(b for b in self.buckets if b >= need)
        sampling = any(not slots[s].request.sampling.greedy for s in active)
        shared = any(slots[s].prefix and slots[s].prefix in self._prefixes for s in active)
        step = self._step(bucket, sampling, self.cascade and shared)
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
        pre_rows, pre_lens = [self.scratch] * bucket, [0] * bucket
        temp, top_k, top_p = [0.0] * bucket, [0] * bucket, [1.0] * bucket
        for s in active:
            r = slots[s]
            tokens[s] = r.tokens[-1]
            positions[s] = len(r.request.prompt) + len(r.tokens) - 1
            rows[s] = s
            # the prefix row still holds the prefix (not evicted since): read it there, where
            # the other rows of the prefix read it too; else the row's own copy
            held = self._prefixes.get(r.prefix) if r.prefix else None
            if held is not None:
                pre_rows[s], pre_lens[s] = held, len(r.prefix)
            sp = r.request.sampling
            temp[s], top_k[s], top_p[s] = sp.temperature, sp.top_k, sp.top_p
        for t, v in (
            (buf.tokens, tokens),
            (buf.positions, positions),
            (buf.rows, rows),
            (buf.prefix_rows, pre_rows),
            (buf.prefix_lens, pre_lens),
            (buf.temperature, temp),
            (buf.top_k, top_k),
            (buf.top_p, top_p),
        ):
            t.copy_(torch.tensor(v, dtype=t.dtype), non_blocking=False)
        buf.step.zero_()
        if buf.slot_rows.numel():  # what each prefix row holds now (0: nothing)
            held = {row: len(key) for key, row in self._prefixes.items()}
            buf.slot_lens.copy_(
                torch.tensor([held.get(r, 0) for r in self.prefix_rows], dtype=torch.int32)
            )

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
        if self._on_tokens is not None:
            self._on_tokens(r.index, r.tokens, r.finished)

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


def fitting_batch(
    model, max_seq_len: int, *, cap: int = BUCKETS[-1], prefix_rows: int = 2, fraction: float = 0.8
) -> int:
    """The most request rows (<= ``cap``) whose K/V cache of ``max_seq_len`` positions, with
    the engine's scratch and ``prefix_rows`` rows, fits in ``fraction`` of the device memory
    that is free once the model's current cache is dropped (CPU: ``cap``). More rows per step
    spread each step's weight reads over more tokens; the cache is what bounds them."""
    if not isinstance(cap, int) or not 1 <= cap <= BUCKETS[-1]:
        raise ValueError(f"cap must be an int in [1, {BUCKETS[-1]}], got {cap!r}")
    if not isinstance(max_seq_len, int) or max_seq_len < 2:
        raise ValueError(f"max_seq_len must be an int >= 2, got {max_seq_len!r}")
    if model.device.type != "cuda":
        return cap
    per_position = (
        sum(2 * layer.attention.n_kv_heads * layer.attention.head_dim for layer in model.layers)
        * torch.empty((), dtype=model.dtype).element_size()
    )
    held = 0
    k0 = model.layers[0].attention.k_cache
    if k0 is not None:  # the current cache is given back before the new one is made
        held = 2 * len(model.layers) * k0.numel() * k0.element_size()
    free = torch.cuda.mem_get_info(model.device)[0] + held
    rows = int(fraction * free // (per_position * (-(-max_seq_len // 64) * 64))) - 1 - prefix_rows
    return max(1, min(cap, rows))


def greedy_requests(
    prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_id: int | None
) -> list[GenerationRequest]:
    """Greedy requests that stop at ``eos_id`` (None: only at the budget)."""
    stop = () if eos_id is None else (eos_id,)
    return [GenerationRequest(p, max_new_tokens, stop_token_ids=stop) for p in prompts]


Decoder = Callable[[list[int]], str]
