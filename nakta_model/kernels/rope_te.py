"""Rotary position embedding with NVIDIA TransformerEngine's API: ``apply_rotary_pos_emb``.

Same arguments and semantics as TE's functions of these names (sbhd / bshd / packed thd, any
strides, partial rotary, ``start_positions``, context-parallel dual-chunk layout), so TE's test
calls run unchanged against it (only ``fused`` defaults to True here). Angles come in as
``freqs``; sin/cos are computed in-kernel once per position per program and reused across the
batch block and all heads the program walks. Math in fp32, stored in the caller's dtype;
backward is the transposed rotation (the same kernel with ``BACKWARD``). The model's own path
is ``rope.py``; both use the pair load / rotate / store of ``_triton_math.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nakta_model.kernels._checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_index,
    check_ndim,
    check_same_device,
    check_tensor,
    check_triton_device,
    debug_checks,
    interpreter_enabled,
)
from nakta_model.kernels._triton_math import load_pairs, rotate, store_pairs
from nakta_model.kernels.rope import Llama3Scaling, te_inv_freq

TENSOR_FORMATS = ("sbhd", "bshd", "thd")

# ------------------------------------------------------------------------------------------------
# 1. Triton kernel
# ------------------------------------------------------------------------------------------------


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
    FREQS, pos2, pmask2, stride_fs, stride_fd,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, INTERLEAVED: tl.constexpr, PIN: tl.constexpr,
):  # fmt: skip
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
    base = FREQS + tl.where(pmask2, pos2, 0) * stride_fs
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
    x_base, o_base, stride_xd, mask_row, HALF: tl.constexpr, PASS: tl.constexpr,
    PASS_PAD: tl.constexpr,
):  # fmt: skip
    """Copy the channels past the rotary ones (partial rotary) unchanged."""
    if PASS > 0:
        offs_p = 2 * HALF + tl.arange(0, PASS_PAD)
        pmask = mask_row & (offs_p < 2 * HALF + PASS)[None, None, :]
        xp = tl.load(x_base + offs_p[None, None, :] * stride_xd, mask=pmask, other=0.0)
        tl.store(o_base + offs_p[None, None, :], xp.to(o_base.dtype.element_ty), mask=pmask)


@triton.jit
def _position(
    s_idx, CU, START, S, n_seqs, cp_size, cp_rank,
    IS_THD: tl.constexpr, HAS_START: tl.constexpr, CP: tl.constexpr, SEARCH_STEPS: tl.constexpr,
):  # fmt: skip
    """Angle row of local index ``s_idx`` (a scalar, or one per tile row), without a per-batch
    start: context-parallel dual-chunk mapping, thd sequence found by binary search in
    ``cu_seqlens`` (plus that sequence's start position)."""
    if IS_THD:
        lo = s_idx * 0
        hi = lo + n_seqs
        for _ in range(SEARCH_STEPS):  # largest i with cu[i] / cp <= token
            mid = (lo + hi) // 2
            go_right = tl.load(CU + mid) // cp_size <= s_idx
            lo = tl.where(go_right, mid, lo)
            hi = tl.where(go_right, hi, mid)
        seq_start = tl.load(CU + lo) // cp_size
        L = tl.load(CU + lo + 1) // cp_size - seq_start
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
        p = p + tl.load(START + lo)
    return p


@triton.jit
def _rope_te_kernel(
    X, OUT, FREQS, START, CU,
    S, B, H, n_freqs, n_seqs, cp_size, cp_rank,
    stride_xs, stride_xb, stride_xh, stride_xd, stride_os, stride_ob, stride_oh,
    stride_fs, stride_fd,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, PASS: tl.constexpr, PASS_PAD: tl.constexpr,
    IS_THD: tl.constexpr, HAS_START: tl.constexpr, CP: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    INTERLEAVED: tl.constexpr, JOINT: tl.constexpr, BACKWARD: tl.constexpr, PIN: tl.constexpr,
    PREFETCH: tl.constexpr, HEADS_PER_PROG,
    BLOCK_S: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_S sequence indices (tokens for thd) x BLOCK_B batch entries x
    HEADS_PER_PROG heads (all of them unless the grid is small), walked BLOCK_H heads at a time
    over a tile of BLOCK_S * BLOCK_B rows.

    The tensor is seen as ``[S, B, H, D]`` through strides (bshd swaps the first two strides,
    thd has B = 1). The first chunk's loads are issued before any position or angle work
    (freqs load, thd search, sin/cos), so that latency hides behind them instead of delaying
    every program's first byte: what dominated small shapes, where a program has few chunks.
    ``PREFETCH`` software-pipelines the walk (the next chunk's loads fly during this one);
    ``PIN`` keeps the angles in a compact layout (``_pin``).
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
    x_row = X + (s64 * stride_xs + b64 * stride_xb)[:, None, None]
    o_row = OUT + (s64 * stride_os + b64 * stride_ob)[:, None, None]
    mask_r3 = mask_r[:, None, None]
    h_begin = tl.program_id(2) * HEADS_PER_PROG
    h_end = tl.minimum(h_begin + HEADS_PER_PROG, H)

    # First chunk in flight before the angle work below.
    offs_h = h_begin + tl.arange(0, BLOCK_H)
    xa, xb = load_pairs(
        x_row + offs_h.to(tl.int64)[None, :, None] * stride_xh, stride_xd,
        mask_r3 & (offs_h < h_end)[None, :, None], HALF, HALF_PAD, INTERLEAVED, JOINT,
    )  # fmt: skip

    p = _position(
        s_row, CU, START, S, n_seqs, cp_size, cp_rank, IS_THD, HAS_START, CP, SEARCH_STEPS
    )
    if HAS_START and not IS_THD:  # one angle row per tile row (per batch entry)
        pos = p + tl.load(START + b_row, mask=mask_r, other=0)
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
        FREQS, pos2, pok2, stride_fs, stride_fd, HALF, HALF_PAD, INTERLEAVED, PIN
    )
    cos_a, sin_a = cos_a[:, None, :], sin_a[:, None, :]
    cos_b, sin_b = cos_b[:, None, :], sin_b[:, None, :]

    for h0 in range(h_begin, h_end, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h3 = offs_h.to(tl.int64)[None, :, None]
        mask_row = mask_r3 & (offs_h < h_end)[None, :, None]
        offs_n = h0 + BLOCK_H + tl.arange(0, BLOCK_H)
        x_next = x_row + offs_n.to(tl.int64)[None, :, None] * stride_xh
        mask_n = mask_r3 & (offs_n < h_end)[None, :, None]
        if PREFETCH:  # software pipelining: the next chunk's loads fly during this one
            na, nb = load_pairs(x_next, stride_xd, mask_n, HALF, HALF_PAD, INTERLEAVED, JOINT)
        ya, yb = rotate(xa, xb, cos_a, sin_a, cos_b, sin_b, BACKWARD)
        store_pairs(o_row + h3 * stride_oh, ya, yb, mask_row, HALF, HALF_PAD, INTERLEAVED, JOINT)
        _copy_pass(
            x_row + h3 * stride_xh, o_row + h3 * stride_oh, stride_xd, mask_row, HALF, PASS,
            PASS_PAD,
        )  # fmt: skip
        if PREFETCH:
            xa = na
            xb = nb
        else:  # the next chunk (fully masked after the last one)
            xa, xb = load_pairs(x_next, stride_xd, mask_n, HALF, HALF_PAD, INTERLEAVED, JOINT)


# ------------------------------------------------------------------------------------------------
# 2. Launch configuration and launcher
# ------------------------------------------------------------------------------------------------

# One rule set for every shape, chosen with ``kernel_benchmark/bench_rope.py --tune`` on an H200;
# MIN_SPLIT, PREFETCH "auto" (PIPE_*) from interleaved A/B runs (the pipelined walk helps long
# one-position walks only). ``_TUNE`` overrides any key (set by the benchmark and the
# tests only). ``_config`` says what each key does.
_CONFIGS: dict[str, dict[str, int | str | bool]] = {
    "rope_te": dict(
        BLOCK_B=16, ROWS=16, TARGET=4096, num_warps=4, MIN_PROGRAMS=1024, MIN_SPLIT=512,
        JOINT=False, PREFETCH="auto", PIPE_TARGET=2048, PIPE_STEPS=8,
    ),
}  # fmt: skip
_TUNE: dict[str, int | str | bool] = {}


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _config(s: int, n_batch: int, n_heads: int, half_pad: int) -> dict[str, int | bool]:
    """BLOCK_S, BLOCK_B, BLOCK_H, HEADS_PER_PROG, PREFETCH, JOINT and num_warps of one launch
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
    cfg = {**_CONFIGS["rope_te"], **_TUNE}
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
    return dict(
        BLOCK_S=block_s, BLOCK_B=block_b, BLOCK_H=block_h, HEADS_PER_PROG=heads_per_prog,
        PREFETCH=bool(prefetch), JOINT=bool(cfg["JOINT"]), num_warps=cfg["num_warps"],
    )  # fmt: skip


def _sbhd_view(t: torch.Tensor, tensor_format: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and strides of ``t`` seen as ``[S, B, H, D]`` (thd: S = tokens, B = 1)."""
    if tensor_format == "sbhd":
        return tuple(t.shape), tuple(t.stride())
    if tensor_format == "bshd":
        (b, s, h, d), (sb, ss, sh, sd) = t.shape, t.stride()
        return (s, b, h, d), (ss, sb, sh, sd)
    (n, h, d), (sn, sh, sd) = t.shape, t.stride()
    return (n, 1, h, d), (sn, 0, sh, sd)


def _launch(
    x: torch.Tensor, freqs: torch.Tensor, tensor_format: str,
    start_positions: torch.Tensor | None, interleaved: bool, cu_seqlens: torch.Tensor | None,
    cp_size: int, cp_rank: int, backward: bool,
) -> torch.Tensor:  # fmt: skip
    """Rotate ``x`` (or its gradient with ``backward``) into a new tensor, contiguous in its format."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    (S, B, H, D), (sxs, sxb, sxh, sxd) = _sbhd_view(x, tensor_format)
    _, (sos, sob, soh, _) = _sbhd_view(out, tensor_format)
    if out.numel() == 0:
        return out
    d2 = freqs.shape[-1]
    half_pad = _pow2(d2 // 2)
    is_thd, has_start = tensor_format == "thd", start_positions is not None
    n_seqs = cu_seqlens.shape[0] - 1 if is_thd else 0
    cfg = _config(S, B, H, half_pad)
    grid = (triton.cdiv(S, cfg["BLOCK_S"]), triton.cdiv(B, cfg["BLOCK_B"]),
            triton.cdiv(H, cfg["HEADS_PER_PROG"]))  # fmt: skip
    _rope_te_kernel[grid](
        x, out, freqs, start_positions if has_start else x, cu_seqlens if is_thd else x,
        S, B, H, freqs.shape[0], n_seqs, cp_size, cp_rank,
        sxs, sxb, sxh, sxd, sos, sob, soh, freqs.stride(0), freqs.stride(3),
        HALF=d2 // 2, HALF_PAD=half_pad, PASS=D - d2, PASS_PAD=_pow2(D - d2),
        IS_THD=is_thd, HAS_START=has_start, CP=cp_size > 1,
        SEARCH_STEPS=max(n_seqs, 1).bit_length() + 1,
        INTERLEAVED=interleaved, JOINT=cfg["JOINT"], BACKWARD=backward,
        PIN=x.is_cuda and not interpreter_enabled(), PREFETCH=cfg["PREFETCH"],
        HEADS_PER_PROG=cfg["HEADS_PER_PROG"], BLOCK_S=cfg["BLOCK_S"], BLOCK_B=cfg["BLOCK_B"],
        BLOCK_H=cfg["BLOCK_H"], num_warps=cfg["num_warps"],
    )  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------------
# 3. Input checks
# ------------------------------------------------------------------------------------------------


def _check_args(
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
    if tensor_format == "thd":
        lens = _check_cu_seqlens(cu_seqlens, t, cp_size)
        n_seqs = len(lens)
        need = lens  # global length of each sequence = positions it needs (cp: already global)
    else:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens is only valid when tensor_format is 'thd'")
        seq = t.shape[1] if tensor_format == "bshd" else t.shape[0]
        n_seqs = t.shape[0] if tensor_format == "bshd" else t.shape[1]
        if cp_size > 1 and seq % 2:
            raise ValueError(f"with cp_size > 1 the local sequence length must be even, got {seq}")
        need = [seq * cp_size] * n_seqs
    if start_positions is not None:
        check_index("start_positions", start_positions)
        if start_positions.shape[0] != n_seqs:
            raise ValueError(
                f"start_positions must have one entry per sequence ({n_seqs}), "
                f"got {start_positions.shape[0]}"
            )
        if not for_kernel or not t.is_cuda or debug_checks():
            starts = start_positions.tolist()
            if starts and min(starts) < 0:
                raise ValueError(f"start_positions must be >= 0, got min {min(starts)}")
            need = [n + s for n, s in zip(need, starts)]
    if need and max(need) > freqs.shape[0]:
        raise ValueError(
            f"freqs has {freqs.shape[0]} positions but the input needs {max(need)} "
            "(sequence length x cp_size + start position)"
        )
    return freqs.float()


def _check_cu_seqlens(cu_seqlens: object, t: torch.Tensor, cp_size: int) -> list[int]:
    """The (global) length of every packed sequence; reads ``cu_seqlens`` on the host."""
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
    return lens


# ------------------------------------------------------------------------------------------------
# 4. Autograd function
# ------------------------------------------------------------------------------------------------


class _RopeTEFunction(torch.autograd.Function):
    """TE-compatible fused RoPE; backward applies the transposed rotation to any-strided grads."""

    @staticmethod
    def forward(ctx, t, freqs, start_positions, tensor_format, interleaved, cu_seqlens, cp_size,
                cp_rank):  # fmt: skip
        out = _launch(
            t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank,
            backward=False,
        )  # fmt: skip
        ctx.save_for_backward(freqs, start_positions, cu_seqlens)
        ctx.args = (tensor_format, interleaved, cp_size, cp_rank)
        return out

    @staticmethod
    def backward(ctx, grad):
        freqs, start_positions, cu_seqlens = ctx.saved_tensors
        tensor_format, interleaved, cp_size, cp_rank = ctx.args
        grad_t = _launch(
            grad, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size,
            cp_rank, backward=True,
        )  # fmt: skip
        return grad_t, None, None, None, None, None, None, None


# ------------------------------------------------------------------------------------------------
# 5. Public API
# ------------------------------------------------------------------------------------------------


class RotaryPositionEmbedding(torch.nn.Module):
    """TE's ``RotaryPositionEmbedding``: ``forward(max_seq_len, offset)`` returns fp32 angles
    ``[max_seq_len, 1, 1, dim']`` (``dim' = int(dim * rotary_percent)``), each angle twice:
    ``cat(f, f)`` for rotate-half pairing, or repeated in place for interleaved pairing;
    ``rope_scaling`` (not TE's): Llama-3.1's scaled frequencies, as the model's tables."""

    def __init__(
        self,
        dim: int,
        rotary_percent: float = 1.0,
        seq_len_interpolation_factor: float | None = None,
        rotary_base: float = 10000.0,
        interleaved: bool = False,
        device: torch.device | str | None = None,
        rope_scaling: Llama3Scaling | None = None,
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
        self.register_buffer("inv_freq", te_inv_freq(dim, rotary_base, rope_scaling, device))

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
    freqs = _check_args(
        t, freqs, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank, for_kernel=True
    )
    if not (torch.is_grad_enabled() and t.requires_grad):  # inference: skip autograd's overhead
        return _launch(
            t, freqs, tensor_format, start_positions, bool(interleaved), cu_seqlens, cp_size,
            cp_rank, backward=False,
        )  # fmt: skip
    return _RopeTEFunction.apply(
        t, freqs, start_positions, tensor_format, bool(interleaved), cu_seqlens, cp_size, cp_rank
    )


# ------------------------------------------------------------------------------------------------
# 6. Reference
# ------------------------------------------------------------------------------------------------


def _positions_reference(
    t: torch.Tensor, tensor_format: str, start_positions: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, cp_size: int, cp_rank: int,
) -> torch.Tensor:  # fmt: skip
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


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
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
    freqs = _check_args(
        t, freqs, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank, for_kernel=False
    )
    pos = _positions_reference(t, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)
    ang = freqs[:, 0, 0, :][pos].unsqueeze(-2)  # [..., 1, d2]
    cos, sin = torch.cos(ang).to(t.dtype), torch.sin(ang).to(t.dtype)
    d2 = freqs.shape[-1]
    rot, rest = t[..., :d2], t[..., d2:]
    return torch.cat((rot * cos + _rotate_half(rot, interleaved) * sin, rest), dim=-1)
