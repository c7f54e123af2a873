"""One packed prefill forward of the generation engine: prompt pieces back to back.

Each piece is the next ``n`` tokens of one row's prompt, from position ``start`` on, with its
K/V written through the row's block table. A piece that starts at 0 is a plain causal
sequence; one that continues a row (an earlier chunk of a long prompt, or a shared prefix
whose pages the row holds) attends to the row's first ``start`` positions too, through the
row's pages (``model.PrefixPages``: the same page-table read the scorer uses for its cached
prefixes). Such a piece gets a ``PREFIX_ALIGN``-aligned segment of the stream to itself (the
packed attention's rule: one prefix per query block); the padding tokens are sequences of
their own whose K/V goes to the scratch page.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nakta_model.kernels.packed_attention import PREFIX_ALIGN
from nakta_model.kv_pages import PAGE_SIZE, SCRATCH_PAGE

__all__ = ["PrefillStream"]


class PrefillStream:
    """Builds the tensors of one ``model.forward_prefill`` call (see the module docstring)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.positions: list[int] = []
        self.seq_start: list[int] = []
        self.slots: list[int] = []
        self.entry: list[int] = []
        self.last: list[int] = []  # index of each piece's last token
        self.tables: list[list[int]] = []  # per entry: the row's pages before the piece
        self.lengths: list[int] = []
        self._open = -1  # the entry of the segment being filled (-1: plain sequences)

    def add(self, prompt: Sequence[int], start: int, n: int, pages: Sequence[int]) -> None:
        """Tokens ``prompt[start : start + n]`` of a row whose block table is ``pages``
        (covering every position the piece writes)."""
        e = -1
        if start:
            e = len(self.lengths)
            self.tables.append(list(pages[: -(-start // PAGE_SIZE)]))
            self.lengths.append(start)
        if e != self._open or e >= 0:  # a continued piece: a segment of its own
            self._pad()
            self._open = e
        s0 = len(self.tokens)
        self.tokens += prompt[start : start + n]
        self.positions += range(start, start + n)
        self.seq_start += [s0] * n
        self.slots += [
            pages[i // PAGE_SIZE] * PAGE_SIZE + i % PAGE_SIZE for i in range(start, start + n)
        ]
        self.entry += [e] * n
        self.last.append(len(self.tokens) - 1)

    def _pad(self) -> None:
        """Close the open segment at a ``PREFIX_ALIGN`` boundary with one-token sequences of
        its entry that write into the scratch page."""
        n = -len(self.tokens) % PREFIX_ALIGN if self.tokens else 0
        self.seq_start.extend(range(len(self.tokens), len(self.tokens) + n))
        self.tokens.extend([0] * n)
        self.positions.extend([0] * n)
        self.slots.extend([SCRATCH_PAGE * PAGE_SIZE] * n)
        self.entry.extend([self._open] * n)

    def run(self, model) -> torch.Tensor:
        """The forward: K/V of every piece into its pages; logits ``[pieces, vocab]`` (model
        dtype) at each piece's last token."""
        if self.lengths:
            self._pad()
        dev = model.device
        as_t = lambda xs, dt=torch.int64: torch.tensor(xs, dtype=dt, device=dev)  # noqa: E731
        from nakta_model.model import PrefixPages

        # A chunk with no continued piece still passes a prefix (one empty entry no token
        # reads): every chunk runs the one packed-attention kernel that reads pages, so a first
        # run compiles one, not two (1.1 s of GSM8K-full's first run on an H200). Slots are
        # int32 as the decode step's are: one RoPE kernel for both (0.2 s more).
        tables, lengths = self.tables or [[SCRATCH_PAGE]], self.lengths or [0]
        width = max(map(len, tables))
        table = [t + [SCRATCH_PAGE] * (width - len(t)) for t in tables]
        prefix = PrefixPages(
            as_t(table, torch.int32), as_t(lengths, torch.int32), as_t(self.entry, torch.int32),
            PAGE_SIZE,
        )  # fmt: skip
        return model.forward_prefill(
            as_t(self.tokens), as_t(self.positions, torch.int32), as_t(self.seq_start, torch.int32),
            as_t(self.slots, torch.int32), as_t(self.last), prefix=prefix,
        )  # fmt: skip
