"""Rotary position embedding (RoPE): a TransformerEngine-compatible API and the model's fused path.

Two families live here because they share the rotation math:

* ``apply_rotary_pos_emb`` / ``RotaryPositionEmbedding``: same arguments and semantics as
  NVIDIA TransformerEngine's functions of these names (sbhd / bshd / packed thd, any strides,
  partial rotary, ``start_positions``, context-parallel dual-chunk layout), so TE's test calls
  run unchanged against it (only ``fused`` defaults to True here). Angles come in as ``freqs``;
  sin/cos are computed in-kernel once per position per program and reused across the batch
  block and all heads the program walks (all heads unless the grid is too small to fill the GPU);
  a small batch takes several positions per program, and each program's first data loads are in
  flight before that angle work starts.
* ``apply_rope_qkv_``: the model's path. It rotates the Q and K heads of a fused ``wqkv``
  projection output IN PLACE in one launch (V untouched), reading per-token positions and a
  precomputed cos/sin table (``build_rope_cache``); optionally the same launch writes the
  rotated K and the V of every token into the KV cache.

Both run math in fp32 and store in the caller's dtype. Backward of a rotation by angle theta is
the rotation by -theta; the kernels take a ``BACKWARD`` flag instead of a second kernel.
"""

from __future__ import annotations

import os

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

INDEX_DTYPES = (torch.int32, torch.int64)


# ------------------------------------------------------------------------------------------------
# 1. Triton kernels
# ------------------------------------------------------------------------------------------------


@triton.jit
def _load_pairs(
    ptrs_base,
    stride_c,
    mask_row,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    JOINT: tl.constexpr,
):
    """Load the rotary channels of a block of rows as the two members of each pair, in fp32.

    ``ptrs_base`` is a pointer tensor ``[R0, R1, 1]`` at channel 0 of each row. Interleaved
    pairs are (2i, 2i+1): one contiguous load split in registers keeps the loads vectorized.
    Non-interleaved pairs are (i, i + HALF): two contiguous loads, or with ``JOINT`` one
    ``[2, HALF_PAD]`` load transposed and split in registers (fewer, wider memory requests).
    """
    if INTERLEAVED:
        offs = tl.arange(0, 2 * HALF_PAD)
        m = mask_row & (offs < 2 * HALF)[None, None, :]
        x = tl.load(ptrs_base + offs[None, None, :] * stride_c, mask=m, other=0.0)
        x = x.to(tl.float32)
        x = tl.reshape(x, (x.shape[0], x.shape[1], HALF_PAD, 2))
        xa, xb = tl.split(x)
    elif JOINT:  # one [2, HALF_PAD] load per row, split in registers
        i = tl.arange(0, HALF_PAD)
        offs = tl.arange(0, 2)[:, None] * HALF + i[None, :]
        m = mask_row[:, :, :, None] & (i < HALF)[None, None, None, :]
        x = tl.load(ptrs_base[:, :, :, None] + offs[None, None, :, :] * stride_c, mask=m, other=0.0)
        x = tl.permute(x.to(tl.float32), (0, 1, 3, 2))
        xa, xb = tl.split(x)
    else:
        offs = tl.arange(0, HALF_PAD)
        m = mask_row & (offs < HALF)[None, None, :]
        xa = tl.load(ptrs_base + offs[None, None, :] * stride_c, mask=m, other=0.0)
        xb = tl.load(ptrs_base + (offs + HALF)[None, None, :] * stride_c, mask=m, other=0.0)
        xa = xa.to(tl.float32)
        xb = xb.to(tl.float32)
    return xa, xb


@triton.jit
def _store_pairs(
    ptrs_base,
    ya,
    yb,
    mask_row,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    JOINT: tl.constexpr,
):
    """Store the two pair members back to unit-stride channels (the inverse of ``_load_pairs``)."""
    dtype = ptrs_base.dtype.element_ty
    if INTERLEAVED:
        offs = tl.arange(0, 2 * HALF_PAD)
        m = mask_row & (offs < 2 * HALF)[None, None, :]
        y = tl.join(ya, yb)
        y = tl.reshape(y, (ya.shape[0], ya.shape[1], 2 * HALF_PAD))
        tl.store(ptrs_base + offs[None, None, :], y.to(dtype), mask=m)
    elif JOINT:
        i = tl.arange(0, HALF_PAD)
        offs = tl.arange(0, 2)[:, None] * HALF + i[None, :]
        m = mask_row[:, :, :, None] & (i < HALF)[None, None, None, :]
        y = tl.permute(tl.join(ya, yb), (0, 1, 3, 2))
        tl.store(ptrs_base[:, :, :, None] + offs[None, None, :, :], y.to(dtype), mask=m)
    else:
        offs = tl.arange(0, HALF_PAD)
        m = mask_row & (offs < HALF)[None, None, :]
        tl.store(ptrs_base + offs[None, None, :], ya.to(dtype), mask=m)
        tl.store(ptrs_base + (offs + HALF)[None, None, :], yb.to(dtype), mask=m)


@triton.jit
def _rotate(xa, xb, cos_a, sin_a, cos_b, sin_b, BACKWARD: tl.constexpr):
    """Forward: ya = xa cos_a - xb sin_a, yb = xb cos_b + xa sin_b (TE's per-channel angles).

    Backward is the transpose: dxa = dya cos_a + dyb sin_b, dxb = dyb cos_b - dya sin_a.
    With equal angles in both members (every real table) this is the rotation by -theta.
    """
    if BACKWARD:
        ya = xa * cos_a + xb * sin_b
        yb = xb * cos_b - xa * sin_a
    else:
        ya = xa * cos_a - xb * sin_a
        yb = xb * cos_b + xa * sin_b
    return ya, yb


