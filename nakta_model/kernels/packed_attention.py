"""Attention over packed sequences with shared-context trees, read straight from the fused QKV.

The scoring engine lays a whole batch out as ONE flat stream of tokens: sequences back to back,
no padding between them. A sequence is a context followed by one or more branches (HellaSwag:
the four endings of one task behind one copy of its context). Each token carries two ints:

* ``seq_start[t]``: index of the first token of t's sequence (sequences are contiguous);
* ``branch[t]``: 0 for the shared context, k > 0 for branch k.

Query i may attend to key j iff they are in the same sequence, ``j <= i``, and j is context or
in i's own branch. With one branch per sequence this is plain causal attention per sequence
(varlen attention); ``seq_start`` of a pad token is its own index, so it attends to itself.

Why a kernel of our own: the alternative is a dense ``[B, L, L]`` additive bias through SDPA,
which picks cuDNN with a per-shape execution plan (milliseconds of host time per call, and a
new plan for every padded width) and needs the batch padded to rows. Here the mask is two int
loads per tile, Q/K/V are read in place from the ``wqkv`` output (no head transposes), the output
is written as ``[T, n_q * head_dim]`` ready for ``wo``, and a query block only visits the key
blocks from its first query's sequence start to its own end. Token counts are not specialised
on, so every batch size runs the same compiled kernel.

Forward only (inference). Math in fp32 (exp2 softmax, online rescaling); Q·K and P·V on the
tensor cores in the input dtype (fp32 inputs use IEEE fp32 dots, not tf32); output rounded once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nakta_model.kernels._checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_ndim,
    check_same_device,
    check_tensor,
    check_triton_device,
    interpreter_enabled,
)
from nakta_model.kernels._triton_math import round_to

__all__ = ["Rope", "packed_attention", "packed_attention_mask", "packed_attention_reference"]

INDEX_DTYPES = (torch.int32, torch.int64)

# ------------------------------------------------------------------------------------------------
# 1. Triton kernel
# ------------------------------------------------------------------------------------------------


@triton.jit
def _head_halves(
    ptr, rows, col0, mask_r, HALF: tl.constexpr, HALF_PAD: tl.constexpr, INTERLEAVED: tl.constexpr
):
    """The two members of every rotary pair of one head for a block of rows, ``[R, HALF_PAD]``
    each in the input dtype: Meta's adjacent pairs (2i, 2i+1) from one contiguous load split in
    registers, or HF's halves (i, i + HALF) from two loads. Padded pairs read as zeros."""
    if INTERLEAVED:
        offs = tl.arange(0, 2 * HALF_PAD)
        m = mask_r[:, None] & (offs < 2 * HALF)[None, :]
        x = tl.load(ptr + rows + col0 + offs[None, :], mask=m, other=0.0)
        a, b = tl.split(tl.reshape(x, (x.shape[0], HALF_PAD, 2)))
    else:
        offs = tl.arange(0, HALF_PAD)
        m = mask_r[:, None] & (offs < HALF)[None, :]
        a = tl.load(ptr + rows + col0 + offs[None, :], mask=m, other=0.0)
        b = tl.load(ptr + rows + col0 + HALF + offs[None, :], mask=m, other=0.0)
    return a, b


