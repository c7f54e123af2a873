"""Attention paths, all through ``F.scaled_dot_product_attention`` (flash / efficient kernels).

* causal prefill (queries == keys): ``is_causal=True``, no mask -> the flash kernel;
* decode (one query over the KV cache): no mask at all;
* continuation (queries are a suffix of the keys, e.g. a prompt appended to a cache): causal
  aligned bottom-right, i.e. query ``i`` sees keys ``0 .. start + i``;
* scoring with an arbitrary boolean mask (shared-context trees): an additive bias built ONCE per
  batch by :func:`attention_bias` and reused by every layer.

Shapes follow SDPA: ``q [b, hq, s, d]``, ``k``/``v`` ``[b, hkv, t, d]`` with ``hq % hkv == 0``.
Views with a unit last stride are fine; nothing here copies q/k/v except to expand GQA heads
for a masked call (the efficient kernel has no GQA support on every torch version we run).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["attention_bias", "causal_attention", "masked_attention"]

_MASK_ALIGN = 16  # mem-efficient SDPA wants the bias row stride to be a multiple of 16 elements


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-D [batch, heads, seq, head_dim], got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head_dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})"
        )
    return q.shape[1] // k.shape[1]


def _expand_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[b, hkv, t, d] -> [b, hkv * n_rep, t, d], query head h reading KV head h // n_rep."""
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention where the ``s`` queries are the LAST ``s`` of the ``t`` keys."""
    n_rep = _check_heads(q, k, v)
    s, t = q.shape[2], k.shape[2]
    if s > t:
        raise ValueError(f"more queries ({s}) than keys ({t}): queries must be a suffix of keys")
    gqa = n_rep > 1
    if s == t:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if s == 1:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    # Bottom-right aligned causal mask (SDPA's is_causal is top-left aligned).
    rows = torch.arange(s, device=q.device)[:, None] + (t - s)
    mask = torch.arange(t, device=q.device)[None, :] <= rows
    return F.scaled_dot_product_attention(q, _expand_kv(k, n_rep), _expand_kv(v, n_rep), mask)


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean ``[B, L, L]`` (True = may attend) -> additive bias ``[B, 1, L, L]`` in ``dtype``.

    Built once per batch and shared by all layers. The row stride is padded to a multiple of 16
    elements so the mem-efficient kernel takes it as is (no per-layer pad/convert copies).
    A row that may attend to nothing (padding) is allowed its own position, so it stays finite
    instead of turning into NaN; such rows are never scored.
    """
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError("attn_mask must be a torch.bool tensor (True = may attend)")
    if mask.dim() != 3 or mask.shape[1] != mask.shape[2]:
        raise ValueError(f"attn_mask must have shape [B, L, L], got {tuple(mask.shape)}")
    b, length, _ = mask.shape
    empty = ~mask.any(dim=-1)  # [B, L]
    diag = torch.eye(length, dtype=torch.bool, device=mask.device)
    mask = mask | (diag & empty[:, :, None])
    padded = -(-length // _MASK_ALIGN) * _MASK_ALIGN
    bias = torch.full((b, 1, length, padded), float("-inf"), dtype=dtype, device=mask.device)
    bias = bias[..., :length]
    bias.masked_fill_(mask[:, None], 0.0)
    return bias


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """Attention with an additive bias from :func:`attention_bias` (broadcast over heads)."""
    n_rep = _check_heads(q, k, v)
    if bias.dtype != q.dtype:
        raise TypeError(f"bias dtype {bias.dtype} must match q dtype {q.dtype}")
    return F.scaled_dot_product_attention(
        q, _expand_kv(k, n_rep), _expand_kv(v, n_rep), attn_mask=bias
    )