# The row/token count is not specialised on: every batch size runs one compiled kernel.
@triton.jit(do_not_specialize=["n_tokens"])
def _rope_qkv_kernel(
    x_ptr,
    out_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    n_tokens,
    n_heads_launch,
    n_q,
    n_kv,
    n_pos,
    n_slots,
    stride_xt,
    stride_xc,
    stride_ot,
    stride_cp,
    stride_cc,
    stride_sp,
    stride_sc,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PASS: tl.constexpr,
    PASS_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    JOINT: tl.constexpr,
    BACKWARD: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    COPY_ALL: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEADS_FASTEST: tl.constexpr,
):
    """One program: BLOCK_T tokens x BLOCK_H heads of the fused QKV matrix.

    Heads [0, n_q) are Q, [n_q, n_q + n_kv) K (both rotated), the rest V (copied only when
    writing the cache or producing a separate output). An out-of-range position or cache slot
    turns that token's rotated values into NaN instead of reading or writing out of bounds:
    a loud failure without a host synchronisation.
    """
    if HEADS_FASTEST:  # 1-D grid, head blocks fastest: programs in flight stream whole rows
        n_h_blocks = tl.cdiv(n_heads_launch, BLOCK_H)
        pid_t = tl.program_id(0) // n_h_blocks
        pid_h = tl.program_id(0) % n_h_blocks
    else:
        pid_t = tl.program_id(0)
        pid_h = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_t = offs_t < n_tokens
    mask_h = offs_h < n_heads_launch

    pos = tl.load(pos_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
    ok = (pos >= 0) & (pos < n_pos)
    if WRITE_CACHE:
        slot = tl.load(slot_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
        ok = ok & (slot >= 0) & (slot < n_slots)
    pos = tl.where(ok, pos, 0)

    # cos/sin: [BLOCK_T, 1, HALF_PAD], one angle per pair.
    offs_f = tl.arange(0, HALF_PAD)
    fmask = mask_t[:, None, None] & (offs_f < HALF)[None, None, :]
    cos = tl.load(
        cos_ptr + pos[:, None, None] * stride_cp + offs_f[None, None, :] * stride_cc,
        mask=fmask,
        other=0.0,
    ).to(tl.float32)
    sin = tl.load(
        sin_ptr + pos[:, None, None] * stride_sp + offs_f[None, None, :] * stride_sc,
        mask=fmask,
        other=0.0,
    ).to(tl.float32)
    nan = float("nan")
    cos = tl.where(ok[:, None, None], cos, nan)
    sin = tl.where(ok[:, None, None], sin, nan)

    is_rot = offs_h < n_q + n_kv  # Q and K heads
    rows_t = offs_t.to(tl.int64)[:, None, None]
    cols_h = (offs_h * HEAD_DIM).to(tl.int64)[None, :, None]
    mask_row = mask_t[:, None, None] & mask_h[None, :, None]
    x_base = x_ptr + rows_t * stride_xt + cols_h * stride_xc
    o_base = out_ptr + rows_t * stride_ot + cols_h

    xa, xb = _load_pairs(x_base, stride_xc, mask_row, HALF, HALF_PAD, INTERLEAVED, JOINT)
    ya, yb = _rotate(xa, xb, cos, sin, cos, sin, BACKWARD)
    rot3 = is_rot[None, :, None]
    ya = tl.where(rot3, ya, xa)
    yb = tl.where(rot3, yb, xb)
    if COPY_ALL:
        _store_pairs(o_base, ya, yb, mask_row, HALF, HALF_PAD, INTERLEAVED, JOINT)
    else:
        _store_pairs(o_base, ya, yb, mask_row & rot3, HALF, HALF_PAD, INTERLEAVED, JOINT)

    if WRITE_CACHE:
        slot3 = slot[:, None, None]
        is_k = (offs_h >= n_q) & is_rot
        is_v = offs_h >= n_q + n_kv
        kh = tl.where(is_k, offs_h - n_q, 0).to(tl.int64)[None, :, None]
        vh = tl.where(is_v, offs_h - n_q - n_kv, 0).to(tl.int64)[None, :, None]
        ok3 = ok[:, None, None]
        k_base = kc_ptr + slot3 * stride_kcs + kh * stride_kch
        v_base = vc_ptr + slot3 * stride_vcs + vh * stride_vch
        _store_pairs(
            k_base, ya, yb, mask_row & ok3 & is_k[None, :, None], HALF, HALF_PAD, INTERLEAVED, JOINT
        )
        _store_pairs(
            v_base, ya, yb, mask_row & ok3 & is_v[None, :, None], HALF, HALF_PAD, INTERLEAVED, JOINT
        )

    if PASS > 0 and (COPY_ALL or WRITE_CACHE):
        offs_p = 2 * HALF + tl.arange(0, PASS_PAD)
        pmask = mask_row & (offs_p < HEAD_DIM)[None, None, :]
        xp = tl.load(x_base + offs_p[None, None, :] * stride_xc, mask=pmask, other=0.0)
        if COPY_ALL:
            tl.store(o_base + offs_p[None, None, :], xp, mask=pmask)
        if WRITE_CACHE:
            km = pmask & ok3 & is_k[None, :, None]
            vm = pmask & ok3 & is_v[None, :, None]
            tl.store(k_base + offs_p[None, None, :], xp.to(kc_ptr.dtype.element_ty), mask=km)
            tl.store(v_base + offs_p[None, None, :], xp.to(vc_ptr.dtype.element_ty), mask=vm)


@triton.jit
def _pin(x, PIN: tl.constexpr):
    """Identity the compiler cannot see through (compiled GPU code only).

    Triton would otherwise recompute the sin/cos below in the layout of the big data tile they
    are broadcast into: every thread evaluating them for each of its columns (8 x 4
    transcendentals per thread instead of ~1). Behind this opaque copy they are computed once
    in a compact layout and moved through shared memory.
    """
    if PIN:
        return tl.inline_asm_elementwise(
            "mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=False, pack=1
        )
    else:
        return x


@triton.jit
def _freq_angles(
    freqs_ptr,
    pos2,
    pmask2,
    stride_fs,
    stride_fd,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PIN: tl.constexpr,
):
    """cos/sin of both pair members from TE-style ``freqs`` rows (one row per position).

    ``pos2`` is ``[P, 1]``; results are ``[P, HALF_PAD]`` fp32, NaN where ``pmask2`` is false
    (a position past the table). Computed once per position per program, then broadcast over
    every head (and batch entry) the program touches.
    """
    i = tl.arange(0, HALF_PAD)
    m = pmask2 & (i < HALF)[None, :]
    if INTERLEAVED:
        ia = 2 * i
        ib = 2 * i + 1
    else:
        ia = i
        ib = i + HALF
    base = freqs_ptr + tl.where(pmask2, pos2, 0) * stride_fs
    fa = tl.load(base + ia[None, :] * stride_fd, mask=m, other=0.0).to(tl.float32)
    fb = tl.load(base + ib[None, :] * stride_fd, mask=m, other=0.0).to(tl.float32)
    nan = float("nan")
    cos_a = _pin(tl.where(pmask2, tl.cos(fa), nan), PIN)
    sin_a = _pin(tl.sin(fa), PIN)
    cos_b = _pin(tl.where(pmask2, tl.cos(fb), nan), PIN)
    sin_b = _pin(tl.sin(fb), PIN)
    return cos_a, sin_a, cos_b, sin_b


@triton.jit
def _copy_pass(
    x_base,
    o_base,
    stride_xd,
    mask_row,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    PASS_PAD: tl.constexpr,
):
    """Copy the channels past the rotary ones (partial rotary) unchanged."""
    if PASS > 0:
        offs_p = 2 * HALF + tl.arange(0, PASS_PAD)
        pmask = mask_row & (offs_p < 2 * HALF + PASS)[None, None, :]
        xp = tl.load(x_base + offs_p[None, None, :] * stride_xd, mask=pmask, other=0.0)
        tl.store(o_base + offs_p[None, None, :], xp.to(o_base.dtype.element_ty), mask=pmask)


@triton.jit
def _te_position(
    s_idx,
    cu_ptr,
    start_ptr,
    S,
    n_seqs,
    cp_size,
    cp_rank,
    IS_THD: tl.constexpr,
    HAS_START: tl.constexpr,
    CP: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    """Angle row of local index ``s_idx`` (a scalar, or one per tile row), without a per-batch
    start: context-parallel dual-chunk mapping, thd sequence found by binary search in
    ``cu_seqlens`` (plus that sequence's start position)."""
    if IS_THD:
        lo = s_idx * 0
        hi = lo + n_seqs
        for _ in range(SEARCH_STEPS):  # largest i with cu[i] / cp <= token
            mid = (lo + hi) // 2
            go_right = tl.load(cu_ptr + mid) // cp_size <= s_idx
            lo = tl.where(go_right, mid, lo)
            hi = tl.where(go_right, hi, mid)
        seq_start = tl.load(cu_ptr + lo) // cp_size
        L = tl.load(cu_ptr + lo + 1) // cp_size - seq_start
        j = s_idx - seq_start
    else:
        L = S
        j = s_idx
    if CP:
        half_l = L // 2
        p = tl.where(
            j < half_l, j + cp_rank * half_l, L * cp_size - (cp_rank + 1) * half_l + j - half_l
        )
    else:
        p = j
    if HAS_START and IS_THD:
        p = p + tl.load(start_ptr + lo)
    return p


@triton.jit
def _rope_te_kernel(
    x_ptr,
    out_ptr,
    freqs_ptr,
    start_ptr,
    cu_ptr,
    S,
    B,
    H,
    n_freqs,
    n_seqs,
    cp_size,
    cp_rank,
    stride_xs,
    stride_xb,
    stride_xh,
    stride_xd,
    stride_os,
    stride_ob,
    stride_oh,
    stride_fs,
    stride_fd,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PASS: tl.constexpr,
    PASS_PAD: tl.constexpr,
    IS_THD: tl.constexpr,
    HAS_START: tl.constexpr,
    CP: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    JOINT: tl.constexpr,
    BACKWARD: tl.constexpr,
    PIN: tl.constexpr,
    PREFETCH: tl.constexpr,
    HEADS_PER_PROG,
    BLOCK_S: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """One program: BLOCK_S sequence indices (tokens for thd) x BLOCK_B batch entries x
    HEADS_PER_PROG heads (all of them unless the grid is small), walked BLOCK_H heads at a time
    over a tile of BLOCK_S * BLOCK_B rows.

    The tensor is seen as ``[S, B, H, D]`` through strides (bshd swaps the first two strides,
    thd has B = 1). The first chunk's loads are issued before any position or angle work
    (freqs load, thd search, sin/cos), so that latency hides behind them instead of delaying
    every program's first byte: what dominated small shapes, where a program has few chunks.
    """
    pid_s = tl.program_id(0)
    pid_b = tl.program_id(1)
    r = tl.arange(0, BLOCK_S * BLOCK_B)
    b_row = pid_b * BLOCK_B + r % BLOCK_B
    if BLOCK_S == 1:
        s_row = pid_s
        mask_r = b_row < B
    else:
        s_row = pid_s * BLOCK_S + r // BLOCK_B
        mask_r = (s_row < S) & (b_row < B)
    b64 = b_row.to(tl.int64)
    s64 = s_row.to(tl.int64)
    x_row = x_ptr + (s64 * stride_xs + b64 * stride_xb)[:, None, None]
    o_row = out_ptr + (s64 * stride_os + b64 * stride_ob)[:, None, None]
    mask_r3 = mask_r[:, None, None]
    h_begin = tl.program_id(2) * HEADS_PER_PROG
    h_end = tl.minimum(h_begin + HEADS_PER_PROG, H)

    # First chunk in flight before the angle work below.
    offs_h = h_begin + tl.arange(0, BLOCK_H)
    xa, xb = _load_pairs(
        x_row + offs_h.to(tl.int64)[None, :, None] * stride_xh,
        stride_xd,
        mask_r3 & (offs_h < h_end)[None, :, None],
        HALF,
        HALF_PAD,
        INTERLEAVED,
        JOINT,
    )

    p = _te_position(
        s_row, cu_ptr, start_ptr, S, n_seqs, cp_size, cp_rank, IS_THD, HAS_START, CP, SEARCH_STEPS
    )
    if HAS_START and not IS_THD:  # one angle row per tile row (per batch entry)
        pos = p + tl.load(start_ptr + b_row, mask=mask_r, other=0)
        pos2 = pos.to(tl.int64)[:, None]
        pok2 = (mask_r & (pos >= 0) & (pos < n_freqs))[:, None]
    elif BLOCK_S == 1:  # one position for the whole program
        pos2 = tl.full((1, 1), 0, tl.int64) + p
        pok2 = (pos2 >= 0) & (pos2 < n_freqs)
    else:
        pos2 = p.to(tl.int64)[:, None]
        pok2 = (mask_r & (p >= 0) & (p < n_freqs))[:, None]
    # Positions past the table were rejected on the host; NaN here if one slips through.
    cos_a, sin_a, cos_b, sin_b = _freq_angles(
        freqs_ptr, pos2, pok2, stride_fs, stride_fd, HALF, HALF_PAD, INTERLEAVED, PIN
    )
    cos_a = cos_a[:, None, :]
    sin_a = sin_a[:, None, :]
    cos_b = cos_b[:, None, :]
    sin_b = sin_b[:, None, :]

    for h0 in range(h_begin, h_end, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h3 = offs_h.to(tl.int64)[None, :, None]
        mask_row = mask_r3 & (offs_h < h_end)[None, :, None]
        offs_n = h0 + BLOCK_H + tl.arange(0, BLOCK_H)
        x_next = x_row + offs_n.to(tl.int64)[None, :, None] * stride_xh
        mask_n = mask_r3 & (offs_n < h_end)[None, :, None]
        if PREFETCH:  # software pipelining: the next chunk's loads fly during this one
            na, nb = _load_pairs(x_next, stride_xd, mask_n, HALF, HALF_PAD, INTERLEAVED, JOINT)
        ya, yb = _rotate(xa, xb, cos_a, sin_a, cos_b, sin_b, BACKWARD)
        _store_pairs(o_row + h3 * stride_oh, ya, yb, mask_row, HALF, HALF_PAD, INTERLEAVED, JOINT)
        _copy_pass(
            x_row + h3 * stride_xh,
            o_row + h3 * stride_oh,
            stride_xd,
            mask_row,
            HALF,
            PASS,
            PASS_PAD,
        )
        if PREFETCH:
            xa = na
            xb = nb
        else:  # the next chunk (fully masked after the last one)
            xa, xb = _load_pairs(x_next, stride_xd, mask_n, HALF, HALF_PAD, INTERLEAVED, JOINT)


# ------------------------------------------------------------------------------------------------
# 2. Launchers (input checks, block sizes)
# ------------------------------------------------------------------------------------------------


def _debug_checks() -> bool:
    """Host-side checks that need a device sync run on the CPU, or when NAKTA_DEBUG=1."""
    return os.environ.get("NAKTA_DEBUG", "0") not in ("", "0")


# Launch configurations, chosen with ``kernel_benchmark/bench_rope.py --tune`` on an H200
# (results/<device>/rope_tune.*); MIN_SPLIT, PREFETCH "auto" (PIPE_*) and HEADS_FASTEST "auto"
# from interleaved A/B runs (results/nvidia-h200/ab/ab1-ab3). The *_TUNE dicts override them
# (set by the benchmark and the tests only).
_TE_DEFAULTS = dict(
    BLOCK_B=16,
    ROWS=16,
    TARGET=4096,
    num_warps=4,
    MIN_PROGRAMS=1024,
    MIN_SPLIT=512,
    JOINT=False,
    PREFETCH="auto",
    PIPE_TARGET=2048,
    PIPE_STEPS=8,
)
_QKV_DEFAULTS = dict(TARGET=2048, num_warps=4, JOINT=True, HEADS_FASTEST="auto")
_QKV_TUNE: dict[str, int] = {}
_TE_TUNE: dict[str, int] = {}


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _check_index(name: str, t: object, n: int | None = None) -> torch.Tensor:
    t = check_tensor(name, t)
    check_dtype(name, t, INDEX_DTYPES)
    check_ndim(name, t, 1)
    if n is not None and t.shape[0] != n:
        raise ValueError(f"{name} must have {n} entries (one per token), got {t.shape[0]}")
    return t


def _qkv_blocks(n_tokens: int, n_heads: int, half_pad: int) -> tuple[int, int, int]:
    """BLOCK_T, BLOCK_H, num_warps: ~TARGET pairs per program (tuned on an H200).

    BLOCK_H is the largest power of two up to TARGET / half_pad that wastes the fewest masked
    heads (40 + 40 heads of LLaMA-13B take 5 blocks of 16, not 64 + a quarter-used 64).
    """
    cfg = {**_QKV_DEFAULTS, **_QKV_TUNE}
    cap = min(_pow2(n_heads), max(1, cfg["TARGET"] // half_pad))
    candidates = [1 << i for i in range(cap.bit_length()) if (1 << i) <= cap]
    block_h = min(
        candidates, key=lambda bh: (triton.cdiv(n_heads, bh) * bh - n_heads) / n_heads - bh * 1e-6
    )
    block_h = cfg.get("BLOCK_H") or block_h
    block_t = cfg.get("BLOCK_T") or max(1, cfg["TARGET"] // (half_pad * block_h))
    block_t = min(block_t, _pow2(n_tokens))
    return block_t, block_h, cfg["num_warps"]


def _launch_rope_qkv(
    x: torch.Tensor,
    out: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    n_q: int,
    n_kv: int,
    head_dim: int,
    rotary_dim: int,
    interleaved: bool,
    backward: bool,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    cache_slots: torch.Tensor | None = None,
) -> None:
    n_tokens = x.shape[0]
    write_cache = k_cache is not None
    copy_all = out.data_ptr() != x.data_ptr()
    n_heads = n_q + 2 * n_kv if (write_cache or copy_all) else n_q + n_kv
    if n_tokens == 0:
        return
    half = rotary_dim // 2
    half_pad = _pow2(half)
    pass_ = head_dim - rotary_dim
    block_t, block_h, num_warps = _qkv_blocks(n_tokens, n_heads, half_pad)
    heads_fastest = {**_QKV_DEFAULTS, **_QKV_TUNE}["HEADS_FASTEST"]
    if heads_fastest == "auto":
        # A program of several tokens covers only a short run of each row: with tokens fastest,
        # the programs in flight would read scattered short runs of many rows. Heads fastest
        # keeps them on the same rows (H200, LLaMA-13B's 2-token programs: 89% -> 94% of copy
        # bandwidth); one-token programs (7B, 65B) measured the same or 1 point better as is.
        heads_fastest = block_t > 1
    heads_fastest = bool(heads_fastest)
    grid = (triton.cdiv(n_tokens, block_t), triton.cdiv(n_heads, block_h))
    if heads_fastest:
        grid = (grid[0] * grid[1],)
    kc = k_cache if write_cache else x
    vc = v_cache if write_cache else x
    slots = cache_slots if write_cache else positions
    _rope_qkv_kernel[grid](
        x, out, positions, cos, sin, kc, vc, slots,
        n_tokens, n_heads, n_q, n_kv, cos.shape[0], kc.shape[0] if write_cache else 0,
        x.stride(0), x.stride(1), out.stride(0),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        kc.stride(0) if write_cache else 0, kc.stride(1) if write_cache else 0,
        vc.stride(0) if write_cache else 0, vc.stride(1) if write_cache else 0,
        HEAD_DIM=head_dim, HALF=half, HALF_PAD=half_pad, PASS=pass_, PASS_PAD=_pow2(pass_),
        INTERLEAVED=interleaved, JOINT=bool({**_QKV_DEFAULTS, **_QKV_TUNE}["JOINT"]), BACKWARD=backward,
        WRITE_CACHE=write_cache, COPY_ALL=copy_all,
        BLOCK_T=block_t, BLOCK_H=block_h, HEADS_FASTEST=heads_fastest, num_warps=num_warps,
    )  # fmt: skip


def _check_rope_qkv_args(
    qkv,
    positions,
    cos,
    sin,
    n_q_heads,
    n_kv_heads,
    head_dim,
    rotary_dim,
    k_cache,
    v_cache,
    cache_slots,
    *,
    for_kernel: bool,
) -> int:
    """Validate ``apply_rope_qkv_`` arguments; returns the effective rotary_dim."""
    qkv = check_tensor("qkv", qkv)
    check_dtype("qkv", qkv, FLOAT_DTYPES)
    check_ndim("qkv", qkv, 2)
    for name, v in (("n_q_heads", n_q_heads), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if n_q_heads % n_kv_heads:
        raise ValueError(f"n_kv_heads ({n_kv_heads}) must divide n_q_heads ({n_q_heads})")
    width = (n_q_heads + 2 * n_kv_heads) * head_dim
    if qkv.shape[1] != width:
        raise ValueError(
            f"qkv must have (n_q_heads + 2 * n_kv_heads) * head_dim = {width} columns, "
            f"got shape {tuple(qkv.shape)}"
        )
    if qkv.shape[0] > 0 and qkv.stride(1) != 1:
        raise ValueError(f"qkv must have unit column stride, got strides {qkv.stride()}")
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if (
        not isinstance(rotary_dim, int)
        or rotary_dim <= 0
        or rotary_dim % 2
        or rotary_dim > head_dim
    ):
        raise ValueError(
            f"rotary_dim must be an even int in (0, head_dim={head_dim}], got {rotary_dim!r}"
        )
    _check_index("positions", positions, qkv.shape[0])
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t)
        check_dtype(name, t, (torch.float32,))
        check_ndim(name, t, 2)
        if t.shape[1] != rotary_dim // 2:
            raise ValueError(
                f"{name} must have rotary_dim // 2 = {rotary_dim // 2} columns, got shape {tuple(t.shape)}"
            )
    if cos.shape != sin.shape:
        raise ValueError(
            f"cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    given = [k_cache is not None, v_cache is not None, cache_slots is not None]
    if any(given) and not all(given):
        raise ValueError("k_cache, v_cache and cache_slots must be given together")
    if all(given):
        _check_index("cache_slots", cache_slots, qkv.shape[0])
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            check_tensor(name, c)
            check_ndim(name, c, 3)
            if c.shape[1:] != (n_kv_heads, head_dim):
                raise ValueError(
                    f"{name} must have shape [num_slots, n_kv_heads={n_kv_heads}, head_dim={head_dim}], got {tuple(c.shape)}"
                )
            if c.dtype != qkv.dtype:
                raise TypeError(f"{name} must have qkv's dtype {qkv.dtype}, got {c.dtype}")
            if c.stride(2) != 1:
                raise ValueError(
                    f"{name} must have unit stride in its last dimension, got {c.stride()}"
                )
    check_same_device(
        qkv=qkv,
        positions=positions,
        cos=cos,
        sin=sin,
        k_cache=k_cache,
        v_cache=v_cache,
        cache_slots=cache_slots,
    )
    if for_kernel:
        check_triton_device("qkv", qkv)
    if not qkv.is_cuda or _debug_checks() or not for_kernel:
        _check_positions_in_table(positions, cos.shape[0])
        if all(given):
            _check_slots(cache_slots, k_cache.shape[0], v_cache.shape[0])
    return rotary_dim


def _check_positions_in_table(positions: torch.Tensor, n_pos: int) -> None:
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= n_pos):
        raise ValueError(
            f"positions must lie in [0, {n_pos}) (the cos/sin table's rows), got "
            f"[{int(positions.min())}, {int(positions.max())}]"
        )


def _check_slots(slots: torch.Tensor, n_k: int, n_v: int) -> None:
    n = min(n_k, n_v)
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= n):
        raise ValueError(
            f"cache_slots must lie in [0, {n}) (the cache's slots), got [{int(slots.min())}, {int(slots.max())}]"
        )


TENSOR_FORMATS = ("sbhd", "bshd", "thd")


def _te_blocks(
    s: int, n_batch: int, n_heads: int, half_pad: int
) -> tuple[int, int, int, int, int, bool]:
    """BLOCK_S, BLOCK_B, BLOCK_H, heads per program, num_warps, PREFETCH for the TE kernel
    (tuned on an H200).

    A program takes BLOCK_B batch entries of BLOCK_S positions (rows of its tile) and walks its
    heads BLOCK_H at a time (~TARGET pairs a step), so sin/cos are computed once for all of
    them. A small batch gets several positions (up to ROWS rows), as long as that leaves
    MIN_PROGRAMS programs: more chunks per program amortise its fixed start. When there are
    still fewer than MIN_SPLIT programs, the heads are split over a third grid axis. MIN_SPLIT
    is lower than MIN_PROGRAMS: at s=512, b=16 the 512 one-position programs (each walking all
    heads) beat 1024 half-head programs, while a batch of 2 still wants 1024 programs.
    With PREFETCH "auto", a one-position program that walks at least PIPE_STEPS head steps of
    ~PIPE_TARGET pairs runs the software-pipelined walk (next step's loads in flight during this
    one): +2-3 points of copy bandwidth at s=512/1024 and rotary_percent 0.5 on an H200, while
    short walks (8 heads) and multi-position tiles (small batches) measured slower with it.
    """
    cfg = {**_TE_DEFAULTS, **_TE_TUNE}
    block_b = min(cfg["BLOCK_B"], _pow2(n_batch))
    n_b_blocks = triton.cdiv(n_batch, block_b)
    block_s = min(max(1, cfg.get("ROWS", 1) // block_b), _pow2(s))
    while block_s > 1 and triton.cdiv(s, block_s) * n_b_blocks < cfg["MIN_PROGRAMS"]:
        block_s //= 2
    rows = block_s * block_b
    block_h = min(_pow2(n_heads), max(1, cfg["TARGET"] // (half_pad * rows)))
    n_h_blocks = triton.cdiv(n_heads, block_h)
    programs = triton.cdiv(s, block_s) * n_b_blocks
    split = max(1, min(n_h_blocks, triton.cdiv(cfg["MIN_SPLIT"], programs)))
    heads_per_prog = triton.cdiv(n_h_blocks, split) * block_h
    prefetch = cfg["PREFETCH"]
    if prefetch == "auto":  # pipeline long walks over the heads of one position
        pipe_h = min(block_h, max(1, cfg["PIPE_TARGET"] // (half_pad * rows)))
        prefetch = block_s == 1 and heads_per_prog // pipe_h >= cfg["PIPE_STEPS"]
        block_h = pipe_h if prefetch else block_h
    return block_s, block_b, block_h, heads_per_prog, cfg["num_warps"], bool(prefetch)


def _sbhd_view(
    t: torch.Tensor, tensor_format: str
) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """Shape and strides of ``t`` seen as ``[S, B, H, D]`` (thd: S = tokens, B = 1)."""
    if tensor_format == "sbhd":
        return tuple(t.shape), tuple(t.stride())
    if tensor_format == "bshd":
        b, s, h, d = t.shape
        sb, ss, sh, sd = t.stride()
        return (s, b, h, d), (ss, sb, sh, sd)
    n, h, d = t.shape
    sn, sh, sd = t.stride()
    return (n, 1, h, d), (sn, 0, sh, sd)


def _launch_rope_te(
    x: torch.Tensor,
    freqs: torch.Tensor,
    tensor_format: str,
    start_positions: torch.Tensor | None,
    interleaved: bool,
    cu_seqlens: torch.Tensor | None,
    cp_size: int,
    cp_rank: int,
    backward: bool,
) -> torch.Tensor:
    """Rotate ``x`` (or its gradient with ``backward``) into a new tensor, contiguous in its format."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    (S, B, H, D), (sxs, sxb, sxh, sxd) = _sbhd_view(x, tensor_format)
    _, (sos, sob, soh, _) = _sbhd_view(out, tensor_format)
    if out.numel() == 0:
        return out
    d2 = freqs.shape[-1]
    half_pad = _pow2(d2 // 2)
    is_thd = tensor_format == "thd"
    has_start = start_positions is not None
    n_seqs = cu_seqlens.shape[0] - 1 if is_thd else 0
    block_s, block_b, block_h, heads_per_prog, num_warps, prefetch = _te_blocks(S, B, H, half_pad)
    grid = (triton.cdiv(S, block_s), triton.cdiv(B, block_b), triton.cdiv(H, heads_per_prog))
    _rope_te_kernel[grid](
        x, out, freqs,
        start_positions if has_start else x,
        cu_seqlens if is_thd else x,
        S, B, H, freqs.shape[0], n_seqs, cp_size, cp_rank,
        sxs, sxb, sxh, sxd, sos, sob, soh,
        freqs.stride(0), freqs.stride(3),
        HALF=d2 // 2, HALF_PAD=half_pad, PASS=D - d2, PASS_PAD=_pow2(D - d2),
        IS_THD=is_thd, HAS_START=has_start, CP=cp_size > 1,
        SEARCH_STEPS=max(n_seqs, 1).bit_length() + 1,
        INTERLEAVED=interleaved, JOINT=bool({**_TE_DEFAULTS, **_TE_TUNE}["JOINT"]), BACKWARD=backward,
        PIN=x.is_cuda and not interpreter_enabled(), PREFETCH=prefetch,
        HEADS_PER_PROG=heads_per_prog, BLOCK_S=block_s, BLOCK_B=block_b, BLOCK_H=block_h,
        num_warps=num_warps,
    )  # fmt: skip
    return out


def _check_rope_te_args(
    t, freqs, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank, *, for_kernel: bool
) -> torch.Tensor:
    """Validate ``apply_rotary_pos_emb`` arguments; returns ``freqs`` as fp32.

    Syncs with the device only for what must be read on the host: ``cu_seqlens`` (thd). The
    ``start_positions`` bound is checked on the host for CPU tensors, in the reference, or with
    ``NAKTA_DEBUG=1``; a fused CUDA call without the flag does not synchronise on it, and a
    position past the table turns that row into NaN instead of reading out of bounds.
    """
    if tensor_format not in TENSOR_FORMATS:
        raise ValueError(f"tensor_format must be one of {TENSOR_FORMATS}, got {tensor_format!r}")
    t = check_tensor("t", t)
    check_dtype("t", t, FLOAT_DTYPES)
    check_ndim("t", t, 3 if tensor_format == "thd" else 4)
    freqs = check_tensor("freqs", freqs)
    check_dtype("freqs", freqs, FLOAT_DTYPES)
    check_ndim("freqs", freqs, 4)
    if freqs.shape[1] != 1 or freqs.shape[2] != 1:
        raise ValueError(f"freqs must have shape [s2, 1, 1, d2], got {tuple(freqs.shape)}")
    d, d2 = t.shape[-1], freqs.shape[-1]
    if d2 <= 0 or d2 % 2:
        raise ValueError(f"freqs' last dimension d2 must be even and positive, got {d2}")
    if d2 > d:
        raise ValueError(f"freqs' last dimension d2={d2} must be <= t's head dimension d={d}")
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    if not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be an int in [0, cp_size={cp_size}), got {cp_rank!r}")
    if start_positions is not None and cp_size > 1:
        raise ValueError("start_positions is only supported with cp_size == 1 (inference)")
    check_same_device(t=t, freqs=freqs, start_positions=start_positions, cu_seqlens=cu_seqlens)
    if for_kernel:
        check_triton_device("t", t)
    s2 = freqs.shape[0]

    if tensor_format == "thd":
        if cu_seqlens is None:
            raise ValueError("cu_seqlens must be given when tensor_format is 'thd'")
        check_tensor("cu_seqlens", cu_seqlens)
        check_dtype("cu_seqlens", cu_seqlens, (torch.int32,))
        check_ndim("cu_seqlens", cu_seqlens, 1)
        if cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must have at least 2 entries, got {cu_seqlens.shape[0]}")
        cu = cu_seqlens.tolist()
        lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        if cu[0] != 0 or min(lens) < 0:
            raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu[:8]}...")
        if cu[-1] // cp_size != t.shape[0] or cu[-1] % cp_size:
            raise ValueError(
                f"cu_seqlens[-1] / cp_size must equal t's token count {t.shape[0]}, "
                f"got {cu[-1]} / {cp_size}"
            )
        if cp_size > 1 and any(n % (2 * cp_size) for n in lens):
            raise ValueError(
                f"with cp_size={cp_size} every sequence length in cu_seqlens must be a multiple "
                f"of 2 * cp_size (padded cu_seqlens)"
            )
        n_seqs = len(lens)
        # Global length of each sequence = positions it needs (cp: lens are already global).
        need = lens
    else:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens is only valid when tensor_format is 'thd'")
        seq = t.shape[1] if tensor_format == "bshd" else t.shape[0]
        n_seqs = t.shape[0] if tensor_format == "bshd" else t.shape[1]
        if cp_size > 1 and seq % 2:
            raise ValueError(f"with cp_size > 1 the local sequence length must be even, got {seq}")
        need = [seq * cp_size] * n_seqs
    if start_positions is not None:
        _check_index("start_positions", start_positions, None)
        if start_positions.shape[0] != n_seqs:
            raise ValueError(
                f"start_positions must have one entry per sequence ({n_seqs}), "
                f"got {start_positions.shape[0]}"
            )
        if not for_kernel or not t.is_cuda or _debug_checks():
            starts = start_positions.tolist()
            if starts and min(starts) < 0:
                raise ValueError(f"start_positions must be >= 0, got min {min(starts)}")
            need = [n + s for n, s in zip(need, starts)]
    if need and max(need) > s2:
        raise ValueError(
            f"freqs has {s2} positions but the input needs {max(need)} "
            "(sequence length x cp_size + start position)"
        )
    return freqs.float()


# ------------------------------------------------------------------------------------------------
# 3. Autograd functions
# ------------------------------------------------------------------------------------------------


class _RopeQKVFunction(torch.autograd.Function):
    """In-place QK rotation; backward rotates the Q/K gradient by -theta, V's passes through."""

    @staticmethod
    def forward(ctx, qkv, positions, cos, sin, n_q, n_kv, head_dim, rotary_dim, interleaved):
        _launch_rope_qkv(
            qkv,
            qkv,
            positions,
            cos,
            sin,
            n_q,
            n_kv,
            head_dim,
            rotary_dim,
            interleaved,
            backward=False,
        )
        ctx.mark_dirty(qkv)
        ctx.save_for_backward(positions, cos, sin)
        ctx.args = (n_q, n_kv, head_dim, rotary_dim, interleaved)
        return qkv

    @staticmethod
    def backward(ctx, grad):
        positions, cos, sin = ctx.saved_tensors
        n_q, n_kv, head_dim, rotary_dim, interleaved = ctx.args
        out = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        _launch_rope_qkv(
            grad,
            out,
            positions,
            cos,
            sin,
            n_q,
            n_kv,
            head_dim,
            rotary_dim,
            interleaved,
            backward=True,
        )
        return out, None, None, None, None, None, None, None, None


class _RopeTEFunction(torch.autograd.Function):
    """TE-compatible fused RoPE; backward applies the transposed rotation to any-strided grads."""

    @staticmethod
    def forward(
        ctx, t, freqs, start_positions, tensor_format, interleaved, cu_seqlens, cp_size, cp_rank
    ):
        out = _launch_rope_te(
            t,
            freqs,
            tensor_format,
            start_positions,
            interleaved,
            cu_seqlens,
            cp_size,
            cp_rank,
            backward=False,
        )
        ctx.save_for_backward(freqs, start_positions, cu_seqlens)
        ctx.args = (tensor_format, interleaved, cp_size, cp_rank)
        return out

    @staticmethod
    def backward(ctx, grad):
        freqs, start_positions, cu_seqlens = ctx.saved_tensors
        tensor_format, interleaved, cp_size, cp_rank = ctx.args
        grad_t = _launch_rope_te(
            grad,
            freqs,
            tensor_format,
            start_positions,
            interleaved,
            cu_seqlens,
            cp_size,
            cp_rank,
            backward=True,
        )
        return grad_t, None, None, None, None, None, None, None


# ------------------------------------------------------------------------------------------------
# 4. Public functions (model path)
# ------------------------------------------------------------------------------------------------


def build_rope_cache(
    max_positions: int, rotary_dim: int, base: float = 10000.0, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: fp32 ``[max_positions, rotary_dim // 2]``, angle[p, i] = p * base**(-2i/rotary_dim).

    Angles are formed in fp64 and rounded once: in fp32, ``p * inv_freq`` at p ~ 2**20 is off by
    up to ~0.06 rad, which would make long-context positions wrong.
    """
    if not isinstance(max_positions, int) or max_positions <= 0:
        raise ValueError(f"max_positions must be a positive int, got {max_positions!r}")
    if not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even int, got {rotary_dim!r}")
    if base <= 0:
        raise ValueError(f"base must be positive, got {base!r}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    half = rotary_dim // 2
    inv = float(base) ** (
        -2.0 * torch.arange(half, dtype=torch.float64, device=device) / rotary_dim
    )
    cos = torch.empty(max_positions, half, dtype=torch.float32, device=device)
    sin = torch.empty_like(cos)
    chunk = max(1, (1 << 22) // half)  # bounds the fp64 temporaries
    for p0 in range(0, max_positions, chunk):
        p = torch.arange(p0, min(p0 + chunk, max_positions), dtype=torch.float64, device=device)
        ang = p[:, None] * inv[None, :]
        cos[p0 : p0 + len(p)] = torch.cos(ang)
        sin[p0 : p0 + len(p)] = torch.sin(ang)
    return cos, sin


def apply_rope_qkv_(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    n_q_heads: int,
    n_kv_heads: int,
    head_dim: int,
    *,
    interleaved: bool,
    rotary_dim: int | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    cache_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate the Q and K heads of a fused ``[tokens, (nq + 2 nkv) * head_dim]`` matrix in place.

    One launch rotates Q and K (V untouched) and, with ``k_cache``/``v_cache``/``cache_slots``,
    writes the rotated K and the V of token t into slot ``cache_slots[t]`` of the caches.
    ``interleaved=True`` pairs channels (2i, 2i+1) (Meta checkpoints), False pairs (i, i + r/2)
    (HF). Positions (and cache slots) outside the table are rejected with ValueError on the CPU
    or with ``NAKTA_DEBUG=1``; on CUDA without the flag they are not synchronised on and instead
    turn that token's rotated Q/K into NaN (and skip its cache write), never reading or writing
    out of bounds.
    """
    rotary_dim = _check_rope_qkv_args(
        qkv,
        positions,
        cos,
        sin,
        n_q_heads,
        n_kv_heads,
        head_dim,
        rotary_dim,
        k_cache,
        v_cache,
        cache_slots,
        for_kernel=True,
    )
    needs_grad = torch.is_grad_enabled() and qkv.requires_grad
    if needs_grad:
        if k_cache is not None:
            raise ValueError(
                "cache writes are inference-only: call under torch.no_grad() or pass a qkv that does not require grad"
            )
        return _RopeQKVFunction.apply(
            qkv, positions, cos, sin, n_q_heads, n_kv_heads, head_dim, rotary_dim, bool(interleaved)
        )
    _launch_rope_qkv(
        qkv,
        qkv,
        positions,
        cos,
        sin,
        n_q_heads,
        n_kv_heads,
        head_dim,
        rotary_dim,
        bool(interleaved),
        backward=False,
        k_cache=k_cache,
        v_cache=v_cache,
        cache_slots=cache_slots,
    )
    return qkv


# ------------------------------------------------------------------------------------------------
# 4b. Public functions (TransformerEngine-compatible API)
# ------------------------------------------------------------------------------------------------


class RotaryPositionEmbedding(torch.nn.Module):
    """TE's ``RotaryPositionEmbedding``: ``forward(max_seq_len, offset)`` returns fp32 angles
    ``[max_seq_len, 1, 1, dim']`` (``dim' = int(dim * rotary_percent)``), each angle twice:
    ``cat(f, f)`` for rotate-half pairing, or repeated in place for interleaved pairing.
    """

    def __init__(
        self,
        dim: int,
        rotary_percent: float = 1.0,
        seq_len_interpolation_factor: float | None = None,
        rotary_base: float = 10000.0,
        interleaved: bool = False,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        if dim <= 0:
            raise ValueError(f"dim * rotary_percent must be positive, got {dim}")
        if device is None:  # TE builds on the current CUDA device
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.rotary_base = rotary_base
        self.interleaved = interleaved
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
        self.register_buffer("inv_freq", 1.0 / (rotary_base**exponents))

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        seq = torch.arange(max_seq_len, device=self.inv_freq.device, dtype=torch.float32) + offset
        if self.seq_len_interpolation_factor is not None:
            seq = seq * (1.0 / self.seq_len_interpolation_factor)
        freqs = torch.outer(seq, self.inv_freq)
        if self.interleaved:
            emb = freqs.repeat_interleave(2, dim=-1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb.reshape(emb.shape[0], 1, 1, emb.shape[1])


def apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    tensor_format: str = "sbhd",
    start_positions: torch.Tensor | None = None,
    interleaved: bool = False,
    fused: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> torch.Tensor:
    """TE's ``apply_rotary_pos_emb``: rotate the first ``d2`` channels of every head of ``t``.

    ``t`` is ``[s, b, h, d]`` (sbhd), ``[b, s, h, d]`` (bshd) or packed ``[t, h, d]`` (thd with
    int32 ``cu_seqlens``), any strides; ``freqs`` is ``[s2, 1, 1, d2]`` angles. Sequence ``i``
    starts at position ``start_positions[i]``; with ``cp_size > 1`` each local sequence holds the
    two chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of the global one. ``fused=True``
    runs the Triton kernel (forward and backward); ``fused=False`` the PyTorch reference. The
    output is a new tensor, contiguous in ``tensor_format``.
    """
    if not fused:
        return apply_rotary_pos_emb_reference(
            t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank
        )
    freqs = _check_rope_te_args(
        t, freqs, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank, for_kernel=True
    )
    if not (torch.is_grad_enabled() and t.requires_grad):  # inference: skip autograd's overhead
        return _launch_rope_te(
            t, freqs, tensor_format, start_positions, bool(interleaved), cu_seqlens, cp_size,
            cp_rank, backward=False,
        )  # fmt: skip
    return _RopeTEFunction.apply(
        t, freqs, start_positions, tensor_format, bool(interleaved), cu_seqlens, cp_size, cp_rank
    )


# ------------------------------------------------------------------------------------------------
# 5. Pure-PyTorch reference (model path)
# ------------------------------------------------------------------------------------------------


def _rotate_reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotate the last dim of ``x`` (fp32) by per-pair angles broadcast from ``cos``/``sin``."""
    if interleaved:
        xa, xb = x[..., 0::2], x[..., 1::2]
        return torch.stack((xa * cos - xb * sin, xb * cos + xa * sin), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    xa, xb = x[..., :half], x[..., half:]
    return torch.cat((xa * cos - xb * sin, xb * cos + xa * sin), dim=-1)


def apply_rope_qkv_reference(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    n_q_heads: int,
    n_kv_heads: int,
    head_dim: int,
    *,
    interleaved: bool,
    rotary_dim: int | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    cache_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch ``apply_rope_qkv_`` (same in-place semantics and cache writes; CPU fallback)."""
    rotary_dim = _check_rope_qkv_args(
        qkv,
        positions,
        cos,
        sin,
        n_q_heads,
        n_kv_heads,
        head_dim,
        rotary_dim,
        k_cache,
        v_cache,
        cache_slots,
        for_kernel=False,
    )
    heads = qkv.unflatten(1, (n_q_heads + 2 * n_kv_heads, head_dim))
    n_rot = n_q_heads + n_kv_heads
    pos = positions.long()
    c = cos[pos][:, None, :]
    s = sin[pos][:, None, :]
    rot = heads[:, :n_rot, :rotary_dim]
    rot.copy_(_rotate_reference(rot.float(), c, s, interleaved).to(qkv.dtype))
    if k_cache is not None:
        slots = cache_slots.long()
        k_cache[slots] = heads[:, n_q_heads:n_rot]
        v_cache[slots] = heads[:, n_rot:]
    return qkv


def _te_positions(
    t: torch.Tensor,
    tensor_format: str,
    start_positions: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    cp_size: int,
    cp_rank: int,
) -> torch.Tensor:
    """The angle row of every token: ``[s, b]`` (sbhd), ``[b, s]`` (bshd) or ``[t]`` (thd)."""

    def local_to_global(n: int) -> torch.Tensor:
        j = torch.arange(n, device=t.device)
        if cp_size == 1:
            return j
        half = n // 2
        return torch.where(
            j < half, j + cp_rank * half, n * cp_size - (cp_rank + 1) * half + j - half
        )

    starts = start_positions.long() if start_positions is not None else None
    if tensor_format == "thd":
        cu = (cu_seqlens // cp_size).tolist()
        parts = []
        for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
            p = local_to_global(b - a)
            parts.append(p + starts[i] if starts is not None else p)
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=t.device)
    seq_dim = 0 if tensor_format == "sbhd" else 1
    p = local_to_global(t.shape[seq_dim])
    pos = p[:, None] if seq_dim == 0 else p[None, :]
    if starts is not None:
        pos = pos + (starts[None, :] if seq_dim == 0 else starts[:, None])
    return pos.expand(t.shape[:2])


def _rotate_half_te(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """[-x2, x1] (rotate-half) or, per interleaved pair, [-x_odd, x_even]."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb_reference(
    t: torch.Tensor,
    freqs: torch.Tensor,
    tensor_format: str = "sbhd",
    start_positions: torch.Tensor | None = None,
    interleaved: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> torch.Tensor:
    """Plain-PyTorch ``apply_rotary_pos_emb`` (TE's unfused semantics: cos/sin in fp32, then the
    rotation in ``t``'s dtype); differentiable by autograd."""
    freqs = _check_rope_te_args(
        t, freqs, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank, for_kernel=False
    )
    pos = _te_positions(t, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)
    ang = freqs[:, 0, 0, :][pos].unsqueeze(-2)  # [..., 1, d2]
    cos, sin = torch.cos(ang).to(t.dtype), torch.sin(ang).to(t.dtype)
    d2 = freqs.shape[-1]
    rot, rest = t[..., :d2], t[..., d2:]
    return torch.cat((rot * cos + _rotate_half_te(rot, interleaved) * sin, rest), dim=-1)