@triton.jit
def _rotated(
    a,
    b,
    pos,
    cos_ptr,
    sin_ptr,
    stride_c,
    n_pos,
    mask_r,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    """RoPE on pair members ``a``, ``b`` at positions ``pos``: fp32 math as ``kernels/rope.py``
    (``a cos - b sin``, ``b cos + a sin``), rounded back to the input dtype as its store does."""
    offs = tl.arange(0, HALF_PAD)
    ok = (pos >= 0) & (pos < n_pos)  # a position outside the table: NaN, never a stray read
    m = (mask_r & ok)[:, None] & (offs < HALF)[None, :]
    at = pos.to(tl.int64)[:, None] * stride_c + offs[None, :]
    c = tl.load(cos_ptr + at, mask=m, other=0.0)
    s = tl.load(sin_ptr + at, mask=m, other=0.0)
    c = tl.where(ok[:, None], c, float("nan"))
    af = a.to(tl.float32)
    bf = b.to(tl.float32)
    ya = round_to(af * c - bf * s, a.dtype, EMULATE_RNE)
    yb = round_to(bf * c + af * s, b.dtype, EMULATE_RNE)
    return ya, yb


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """``a @ b`` with fp32 accumulation; IEEE fp32 operands when asked (see the kernel)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit(do_not_specialize=["n_tokens"])
def _packed_attention_kernel(
    qkv_ptr,
    out_ptr,
    start_ptr,
    branch_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    n_tokens,
    stride_qt,
    stride_ot,
    stride_c,
    n_pos,
    qk_scale,
    N_Q: tl.constexpr,
    N_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROTATE: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    IEEE: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    """One program: BLOCK_M queries of one query head, over the key blocks they may see.

    ``ROTATE``: Q and K are read unrotated and RoPE is applied on load (positions + cos/sin
    tables), so the scorer needs no separate rope pass; scores are then the sum of the two pair
    members' dot products. ``IEEE``: fp32 operands and IEEE fp32 dots (fp32 inputs; also half
    inputs under the interpreter, whose half-precision dot is wrong -- half x half products are
    exact in fp32, so the result is what the tensor cores compute up to summation order)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // (N_Q // N_KV)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < n_tokens
    mask_d = offs_d < HEAD_DIM
    q_start = tl.load(start_ptr + offs_m, mask=mask_m, other=-1)
    q_branch = tl.load(branch_ptr + offs_m, mask=mask_m, other=-1)
    rows_m = offs_m.to(tl.int64)[:, None] * stride_qt
    if ROTATE:
        q_pos = tl.load(pos_ptr + offs_m, mask=mask_m, other=0)
        qa, qb = _head_halves(qkv_ptr, rows_m, head * HEAD_DIM, mask_m, HALF, HALF_PAD, INTERLEAVED)
        qa, qb = _rotated(
            qa, qb, q_pos, cos_ptr, sin_ptr, stride_c, n_pos, mask_m, HALF, HALF_PAD, EMULATE_RNE
        )
    else:
        q = tl.load(
            qkv_ptr + rows_m + head * HEAD_DIM + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        )
    k_col = (N_Q + kv_head) * HEAD_DIM
    v_col = (N_Q + N_KV + kv_head) * HEAD_DIM

    # Keys: from the first query's sequence start (sequences are contiguous, so it is the
    # smallest start in the block) to the block's last query.
    lo = tl.load(start_ptr + pid_m * BLOCK_M)
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.minimum((pid_m + 1) * BLOCK_M, n_tokens)

    # A finite "minus infinity" keeps rows whose first key blocks are all masked NaN-free.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n_tokens
        rows_n = offs_n.to(tl.int64)[:, None] * stride_qt
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k_start = tl.load(start_ptr + offs_n, mask=mask_n, other=-2)
        k_branch = tl.load(branch_ptr + offs_n, mask=mask_n, other=-2)
        if ROTATE:
            k_pos = tl.load(pos_ptr + offs_n, mask=mask_n, other=0)
            ka, kb = _head_halves(qkv_ptr, rows_n, k_col, mask_n, HALF, HALF_PAD, INTERLEAVED)
            ka, kb = _rotated(
                ka,
                kb,
                k_pos,
                cos_ptr,
                sin_ptr,
                stride_c,
                n_pos,
                mask_n,
                HALF,
                HALF_PAD,
                EMULATE_RNE,
            )
            s = _dot(qa, tl.trans(ka), IEEE) + _dot(qb, tl.trans(kb), IEEE)
        else:
            k = tl.load(qkv_ptr + rows_n + k_col + offs_d[None, :], mask=kv_mask, other=0.0)
            s = _dot(q, tl.trans(k), IEEE)
        allowed = (
            (offs_n[None, :] <= offs_m[:, None])
            & (k_start[None, :] == q_start[:, None])
            & ((k_branch[None, :] == 0) | (k_branch[None, :] == q_branch[:, None]))
        )
        s = tl.where(allowed, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(qkv_ptr + rows_n + v_col + offs_d[None, :], mask=kv_mask, other=0.0)
        p_in = round_to(p, v.dtype, EMULATE_RNE)  # P enters the P.V product in V's dtype
        acc = acc * alpha[:, None] + _dot(p_in, v, IEEE)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + offs_m.to(tl.int64)[:, None] * stride_ot + head * HEAD_DIM + offs_d[None, :],
        round_to(out, out_ptr.dtype.element_ty, EMULATE_RNE),
        mask=mask_m[:, None] & mask_d[None, :],
    )


