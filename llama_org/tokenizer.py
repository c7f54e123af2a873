"""Meta's LLaMA tokenizer wrapper: sentencepiece, BOS/EOS added by the caller's choice."""

from __future__ import annotations

import os

from sentencepiece import SentencePieceProcessor


class Tokenizer:
    def __init__(self, model_path: str | os.PathLike):
        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"tokenizer model_path {str(model_path)!r} is not a file")
        self.sp_model = SentencePieceProcessor(model_file=str(model_path))

        # BOS / EOS token IDs
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

    def decode(self, t: list[int]) -> str:
        return self.sp_model.decode(t)
