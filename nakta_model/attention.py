"""Attention paths, all through ``F.scaled_dot_product_attention`` (flash / efficient kernels).

* causal prefill (queries == keys): ``is_causal=True``, no mask -> the flash kernel;
* decode (one query over the KV cache): no mask at all;
* continuation (queries are a suffix of the keys, e.g. a prompt appended to a cache): causal
  aligned bottom-right, i.e. query ``i`` sees keys ``0 .. start + i``;
* sliding window (Mistral, ``window``): query at position p also sees only keys at positions
  above ``p - window`` (transformers' convention); keys below every query's window are sliced
  off before the call, the rest masked.

Scoring (packed sequences with shared-context trees) has its own Triton kernel:
``kernels/packed_attention.py``.

Shapes follow SDPA: ``q [b, hq, s, d]``, ``k``/``v`` ``[b, hkv, t, d]`` with ``hq % hkv == 0``.
Views with a unit last stride are fine; nothing here copies q/k/v except to expand GQA heads
for the bottom-right masked call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_attention"]


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


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """Causal attention where the ``s`` queries are the LAST ``s`` of the ``t`` keys; with
    ``window``, query ``i`` sees only the ``window`` keys ending at its own."""
    n_rep = _check_heads(q, k, v)
    s, t = q.shape[2], k.shape[2]
    if s > t:
        raise ValueError(f"more queries ({s}) than keys ({t}): queries must be a suffix of keys")
    if window is not None:
        return _windowed(q, k, v, window, n_rep)
    gqa = n_rep > 1
    if s == t:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if s == 1:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    # Bottom-right aligned causal mask (SDPA's is_causal is top-left aligned).
    rows = torch.arange(s, device=q.device)[:, None] + (t - s)
    mask = torch.arange(t, device=q.device)[None, :] <= rows
    return F.scaled_dot_product_attention(q, _expand_kv(k, n_rep), _expand_kv(v, n_rep), mask)


def _windowed(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, n_rep: int
) -> torch.Tensor:
    """``causal_attention`` with a sliding window: the keys no query sees are dropped first."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int, got {window!r}")
    s, t = q.shape[2], k.shape[2]
    lo = max(0, t - s - window + 1)  # the first query's first visible key
    k, v = k[:, :, lo:], v[:, :, lo:]
    t -= lo
    if s == 1:  # one query: every key left is inside its window
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=n_rep > 1)
    rows = torch.arange(s, device=q.device)[:, None] + (t - s)
    cols = torch.arange(t, device=q.device)[None, :]
    mask = (cols <= rows) & (rows - cols < window)
    return F.scaled_dot_product_attention(q, _expand_kv(k, n_rep), _expand_kv(v, n_rep), mask)
