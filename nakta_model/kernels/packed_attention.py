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

import torch
import triton
import triton.language as tl

from nakta_model.kernels._checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_index,
    check_ndim,
    check_positive_int,
    check_same_device,
    check_tensor,
    check_triton_device,
    interpreter_enabled,
)
from nakta_model.kernels._triton_math import round_to

__all__ = ["packed_attention", "packed_attention_mask", "packed_attention_reference"]

# ------------------------------------------------------------------------------------------------
# 1. Triton kernel
# ------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["n_tokens"])
def _packed_attention_kernel(
    QKV, OUT, START, BRANCH, n_tokens, stride_qt, stride_ot, qk_scale,
    N_Q: tl.constexpr, N_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, EMULATE_RNE: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_M queries of one query head, over the key blocks they may see.

    ``IEEE``: fp32 operands and IEEE fp32 dots (fp32 inputs; also half inputs under the
    interpreter, whose half-precision dot is wrong -- half x half products are exact in fp32,
    so the result is what the tensor cores compute up to summation order)."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // (N_Q // N_KV)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < n_tokens
    mask_d = offs_d < HEAD_DIM
    q_start = tl.load(START + offs_m, mask=mask_m, other=-1)
    q_branch = tl.load(BRANCH + offs_m, mask=mask_m, other=-1)
    rows_m = offs_m.to(tl.int64)[:, None] * stride_qt
    q = tl.load(
        QKV + rows_m + head * HEAD_DIM + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    k_col = (N_Q + kv_head) * HEAD_DIM
    v_col = (N_Q + N_KV + kv_head) * HEAD_DIM

    # Keys: from the first query's sequence start (sequences are contiguous, so it is the
    # smallest start in the block) to the block's last query.
    lo = tl.load(START + pid_m * BLOCK_M)
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
        k = tl.load(QKV + rows_n + k_col + offs_d[None, :], mask=kv_mask, other=0.0)
        k_start = tl.load(START + offs_n, mask=mask_n, other=-2)
        k_branch = tl.load(BRANCH + offs_n, mask=mask_n, other=-2)
        if IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
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
        v = tl.load(QKV + rows_n + v_col + offs_d[None, :], mask=kv_mask, other=0.0)
        p_in = round_to(p, v.dtype, EMULATE_RNE)  # P enters the P.V product in V's dtype
        if IEEE:
            pv = tl.dot(p_in.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p_in, v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        OUT + offs_m.to(tl.int64)[:, None] * stride_ot + head * HEAD_DIM + offs_d[None, :],
        round_to(out, OUT.dtype.element_ty, EMULATE_RNE),
        mask=mask_m[:, None] & mask_d[None, :],
    )


# ------------------------------------------------------------------------------------------------
# 2. Launch configuration, checks and launcher
# ------------------------------------------------------------------------------------------------

# Launch configurations by padded head dim; ``_TUNE`` overrides any key (set by
# ``kernel_benchmark/bench_attention.py --tune`` and the tests only).
_CONFIGS: dict[int, dict[str, int]] = {
    16: dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
    32: dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
    64: dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=3),
    # H100 sweep (bench_attention --tune): 0.268 ms vs 0.426 at 128x64x8
    128: dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=3),
    256: dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2),
}
_TUNE: dict[str, int] = {}
_INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1)  # CPU tests


def _config(block_d: int, interpret: bool) -> dict[str, int]:
    """The entry of a padded head dim, then ``_TUNE``; small blocks under the interpreter."""
    if interpret:
        return dict(_INTERPRETER_CONFIG)
    return {**_CONFIGS[min(max(block_d, 16), 256)], **_TUNE}


def _check_index(name: str, t: object, n: int) -> torch.Tensor:
    t = check_index(name, t, n)
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
        check_positive_int(name, v)
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
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tree/varlen attention over a packed token stream (module docstring): ``[T, n_q * hd]``.

    ``qkv`` is ``[T, (n_q + 2 n_kv) * head_dim]`` (Q heads, then K heads, then V heads, as the
    fused ``wqkv`` projection writes them, already rotated); ``seq_start`` / ``branch`` are int
    ``[T]``. ``scale`` defaults to ``1 / sqrt(head_dim)``. Sequences must be contiguous with
    ``seq_start[t] <= t`` (not checked on the GPU: it would need a host sync).
    """
    qkv = _check_args(qkv, seq_start, branch, n_q_heads, n_kv_heads, head_dim)
    check_triton_device("qkv", qkv)
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
    cfg = _config(block_d, interp)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    grid = (triton.cdiv(n_tokens, cfg["BLOCK_M"]), n_q_heads)
    _packed_attention_kernel[grid](
        qkv, out, seq_start, branch,
        n_tokens, qkv.stride(0), out.stride(0), scale * math.log2(math.e),
        N_Q=n_q_heads, N_KV=n_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], IEEE=qkv.dtype == torch.float32 or interp,
        EMULATE_RNE=interp, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
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
    seq_start: torch.Tensor,
    branch: torch.Tensor,
    rows: slice | None = None,
    keys: slice | None = None,
) -> torch.Tensor:
    """Bool ``[T_rows, T_keys]`` mask (True = may attend) of the packed layout, for queries
    ``rows`` and keys ``keys`` (default: all tokens)."""
    n = seq_start.shape[0]
    rows = rows or slice(0, n)
    keys = keys or slice(0, n)
    qi = torch.arange(n, device=seq_start.device)[rows]
    kj = torch.arange(n, device=seq_start.device)[keys]
    qs, qb = seq_start[rows], branch[rows]
    ks, kb = seq_start[keys], branch[keys]
    return (
        (kj[None, :] <= qi[:, None])
        & (ks[None, :] == qs[:, None])
        & ((kb[None, :] == 0) | (kb[None, :] == qb[:, None]))
    )


def packed_attention_reference(
    qkv: torch.Tensor,
    seq_start: torch.Tensor,
    branch: torch.Tensor,
    n_q_heads: int,
    n_kv_heads: int,
    head_dim: int,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch twin of :func:`packed_attention` (SDPA with a dense mask per query block);
    also takes fp64 (tests)."""
    import torch.nn.functional as F

    dtypes = (*FLOAT_DTYPES, torch.float64)
    qkv = _check_args(qkv, seq_start, branch, n_q_heads, n_kv_heads, head_dim, dtypes)
    _check_layout(seq_start)
    n, hq, hkv, hd = qkv.shape[0], n_q_heads, n_kv_heads, head_dim
    if out is None:
        out = torch.empty(n, hq * hd, dtype=qkv.dtype, device=qkv.device)
    heads = qkv.view(n, hq + 2 * hkv, hd)
    q = heads[:, :hq].transpose(0, 1)
    k = heads[:, hq : hq + hkv].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    v = heads[:, hq + hkv :].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    block = 256  # the mask is [256, keys of the block's sequences]: no [T, T] work
    for q0 in range(0, n, block):
        q1 = min(q0 + block, n)
        lo = int(seq_start[q0])
        mask = packed_attention_mask(seq_start, branch, slice(q0, q1), slice(lo, q1))
        o = F.scaled_dot_product_attention(
            q[:, q0:q1], k[:, lo:q1], v[:, lo:q1], attn_mask=mask, scale=scale
        )
        out[q0:q1] = o.transpose(0, 1).reshape(q1 - q0, hq * hd)
    return out
