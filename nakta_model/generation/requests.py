"""What the generation engine takes and gives back, and its per-row bookkeeping.

Stop strings (lm-eval's ``until``): ``generate_until`` returns the continuation cut before the
first occurrence of any ``until`` string. The engine checks this at every host check, so a row
stops as soon as a stop string has appeared instead of running to ``max_gen_toks``; the text
it returns is the same cut. Text is decoded from the whole continuation each time:
SentencePiece output is not prefix-stable token by token (byte pieces, the leading space), and
decoding a few hundred tokens costs microseconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from nakta_model.generation.sampling import SamplingParams

__all__ = [
    "GenerationRequest",
    "GenerationResult",
    "GenerationStats",
    "StopStrings",
    "check_int",
    "check_requests",
    "greedy_requests",
]


class StopStrings:
    """The stop strings of one request and the decoder of its token ids."""

    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str]):
        if isinstance(stops, str):
            stops = [stops]
        bad = [s for s in stops if not isinstance(s, str)]
        if bad:
            raise TypeError(f"stop sequences must be strings, got {bad!r}")
        self.stops = [s for s in stops if s]  # lm-eval ignores empty ones too
        self.decode = decode

    def cut(self, tokens: list[int]) -> tuple[str, bool]:
        """``(text, stopped)``: the decoded continuation cut before the earliest stop string,
        and whether one was found."""
        text = self.decode(tokens)
        at = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        return (text[:at], True) if at >= 0 else (text, False)


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
    kept and ``text`` is cut before the stop string), ``finish`` = ``"stop"``, ``"length"`` or
    ``"error"`` (the request could never fit the KV pool: ``error`` says why, no tokens)."""

    tokens: list[int]
    text: str | None
    finish: str
    error: str | None = None


@dataclass
class _Held:
    """A shared prefix held in pages of its own (one reference on each)."""

    pages: list[int]
    length: int
    slot: int  # its slot in the decode step's cascade tables


@dataclass
class _Row:
    index: int  # position of the request in the caller's list
    request: GenerationRequest
    shared: int = 0  # length of the prefix it shares with other requests (0: none)
    held: _Held | None = None  # the held prefix it shares (read by the cascade while held)
    pages: list[int] = field(default_factory=list)  # its block table
    reserved: int = 0  # pages it may still take from the pool
    done: int = 0  # prompt positions whose K/V is in its pages
    seq: int = 0  # admission order (prefill pieces go oldest first)
    tokens: list[int] = field(default_factory=list)
    text: str | None = None
    finished: str | None = None
    error: str | None = None

    @property
    def total(self) -> int:  # positions it may ever hold (the last token is never written)
        return len(self.request.prompt) + self.request.max_new_tokens

    @property
    def prompt_in(self) -> bool:  # every prompt position's K/V is in its pages
        return self.done == len(self.request.prompt)

    @property
    def position(self) -> int:  # where its last token goes in its cache
        return len(self.request.prompt) + len(self.tokens) - 1

    def accept(self, new: Sequence[int], max_seq_len: int) -> None:
        """Append decoded tokens until the row finishes (stop token, budget, ``max_seq_len``,
        stop string); tokens after that are dropped."""
        req = self.request
        stop_ids = set(req.stop_token_ids)
        for t in new:
            if self.finished:
                return
            if t in stop_ids:
                self.finished = "stop"
                break
            self.tokens.append(t)
            if len(self.tokens) >= req.max_new_tokens or self.position + 1 >= max_seq_len:
                self.finished = "length"
        if req.stop is not None:
            self.text, hit = req.stop.cut(self.tokens)
            if hit:
                self.finished = "stop"


@dataclass
class GenerationStats:
    """Counters of the last :meth:`Generator.generate` call (benchmarks report them)."""

    prefill_s: float = 0.0  # wall time in prefill forwards
    decode_s: float = 0.0  # wall time from a chunk's launch to its tokens read
    decode_steps: int = 0  # graph replays (each decodes one token for every row of its bucket)
    prefill_chunks: int = 0  # packed prefill forwards
    continued_chunks: int = 0  # decode chunks enqueued before the previous one was read
    generated_tokens: int = 0  # tokens kept in results
    prefilled_tokens: int = 0  # prompt tokens run through the model (shared prefixes once)
    prompt_tokens: int = 0  # prompt tokens asked for
    peak_pages: int = 0  # most KV pages in use at once (held prefixes included)
    first_token_s: list[float] = field(default_factory=list)  # per request, from the call's start


def check_int(name: str, value: object, lo: int, hi: int | None = None, why: str = "") -> int:
    """``value`` if it is an int (not a bool) in ``[lo, hi]``, else a ValueError naming it."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not lo <= value <= (value if hi is None else hi)
    ):
        limits = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be an int {limits}{why}, got {value!r}")
    return value


def check_requests(requests: Sequence[GenerationRequest], vocab: int, max_seq_len: int) -> None:
    """Every request well-formed before any runs (a clear error naming the first bad one)."""
    for i, r in enumerate(requests):
        if not isinstance(r, GenerationRequest):
            raise TypeError(f"requests[{i}] must be a GenerationRequest")
        p = list(r.prompt)
        if not p:
            raise ValueError(f"requests[{i}] has an empty prompt (pass at least BOS)")
        if any(type(t) is not int or not 0 <= t < vocab for t in p):
            raise ValueError(f"requests[{i}] prompt holds a token outside [0, {vocab})")
        if len(p) >= max_seq_len:
            raise ValueError(
                f"requests[{i}] prompt has {len(p)} tokens; max_seq_len={max_seq_len} "
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
