"""One packed prefill forward of the generation engine: prompt pieces back to back.

Each piece is the next ``n`` tokens of one row's prompt, from position ``start`` on, with its
K/V written through the row's block table. A piece that starts at 0 is a plain causal
sequence; one that continues a row (an earlier chunk of a long prompt, or a shared prefix
whose pages the row holds) attends to the row's first ``start`` positions too, through the
row's pages (``model.PrefixPages``: the same page-table read the scorer uses for its cached
prefixes). Such a piece starts a ``PREFIX_ALIGN``-aligned segment of the stream (the packed
attention's rule: one prefix per query block), which the next pieces share when they read the
same pages from the same start (rows continuing one held few-shot prefix); the padding tokens
are sequences of their own whose K/V goes to the scratch page.
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

    def add(
        self, prompt: Sequence[int], start: int, n: int, pages: Sequence[int],
        read_pages: Sequence[int] | None = None,
    ) -> None:  # fmt: skip
        """Tokens ``prompt[start : start + n]`` of a row whose block table is ``pages``
        (covering every position the piece writes). ``read_pages``: where its first ``start``
        positions are read instead (a held shared prefix's pages: the same keys as the row's
        copy-on-write page). Pieces that read the same pages from the same start share one
        entry and one segment: rows continuing a few-shot prefix pack back to back instead of
        one ``PREFIX_ALIGN`` segment each (GSM8K's 47-token pieces were 2.7x padded)."""
        e, new = -1, False
        if start:
            table = list(read_pages if read_pages is not None else pages[: -(-start // PAGE_SIZE)])
            o = self._open
            if o >= 0 and self.lengths[o] == start and self.tables[o] == table:
                e = o  # the open segment's prefix: no padding
            else:
                e, new = len(self.lengths), True
                self.tables.append(table)
                self.lengths.append(start)
        if new or e != self._open:  # a segment of its own
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
        # run compiles one kernel, not two. Slots are int32 as the decode step's are: one RoPE
        # kernel compiled for both.
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
