"""``decode_linear``'s argument types and input checks (``RopeArgs``; the tensors, shapes,
dtypes, devices and aliasing a launch needs), kept apart so that the launcher file stays
readable; ``decode_linear`` re-exports them and ``step_gemm`` uses the checks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nakta_model.kernels._checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_index,
    check_ndim,
    check_no_overlap,
    check_positive_int,
    check_range,
    check_same_device,
    check_tensor,
    check_triton_device,
    debug_checks,
    tracing,
)
from nakta_model.kernels.fp8_quant import FP8_DTYPE

MAX_BATCH = 64


@dataclass(frozen=True)
class RopeArgs:
    """What the ROPE epilogue needs: per-row positions and cache slots, the fp32 cos/sin tables
    (``build_rope_cache``), the head layout of ``wqkv`` and the caches to write K/V into."""

    positions: torch.Tensor  # int [B]
    cos: torch.Tensor  # fp32 [max_pos, head_dim // 2]
    sin: torch.Tensor  # fp32 [max_pos, head_dim // 2]
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    k_cache: torch.Tensor  # [slots, n_kv_heads, head_dim]
    v_cache: torch.Tensor  # [slots, n_kv_heads, head_dim]
    cache_slots: torch.Tensor  # int [B]


def _check_matrix(
    name: str, t: object, dtype: torch.dtype | tuple[torch.dtype, ...] | None = None
) -> torch.Tensor:
    """A 2-D float tensor with a unit-stride last dimension (rows may have any stride)."""
    t = check_tensor(name, t)
    allowed = FLOAT_DTYPES if dtype is None else dtype if isinstance(dtype, tuple) else (dtype,)
    check_dtype(name, t, allowed)
    check_ndim(name, t, 2)
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must be unit-stride along its last dimension, got {t.stride()}")
    return t


def _check_rope(rope: object, x: torch.Tensor, weight: torch.Tensor) -> RopeArgs:
    if not isinstance(rope, RopeArgs):
        raise TypeError(f"rope must be a RopeArgs, got {type(rope).__name__}")
    r = rope
    for name in ("n_q_heads", "n_kv_heads", "head_dim"):
        check_positive_int(f"rope.{name}", getattr(r, name))
    if r.head_dim % 2:
        raise ValueError(f"rope.head_dim must be even (Meta's pairs), got {r.head_dim}")
    if r.n_q_heads % r.n_kv_heads:
        raise ValueError(
            f"rope.n_kv_heads ({r.n_kv_heads}) must divide rope.n_q_heads ({r.n_q_heads})"
        )
    width = (r.n_q_heads + 2 * r.n_kv_heads) * r.head_dim
    if weight.shape[0] != width:
        raise ValueError(
            f"weight must be wqkv with (n_q_heads + 2 * n_kv_heads) * head_dim = {width} rows "
            f"for rope, got shape {tuple(weight.shape)}"
        )
    batch = x.shape[0]
    check_index("rope.positions", r.positions, batch, per="batch row")
    check_index("rope.cache_slots", r.cache_slots, batch, per="batch row")
    for name in ("cos", "sin"):
        t = check_tensor(f"rope.{name}", getattr(r, name))
        check_dtype(f"rope.{name}", t, (torch.float32,))
        check_ndim(f"rope.{name}", t, 2)
        if t.shape[1] != r.head_dim // 2 or t.shape[0] < 1:
            raise ValueError(
                f"rope.{name} must have shape [max_pos, head_dim // 2 = {r.head_dim // 2}], "
                f"got {tuple(t.shape)}"
            )
    if r.cos.shape != r.sin.shape:
        raise ValueError(
            f"rope.cos and rope.sin must have the same shape, got {tuple(r.cos.shape)} "
            f"and {tuple(r.sin.shape)}"
        )
    for name in ("k_cache", "v_cache"):
        c = check_tensor(f"rope.{name}", getattr(r, name))
        check_ndim(f"rope.{name}", c, 3)
        if c.shape[1:] != (r.n_kv_heads, r.head_dim):
            raise ValueError(
                f"rope.{name} must have shape [slots, n_kv_heads={r.n_kv_heads}, "
                f"head_dim={r.head_dim}], got {tuple(c.shape)}"
            )
        if c.dtype != x.dtype:
            raise TypeError(f"rope.{name} must have x's dtype {x.dtype}, got {c.dtype}")
        if c.stride(2) != 1:
            raise ValueError(
                f"rope.{name} must be unit-stride in its last dimension, got {c.stride()}"
            )
    if not tracing() and r.k_cache.data_ptr() == r.v_cache.data_ptr():
        raise ValueError("rope.k_cache and rope.v_cache must be different tensors")
    return r


def _check_weight_scale(weight: torch.Tensor, weight_scale: object) -> None:
    """``weight_scale`` is required iff ``weight`` is FP8 (e4m3): fp32 ``[N]``, one per row."""
    if weight.dtype != FP8_DTYPE:
        if weight_scale is not None:
            raise ValueError(
                f"weight_scale is only for an FP8 (float8_e4m3fn) weight, got a {weight.dtype} "
                "weight; drop weight_scale or pass the quantized weight"
            )
        return
    if weight_scale is None:
        raise ValueError(
            "weight is FP8 (float8_e4m3fn): pass weight_scale, its fp32 [N] per-row scales"
        )
    check_tensor("weight_scale", weight_scale)
    check_dtype("weight_scale", weight_scale, (torch.float32,))
    if weight_scale.shape != (weight.shape[0],):
        raise ValueError(
            f"weight_scale must have shape [{weight.shape[0]}] (one per weight row), "
            f"got {tuple(weight_scale.shape)}"
        )


def _check_args(
    x, weight, norm_weight, eps, residual, swiglu, rope, out, out_dtype, *, for_kernel: bool,
    weight_scale=None, max_rows: int = MAX_BATCH,
) -> torch.dtype:  # fmt: skip
    """Validate a ``decode_linear`` call (or, with ``max_rows``, the decode step's GEMM path,
    ``generation/step_gemm.py``, which takes the same arguments); returns the output dtype."""
    x = _check_matrix("x", x)
    weight = _check_matrix("weight", weight, (x.dtype, FP8_DTYPE))
    _check_weight_scale(weight, weight_scale)
    batch, k = x.shape
    if not 1 <= batch <= max_rows:
        raise ValueError(f"x must have 1..{max_rows} rows (decode batch), got {batch}")
    if k < 1 or weight.shape[1] != k:
        raise ValueError(
            f"weight must have shape [N, K={k}] (nn.Linear layout), got {tuple(weight.shape)}"
        )
    if weight.shape[0] < 1:
        raise ValueError(f"weight must have at least one row, got shape {tuple(weight.shape)}")
    if not isinstance(swiglu, bool):
        raise TypeError(f"swiglu must be a bool, got {type(swiglu).__name__}")
    if sum([residual is not None, swiglu, rope is not None]) > 1:
        raise ValueError("residual, swiglu and rope are exclusive epilogues: give at most one")
    if norm_weight is not None:
        norm_weight = check_tensor("norm_weight", norm_weight)
        check_dtype("norm_weight", norm_weight, (x.dtype,))
        if norm_weight.dim() != 1 or norm_weight.shape[0] != k:
            raise ValueError(f"norm_weight must have shape [{k}], got {tuple(norm_weight.shape)}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(f"eps must be a positive float with norm_weight, got {eps!r}")
    elif eps is not None:
        raise ValueError("eps is only used with norm_weight; pass norm_weight or drop eps")
    if swiglu and weight.shape[0] % 2:
        raise ValueError(
            f"swiglu needs the fused w13 weight with an even number of rows [2F, K], "
            f"got shape {tuple(weight.shape)}"
        )
    if rope is not None:
        rope = _check_rope(rope, x, weight)
        n_out = rope.n_q_heads * rope.head_dim
    else:
        n_out = weight.shape[0] // 2 if swiglu else weight.shape[0]
    if out_dtype not in (None, x.dtype, torch.float32):
        raise TypeError(f"out_dtype must be None, x's dtype or torch.float32, got {out_dtype}")
    out_dtype = out_dtype or x.dtype
    if out_dtype != x.dtype and (residual is not None or swiglu or rope is not None):
        raise ValueError(
            "out_dtype=torch.float32 is for logits: only without residual, swiglu and rope"
        )
    if residual is not None:
        residual = _check_matrix("residual", residual, x.dtype)
        if residual.shape != (batch, n_out):
            raise ValueError(
                f"residual must have shape {(batch, n_out)}, got {tuple(residual.shape)}"
            )
    if out is not None:
        out = _check_matrix("out", out, out_dtype)
        if out.shape != (batch, n_out):
            raise ValueError(f"out must have shape {(batch, n_out)}, got {tuple(out.shape)}")
    tensors = dict(x=x, weight=weight, weight_scale=weight_scale, norm_weight=norm_weight,
                   residual=residual, out=out)  # fmt: skip
    if rope is not None:
        tensors |= {f"rope.{f}": getattr(rope, f) for f in
                    ("positions", "cos", "sin", "k_cache", "v_cache", "cache_slots")}  # fmt: skip
    check_same_device(**tensors)
    _check_no_aliasing(x, weight, norm_weight, residual, rope, out, weight_scale)
    if rope is not None and (not x.is_cuda or debug_checks() or not for_kernel):
        check_range("rope.positions", rope.positions, rope.cos.shape[0], "the cos/sin rows")
        n_slots = min(rope.k_cache.shape[0], rope.v_cache.shape[0])
        check_range("rope.cache_slots", rope.cache_slots, n_slots, "the cache's slots")
    if for_kernel:
        check_triton_device("x", x)
    return out_dtype


def _check_no_aliasing(x, weight, norm_weight, residual, rope, out, weight_scale=None) -> None:
    """Every program reads all of x (and the norm weight): writes must not land there. ``out``
    may be ``residual`` itself (each element is read, then written, by one program)."""
    reads = dict(x=x, weight=weight, norm_weight=norm_weight, weight_scale=weight_scale)
    writes = {"out": out}
    if rope is not None:
        writes |= {"rope.k_cache": rope.k_cache, "rope.v_cache": rope.v_cache}
    for wname, w in writes.items():
        if w is None:
            continue
        for rname, r in reads.items():
            if r is not None:
                check_no_overlap(wname, w, rname, r)
    if out is not None and residual is not None and not tracing():
        same = out.data_ptr() == residual.data_ptr() and out.stride() == residual.stride()
        if not same:
            check_no_overlap("out", out, "residual", residual)
