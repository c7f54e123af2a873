"""Generated text as it is decoded: the pieces a terminal prints, and the clock around them.

SentencePiece text is not prefix-stable token by token (a character split over byte pieces, the
word-start space that decoding a continuation on its own drops), so a :class:`TextStream`
decodes prompt + continuation and hands out what grew beyond the text already shown. It holds
back a trailing incomplete character (decoded as U+FFFD until its last byte arrives) and a tail
that could be the start of a stop string (the stop would cut it), so what was printed is never
taken back and, once the request finishes, equals the result's text.

:func:`generate_streaming` runs :meth:`Generator.generate` with such streams and measures time
to first token (the first token of any request known on the host) and the whole call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nakta_model.generation.engine import GenerationRequest, GenerationResult, Generator
from nakta_model.generation.requests import StopStrings

__all__ = ["StreamTiming", "TextStream", "generate_streaming"]

_PARTIAL = "\ufffd"  # what sentencepiece decodes an incomplete UTF-8 sequence to


class TextStream:
    """The continuation text of one prompt, handed out piece by piece (see the module doc).

    ``tokenizer`` has ``decode(ids) -> str``; ``prompt`` are the prompt's token ids (BOS
    included); ``stops``: strings that end the continuation (cut before the first one).
    """

    def __init__(self, tokenizer, prompt: Sequence[int], stops: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.prompt = list(prompt)
        self.prompt_text = tokenizer.decode(self.prompt)
        self.stop = StopStrings(list(stops), self.continuation)
        self.shown = ""

    def continuation(self, tokens: Sequence[int]) -> str:
        """The text ``tokens`` add after the prompt, with the spacing it has after the prompt
        (decoded on their own, a continuation's first word loses its leading space)."""
        text = self.tokenizer.decode(self.prompt + list(tokens))
        if text.startswith(self.prompt_text):
            return text[len(self.prompt_text) :]
        return self.tokenizer.decode(list(tokens))  # a prompt whose text the tokens rewrite

    def request(self, max_new_tokens: int, sampling, stop_token_ids=()) -> GenerationRequest:
        """The engine request of this prompt, its stop strings cut on :meth:`continuation`."""
        return GenerationRequest(self.prompt, max_new_tokens, sampling, stop_token_ids, self.stop)

    def update(self, tokens: Sequence[int], finished: bool) -> str:
        """The text not yet shown, given the continuation's tokens so far."""
        text, hit = self.stop.cut(list(tokens))
        if not (finished or hit):
            text = text.rstrip(_PARTIAL)
            text = text[: len(text) - self._held_back(text)]
        if not text.startswith(self.shown):  # decoding rewrote shown text: wait for the end
            return ""
        piece, self.shown = text[len(self.shown) :], text
        return piece

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of ``text`` that a stop string starts with."""
        longest = 0
        for s in self.stop.stops:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest


@dataclass
class StreamTiming:
    """Clock of one :func:`generate_streaming` call (seconds) and its token counts."""

    first_token_s: float = float("nan")  # call start -> first generated token on the host
    total_s: float = 0.0
    generated_tokens: int = 0
    prompt_tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.total_s if self.total_s > 0 else float("nan")


def generate_streaming(
    generator: Generator,
    streams: Sequence[TextStream],
    requests: Sequence[GenerationRequest],
    write: Callable[[int, str, str | None], None],
) -> tuple[list[GenerationResult], StreamTiming]:
    """Generate ``requests`` (made by ``streams[i].request``); ``write(i, piece, finish)`` gets
    each new piece of text of request ``i`` as soon as it is decoded, and once more (maybe with
    an empty piece) when the request finishes (``finish``: ``"stop"`` or ``"length"``)."""
    timing = StreamTiming(prompt_tokens=sum(len(s.prompt) for s in streams))
    t0 = time.perf_counter()

    def on_tokens(i: int, tokens: list[int], finish: str | None) -> None:
        if tokens and timing.first_token_s != timing.first_token_s:  # nan: none yet
            timing.first_token_s = time.perf_counter() - t0
        piece = streams[i].update(tokens, finish is not None)
        if piece or finish is not None:
            write(i, piece, finish)

    results = generator.generate(list(requests), on_tokens=on_tokens)
    timing.total_s = time.perf_counter() - t0
    timing.generated_tokens = sum(len(r.tokens) for r in results)
    return results, timing
