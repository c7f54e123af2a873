"""SentencePiece tokenizer with Meta's LLaMA interface (``encode(s, bos, eos)``, ``decode``).

Kept separate from ``llama_org.tokenizer`` on purpose: ``nakta_model`` never imports the
reference it is checked against.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["Tokenizer"]


class Tokenizer:
    """``bos_id``, ``eos_id``, ``pad_id`` (-1 for LLaMA: no pad piece) and ``n_words``."""

    def __init__(self, model_path: str | os.PathLike):
        from sentencepiece import SentencePieceProcessor

        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"tokenizer model_path {str(model_path)!r} is not a file")
        self.model_path = str(model_path)
        self.sp_model = SentencePieceProcessor(model_file=self.model_path)
        self.n_words: int = self.sp_model.vocab_size()
        self.bos_id: int = self.sp_model.bos_id()
        self.eos_id: int = self.sp_model.eos_id()
        self.pad_id: int = self.sp_model.pad_id()
        if self.sp_model.vocab_size() != self.sp_model.get_piece_size():
            raise ValueError(f"tokenizer {model_path}: vocab_size != piece count")

    def encode(self, s: str, bos: bool, eos: bool) -> list[int]:
        if type(s) is not str:
            raise TypeError(f"s must be a str, got {type(s).__name__}")
        t = self.sp_model.encode(s)
        if bos:
            t = [self.bos_id] + t
        if eos:
            t = t + [self.eos_id]
        return t

    def encode_many(
        self, strings: Sequence[str], bos: bool, eos: bool, num_threads: int = -1
    ) -> list[list[int]]:
        """``[encode(s, bos, eos) for s in strings]`` in one sentencepiece call over
        ``num_threads`` threads (-1: every core): lm-eval's request tokenization encodes
        thousands of few-shot contexts, and one string per call is the slow way."""
        strings = list(strings)
        for s in strings:
            if type(s) is not str:
                raise TypeError(f"strings must hold str only, got {type(s).__name__}")
        if not strings:
            return []
        out = self.sp_model.encode(strings, num_threads=num_threads)
        head, tail = [self.bos_id] if bos else [], [self.eos_id] if eos else []
        if head or tail:
            out = [head + t + tail for t in out]
        return out

    def decode(self, t: Sequence[int]) -> str:
        return self.sp_model.decode(list(t))
