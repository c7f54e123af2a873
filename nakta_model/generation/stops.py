"""Stop sequences (lm-eval's ``until``) on the decoded text of a generated continuation.

lm-eval's ``generate_until`` returns the continuation cut before the first occurrence of any
``until`` string. The engine checks this while decoding (at every host check), so a row stops
as soon as a stop string has appeared instead of running to ``max_gen_toks``; the text it
returns is the same cut. Text is decoded from the whole continuation each time: SentencePiece
output is not prefix-stable token by token (byte pieces, the leading space), and decoding a
few hundred tokens costs microseconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["StopStrings"]


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
