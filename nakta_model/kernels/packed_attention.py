"""Attention over packed sequences with token trees, read straight from the fused QKV.

The scoring engine lays a whole batch out as ONE flat stream of tokens: sequences back to back,
no padding between them. A sequence is a tree of tokens laid out depth first: a context, then
the continuations that follow it (HellaSwag: the four endings of one task behind one copy of its
context), themselves a trie where endings share their first tokens ("the man", "the woman").
Each token carries two ints:

* ``seq_start[t]``: index of the first token of t's sequence (sequences are contiguous);
* ``span_end[t]``: one past the last token of t's subtree (depth-first order keeps a subtree
  contiguous): the tokens that descend from t, and t itself, are ``[t, span_end[t])``.

Query i may attend to key j iff they are in the same sequence and ``j <= i < span_end[j]``: j is
i itself or one of its ancestors. A context token's span is the rest of its sequence; a chain
of tokens (``span_end`` = the sequence's end everywhere) is plain causal attention, and
``span_end=None`` means exactly that (varlen attention, prefill); ``seq_start`` of a pad token
is its own index, so it attends to itself.

Sliding-window attention (Mistral, ``window``): key j is also masked unless it lies less than
``window`` positions before query i (``positions[i] - positions[j] < window``, positions as the
model rotates them: a tree token's depth, plus its cached prefix's length). Key tiles below
every query's window are not visited at all: the key loop starts at the block's lowest first
visible key, and the prefix loop at its lowest first visible prefix position.

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
    INDEX_DTYPES,
    check_dtype,
    check_index,
    check_ndim,
    check_positive_int,
    check_same_device,
    check_tensor,
    check_triton_device,
    debug_checks,
    interpreter_enabled,
)
from nakta_model.kernels._triton_math import round_to
from nakta_model.kernels.fp8_quant import FP8_DTYPE

__all__ = [
    "PREFIX_ALIGN",
    "PrefixKV",
    "packed_attention",
    "packed_attention_mask",
    "packed_attention_reference",
]

# ------------------------------------------------------------------------------------------------
# 1. Triton kernel
# ------------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """``a @ b`` in fp32: IEEE fp32 operands, or the inputs' dtype on the tensor cores."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _softmax_tile(m_i, l_i, s):
    """One key tile of online softmax (scores ``s`` scaled, masked keys -inf): the new running
    max and sum, the tile's probabilities and the old output's rescale factor."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, 1), p, alpha


@triton.jit
def _pv(p, v, IEEE: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """``P @ V`` with P rounded to V's dtype first (it enters the product in that dtype)."""
    return _dot(round_to(p, v.dtype, EMULATE_RNE), v, IEEE)