# ------------------------------------------------------------------------------------------------
# 2. Launcher: checks and launch configuration
# ------------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, num_warps, num_stages) by head_dim bucket; ``_TUNE`` overrides (benchmarks).
_CONFIGS: dict[int, tuple[int, int, int, int]] = {
    16: (64, 32, 4, 2),
    32: (64, 32, 4, 2),
    64: (128, 32, 4, 3),
    128: (128, 32, 4, 3),  # H100 sweep (bench_attention --tune): 0.268 ms vs 0.426 at 128x64x8
    256: (64, 32, 8, 2),
}
_TUNE: dict[str, int] = {}


def _config(block_d: int, interpret: bool) -> tuple[int, int, int, int]:
    """Launch config for a padded head dim; small blocks under the interpreter (CPU tests)."""
    if interpret:
        return 16, 16, 1, 1
    bm, bn, warps, stages = _CONFIGS[min(max(block_d, 16), 256)]
    return (
        _TUNE.get("BLOCK_M", bm),
        _TUNE.get("BLOCK_N", bn),
        _TUNE.get("num_warps", warps),
        _TUNE.get("num_stages", stages),
    )


@dataclass(frozen=True)
class Rope:
    """RoPE applied on load: per-token ``positions [T]`` (int), fp32 ``cos`` / ``sin`` tables
    ``[max_pos, head_dim // 2]`` (``kernels.rope.build_rope_cache``), and the pairing:
    ``interleaved`` = Meta's adjacent pairs (2i, 2i+1), else HF's halves (i, i + head_dim/2)."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool = True


def _check_rope(rope: object, qkv: torch.Tensor, head_dim: int) -> None:
    if not isinstance(rope, Rope):
        raise TypeError(f"rope must be a packed_attention.Rope, got {type(rope).__name__}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even to rotate pairs, got {head_dim}")
    _check_index("rope.positions", rope.positions, qkv.shape[0])
    for name in ("cos", "sin"):
        t = check_tensor(f"rope.{name}", getattr(rope, name))
        check_dtype(f"rope.{name}", t, (torch.float32,))
        if t.dim() != 2 or t.shape[1] != head_dim // 2 or t.stride(1) != 1:
            raise ValueError(
                f"rope.{name} must be [max_pos, {head_dim // 2}] with unit column stride, "
                f"got {tuple(t.shape)} strides {t.stride()}"
            )
    if rope.cos.shape != rope.sin.shape or rope.cos.stride() != rope.sin.stride():
        raise ValueError("rope.cos and rope.sin must have the same shape and strides")
    check_same_device(qkv=qkv, positions=rope.positions, cos=rope.cos, sin=rope.sin)


def _check_index(name: str, t: object, n: int) -> torch.Tensor:
    t = check_tensor(name, t)
    check_dtype(name, t, INDEX_DTYPES)
    check_ndim(name, t, 1)
    if t.shape[0] != n:
        raise ValueError(f"{name} must have {n} entries (one per token), got {t.shape[0]}")
    if t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")
    return t


def _check_args(
    qkv: object,
    seq_start: object,
    branch: object,
    n_q: int,
    n_kv: int,
    head_dim: int,
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
) -> torch.Tensor:
    qkv = check_tensor("qkv", qkv)
    check_dtype("qkv", qkv, dtypes)
    check_ndim("qkv", qkv, 2)
    for name, v in (("n_q_heads", n_q), ("n_kv_heads", n_kv), ("head_dim", head_dim)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if n_q % n_kv:
        raise ValueError(f"n_q_heads ({n_q}) must be a multiple of n_kv_heads ({n_kv})")
    width = (n_q + 2 * n_kv) * head_dim
    if qkv.shape[1] != width:
        raise ValueError(
            f"qkv must have (n_q_heads + 2 n_kv_heads) * head_dim = {width} columns, "
            f"got shape {tuple(qkv.shape)}"
        )
    if qkv.stride(1) != 1 and qkv.shape[1] > 1:
        raise ValueError(f"qkv must be unit-stride along its columns, got strides {qkv.stride()}")
    n = qkv.shape[0]
    _check_index("seq_start", seq_start, n)
    _check_index("branch", branch, n)
    check_same_device(qkv=qkv, seq_start=seq_start, branch=branch)
    return qkv


def packed_attention(
    qkv: torch.Tensor,
    seq_start: torch.Tensor,
    branch: torch.Tensor,
    n_q_heads: int,
    n_kv_heads: int,
    head_dim: int,
    *,
    rope: Rope | None = None,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tree/varlen attention over a packed token stream (module docstring): ``[T, n_q * hd]``.

    ``qkv`` is ``[T, (n_q + 2 n_kv) * head_dim]`` (Q heads, then K heads, then V heads, as the
    fused ``wqkv`` projection writes them); ``seq_start`` / ``branch`` are int ``[T]``. With
    ``rope`` (positions and cos/sin tables, see :class:`Rope`) Q and K are rotated as they are
    read, exactly as ``kernels/rope.py`` would have rotated them in place (``qkv`` is left
    untouched); without it they are taken as already rotated. ``scale`` defaults to
    ``1 / sqrt(head_dim)``. Sequences must be contiguous with ``seq_start[t] <= t`` (not checked
    on the GPU: it would need a host sync); a position outside the tables gives NaN.
    """
    qkv = _check_args(qkv, seq_start, branch, n_q_heads, n_kv_heads, head_dim)
    check_triton_device("qkv", qkv)
    if rope is not None:
        _check_rope(rope, qkv, head_dim)
    n_tokens = qkv.shape[0]
    if out is None:
        out = torch.empty(n_tokens, n_q_heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    elif tuple(out.shape) != (n_tokens, n_q_heads * head_dim) or out.stride(1) != 1:
        raise ValueError(
            f"out must be [{n_tokens}, {n_q_heads * head_dim}] with unit column stride, "
            f"got {tuple(out.shape)} strides {out.stride()}"
        )
    if n_tokens == 0:
        return out
    interp = interpreter_enabled()
    if interp:
        _check_layout(seq_start)
    block_d = triton.next_power_of_2(max(head_dim, 16))
    block_m, block_n, num_warps, num_stages = _config(block_d, interp)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    grid = (triton.cdiv(n_tokens, block_m), n_q_heads)
    pos, cos, sin = (rope.positions, rope.cos, rope.sin) if rope else (seq_start, qkv, qkv)
    _packed_attention_kernel[grid](
        qkv, out, seq_start, branch, pos, cos, sin,
        n_tokens, qkv.stride(0), out.stride(0), cos.stride(0), cos.shape[0],
        scale * math.log2(math.e),
        N_Q=n_q_heads, N_KV=n_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
        HALF_PAD=triton.next_power_of_2(max(head_dim // 2, 16)),
        BLOCK_M=block_m, BLOCK_N=block_n, ROTATE=rope is not None,
        INTERLEAVED=bool(rope.interleaved) if rope else True,
        IEEE=qkv.dtype == torch.float32 or interp,
        EMULATE_RNE=interp, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def _check_layout(seq_start: torch.Tensor) -> None:
    """Contiguous sequences: ``seq_start`` non-decreasing, ``seq_start[t] <= t``, and each start
    is the index of a token that starts its own sequence (CPU/debug only: needs the values)."""
    s = seq_start.to("cpu", torch.int64)
    t = torch.arange(s.shape[0])
    if bool((s < 0).any()) or bool((s > t).any()):
        raise ValueError("seq_start[t] must lie in [0, t]")
    if s.shape[0] > 1 and bool((s[1:] < s[:-1]).any()):
        raise ValueError("seq_start must be non-decreasing (sequences are contiguous)")
    if bool((s[s] != s).any()):
        raise ValueError("seq_start must point at the first token of each sequence")


# ------------------------------------------------------------------------------------------------
# 3. Reference (CPU fallback and tests)
# ------------------------------------------------------------------------------------------------


def packed_attention_mask(
    seq_start: torch.Tensor, branch: torch.Tensor, rows: slice | None = None
) -> torch.Tensor:
    """Bool ``[T_rows, T]`` mask (True = may attend) of the packed layout, for queries ``rows``."""
    rows = rows or slice(0, seq_start.shape[0])
    qi = torch.arange(seq_start.shape[0], device=seq_start.device)[rows]
    kj = torch.arange(seq_start.shape[0], device=seq_start.device)
    qs, qb = seq_start[rows], branch[rows]
    return (
        (kj[None, :] <= qi[:, None])
        & (seq_start[None, :] == qs[:, None])
        & ((branch[None, :] == 0) | (branch[None, :] == qb[:, None]))
    )


def packed_attention_reference(
    qkv: torch.Tensor,
    seq_start: torch.Tensor,
    branch: torch.Tensor,
    n_q_heads: int,
    n_kv_heads: int,
    head_dim: int,
    *,
    rope: Rope | None = None,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch twin of :func:`packed_attention` (SDPA with a dense mask per query block;
    ``rope`` rotates a copy of Q/K with ``kernels.rope``'s reference); also takes fp64 (tests)."""
    import torch.nn.functional as F

    dtypes = (*FLOAT_DTYPES, torch.float64)
    qkv = _check_args(qkv, seq_start, branch, n_q_heads, n_kv_heads, head_dim, dtypes)
    _check_layout(seq_start)
    if rope is not None:
        from nakta_model.kernels.rope import apply_rope_qkv_reference

        _check_rope(rope, qkv, head_dim)
        qkv = qkv.clone()
        apply_rope_qkv_reference(
            qkv, rope.positions, rope.cos, rope.sin, n_q_heads, n_kv_heads, head_dim,
            interleaved=rope.interleaved,
        )  # fmt: skip
    n, hq, hkv, hd = qkv.shape[0], n_q_heads, n_kv_heads, head_dim
    if out is None:
        out = torch.empty(n, hq * hd, dtype=qkv.dtype, device=qkv.device)
    heads = qkv.view(n, hq + 2 * hkv, hd)
    q = heads[:, :hq].transpose(0, 1)
    k = heads[:, hq : hq + hkv].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    v = heads[:, hq + hkv :].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    block = 512  # bounds the mask to [512, T]; keys start at the block's first sequence
    for q0 in range(0, n, block):
        q1 = min(q0 + block, n)
        lo = int(seq_start[q0])
        mask = packed_attention_mask(seq_start, branch, slice(q0, q1))[:, lo:q1]
        o = F.scaled_dot_product_attention(
            q[:, q0:q1], k[:, lo:q1], v[:, lo:q1], attn_mask=mask, scale=scale
        )
        out[q0:q1] = o.transpose(0, 1).reshape(q1 - q0, hq * hd)
    return out
