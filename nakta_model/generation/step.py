"""One decode step for a fixed batch of cache rows: its buffers, inputs, graph and sampling.

The layers themselves run in ``model.py`` (``Transformer.forward_decode``: every block's
``TransformerBlock.decode`` on the step's ``DecodePath``); this module owns what is the step's:
the static buffers, the inputs, the capture and the next-token choice. A decode step reads every weight once for a handful of tokens, so its floor is the weight
bytes over the copy bandwidth, and every extra kernel costs launch and tail time. Per layer:

1. RMSNorm + ``wqkv`` + RoPE, K/V written into the cache   (``decode_linear``: NORM + ROPE)
2. attention over each row's cache pages                   (``decode_attention``, split-K)
3. ``wo`` + residual add                                    (``decode_linear``: RESIDUAL)
4. RMSNorm + ``w13`` + SwiGLU                               (``decode_linear``: NORM + SWIGLU)
5. ``w2`` + residual add                                    (``decode_linear``: RESIDUAL)

then the final RMSNorm + LM head and the next-token choice (``sampling.sample_next``), all on
static buffers so the whole step is captured once per batch bucket in a CUDA graph and
replayed: the host issues one graph launch per token (``graph_mode="cuda_graph"``; ``"compile"``
runs the step through ``torch.compile(mode="reduce-overhead")`` instead, so the two can be
compared, and ``"eager"`` just calls it). Under tensor parallelism the ``wo``/``w2``
partial sums are all-reduced (NCCL, inside the graph) before the residual add. The same code
runs the PyTorch references on the CPU (``model.kernels``), which the tests compare against.

Rounding follows Meta's eager chain op by op (see the kernels), except that sums run in a
different order; the logits are rounded to the model's dtype like Meta's ``output(h).float()``.

A step holds up to ``MAX_ROWS`` (1024) rows; from ``step_gemm.crossover`` rows on (always above
``decode_linear``'s 64) its linears run as cuBLAS / cuBLASLt W8A8 GEMMs with the fused norm,
SwiGLU and RoPE kernels around them (``step_gemm.py``), at the same rounding points.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from nakta_model.generation import step_gemm as _gemm
from nakta_model.generation.sampling import SamplingParams, sample_next
from nakta_model.kernels import decode_attention as _da
from nakta_model.kernels import greedy_advance as _ga
from nakta_model.kernels import step_inputs as _si
from nakta_model.kernels._checks import mark_compile_constants

__all__ = [
    "GRAPH_MODES",
    "MAX_ROWS",
    "DecodeBuffers",
    "DecodeStep",
    "EntryState",
    "batch_limit",
    "check_graph_mode",
]

MAX_ROWS = _gemm.MAX_ROWS  # rows a step may hold; above the crossover its linears are GEMMs

GRAPH_MODES = ("cuda_graph", "compile", "eager")

# With kernels, a step's inputs (write slots, key counts, embedding rows, the step counter) are
# one launch (``kernels/step_inputs.py``) and a greedy step's end (argmax, history, token,
# position) another (``kernels/greedy_advance.py``), instead of ~14 small PyTorch launches that
# each cost launch time on a batch-1 token; the same bits as those ops.
# Not under ``graph_mode="compile"``, whose inductor fuses those ops itself.


@dataclass
class DecodeBuffers:
    """The step's inputs and outputs, on the device, at fixed addresses (graph capture).

    Row b of the batch holds its last token ``tokens[b]`` at position ``positions[b]``; its
    keys live in the model's KV cache viewed as pages of ``page`` positions (``setup_cache(
    n_pages, page)``), key s in page ``block_table[b, s // page]`` (the step writes the new
    token's K/V there too). ``temperature``/``top_k``/``top_p`` are its sampling settings.
    ``slot_table``/``slot_lens``: the page tables of held shared prefixes and their lengths
    (empty: no cascade); row b reads its first ``prefix_lens[b]`` keys from the slot whose
    first page is ``prefix_rows[b]``, computed once for all its rows by the attention's
    cascade. Each step writes the chosen token into ``history[:, step]`` and advances
    ``tokens``, ``positions`` and ``step`` in place, so replaying the step N times decodes N
    tokens per row.
    """

    tokens: torch.Tensor  # int64 [B]
    positions: torch.Tensor  # int32 [B]
    block_table: torch.Tensor  # int32 [B, W]
    prefix_rows: torch.Tensor  # int32 [B]
    prefix_lens: torch.Tensor  # int32 [B]
    temperature: torch.Tensor  # fp32 [B]
    top_k: torch.Tensor  # int64 [B]
    top_p: torch.Tensor  # fp32 [B]
    history: torch.Tensor  # int64 [B, chunk]
    step: torch.Tensor  # int64 [1]
    slot_table: torch.Tensor  # int32 [P, W]
    slot_lens: torch.Tensor  # int32 [P]

    @classmethod
    def allocate(
        cls, batch: int, chunk: int, device: torch.device, slots: int = 0, row_pages: int = 1
    ) -> DecodeBuffers:
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        return cls(
            tokens=torch.zeros(batch, **i64),
            positions=torch.zeros(batch, **i32),
            block_table=torch.zeros(batch, row_pages, **i32),
            prefix_rows=torch.zeros(batch, **i32),
            prefix_lens=torch.zeros(batch, **i32),
            temperature=torch.zeros(batch, **f32),
            top_k=torch.zeros(batch, **i64),
            top_p=torch.ones(batch, **f32),
            history=torch.zeros(batch, chunk, **i64),
            step=torch.zeros(1, **i64),
            slot_table=torch.zeros(slots, row_pages, **i32),
            slot_lens=torch.zeros(slots, **i32),
        )


@dataclass(frozen=True)
class EntryState:
    """What one batch entry decodes from: its last token at ``position`` of its cache, its
    block table ``pages``, its sampling settings, and (``prefix_page``, ``prefix_len``) the
    first page and length of a held prefix the cascade reads for it (0, 0: none)."""

    token: int
    position: int
    pages: Sequence[int]
    sampling: SamplingParams
    prefix_page: int = 0
    prefix_len: int = 0


def batch_limit() -> int:
    """The most rows one :class:`DecodeStep` takes (the generation engine keeps its batch
    buckets within it): :data:`MAX_ROWS` (the GEMVs take up to ``decode_linear.MAX_BATCH``,
    the GEMM path the rest)."""
    return MAX_ROWS


def check_graph_mode(graph_mode: object) -> str:
    """``graph_mode`` if it is one of :data:`GRAPH_MODES`, else a ValueError naming it."""
    if graph_mode not in GRAPH_MODES:
        raise ValueError(f"graph_mode must be one of {GRAPH_MODES}, got {graph_mode!r}")
    return str(graph_mode)


class DecodeStep:
    """The decode step of ``model`` for ``batch`` rows; call it, or :meth:`capture` it once
    and :meth:`run` replays it (CUDA). ``sampling=False`` keeps the step greedy (no sort, no
    draw). ``graph_mode="compile"``: :meth:`run` calls the step compiled by ``torch.compile``
    (reduce-overhead: inductor + CUDA graph trees) and :meth:`capture` is refused.
    ``prefix_slots``: how many held shared prefixes (``buffers.slot_table`` / ``slot_lens``)
    the attention's cascade computes once per step for all the rows that read them; 0: every
    row reads its prefix's pages through its own block table. ``row_pages``: the block tables'
    width W (a row holds up to ``W * page`` positions, ``page = model.max_seq_len``: the KV
    cache set up as pages); 1 is the unpaged layout, one cache row a batch row."""

    def __init__(
        self,
        model,
        batch: int,
        chunk: int,
        *,
        sampling: bool,
        graph_mode: str = "cuda_graph",
        prefix_slots: int = 0,
        row_pages: int = 1,
    ):
        self.graph_mode = check_graph_mode(graph_mode)
        if not 1 <= batch <= MAX_ROWS:
            raise ValueError(f"decode batch must be in [1, {MAX_ROWS}], got {batch}")
        self.gemm = _gemm.use_gemm(batch, model.dtype, model.quant)  # linears as GEMMs
        fp8_epilogue = model.quant == "fp8" and _gemm.use_fp8_kernel(batch, model.device)
        # GEMM path, one rank: each wo / w2 residual add is made by the next RMSNorm kernel
        # (``decode_gemm``'s norm_residual) instead of a launch of its own, except where the
        # FP8 kernel already adds it in its epilogue (and under TP the partial sums come first);
        # the same bits as a separate add
        self.defer_residual = self.gemm and model.parallel.tp_size == 1 and not fp8_epilogue
        if not model.max_seq_len:
            raise ValueError("the model needs a KV cache: call model.setup_cache() first")
        if isinstance(prefix_slots, bool) or not isinstance(prefix_slots, int) or prefix_slots < 0:
            raise ValueError(f"prefix_slots must be an int >= 0, got {prefix_slots!r}")
        if isinstance(row_pages, bool) or not isinstance(row_pages, int) or row_pages < 1:
            raise ValueError(f"row_pages must be an int >= 1, got {row_pages!r}")
        self.model, self.batch, self.sampling = model, batch, sampling
        self.buffers = DecodeBuffers.allocate(batch, chunk, model.device, prefix_slots, row_pages)
        args = model.args
        tp = model.parallel.tp_size
        self.n_q, self.n_kv = args.n_heads // tp, args.local_kv_heads(tp)
        self.head_dim = args.head_dim
        self.page = model.max_seq_len  # positions per page of the KV cache
        self.cache_len = row_pages * self.page  # the most positions a row holds
        self.cos, self.sin = model._rope_tables(self.cache_len)
        self.kernels = model.ops.triton(model.output.weight)
        # under torch.compile inductor fuses the step's small ops itself
        self.step_kernels = self.kernels and graph_mode != "compile"
        self.window = args.sliding_window  # a row attends to its last `window` keys (None: all)
        seen = self.cache_len if self.window is None else min(self.cache_len, self.window)
        self.splits = _da.decode_splits(batch, self.n_kv, seen, model.device)
        self.slot_splits = (
            _da.cascade_splits(batch, self.n_q, self.n_kv, prefix_slots, seen, model.device)
            if prefix_slots
            else 0
        )
        partials = self.splits + prefix_slots * self.slot_splits
        self.workspace = (
            _da.attention_workspace(batch, self.n_q, self.head_dim, partials, model.device)
            if partials > 1
            else None
        )
        buf = self.buffers
        attention_kw = dict(block_table=buf.block_table)
        if self.window is not None:
            attention_kw["window"] = self.window
        if buf.slot_table.numel():
            attention_kw.update(prefix_rows=buf.prefix_rows, prefix_lens=buf.prefix_lens)
            attention_kw["prefix_slots"] = (buf.slot_table, buf.slot_lens)
        self.path = model.decode_path(
            batch, gemm=self.gemm, defer_residual=self.defer_residual, page=self.page,
            cos=self.cos, sin=self.sin, positions=buf.positions, splits=self.splits,
            workspace=self.workspace, attention_kw=attention_kw,
        )  # fmt: skip
        self.graph: torch.cuda.CUDAGraph | None = None
        self._compiled = self._compile() if graph_mode == "compile" else None

    def load(
        self, entries: Mapping[int, EntryState], prefixes: Sequence[tuple[int, Sequence[int], int]]
    ) -> None:
        """Write the entries' state into the buffers (entry s of ``entries`` -> batch entry s;
        idle entries read and write the scratch page) and reset ``step``; ``prefixes``: the
        held prefixes as (cascade slot, pages, length), written when the step has a cascade
        (empty slots: length 0)."""
        buf = self.buffers
        width, b = buf.block_table.shape[1], self.batch
        tokens, positions, pre_rows, pre_lens = [0] * b, [0] * b, [0] * b, [0] * b
        table = [[0] * width for _ in range(b)]
        temp, top_k, top_p = [0.0] * b, [0] * b, [1.0] * b
        for s, e in entries.items():
            tokens[s], positions[s] = e.token, e.position
            table[s][: len(e.pages)] = e.pages
            pre_rows[s], pre_lens[s] = e.prefix_page, e.prefix_len
            temp[s], top_k[s], top_p[s] = (
                e.sampling.temperature, e.sampling.top_k, e.sampling.top_p
            )  # fmt: skip
        for t, v in (
            (buf.tokens, tokens), (buf.positions, positions), (buf.block_table, table),
            (buf.prefix_rows, pre_rows), (buf.prefix_lens, pre_lens), (buf.temperature, temp),
            (buf.top_k, top_k), (buf.top_p, top_p),
        ):  # fmt: skip
            t.copy_(torch.tensor(v, dtype=t.dtype), non_blocking=False)
        buf.step.zero_()
        if buf.slot_table.numel():
            slot_table = [[0] * width for _ in range(buf.slot_table.shape[0])]
            slot_lens = [0] * buf.slot_table.shape[0]
            for slot, pages, length in prefixes:
                slot_table[slot][: len(pages)] = pages
                slot_lens[slot] = length
            buf.slot_table.copy_(torch.tensor(slot_table, dtype=torch.int32))
            buf.slot_lens.copy_(torch.tensor(slot_lens, dtype=torch.int32))

    # ------------------------------------------------------------------------------- math
    def _inputs(self, advance_step: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's write slot through its block table, key count and embedding row, on the
        device (graph-safe); ``advance_step``: ``step += 1`` too (the fused step's first launch)."""
        m, buf = self.model, self.buffers
        if self.step_kernels:
            return _si.step_inputs(buf.positions, buf.block_table, self.page, buf.tokens,
                                   m.tok_embeddings.weight, buf.step, advance_step)  # fmt: skip
        positions = buf.positions
        page_of = buf.block_table.gather(1, (positions // self.page).long()[:, None])[:, 0]
        if advance_step:
            buf.step.add_(1)
        return (
            page_of * self.page + positions % self.page,
            positions + 1,
            m.tok_embeddings(buf.tokens),
        )

    def logits(self, advance_step: bool = False) -> torch.Tensor:
        """Logits ``[B, vocab]`` (model dtype) for the buffers' tokens; writes their K/V (the
        layers: ``model.forward_decode`` on this step's ``DecodePath``).
        ``advance_step``: the step counter is advanced first (``__call__``'s kernel path)."""
        slots, lens, h = self._inputs(advance_step)
        return self.model.forward_decode(h, slots, lens, self.path)

    def __call__(self) -> None:
        """Decode one token per row into ``history[:, step]`` and advance the buffers."""
        buf = self.buffers
        if self.step_kernels and not self.sampling:  # two launches around the layers
            logits = self.logits(advance_step=True)  # step advanced: this step's column is step - 1
            _ga.greedy_advance_(logits, buf.history, buf.step, buf.tokens, buf.positions,
                                step_offset=-1)  # fmt: skip
            return
        nxt = sample_next(
            self.logits(), buf.temperature, buf.top_k, buf.top_p, any_sampling=self.sampling
        )
        buf.history.index_copy_(1, buf.step, nxt[:, None])
        buf.tokens.copy_(nxt)
        buf.positions.add_(1)
        buf.step.add_(1)

    # ---------------------------------------------------------------------------- graphs
    def capture(self) -> None:
        """Record one step as a CUDA graph (after two eager warm-up steps, which compile the
        kernels; the buffers' values are restored afterwards)."""
        if self.graph_mode != "cuda_graph":
            raise ValueError(f"capture() needs graph_mode='cuda_graph', got {self.graph_mode!r}")
        buf = self.buffers
        saved = {k: getattr(buf, k).clone() for k in ("tokens", "positions", "step", "history")}
        stream = torch.cuda.Stream(self.model.device)
        stream.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self()
                for k, v in saved.items():
                    getattr(buf, k).copy_(v)
        torch.cuda.current_stream(self.model.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self()
        for k, v in saved.items():
            getattr(buf, k).copy_(v)
        self.graph = graph

    def _compile(self):
        """``self.__call__`` under ``torch.compile(mode="reduce-overhead")``. The tensors the
        step mutates or reads by address (buffers, KV cache, tables) are marked static: CUDA
        graph trees then neither copy them in on each replay nor skip graphs that mutate them
        in place. Host checks in the kernel launchers break the graph (``fullgraph=False``)."""
        mark_compile_constants()
        tensors = [*vars(self.buffers).values(), self.cos, self.sin, self.workspace]
        for layer in self.model.layers:
            a = layer.attention
            tensors += [a.k_cache, a.v_cache, a.k_scale, a.v_scale]
        for t in tensors:
            if t is not None:
                torch._dynamo.mark_static_address(t, guard=False)
        # static shapes: a symbolic batch or width breaks the Triton launchers' grid arithmetic
        return torch.compile(self.__call__, mode="reduce-overhead", fullgraph=False, dynamic=False)

    def restart(self) -> None:
        """Start a new chunk from the buffers' current state (a continuation: no ``load``)."""
        self.buffers.step.zero_()

    def read_out(self, steps: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Enqueue the copy of the chunk's tokens (``history[:, :steps]``) to the host: into
        pinned memory with an event on CUDA, so that the host reads them (``step_tokens``)
        while the device runs what was enqueued after them."""
        hist = self.buffers.history[:, :steps]
        if hist.device.type != "cuda":
            return hist.clone(), None
        host = torch.empty(hist.shape, dtype=hist.dtype, pin_memory=True)
        host.copy_(hist, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def run(self, steps: int) -> None:
        """``steps`` decode steps (graph replays when captured, compiled calls in compile mode)."""
        for _ in range(steps):
            if self._compiled is not None:
                torch.compiler.cudagraph_mark_step_begin()  # a new step: outputs are not kept
                self._compiled()
            elif self.graph is not None:
                self.graph.replay()
            else:
                self()


def step_tokens(out: tuple[torch.Tensor, torch.cuda.Event | None]) -> list[list[int]]:
    """The tokens of a chunk that ``DecodeStep.read_out`` copied: waits for the copy alone."""
    host, event = out
    if event is not None:
        event.synchronize()
    return host.tolist()