# Neither the token count nor the page table's row stride (the token count again when there
# is no prefix) is specialised on: one compile per constexpr set, whatever the batch's size.
@triton.jit(do_not_specialize=["n_tokens", "stride_table"])
def _packed_attention_kernel(
    QKV, OUT, START, END, ENTRY, TABLE, PLEN, PK, PV,
    n_tokens, stride_qt, stride_ot, stride_table, stride_pks, stride_pkh, stride_pvs, stride_pvh,
    qk_scale, POS,
    N_Q: tl.constexpr, N_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, HAS_PREFIX: tl.constexpr,
    TREE: tl.constexpr, SKIP: tl.constexpr, IEEE: tl.constexpr, EMULATE_RNE: tl.constexpr,
    WINDOW: tl.constexpr = 0, PKS=None, PVS=None, stride_pkss=0, stride_pvss=0,
    KV_FP8: tl.constexpr = False,
):  # fmt: skip
    """One program: BLOCK_M queries of one query head, over the key blocks they may see.

    ``TREE``: keys also masked by their subtree (``END``: ``span_end``); else causal per
    sequence. ``HAS_PREFIX``: first, the cached prefix of the block's first query (``ENTRY``: an
    index into the page table, -1 for none): its ``plen`` keys, read page by page from the K/V
    pool, visible to every query of the block with the same entry. ``IEEE``: fp32 operands and
    IEEE fp32 dots (fp32 inputs; also half inputs under the interpreter, whose half-precision
    dot is wrong -- half x half products are exact in fp32, so the result is what the tensor
    cores compute up to summation order). ``WINDOW`` (0: none; a constexpr, so no window
    compiles to the kernel without one): key j (prefix key p: position p) is also masked
    unless ``POS[i] - POS[j] < WINDOW``, and the key loops start at the first tile a query of
    the block may see (a token's depth ``POS - plen`` is at most its offset in its sequence,
    so no visible key lies below ``seq_start + depth - WINDOW + 1``). ``KV_FP8``: the prefix
    pool holds e4m3 codes with fp32 scales per (slot, KV head) at ``PKS``/``PVS`` (unit stride
    along the heads): codes widened to qkv's dtype (exact), K's scale applied to the scores,
    V's to the probabilities of the P @ V product, in fp32."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // (N_Q // N_KV)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < n_tokens
    mask_d = offs_d < HEAD_DIM
    q_start = tl.load(START + offs_m, mask=mask_m, other=-1)
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
    plen = 0
    if WINDOW > 0:
        q_pos = tl.load(POS + offs_m, mask=mask_m, other=0)
    if HAS_PREFIX:
        entry = tl.load(ENTRY + pid_m * BLOCK_M)
        q_entry = tl.load(ENTRY + offs_m, mask=mask_m, other=-1)
        plen = tl.load(PLEN + tl.maximum(entry, 0))
        plen = tl.where(entry >= 0, plen, 0)
        p_lo = 0
        if WINDOW > 0:  # prefix keys below every query's window: not visited
            p_lo = tl.min(tl.where(mask_m, q_pos - WINDOW + 1, plen), 0)
            p_lo = (tl.maximum(p_lo, 0) // BLOCK_N) * BLOCK_N
        for p0 in range(p_lo, plen, BLOCK_N):
            offs_p = p0 + tl.arange(0, BLOCK_N)
            valid = offs_p < plen
            page = tl.load(TABLE + entry.to(tl.int64) * stride_table + offs_p // PAGE,
                           mask=valid, other=0)  # fmt: skip
            slot1 = page.to(tl.int64) * PAGE + offs_p % PAGE
            slot = slot1[:, None]
            pmask = valid[:, None] & mask_d[None, :]
            k = tl.load(PK + slot * stride_pks + kv_head * stride_pkh + offs_d[None, :],
                        mask=pmask, other=0.0)  # fmt: skip
            if KV_FP8:
                ks = tl.load(PKS + slot1 * stride_pkss + kv_head, mask=valid, other=0.0)
                vs = tl.load(PVS + slot1 * stride_pvss + kv_head, mask=valid, other=0.0)
                s = _dot(q, tl.trans(k.to(QKV.dtype.element_ty)), IEEE) * ks[None, :]
            else:
                s = _dot(q, tl.trans(k), IEEE)
            seen = (q_entry == entry)[:, None] & valid[None, :]
            if WINDOW > 0:
                seen = seen & ((q_pos[:, None] - offs_p[None, :]) < WINDOW)
            s = tl.where(seen, s * qk_scale, float("-inf"))
            m_i, l_i, p, alpha = _softmax_tile(m_i, l_i, s)
            v = tl.load(PV + slot * stride_pvs + kv_head * stride_pvh + offs_d[None, :],
                        mask=pmask, other=0.0)  # fmt: skip
            if KV_FP8:
                v = v.to(QKV.dtype.element_ty)
                p = p * vs[None, :]
            acc = acc * alpha[:, None] + _pv(p, v, IEEE, EMULATE_RNE)
    if WINDOW > 0:  # the first key any query of the block may see (docstring)
        depth = tl.where(mask_m, q_pos - plen, 0)
        lo = tl.min(tl.where(mask_m, q_start + tl.maximum(depth - WINDOW + 1, 0), hi), 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    q_first = pid_m * BLOCK_M
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n_tokens
        k_start = tl.load(START + offs_n, mask=mask_n, other=-2)
        allowed = (offs_n[None, :] <= offs_m[:, None]) & (k_start[None, :] == q_start[:, None])
        if WINDOW > 0:
            k_pos = tl.load(POS + offs_n, mask=mask_n, other=0)
            allowed = allowed & ((q_pos[:, None] - k_pos[None, :]) < WINDOW)
        visit = True
        kv_mask = mask_n[:, None] & mask_d[None, :]
        if TREE:  # j is i or an ancestor: i inside j's subtree
            k_end = tl.load(END + offs_n, mask=mask_n, other=0)
            allowed = allowed & (offs_m[:, None] < k_end[None, :])
            # SKIP: a block of other branches' keys (every subtree ends before this query
            # block; merged trees put whole subtrees between a query and its ancestors) is
            # skipped by a branch (1) or by the loads' mask (2). Off by default (0): a load
            # under a branch is not software-pipelined, and on the scorer's own batches that
            # cost more than the skipped blocks (``bench_attention --tune-scoring``; the A/B:
            # docs/experiments.md)
            if SKIP == 1:
                visit = tl.max(k_end, 0) > q_first
            elif SKIP == 2:
                kv_mask = kv_mask & (tl.max(k_end, 0) > q_first)
        if visit:
            rows_n = offs_n.to(tl.int64)[:, None] * stride_qt
            k = tl.load(QKV + rows_n + k_col + offs_d[None, :], mask=kv_mask, other=0.0)
            s = _dot(q, tl.trans(k), IEEE)
            s = tl.where(allowed, s * qk_scale, float("-inf"))
            m_i, l_i, p, alpha = _softmax_tile(m_i, l_i, s)
            v = tl.load(QKV + rows_n + v_col + offs_d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + _pv(p, v, IEEE, EMULATE_RNE)
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
    16: dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2, SKIP=0),
    32: dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2, SKIP=0),
    64: dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=3, SKIP=0),
    # the best of ``bench_attention --tune`` on an H100 and of ``--tune-scoring`` (18 configs x
    # 3 SKIP modes) on an H200
    128: dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=3, SKIP=0),
    256: dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2, SKIP=0),
}
_TUNE: dict[str, int] = {}
_INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1, SKIP=0)  # CPU


def _config(block_d: int, interpret: bool) -> dict[str, int]:
    """The entry of a padded head dim, then ``_TUNE``; small blocks under the interpreter."""
    if interpret:
        return dict(_INTERPRETER_CONFIG)
    return {**_CONFIGS[min(max(block_d, 16), 256)], **_TUNE}


PREFIX_ALIGN = 128  # a multiple of every BLOCK_M: query blocks never straddle two prefixes


@dataclass(frozen=True)
class PrefixKV:
    """Cached prefixes (their K/V computed once, e.g. a few-shot prompt shared by many
    questions) that packed tokens attend to before their own sequence.

    ``k_pool`` / ``v_pool`` ``[slots, n_kv, head_dim]`` hold K/V by slot; ``page_table``
    ``[n_entries, max_pages]`` (int) lists each prefix's pages (slot = page * ``page_size`` + i),
    ``lengths [n_entries]`` its token count, and ``token_entry [T]`` the prefix of each packed
    token (-1: none). e4m3 pools (``kv_cache="fp8"``) come with ``k_scale``/``v_scale``, fp32
    ``[slots, n_kv]``: slot s of head h stands for ``codes * scale[s, h]``. A token at
    position p of its sequence sits after its prefix: the caller
    gives it position ``length + p``. Layout rule (the scorer keeps it): tokens with different
    entries never share a ``PREFIX_ALIGN``-aligned block of the stream.
    """

    k_pool: torch.Tensor
    v_pool: torch.Tensor
    page_table: torch.Tensor
    lengths: torch.Tensor
    token_entry: torch.Tensor
    page_size: int
    k_scale: torch.Tensor | None = None  # e4m3 pools (kv_cache="fp8"): fp32 [slots, n_kv]
    v_scale: torch.Tensor | None = None


def _check_prefix(prefix: object, qkv: torch.Tensor, n_kv: int, head_dim: int, block_n: int):
    if not isinstance(prefix, PrefixKV):
        raise TypeError(f"prefix must be a PrefixKV, got {type(prefix).__name__}")
    for name in ("k_pool", "v_pool"):
        t = check_tensor(f"prefix.{name}", getattr(prefix, name))
        if t.dtype not in (qkv.dtype, FP8_DTYPE):
            raise TypeError(
                f"prefix.{name} must have qkv's dtype {qkv.dtype} or {FP8_DTYPE}, got {t.dtype}"
            )
        if t.dim() != 3 or t.shape[1:] != (n_kv, head_dim) or t.stride(2) != 1:
            raise ValueError(
                f"prefix.{name} must be [slots, {n_kv}, {head_dim}] with unit last stride, "
                f"got {tuple(t.shape)} strides {t.stride()}"
            )
    _check_prefix_scales(prefix, n_kv)
    table = check_tensor("prefix.page_table", prefix.page_table)
    check_dtype("prefix.page_table", table, INDEX_DTYPES)
    check_ndim("prefix.page_table", table, 2)
    if table.stride(1) != 1:
        raise ValueError("prefix.page_table must be unit-stride along its columns")
    lengths = _check_index("prefix.lengths", prefix.lengths, table.shape[0])
    _check_index("prefix.token_entry", prefix.token_entry, qkv.shape[0])
    ps = prefix.page_size
    if isinstance(ps, bool) or not isinstance(ps, int) or ps < 1 or ps % block_n:
        raise ValueError(f"prefix.page_size must be a positive multiple of {block_n}, got {ps!r}")
    check_same_device(
        qkv=qkv, k_pool=prefix.k_pool, v_pool=prefix.v_pool, page_table=table,
        lengths=lengths, token_entry=prefix.token_entry,
    )  # fmt: skip


def _check_prefix_scales(prefix: PrefixKV, n_kv: int) -> None:
    """e4m3 pools (both or neither) with fp32 scales ``[slots, n_kv]``; others with none."""
    if prefix.k_pool.dtype != prefix.v_pool.dtype:
        raise TypeError(
            f"prefix.k_pool and prefix.v_pool must have one dtype, got {prefix.k_pool.dtype} "
            f"and {prefix.v_pool.dtype}"
        )
    if prefix.k_pool.dtype != FP8_DTYPE:
        if prefix.k_scale is not None or prefix.v_scale is not None:
            raise ValueError("prefix.k_scale and prefix.v_scale go with e4m3 pools")
        return
    for name, pool in (("k_scale", prefix.k_pool), ("v_scale", prefix.v_pool)):
        sc = getattr(prefix, name)
        if sc is None:
            raise ValueError(f"e4m3 pools need prefix.{name} (fp32 [slots, {n_kv}])")
        check_tensor(f"prefix.{name}", sc)
        check_dtype(f"prefix.{name}", sc, (torch.float32,))
        if sc.shape != (pool.shape[0], n_kv) or sc.stride(1) != 1 or sc.device != pool.device:
            raise ValueError(
                f"prefix.{name} must be fp32 [slots={pool.shape[0]}, {n_kv}] on the pool's "
                f"device, unit-stride along the heads, got {tuple(sc.shape)} strides "
                f"{sc.stride()} on {sc.device}"
            )


def _check_prefix_layout(prefix: PrefixKV, block_m: int) -> None:
    """CPU/debug: every block of ``block_m`` tokens has one entry; entries and pages in range."""
    entry = prefix.token_entry.to("cpu", torch.int64)
    n = entry.shape[0]
    padded = torch.cat([entry, entry[-1:].expand(-n % block_m)]) if n else entry
    blocks = padded.view(-1, block_m)
    if bool((blocks != blocks[:, :1]).any()):
        raise ValueError(
            f"prefix.token_entry changes inside a block of {block_m} tokens: keep each prefix's "
            f"tokens in their own {PREFIX_ALIGN}-aligned segment"
        )
    n_entries = prefix.page_table.shape[0]
    if n and (int(entry.max()) >= n_entries or int(entry.min()) < -1):
        raise ValueError(f"prefix.token_entry must lie in [-1, {n_entries})")
    lengths = prefix.lengths.to("cpu", torch.int64)
    need = -(-lengths // prefix.page_size)
    if bool((lengths < 0).any()) or bool((need > prefix.page_table.shape[1]).any()):
        raise ValueError("prefix.lengths must be >= 0 and fit in the page table's columns")
    slots = prefix.k_pool.shape[0] // prefix.page_size
    for e in range(n_entries):
        pages = prefix.page_table[e, : int(need[e])].to("cpu", torch.int64)
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= slots):
            raise ValueError(f"prefix.page_table[{e}] holds a page outside [0, {slots})")


def _check_index(name: str, t: object, n: int) -> torch.Tensor:
    t = check_index(name, t, n)
    if t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")
    return t


def _check_args(
    qkv: object,
    seq_start: object,
    span_end: object,
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
    check_same_device(qkv=qkv, seq_start=seq_start)
    if span_end is not None:
        _check_index("span_end", span_end, n)
        check_same_device(qkv=qkv, span_end=span_end)
    return qkv


def packed_attention(
    qkv: torch.Tensor,
    seq_start: torch.Tensor,
    span_end: torch.Tensor | None,
    n_q_heads: int,
    n_kv_heads: int,
    head_dim: int,
    *,
    prefix: PrefixKV | None = None,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tree/varlen attention over a packed token stream (module docstring): ``[T, n_q * hd]``.

    ``qkv`` is ``[T, (n_q + 2 n_kv) * head_dim]`` (Q heads, then K heads, then V heads, as the
    fused ``wqkv`` projection writes them, already rotated); ``seq_start`` / ``span_end`` are
    int ``[T]`` (``span_end`` None: causal within each sequence); ``prefix`` adds cached
    prefixes each token also attends to (:class:`PrefixKV`). ``scale`` defaults to
    ``1 / sqrt(head_dim)``. Sequences must be contiguous with ``seq_start[t] <= t`` and
    ``t < span_end[t] <=`` the end of t's sequence (not checked on the GPU: it would need a host
    sync).

    ``window`` (sliding-window attention, Mistral): query i also sees only the keys j with
    ``positions[i] - positions[j] < window``, a cached prefix's key p having position p;
    ``positions`` (int ``[T]``, needed with a window) are each token's depth in its tree plus
    its prefix's length, as the model rotates them. ``None``: no window (the kernel compiles
    without it).
    """
    qkv = _check_args(qkv, seq_start, span_end, n_q_heads, n_kv_heads, head_dim)
    window = _check_window(window, positions, qkv)
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
    block_d = triton.next_power_of_2(max(head_dim, 16))
    cfg = _config(block_d, interp)
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if prefix is not None:
        _check_prefix(prefix, qkv, n_kv_heads, head_dim, block_n)
    if interp or debug_checks():
        _check_layout(seq_start, span_end)
        if prefix is not None:
            _check_prefix_layout(prefix, block_m)
        if window:
            _check_positions(positions, seq_start, prefix)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    grid = (triton.cdiv(n_tokens, block_m), n_q_heads)
    if prefix is None:  # unused pointers: any tensor of the right kind
        entry, table, lengths, pk, pv, page = seq_start, seq_start[None], seq_start, qkv, qkv, 1
        pk_strides = pv_strides = (0, 0)
    else:
        entry, table, lengths = prefix.token_entry, prefix.page_table, prefix.lengths
        pk, pv, page = prefix.k_pool, prefix.v_pool, prefix.page_size
        pk_strides, pv_strides = pk.stride()[:2], pv.stride()[:2]
    fp8_args = {}
    if prefix is not None and prefix.k_pool.dtype == FP8_DTYPE:
        fp8_args = dict(
            PKS=prefix.k_scale, PVS=prefix.v_scale, stride_pkss=prefix.k_scale.stride(0),
            stride_pvss=prefix.v_scale.stride(0), KV_FP8=True,
        )  # fmt: skip
    _packed_attention_kernel[grid](
        qkv, out, seq_start, seq_start if span_end is None else span_end, entry, table, lengths,
        pk, pv,
        n_tokens, qkv.stride(0), out.stride(0), table.stride(0), *pk_strides, *pv_strides,
        scale * math.log2(math.e), seq_start if positions is None else positions,
        N_Q=n_q_heads, N_KV=n_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=block_m, BLOCK_N=block_n, PAGE=page, HAS_PREFIX=prefix is not None,
        TREE=span_end is not None, SKIP=cfg["SKIP"], IEEE=qkv.dtype == torch.float32 or interp,
        EMULATE_RNE=interp, WINDOW=window, **fp8_args,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


def _check_window(window: object, positions: object, qkv: torch.Tensor) -> int:
    """``window`` as an int (0: none); ``positions`` checked when a window needs them."""
    if window is None:
        return 0
    check_positive_int("window", window)
    if positions is None:
        raise ValueError("window needs positions (each token's position, int [T])")
    _check_index("positions", positions, qkv.shape[0])
    check_same_device(qkv=qkv, positions=positions)
    return int(window)


def _check_positions(
    positions: torch.Tensor, seq_start: torch.Tensor, prefix: PrefixKV | None
) -> None:
    """CPU/debug: a token's depth (position minus its prefix's length) is at most its offset
    in its sequence, which the window's loop bound relies on."""
    pos = positions.to("cpu", torch.int64)
    depth = torch.arange(pos.shape[0]) - seq_start.to("cpu", torch.int64)
    if prefix is not None:
        entry = prefix.token_entry.to("cpu", torch.int64)
        plen = prefix.lengths.to("cpu", torch.int64)[entry.clamp(min=0)]
        pos = pos - torch.where(entry >= 0, plen, 0)
    if bool((pos > depth).any()):
        t = int((pos > depth).nonzero()[0, 0])
        raise ValueError(
            f"positions[{t}] = {int(positions[t])} is past its depth in its sequence ({int(depth[t])})"
            " plus its prefix's length: positions must count from the sequence's start"
        )


def _check_layout(seq_start: torch.Tensor, span_end: torch.Tensor | None = None) -> None:
    """Contiguous sequences: ``seq_start`` non-decreasing, ``seq_start[t] <= t``, and each start
    is the index of a token that starts its own sequence; every span inside its sequence and
    holding its own token (CPU/debug only: needs the values)."""
    s = seq_start.to("cpu", torch.int64)
    t = torch.arange(s.shape[0])
    if bool((s < 0).any()) or bool((s > t).any()):
        raise ValueError("seq_start[t] must lie in [0, t]")
    if s.shape[0] > 1 and bool((s[1:] < s[:-1]).any()):
        raise ValueError("seq_start must be non-decreasing (sequences are contiguous)")
    if bool((s[s] != s).any()):
        raise ValueError("seq_start must point at the first token of each sequence")
    if span_end is not None:
        e = span_end.to("cpu", torch.int64)
        if bool((e <= t).any()) or bool((e > _sequence_ends(s)).any()):
            raise ValueError("span_end[t] must lie in (t, end of t's sequence]")


def _sequence_ends(seq_start: torch.Tensor) -> torch.Tensor:
    """One past the last token of each token's sequence (``seq_start`` on the CPU)."""
    n = seq_start.shape[0]
    starts = torch.unique_consecutive(seq_start)
    ends = torch.cat([starts[1:], torch.tensor([n])])
    return ends[torch.searchsorted(starts, seq_start)]


# ------------------------------------------------------------------------------------------------
# 3. Reference (CPU fallback and tests)
# ------------------------------------------------------------------------------------------------


def packed_attention_mask(
    seq_start: torch.Tensor,
    span_end: torch.Tensor | None,
    rows: slice | None = None,
    keys: slice | None = None,
    *,
    window: int | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool ``[T_rows, T_keys]`` mask (True = may attend) of the packed layout, for queries
    ``rows`` and keys ``keys`` (default: all tokens); with ``window``, only keys whose
    ``positions`` lie less than ``window`` before the query's."""
    n = seq_start.shape[0]
    rows = rows or slice(0, n)
    keys = keys or slice(0, n)
    qi = torch.arange(n, device=seq_start.device)[rows]
    kj = torch.arange(n, device=seq_start.device)[keys]
    mask = (kj[None, :] <= qi[:, None]) & (seq_start[keys][None, :] == seq_start[rows][:, None])
    if span_end is not None:
        mask &= qi[:, None] < span_end[keys][None, :]
    if window is not None:
        pos = positions.long()
        mask &= (pos[rows][:, None] - pos[keys][None, :]) < window
    return mask


def packed_attention_reference(
    qkv: torch.Tensor,
    seq_start: torch.Tensor,
    span_end: torch.Tensor | None,
    n_q_heads: int,
    n_kv_heads: int,
    head_dim: int,
    *,
    prefix: PrefixKV | None = None,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch twin of :func:`packed_attention` (SDPA with a dense mask per query block;
    with ``prefix``, the block's prefix K/V gathered from the pool in front of its keys); also
    takes fp64 (tests)."""
    import torch.nn.functional as F

    dtypes = (*FLOAT_DTYPES, torch.float64)
    qkv = _check_args(qkv, seq_start, span_end, n_q_heads, n_kv_heads, head_dim, dtypes)
    window = _check_window(window, positions, qkv) or None
    _check_layout(seq_start, span_end)
    if prefix is not None:
        _check_prefix(prefix, qkv, n_kv_heads, head_dim, 1)
        _check_prefix_layout(prefix, PREFIX_ALIGN)
    if window is not None:
        _check_positions(positions, seq_start, prefix)
    n, hq, hkv, hd = qkv.shape[0], n_q_heads, n_kv_heads, head_dim
    if out is None:
        out = torch.empty(n, hq * hd, dtype=qkv.dtype, device=qkv.device)
    rep = hq // hkv
    heads = qkv.view(n, hq + 2 * hkv, hd)
    q = heads[:, :hq].transpose(0, 1)
    k = heads[:, hq : hq + hkv].repeat_interleave(rep, dim=1).transpose(0, 1)
    v = heads[:, hq + hkv :].repeat_interleave(rep, dim=1).transpose(0, 1)
    block = 256 if prefix is None else PREFIX_ALIGN  # one prefix per block
    for q0 in range(0, n, block):
        q1 = min(q0 + block, n)
        lo = int(seq_start[q0])
        mask = packed_attention_mask(
            seq_start, span_end, slice(q0, q1), slice(lo, q1), window=window, positions=positions
        )
        keys, values = k[:, lo:q1], v[:, lo:q1]
        if prefix is not None and int(prefix.token_entry[q0]) >= 0:
            pk, pv = _gather_prefix(prefix, int(prefix.token_entry[q0]))
            pk = pk.to(qkv.dtype).repeat_interleave(rep, dim=1).transpose(0, 1)
            pv = pv.to(qkv.dtype).repeat_interleave(rep, dim=1).transpose(0, 1)
            keys, values = torch.cat([pk, keys], 1), torch.cat([pv, values], 1)
            seen = torch.ones(q1 - q0, pk.shape[1], dtype=torch.bool, device=mask.device)
            if window is not None:  # prefix key p sits at position p
                p = torch.arange(pk.shape[1], device=mask.device)
                seen = (positions[q0:q1].long()[:, None] - p[None, :]) < window
            mask = torch.cat([seen, mask], 1)
        o = F.scaled_dot_product_attention(q[:, q0:q1], keys, values, attn_mask=mask, scale=scale)
        out[q0:q1] = o.transpose(0, 1).reshape(q1 - q0, hq * hd)
    return out


def _gather_prefix(prefix: PrefixKV, entry: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Entry ``entry``'s K and V, ``[length, n_kv, head_dim]`` each, from the pools."""
    length = int(prefix.lengths[entry])
    pages = prefix.page_table[entry, : -(-length // prefix.page_size)].long()
    within = torch.arange(prefix.page_size, device=pages.device)
    slots = (pages[:, None] * prefix.page_size + within[None, :]).reshape(-1)[:length]
    if prefix.k_pool.dtype == FP8_DTYPE:  # dequantized: codes * scale, fp32
        return (
            prefix.k_pool[slots].float() * prefix.k_scale[slots][..., None],
            prefix.v_pool[slots].float() * prefix.v_scale[slots][..., None],
        )
    return prefix.k_pool[slots], prefix.v_pool[slots]
