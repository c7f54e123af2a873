"""The Nakta Transformer: LLaMA with fused weights and Triton kernels, readable in one sitting.

Per block: RMSNorm (fused with the residual add) -> ONE ``wqkv`` GEMM -> in-place QK RoPE that
also writes K/V into the cache -> attention (SDPA flash with a cache / causal rows; the packed
Triton kernel for scoring and prefill) -> ``wo`` -> RMSNorm + residual ->
ONE ``w13`` GEMM -> SwiGLU -> ``w2``. Same math as Meta's LLaMA-1 (``llama_org``), fewer launches.

Tensor parallel (``ParallelContext``): each rank holds its Q/K/V heads and FFN columns; ``wo``
and ``w2`` are row-split and end in one all-reduce each; the embedding is replicated; the LM
head is split over the vocabulary and gathered only at the rows that are scored.

Two paths through the same blocks: the packed one (``TransformerBlock.forward``: scoring,
prefill, ``model(tokens)``) and the decode one (``TransformerBlock.decode`` on a
``DecodePath``: a fixed batch of cache rows, one token each, five weight-streaming launches a
layer with the norms, RoPE, SwiGLU and residual adds fused in, captured in a CUDA graph by
``generation/step.py``). ``_Ops`` is the one kernel dispatch (Triton or the references).

Entry points: ``model(tokens, start_pos)`` (logits for every position, KV cache when set up),
``model.forward_packed(...)`` (packed sequences with shared-context trees, logits only at the
scored rows), ``model.forward_decode(...)`` (a decode step's logits). Building one (from a checkpoint, a Meta/HF directory, random weights):
``loading.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn

from nakta_model import knobs
from nakta_model.attention import causal_attention
from nakta_model.config import ModelArgs
from nakta_model.fp8 import Fp8Linear, Precision
from nakta_model.generation import step_gemm as _gemm
from nakta_model.kernels import decode_attention as _da
from nakta_model.kernels import decode_linear as _dl
from nakta_model.kernels import fp8_decode_gemm as _fp8_small
from nakta_model.kernels import fp8_gemm as _fp8_gemm
from nakta_model.kernels import fp8_quant as _fp8
from nakta_model.kernels import packed_attention as _packed
from nakta_model.kernels import rmsnorm as _rmsnorm
from nakta_model.kernels import rope as _rope
from nakta_model.kernels import swiglu as _swiglu
from nakta_model.kernels._checks import fp8_mma, interpreter_enabled
from nakta_model.kernels.fp8_quant import FP8_DTYPE
from nakta_model.parallel import ParallelContext, all_reduce, gather_last_dim

__all__ = ["Transformer"]

KERNEL_MODES = ("auto", "triton", "reference")
# Rows up to which an FP8 model's W8A8 products (prefill, scoring) run the decode step's Triton
# ``fp8_decode_gemm`` instead of cuBLASLt, whose small-M FP8 GEMMs stream the weights at a
# fraction of copy bandwidth (``_Ops.fp8_matmul``); at most its ``MAX_ROWS``. 0 (never): in an
# eager prompt forward the Triton launches' host time outweighed the better streaming
# (docs/fp8.md has the batch-1 A/B); kept for that A/B.
FP8_SMALL_GEMM_ROWS = 0


def _default_kernels() -> str:
    mode = knobs.get_str("NAKTA_KERNELS")
    if mode not in KERNEL_MODES:
        raise ValueError(f"NAKTA_KERNELS must be one of {KERNEL_MODES}, got {mode!r}")
    return mode


class _Ops:
    """Kernel dispatch. ``auto``: Triton on CUDA tensors, the PyTorch reference elsewhere (the
    interpreter is far too slow to be a default); ``triton``: always the Triton kernels (on the
    CPU only with ``TRITON_INTERPRET=1``); ``reference``: always plain PyTorch.

    ``quant="fp8"``: the norms before ``wqkv``/``w13`` and the SwiGLU before ``w2`` return
    ``QuantRows`` (e4m3 + a scale per row) for the FP8 GEMMs; ``act_dtype`` is the model's
    dtype, in which those GEMMs write (set by the model at each forward)."""

    def __init__(self, mode: str, quant: Precision | str | None = None):
        if mode not in KERNEL_MODES:
            raise ValueError(f"kernels must be one of {KERNEL_MODES}, got {mode!r}")
        self.mode = mode
        self.quant = Precision.of(quant).quant  # parsed by the caller: not again
        self.act_dtype = torch.bfloat16

    def triton(self, x: torch.Tensor) -> bool:
        if self.mode == "reference":
            return False
        if self.mode == "triton":
            if not (x.is_cuda or interpreter_enabled()):
                raise ValueError(
                    "kernels='triton' on a CPU tensor needs TRITON_INTERPRET=1; use 'auto'"
                )
            return True
        return x.is_cuda

    def rms_norm(self, x, w, eps, residual=None):
        fn = _rmsnorm.rms_norm if self.triton(x) else _rmsnorm.rms_norm_reference
        return fn(x, w, eps, residual=residual)

    def block_norm(self, x, w, eps, residual=None):
        """The norm before a block matrix: ``rms_norm``, or with FP8 its ``QuantRows``."""
        if self.quant is None:
            return self.rms_norm(x, w, eps, residual)
        fn = _rmsnorm.rms_norm_fp8 if self.triton(x) else _rmsnorm.rms_norm_fp8_reference
        return fn(x, w, eps, residual=residual)

    def swiglu(self, gate_up):
        """SwiGLU before ``w2``; with FP8 its ``QuantRows``."""
        if self.quant is None:
            fn = _swiglu.swiglu if self.triton(gate_up) else _swiglu.swiglu_reference
        else:
            fn = _swiglu.swiglu_fp8 if self.triton(gate_up) else _swiglu.swiglu_fp8_reference
        return fn(gate_up)

    def quantize_rows(self, x):
        fn = _fp8.quantize_rows if self.triton(x) else _fp8.quantize_rows_reference
        return fn(x)

    def fp8_matmul(self, xq, x_scale, wq, w_scale, out_dtype):
        """An ``Fp8Linear``'s W8A8 product (scoring, prefill): cuBLASLt's row-wise scaled GEMM,
        except at up to ``FP8_SMALL_GEMM_ROWS`` rows (a prefill of a few dozen tokens, a
        batch-1 call's prompt) where cuBLASLt streams the weights poorly: there the Triton
        ``fp8_decode_gemm`` the decode step uses from 8 rows. Same function (fp32 sums of exact
        e4m3 products, the same scales and rounding); summation order only."""
        if (
            self.triton(xq)
            and xq.shape[0] <= min(FP8_SMALL_GEMM_ROWS, _fp8_small.MAX_ROWS)
            and fp8_mma(xq.device)
            and out_dtype in _fp8_small.OUT_DTYPES
        ):
            return _fp8_small.fp8_decode_gemm(xq, x_scale, wq, w_scale, out_dtype)
        return _fp8_gemm.fp8_matmul(xq, x_scale, wq, w_scale, out_dtype)

    def linear(self, in_features: int, out_features: int) -> nn.Module:
        """A block matrix: ``nn.Linear``, or with FP8 an ``Fp8Linear`` (e4m3 + scales)."""
        if self.quant is None:
            return nn.Linear(in_features, out_features, bias=False)
        return Fp8Linear(in_features, out_features, self)

    def rope_qkv_(self, qkv, *args, **kw):
        fn = _rope.apply_rope_qkv_ if self.triton(qkv) else _rope.apply_rope_qkv_reference
        return fn(qkv, *args, **kw)

    def packed_attention(self, qkv, *args, **kw):
        ok = self.triton(qkv)
        fn = _packed.packed_attention if ok else _packed.packed_attention_reference
        return fn(qkv, *args, **kw)

    # the decode step's launches (``DecodePath``)
    def decode_linear(self, x, weight, **kw):
        fn = _dl.decode_linear if self.triton(x) else _dl.decode_linear_reference
        return fn(x, weight, **kw)

    def decode_gemm(self, x, weight, **kw):
        """``decode_linear``'s call as a GEMM (``generation/step_gemm.py``); ``x`` may be the
        FP8 SwiGLU's ``QuantRows``."""
        rows = x.q if isinstance(x, _fp8.QuantRows) else x
        fn = _gemm.decode_gemm if self.triton(rows) else _gemm.decode_gemm_reference
        return fn(x, weight, **kw)

    def decode_attention(self, q, k_cache, v_cache, lens, *, n_splits, workspace, **kw):
        if self.triton(q):
            return _da.decode_attention(
                q, k_cache, v_cache, lens, n_splits=n_splits, workspace=workspace, **kw
            )
        return _da.decode_attention_reference(q, k_cache, v_cache, lens, **kw)


@dataclass(frozen=True)
class PrefixPages:
    """Which cached prefixes packed tokens attend to: pages of the model's KV cache (set up as
    ``setup_cache(n_pages, page_size)``), see ``kernels.packed_attention.PrefixKV``."""

    page_table: torch.Tensor  # int [n_entries, max_pages]
    lengths: torch.Tensor  # int [n_entries]
    token_entry: torch.Tensor  # int [T], -1: no prefix
    page_size: int


@dataclass
class _Step:
    """What every layer needs to know about the current forward call."""

    batch: int
    seqlen: int
    positions: torch.Tensor  # int [batch * seqlen]
    cos: torch.Tensor
    sin: torch.Tensor
    cache_slots: torch.Tensor | None = None  # int [batch * seqlen]: write K/V here
    key_len: int = 0  # with a cache: attend over cache positions [0, key_len)
    packed: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (seq_start, span_end) [T]
    prefix: PrefixPages | None = None  # cached prefixes in the KV cache (packed scoring)


class DecodePath:
    """How one decode step (a fixed batch of cache rows, graph-captured by
    ``generation/step.py``) runs each layer: five weight-streaming launches per layer, the
    norms, RoPE, SwiGLU and residual adds fused into them (``decode_linear``; from
    ``step_gemm.crossover`` rows on, ``gemm``: cuBLAS / cuBLASLt GEMMs with the fused kernels
    around them). ``defer_residual``: a ``wo`` / ``w2`` product's residual add is made by the
    next norm kernel (GEMM path, one rank). ``positions`` [B] and the attention's page tables
    (``attention_kw``) are the step's buffers, at fixed addresses; ``page``: positions per page
    of the KV cache; ``splits`` / ``workspace``: the split-K attention's."""

    def __init__(
        self, model: Transformer, batch: int, *, gemm: bool, defer_residual: bool, page: int,
        cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, splits: int,
        workspace: torch.Tensor | None, attention_kw: dict,
    ):  # fmt: skip
        self.ops, self.ctx, self.dtype = model.ops, model.parallel, model.dtype
        self.batch, self.gemm, self.defer_residual, self.page = batch, gemm, defer_residual, page
        self.cos, self.sin, self.positions = cos, sin, positions
        self.splits, self.workspace, self.attention_kw = splits, workspace, attention_kw

    def linear(self, x, layer, **kw) -> torch.Tensor:
        """``layer``'s product (an ``nn.Linear``, or an ``Fp8Linear``: e4m3 weights streamed
        with their per-channel scales, half the bytes): ``decode_linear``, or above the
        crossover the GEMM path (``step_gemm``: W8A8 with FP8 weights, whose SwiGLU hands
        ``w2`` quantized rows)."""
        scale = getattr(layer, "weight_scale", None)
        if scale is not None:
            kw["weight_scale"] = scale
        if self.gemm:
            return self.ops.decode_gemm(x, layer.weight, out_dtype=self.dtype, **kw)
        return self.ops.decode_linear(x, layer.weight, **kw)

    def attention(self, q, k_cache, v_cache, lens, **scales) -> torch.Tensor:
        return self.ops.decode_attention(
            q, k_cache, v_cache, lens, n_splits=self.splits, workspace=self.workspace,
            **self.attention_kw, **scales,
        )  # fmt: skip

    def normed(self, h, layer, norm, **kw) -> tuple:
        """``(layer(norm(h)), h)``; ``h`` a deferred ``(product, residual)`` pair (``add``)
        is added by the norm kernel, which returns the sum as the new ``h``."""
        kw.update(norm_weight=norm.weight, eps=norm.eps)
        if isinstance(h, tuple):
            y, residual = h
            return self.linear(y, layer, norm_residual=residual, **kw)
        return self.linear(h, layer, **kw), h

    def add(self, x, layer, residual):
        """``residual + x @ weight^T`` (``residual_add``), or with ``defer_residual`` the pair
        ``(x @ weight^T, residual)`` that the next ``normed`` adds."""
        if self.defer_residual:
            return self.linear(x, layer), residual
        return self.residual_add(x, layer, residual)

    def residual_add(self, x, layer, residual) -> torch.Tensor:
        """``residual + x @ weight^T``: fused when the product is whole on this rank; under
        tensor parallelism the partial products are all-reduced first."""
        if self.ctx.tp_size == 1:
            return self.linear(x, layer, residual=residual)
        part = all_reduce(self.linear(x, layer), self.ctx)
        return residual + part


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, ctx: ParallelContext, ops: _Ops):
        super().__init__()
        self.ctx, self.ops = ctx, ops
        self.n_heads = args.n_heads // ctx.tp_size
        self.n_kv_heads = args.local_kv_heads(ctx.tp_size)  # replicated when tp > n_kv_heads
        self.head_dim = args.head_dim
        self.interleaved = args.rope_interleaved  # Meta pairs (Nakta checkpoints) or HF halves
        self.window = args.sliding_window  # None: full causal attention
        self.wqkv = ops.linear(args.dim, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim)
        self.wo = ops.linear(self.n_heads * self.head_dim, args.dim)
        self.k_cache: torch.Tensor | None = None  # [max_batch * max_seq, n_kv_heads, head_dim]
        self.v_cache: torch.Tensor | None = None
        # kv_cache="fp8": the caches hold e4m3 codes, these one fp32 scale per slot and KV head
        self.k_scale: torch.Tensor | None = None  # [max_batch * max_seq, n_kv_heads]
        self.v_scale: torch.Tensor | None = None
        self.cache_seq_len = 0

    def cache_kw(self) -> dict:
        """The caches as the RoPE write and the attention reads take them (e4m3: with the
        scales)."""
        kw = dict(k_cache=self.k_cache, v_cache=self.v_cache)
        if self.k_scale is not None:
            kw.update(k_scale=self.k_scale, v_scale=self.v_scale)
        return kw

    def _dense_cache(self, cache: torch.Tensor, scale: torch.Tensor | None, dtype) -> torch.Tensor:
        """The cache in ``dtype`` (e4m3 dequantized: codes * scale) for the dense path."""
        if scale is None:
            return cache
        return (cache.float() * scale[..., None]).to(dtype)

    def forward(self, x: torch.Tensor, step: _Step) -> torch.Tensor:
        hq, hkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        b, s = step.batch, step.seqlen
        qkv = self.wqkv(x)  # [b*s, (hq + 2 hkv) * hd]
        if step.packed is not None:  # one flat stream of sequences
            # RoPE once, in place (prefill also writes K/V into the cache), then attention
            # within each sequence's token tree. (Rotating K as it is read cost more than this
            # pass on long rows: every query block re-rotates the same keys.)
            cache = {}
            if step.cache_slots is not None:
                cache = dict(self.cache_kw(), cache_slots=step.cache_slots)
            self.ops.rope_qkv_(
                qkv, step.positions, step.cos, step.sin, hq, hkv, hd,
                interleaved=self.interleaved, **cache,
            )  # fmt: skip
            prefix = None
            if step.prefix is not None:  # cached prefixes: pages of this layer's KV cache
                pp = step.prefix
                prefix = _packed.PrefixKV(
                    self.k_cache, self.v_cache, pp.page_table, pp.lengths, pp.token_entry,
                    pp.page_size, self.k_scale, self.v_scale,
                )  # fmt: skip
            win = {} if self.window is None else dict(window=self.window, positions=step.positions)
            out = self.ops.packed_attention(qkv, *step.packed, hq, hkv, hd, prefix=prefix, **win)
            return all_reduce(self.wo(out), self.ctx)
        cache = {}
        if step.cache_slots is not None:
            cache = dict(self.cache_kw(), cache_slots=step.cache_slots)
        self.ops.rope_qkv_(
            qkv,
            step.positions,
            step.cos,
            step.sin,
            hq,
            hkv,
            hd,
            interleaved=self.interleaved,
            **cache,
        )
        heads = qkv.view(b, s, hq + 2 * hkv, hd)
        q = heads[:, :, :hq].transpose(1, 2)
        if step.cache_slots is not None:
            kv_shape = (-1, self.cache_seq_len, hkv, hd)
            sc_shape = kv_shape[:3]
            k, v, ks, vs = self.k_cache, self.v_cache, self.k_scale, self.v_scale
            if ks is not None:
                ks, vs = (
                    ks.view(sc_shape)[:b, : step.key_len],
                    vs.view(sc_shape)[:b, : step.key_len],
                )
            k = self._dense_cache(k.view(kv_shape)[:b, : step.key_len], ks, qkv.dtype)
            v = self._dense_cache(v.view(kv_shape)[:b, : step.key_len], vs, qkv.dtype)
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        else:
            k = heads[:, :, hq : hq + hkv].transpose(1, 2)
            v = heads[:, :, hq + hkv :].transpose(1, 2)
        out = causal_attention(q, k, v, self.window)
        out = out.transpose(1, 2).reshape(b * s, hq * hd)
        return all_reduce(self.wo(out), self.ctx)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs, ctx: ParallelContext, ops: _Ops):
        super().__init__()
        self.ctx, self.ops = ctx, ops
        hidden = args.hidden_dim // ctx.tp_size
        self.w13 = ops.linear(args.dim, 2 * hidden)  # gate rows, then up rows
        self.w2 = ops.linear(hidden, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.w2(self.ops.swiglu(self.w13(x))), self.ctx)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, ctx: ParallelContext, ops: _Ops):
        super().__init__()
        self.ops = ops
        self.attention = Attention(args, ctx, ops)
        self.feed_forward = FeedForward(args, ctx, ops)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(
        self, delta: torch.Tensor, residual: torch.Tensor | None, step: _Step
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``h = residual + delta`` (the previous sublayer's output), then this block.

        Returns this block's FFN output and the residual stream before it, so the add is fused
        into the next norm. ``residual is None`` for the first block (``delta`` = embeddings).
        """
        n = self.attention_norm
        if residual is None:
            h, y = delta, self.ops.block_norm(delta, n.weight, n.eps)
        else:
            y, h = self.ops.block_norm(delta, n.weight, n.eps, residual=residual)
        a = self.attention(y, step)
        y, h = self.ops.block_norm(a, self.ffn_norm.weight, self.ffn_norm.eps, residual=h)
        return self.feed_forward(y), h

    def decode(self, h, slots: torch.Tensor, lens: torch.Tensor, d: DecodePath):
        """This block on the decode path (``DecodePath``): ``h`` the residual stream [B, dim]
        (or, deferred, a ``(product, residual)`` pair); K/V of the new tokens go to cache slots
        ``slots``, each row attends to its ``lens`` keys. Returns the new ``h``."""
        a, f = self.attention, self.feed_forward
        b, hq, hkv, hd = d.batch, a.n_heads, a.n_kv_heads, a.head_dim
        positions = d.positions
        kc = a.k_cache.view(-1, d.page, hkv, hd)
        vc = a.v_cache.view(-1, d.page, hkv, hd)
        scales = {}
        if a.k_scale is not None:  # e4m3 pages: their scales, paged alike
            scales = dict(
                k_scale=a.k_scale.view(-1, d.page, hkv), v_scale=a.v_scale.view(-1, d.page, hkv)
            )
        if a.interleaved and (not scales or d.gemm):  # an e4m3 cache: the GEMM path's epilogue
            rope = _dl.RopeArgs(
                positions, d.cos, d.sin, hq, hkv, hd, a.k_cache, a.v_cache, slots, a.k_scale,
                a.v_scale,
            )  # fmt: skip
            q, h = d.normed(h, a.wqkv, self.attention_norm, rope=rope)
        else:  # HF's rotate-half pairs, or e4m3 pages on the GEMVs: the rope kernel
            qkv, h = d.normed(h, a.wqkv, self.attention_norm)
            self.ops.rope_qkv_(
                qkv, positions, d.cos, d.sin, hq, hkv, hd, interleaved=a.interleaved,
                cache_slots=slots, **a.cache_kw(),
            )  # fmt: skip
            q = qkv[:, : hq * hd]
        o = d.attention(q.view(b, hq, hd), kc, vc, lens, **scales).view(b, hq * hd)
        h = d.add(o, a.wo, h)
        g, h = d.normed(h, f.w13, self.ffn_norm, swiglu=True)
        return d.add(g, f.w2, h)


class Transformer(nn.Module):
    """LLaMA with fused ``wqkv``/``w13`` weights; see the module docstring."""

    def __init__(
        self,
        args: ModelArgs,
        parallel: ParallelContext | None = None,
        kernels: str | None = None,
        quant: Precision | str | None = None,
    ):
        super().__init__()
        ctx = parallel or ParallelContext()
        args.check_tp(ctx.tp_size)
        self.args, self.parallel = args, ctx
        self.precision = Precision.of(quant)  # parsed by the caller: not again
        self.ops = _Ops(kernels or _default_kernels(), self.precision)
        # _weight: no random init (on the meta device it would import torch._dynamo: seconds)
        self.tok_embeddings = nn.Embedding(
            args.vocab_size, args.dim, _weight=torch.zeros(args.vocab_size, args.dim)
        )
        self.layers = nn.ModuleList(
            TransformerBlock(args, ctx, self.ops) for _ in range(args.n_layers)
        )
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size // ctx.tp_size, bias=False)
        self.requires_grad_(False)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.max_batch_size = 0
        self.max_seq_len = 0

    # ------------------------------------------------------------------------ helpers
    @property
    def device(self) -> torch.device:
        return self.output.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.output.weight.dtype

    @property
    def quant(self) -> str | None:
        """``None`` (the model's dtype throughout) or ``"fp8"`` (see ``nakta_model/fp8.py``)."""
        return self.ops.quant

    @property
    def kv_cache(self) -> str:
        """The KV cache's dtype: ``"bf16"`` (the model's dtype) or ``"fp8"`` (e4m3 + scales)."""
        return self.precision.kv_cache

    def set_kv_cache(self, kv_cache: str) -> None:
        """Change the KV cache's dtype (a parsed ``Precision.kv_cache`` value); a cache of the
        other dtype is freed (the KV pool sees it replaced and rebuilds at its next use)."""
        if kv_cache == self.precision.kv_cache:
            return
        self.precision = dataclasses.replace(self.precision, kv_cache=kv_cache)  # checks it
        self.clear_cache()

    @property
    def kernels(self) -> str:
        return self.ops.mode

    @kernels.setter
    def kernels(self, mode: str) -> None:
        self.ops.mode = _Ops(mode).mode  # validates; shared by every layer

    def _rope_tables(self, n_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (the config's theta and scaling) for at least ``n_positions``, on our device.

        Grown on demand, to the next power of two: a 128K-context config allocates only what
        a run reaches, never ``max_seq_len`` rows up front. A grown table is a new tensor, so a
        captured decode step keeps the one it was built with (already long enough for it).
        """
        if not isinstance(n_positions, int) or n_positions < 1:
            raise ValueError(f"n_positions must be an int >= 1, got {n_positions!r}")
        if (
            self._rope is None
            or self._rope[0].shape[0] < n_positions
            or self._rope[0].device != self.device
        ):
            need = max(n_positions, 256, self._rope[0].shape[0] if self._rope else 0)
            self._rope = _rope.build_rope_cache(
                1 << (need - 1).bit_length(),
                self.args.head_dim,
                self.args.rope_theta,
                device=self.device,
                scaling=self.args.rope_scaling,
            )
        return self._rope

    def _check_tokens(self, tokens: torch.Tensor) -> None:
        if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError("tokens must be an int64/int32 tensor [batch, seq]")
        if tokens.dim() != 2 or tokens.shape[1] == 0:
            raise ValueError(f"tokens must have shape [batch, seq>0], got {tuple(tokens.shape)}")
        if tokens.device != self.device:
            raise ValueError(f"tokens are on {tokens.device}, the model on {self.device}")

    def _trunk(self, tokens: torch.Tensor, step: _Step) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings through every block: the last FFN output and the residual before it."""
        delta = self.tok_embeddings(tokens.reshape(-1))
        self.ops.act_dtype = delta.dtype  # the FP8 GEMMs write in the model's dtype
        residual = None
        for layer in self.layers:
            delta, residual = layer(delta, residual, step)
        return delta, residual

    def _head(
        self, delta: torch.Tensor, residual: torch.Tensor, upcast: bool = True
    ) -> torch.Tensor:
        """Final residual add + norm + LM head on these rows only: logits [rows, vocab], fp32
        unless ``upcast`` is False (then the model's dtype: the scorer reads them in fp32 itself)."""
        y, _ = self.ops.rms_norm(delta, self.norm.weight, self.norm.eps, residual=residual)
        logits = gather_last_dim(self.output(y), self.parallel)
        return logits.float() if upcast else logits

    # ---------------------------------------------------------------------- KV cache
    def setup_cache(self, max_batch_size: int, max_seq_len: int) -> None:
        """Allocate K/V caches; afterwards ``model(tokens, start_pos)`` reads and extends them."""
        if max_batch_size < 1 or max_seq_len < 1:
            raise ValueError(
                f"max_batch_size and max_seq_len must be >= 1, got {max_batch_size}, {max_seq_len}"
            )
        if (max_batch_size, max_seq_len) == (self.max_batch_size, self.max_seq_len):
            return
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        fp8 = self.kv_cache == "fp8"
        dtype = FP8_DTYPE if fp8 else self.dtype
        for layer in self.layers:
            a = layer.attention
            shape = (max_batch_size * max_seq_len, a.n_kv_heads, a.head_dim)
            a.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
            a.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
            a.k_scale = a.v_scale = None
            if fp8:  # one fp32 scale per slot and KV head (zeros: unwritten slots read as 0)
                a.k_scale = torch.zeros(shape[:2], dtype=torch.float32, device=self.device)
                a.v_scale = torch.zeros(shape[:2], dtype=torch.float32, device=self.device)
            a.cache_seq_len = max_seq_len

    def clear_cache(self) -> None:
        """Free the K/V caches; ``model(...)`` goes back to cache-free causal attention."""
        for layer in self.layers:
            a = layer.attention
            a.k_cache = a.v_cache = a.k_scale = a.v_scale = None
            a.cache_seq_len = 0
        self.max_batch_size = self.max_seq_len = 0

    # ----------------------------------------------------------------------- forwards
    def _step(self, tokens: torch.Tensor, start_pos: int) -> _Step:
        self._check_tokens(tokens)
        b, s = tokens.shape
        if not isinstance(start_pos, int) or start_pos < 0:
            raise ValueError(f"start_pos must be an int >= 0, got {start_pos!r}")
        pos = torch.arange(start_pos, start_pos + s, device=self.device)
        cos, sin = self._rope_tables(start_pos + s)
        step = _Step(b, s, pos.repeat(b), cos, sin)
        if self.max_seq_len:
            if b > self.max_batch_size or start_pos + s > self.max_seq_len:
                raise ValueError(
                    f"batch {b} x positions up to {start_pos + s} exceed the KV cache "
                    f"({self.max_batch_size} x {self.max_seq_len}); call setup_cache() larger"
                )
            rows = torch.arange(b, device=self.device)[:, None] * self.max_seq_len
            step.cache_slots = (rows + pos[None, :]).reshape(-1)
            step.key_len = start_pos + s
        return step

    # no_grad rather than inference_mode: callers may modify the returned logits in place.
    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        """fp32 logits ``[batch, seq, vocab]`` for ``tokens`` at positions ``start_pos ..``.

        With a KV cache (``setup_cache``) the new K/V are written at those positions and the
        queries attend, causally, to everything cached before them; without one, plain causal
        attention over ``tokens`` alone.
        """
        step = self._step(tokens, start_pos)
        delta, residual = self._trunk(tokens, step)
        return self._head(delta, residual).view(step.batch, step.seqlen, -1)

    @torch.no_grad()
    def forward_last(self, tokens: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        """Like ``forward`` but the LM head runs on the last position only: ``[batch, vocab]``
        (what Meta's LLaMA forward returns; used by generation)."""
        step = self._step(tokens, start_pos)
        delta, residual = self._trunk(tokens, step)
        last = torch.arange(step.batch, device=self.device) * step.seqlen + step.seqlen - 1
        return self._head(delta[last], residual[last])

    @torch.no_grad()
    def forward_packed(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        seq_start: torch.Tensor,
        span_end: torch.Tensor | None,
        logits_index: torch.Tensor,
        *,
        upcast: bool = True,
        prefix: PrefixPages | None = None,
        _cache_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Score a packed token stream: fp32 logits ``[N, vocab]`` at ``logits_index`` only
        (in the model's dtype with ``upcast=False``).

        All inputs but ``logits_index`` are 1-D ``[T]``: sequences back to back with no padding
        between them, each a token tree in depth-first order; ``seq_start[t]`` is the index of
        the first token of t's sequence and ``span_end[t]`` one past the last token of t's
        subtree (a token sees itself and its ancestors; None: every sequence a chain, plain
        causal attention; see ``kernels/packed_attention.py``). ``positions`` are each token's
        depth in its tree (plus the prefix length) as the caller lays them out (with
        ``args.sliding_window`` they also say which keys a token sees). The final norm
        and the LM head run on the N rows of ``logits_index`` only. The KV cache is not used.
        """
        if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError("tokens must be an int64/int32 tensor [T]")
        if tokens.dim() != 1 or tokens.shape[0] == 0:
            raise ValueError(f"tokens must have shape [T>0], got {tuple(tokens.shape)}")
        if tokens.device != self.device:
            raise ValueError(f"tokens are on {tokens.device}, the model on {self.device}")
        n = tokens.shape[0]
        named = [("positions", positions), ("seq_start", seq_start)]
        for name, t in named + ([("span_end", span_end)] if span_end is not None else []):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (n,):
                raise ValueError(f"{name} must be a tensor of shape ({n},)")
            if t.dtype not in (torch.int64, torch.int32):
                raise TypeError(f"{name} must be an int64/int32 tensor")
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}, the model on {self.device}")
        if not isinstance(logits_index, torch.Tensor) or logits_index.dim() != 1:
            raise ValueError("logits_index must be a 1-D integer tensor of token indices")
        if logits_index.dtype not in (torch.int64, torch.int32):
            raise TypeError("logits_index must be an int64/int32 tensor")
        # A position is a token's depth in its tree (< n) plus its prefix's length (at most the
        # prefix's pages); prefill continuing a row is covered by the generator, which grows the
        # tables to its rows' capacity first. Known on the host: no synchronisation.
        held = isinstance(prefix, PrefixPages)
        reach = n + (prefix.page_table.shape[1] * prefix.page_size if held else 0)
        cos, sin = self._rope_tables(reach)
        step = _Step(1, n, positions, cos, sin, packed=(seq_start, span_end))
        step.cache_slots = _cache_slots  # forward_prefill: K/V into the cache
        if prefix is not None:
            if not isinstance(prefix, PrefixPages):
                raise TypeError(f"prefix must be a PrefixPages, got {type(prefix).__name__}")
            if not self.max_seq_len or self.max_seq_len != prefix.page_size:
                raise ValueError(
                    "prefix pages live in the KV cache: setup_cache(n_pages, page_size) first"
                )
            step.prefix = prefix
        delta, residual = self._trunk(tokens, step)
        idx = logits_index.to(self.device)
        return self._head(delta.index_select(0, idx), residual.index_select(0, idx), upcast)

    @torch.no_grad()
    def forward_prefill(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        seq_start: torch.Tensor,
        cache_slots: torch.Tensor,
        logits_index: torch.Tensor,
        *,
        prefix: PrefixPages | None = None,
    ) -> torch.Tensor:
        """Prefill prompts packed back to back (``[T]`` each, as ``forward_packed`` with every
        sequence a chain) into the KV cache: token t's rotated K and its V go to cache slot
        ``cache_slots[t]`` (cache row r, position p: ``r * max_seq_len + p``). Returns logits
        ``[N, vocab]`` in the model's dtype at ``logits_index`` (each prompt's last token).
        Needs ``setup_cache``; each prompt attends to itself, and with ``prefix`` also to the
        cached prefix pages of its entry (a prompt whose shared prefix is already cached).
        """
        if not self.max_seq_len:
            raise ValueError("forward_prefill needs a KV cache: call setup_cache() first")
        n = tokens.shape[0] if isinstance(tokens, torch.Tensor) else 0
        if not isinstance(cache_slots, torch.Tensor) or tuple(cache_slots.shape) != (n,):
            raise ValueError(f"cache_slots must be a tensor of shape ({n},)")
        return self.forward_packed(
            tokens, positions, seq_start, None, logits_index, upcast=False,
            prefix=prefix, _cache_slots=cache_slots,
        )  # fmt: skip

    # ------------------------------------------------------------------ decode step
    def decode_path(self, batch: int, **kw) -> DecodePath:
        """The decode path of a step of ``batch`` rows (``DecodePath``'s keyword arguments);
        built by ``generation.step.DecodeStep``."""
        return DecodePath(self, batch, **kw)

    def forward_decode(
        self, h: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, d: DecodePath
    ) -> torch.Tensor:
        """One decode step's logits ``[B, vocab]`` (model dtype, rounded like Meta's
        ``output(h).float()``) for the embedded rows ``h`` [B, dim]: every layer's
        ``TransformerBlock.decode``, then the final RMSNorm + LM head. Static shapes, no host
        sync: ``generation/step.py`` captures it in a CUDA graph."""
        for layer in self.layers:
            h = layer.decode(h, slots, lens, d)
        logits, _ = d.normed(h, self.output, self.norm)
        if self.parallel.tp_size > 1:
            logits = gather_last_dim(logits, self.parallel)
        return logits
