"""The LLaMA Transformer as Meta's ``llama/model.py`` defines it (fairscale model parallel).

This is the reference Nakta is checked against, so it keeps Meta's structure and numerics:
fairscale ``ColumnParallelLinear`` / ``RowParallelLinear`` / ``ParallelEmbedding``, rotary
embedding as complex multiplication on adjacent pairs, RMSNorm computed in fp32 then cast back
before ``* weight``, a preallocated KV cache, attention softmax in fp32. Llama-2 additions are
supported when ``params.json`` has them (``n_kv_heads`` with ``repeat_kv``,
``ffn_dim_multiplier``, ``rope_theta``).

Deviations from LLaMA-1, each needed and none changing the numbers:
* ``Transformer.forward`` returns float logits for ALL positions ``[b, s, vocab]`` (as Llama-2
  does); LLaMA-1 returned only the last position, but scoring needs every position.
* The KV cache lives on the device the model is built on (Meta called ``.cuda()``).
* The causal mask is ``full(-inf).triu(start_pos + 1)`` as LLaMA-1 writes it, but with
  ``start_pos + seqlen`` columns so that a multi-token chunk after a cached prefix is masked
  correctly (LLaMA-1's ``seqlen x seqlen`` mask only ever met ``start_pos == 0``). For
  ``start_pos == 0`` it is Meta's mask exactly.
* Inputs are checked (token shape, batch size, cache length) with clear errors instead of
  asserts or CUDA index errors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import fairscale.nn.model_parallel.initialize as fs_init
import torch
import torch.nn.functional as F
from fairscale.nn.model_parallel.layers import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
)
from torch import nn


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # Llama-2 GQA; None = multi-head attention (LLaMA-1)
    vocab_size: int = -1  # defined later by the tokenizer
    multiple_of: int = 256  # SwiGLU hidden size is a multiple of this
    ffn_dim_multiplier: float | None = None  # Llama-2 70B
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0  # CodeLlama / Llama-2 long-context checkpoints set it

    max_batch_size: int = 32
    max_seq_len: int = 2048


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics, back to the input dtype, THEN the weight (Meta's order of roundings).
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    """complex64 ``[end, dim // 2]``: e^(i * pos * theta^(-2j/dim)) for each rotated pair j."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    ndim = x.ndim
    if freqs_cis.shape != (x.shape[1], x.shape[-1]):
        raise ValueError(
            f"freqs_cis has shape {tuple(freqs_cis.shape)}, expected {(x.shape[1], x.shape[-1])}"
        )
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate adjacent pairs (x[2j], x[2j+1]) as complex numbers, in fp32, cast back."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """torch.repeat_interleave(x, dim=2, repeats=n_rep): KV head h serves query heads h*n_rep.."""
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        x[:, :, :, None, :]
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        model_parallel_size = fs_init.get_model_parallel_world_size()
        self.n_local_heads = args.n_heads // model_parallel_size
        self.n_local_kv_heads = self.n_kv_heads // model_parallel_size
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        self.head_dim = args.dim // args.n_heads

        self.wq = ColumnParallelLinear(
            args.dim,
            args.n_heads * self.head_dim,
            bias=False,
            gather_output=False,
            init_method=lambda x: x,
        )
        self.wk = ColumnParallelLinear(
            args.dim,
            self.n_kv_heads * self.head_dim,
            bias=False,
            gather_output=False,
            init_method=lambda x: x,
        )
        self.wv = ColumnParallelLinear(
            args.dim,
            self.n_kv_heads * self.head_dim,
            bias=False,
            gather_output=False,
            init_method=lambda x: x,
        )
        self.wo = RowParallelLinear(
            args.n_heads * self.head_dim,
            args.dim,
            bias=False,
            input_is_parallel=True,
            init_method=lambda x: x,
        )

        # Preallocated KV cache, created on the default device/dtype of construction (the
        # model's device; Meta wrote `.cuda()` here). Plain attributes, as in Meta's code.
        cache_shape = (args.max_batch_size, args.max_seq_len, self.n_local_kv_heads, self.head_dim)
        self.cache_k = torch.zeros(cache_shape)
        self.cache_v = torch.zeros(cache_shape)

    def forward(
        self,
        x: torch.Tensor,
        start_pos: int,
        freqs_cis: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)

        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)

        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)

        self.cache_k = self.cache_k.to(xq)
        self.cache_v = self.cache_v.to(xq)

        self.cache_k[:bsz, start_pos : start_pos + seqlen] = xk
        self.cache_v[:bsz, start_pos : start_pos + seqlen] = xv

        keys = self.cache_k[:bsz, : start_pos + seqlen]
        values = self.cache_v[:bsz, : start_pos + seqlen]

        # repeat k/v heads if n_kv_heads < n_heads
        keys = repeat_kv(keys, self.n_rep)  # (bs, cache_len + seqlen, n_local_heads, head_dim)
        values = repeat_kv(values, self.n_rep)

        xq = xq.transpose(1, 2)  # (bs, n_local_heads, seqlen, head_dim)
        keys = keys.transpose(1, 2)
        values = values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask  # (bs, n_local_heads, seqlen, cache_len + seqlen)
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values)  # (bs, n_local_heads, seqlen, head_dim)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        multiple_of: int,
        ffn_dim_multiplier: float | None = None,
    ):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        if ffn_dim_multiplier is not None:
            hidden_dim = int(ffn_dim_multiplier * hidden_dim)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)

        self.w1 = ColumnParallelLinear(
            dim, hidden_dim, bias=False, gather_output=False, init_method=lambda x: x
        )
        self.w2 = RowParallelLinear(
            hidden_dim, dim, bias=False, input_is_parallel=True, init_method=lambda x: x
        )
        self.w3 = ColumnParallelLinear(
            dim, hidden_dim, bias=False, gather_output=False, init_method=lambda x: x
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.dim = args.dim
        self.head_dim = args.dim // args.n_heads
        self.attention = Attention(args)
        self.feed_forward = FeedForward(
            dim=args.dim,
            hidden_dim=4 * args.dim,
            multiple_of=args.multiple_of,
            ffn_dim_multiplier=args.ffn_dim_multiplier,
        )
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        start_pos: int,
        freqs_cis: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        h = x + self.attention.forward(self.attention_norm(x), start_pos, freqs_cis, mask)
        out = h + self.feed_forward.forward(self.ffn_norm(h))
        return out


def check_model_args(args: ModelArgs) -> None:
    """Shapes Meta's layers need, as clear errors (Meta relied on asserts deep inside)."""
    mp = fs_init.get_model_parallel_world_size()
    n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
    if args.vocab_size <= 0:
        raise ValueError(f"ModelArgs.vocab_size must be positive, got {args.vocab_size}")
    if args.dim % args.n_heads or (args.dim // args.n_heads) % 2:
        raise ValueError(
            f"ModelArgs.dim={args.dim} must split into n_heads={args.n_heads} heads of even size"
        )
    if args.n_heads % n_kv_heads:
        raise ValueError(f"n_heads={args.n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
    for name, value in (("n_heads", args.n_heads), ("n_kv_heads", n_kv_heads), ("dim", args.dim)):
        if value % mp:
            raise ValueError(f"{name}={value} is not divisible by the model-parallel size {mp}")
    if args.vocab_size % mp:
        raise ValueError(f"vocab_size={args.vocab_size} is not divisible by model-parallel {mp}")
    if args.max_batch_size < 1 or args.max_seq_len < 1:
        raise ValueError(
            f"max_batch_size and max_seq_len must be >= 1, got "
            f"{args.max_batch_size} and {args.max_seq_len}"
        )


class Transformer(nn.Module):
    def __init__(self, params: ModelArgs):
        super().__init__()
        check_model_args(params)
        self.params = params
        self.vocab_size = params.vocab_size
        self.n_layers = params.n_layers

        self.tok_embeddings = ParallelEmbedding(
            params.vocab_size, params.dim, init_method=lambda x: x
        )

        self.layers = torch.nn.ModuleList()
        for layer_id in range(params.n_layers):
            self.layers.append(TransformerBlock(layer_id, params))

        self.norm = RMSNorm(params.dim, eps=params.norm_eps)
        self.output = ColumnParallelLinear(
            params.dim, params.vocab_size, bias=False, init_method=lambda x: x
        )

        self.freqs_cis = precompute_freqs_cis(
            self.params.dim // self.params.n_heads,
            self.params.max_seq_len * 2,
            self.params.rope_theta,
        )

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Float logits ``[bsz, seqlen, vocab]`` for every position of ``tokens``.

        ``tokens`` continue the sequences whose first ``start_pos`` positions are in the cache.
        """
        self._check_forward_inputs(tokens, start_pos)
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        self.freqs_cis = self.freqs_cis.to(h.device)
        freqs_cis = self.freqs_cis[start_pos : start_pos + seqlen]

        mask = None
        if seqlen > 1:
            mask = torch.full((1, 1, seqlen, start_pos + seqlen), float("-inf"), device=h.device)
            mask = torch.triu(mask, diagonal=start_pos + 1).type_as(h)

        for layer in self.layers:
            h = layer(h, start_pos, freqs_cis, mask)
        h = self.norm(h)
        output = self.output(h)  # all positions (LLaMA-1: h[:, -1, :] only)
        return output.float()

    def _check_forward_inputs(self, tokens: torch.Tensor, start_pos: int) -> None:
        if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.long, torch.int):
            raise TypeError(
                f"tokens must be an int64/int32 tensor, got "
                f"{getattr(tokens, 'dtype', type(tokens).__name__)}"
            )
        if tokens.ndim != 2 or tokens.shape[1] < 1:
            raise ValueError(f"tokens must have shape [bsz, seqlen>=1], got {tuple(tokens.shape)}")
        if tokens.shape[0] > self.params.max_batch_size:
            raise ValueError(
                f"tokens has batch {tokens.shape[0]} > max_batch_size={self.params.max_batch_size}"
            )
        if not isinstance(start_pos, int) or start_pos < 0:
            raise ValueError(f"start_pos must be a non-negative int, got {start_pos!r}")
        if start_pos + tokens.shape[1] > self.params.max_seq_len:
            raise ValueError(
                f"start_pos + seqlen = {start_pos + tokens.shape[1]} exceeds "
                f"max_seq_len={self.params.max_seq_len} (the KV cache length)"
            )
