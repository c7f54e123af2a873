"""RMSNorm (+ fused residual add), forward and backward, rounding like Meta's LLaMA.

Meta's ``RMSNorm.forward`` is ``self._norm(x.float()).type_as(x) * self.weight``: normalize in
fp32, round to the input dtype, THEN multiply by the weight (in fp32 from the rounded operands,
rounded to the promoted dtype). ``cast="meta"`` (default) reproduces that order (so does HF's
``LlamaRMSNorm``); ``cast="fp32"`` multiplies the fp32 normalized row by the weight and rounds
once (Gemma / Liger's ``casting_mode="gemma"``), for parity studies. Output dtype, both modes:
``torch.promote_types(x.dtype, weight.dtype)``, as PyTorch's ``type_as(x) * weight`` gives.
With ``residual``, ``h = x + residual`` rounded to x's dtype (as PyTorch's add) is computed in
the same pass and returned: ``(rms_norm(h), h)``.

Backward: gradients for x, weight and residual; the weight gradient is summed in fp32 per
program into a ``[programs, N]`` buffer reduced once (deterministic, no atomics). Rounding inside
the forward is treated as identity (straight-through), as autograd on the reference does.

Row layouts (``_layout``): a row up to MAX_SINGLE_BLOCK columns is held in registers as up to
three power-of-2 column chunks ``C0 >= C1 >= C2`` (5120 = 4096 + 1024, no padded 8192 block);
wider rows, and forward rows of three chunks without residual, loop over column blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from nakta_model.kernels._checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_same_device,
    check_tensor,
    check_triton_device,
    grad_rows,
    interpreter_enabled,
    rows_view,
    sm_count,
)
from nakta_model.kernels._triton_math import round_to, rsqrt

CAST_MODES = ("meta", "fp32")
MAX_SINGLE_BLOCK = 16384  # widest row held in registers at once; wider rows loop over blocks
MULTI_BLOCK_N = 4096  # column block used when a row does not fit in one block
MAX_HIDDEN = 65536


# ----------------------------------------------------------------------------------------------
# 1. Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _weight_mul(a, b, KEEP_FP32: tl.constexpr):
    """``a * b`` in fp32 where both operands are exact half-precision values (the rounded
    normalized row and the weight). LLVM turns such a product, rounded to bf16/fp16 right
    after, into one packed half multiply (HMUL2, same bits). ``KEEP_FP32`` issues ``mul.rn.f32``
    instead, which it leaves alone: on an H200 that measured 0.3-0.9% faster for rows held in
    one chunk without the residual add (4096, 8192), 2.5% slower for rows of several chunks
    (5120, 6656) and 0.4% slower with the residual add (results/nvidia-h200/ab/ab12)."""
    if KEEP_FP32:
        return libdevice.mul_rn(a, b)
    else:
        return a * b


@triton.jit
def _fwd_load(
    X, R, H, rows, row_ok, n_cols, stride_x, stride_r, stride_h,
    START: tl.constexpr, SIZE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    EMULATE_RNE: tl.constexpr, ONE_ROW: tl.constexpr,
):  # fmt: skip
    """One column chunk of h = x (+ residual, rounded and written to H), in fp32.

    ``ONE_ROW``: ``rows`` is one row index and the chunk a 1-D vector (no row mask: the grid
    has one program per row); otherwise ``rows`` is a vector and the chunk ``[rows, SIZE]``."""
    cols = START + tl.arange(0, SIZE)
    if ONE_ROW:
        mask = cols < n_cols
        x_off = rows * stride_x + cols
        r_off = rows * stride_r + cols
        h_off = rows * stride_h + cols
    else:
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        x_off = rows[:, None] * stride_x + cols[None, :]
        r_off = rows[:, None] * stride_r + cols[None, :]
        h_off = rows[:, None] * stride_h + cols[None, :]
    h = tl.load(X + x_off, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + r_off, mask=mask, other=0.0)
        h_low = round_to(h + r.to(tl.float32), X.dtype.element_ty, EMULATE_RNE)
        tl.store(H + h_off, h_low, mask=mask)
        h = h_low.to(tl.float32)
    return h


@triton.jit
def _fwd_weight(W, n_cols, stride_w, START: tl.constexpr, SIZE: tl.constexpr):
    """One column chunk of the weight in fp32."""
    cols = START + tl.arange(0, SIZE)
    return tl.load(W + cols * stride_w, mask=cols < n_cols, other=0.0).to(tl.float32)


@triton.jit
def _fwd_store(
    w, Y, h, rstd, rows, row_ok, n_cols, stride_y,
    START: tl.constexpr, SIZE: tl.constexpr, CAST_META: tl.constexpr, EMULATE_RNE: tl.constexpr,
    x_dtype: tl.constexpr, ONE_ROW: tl.constexpr, KEEP_FP32: tl.constexpr,
):  # fmt: skip
    """Normalize one column chunk, multiply by the (preloaded, fp32) weight, round and store."""
    cols = START + tl.arange(0, SIZE)
    col_ok = cols < n_cols
    if ONE_ROW:
        n = h * rstd
        wb = w
        mask = col_ok
        y_off = rows * stride_y + cols
    else:
        n = h * rstd[:, None]
        wb = w[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        y_off = rows[:, None] * stride_y + cols[None, :]
    if CAST_META:
        y = _weight_mul(round_to(n, x_dtype, EMULATE_RNE).to(tl.float32), wb, KEEP_FP32)
    else:
        y = wb * n
    y = round_to(y, Y.dtype.element_ty, EMULATE_RNE)
    tl.store(Y + y_off, y, mask=mask)


# The row/token count is not specialised on: every batch size runs one compiled kernel.
@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_fwd_kernel(
    X, R, W, Y, H, RSTD,
    n_rows, n_cols, stride_x, stride_r, stride_w, stride_y, stride_h, eps, inv_n,
    HAS_RESIDUAL: tl.constexpr, STORE_RSTD: tl.constexpr, CAST_META: tl.constexpr,
    BLOCK_M: tl.constexpr, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr, ACCURATE: tl.constexpr, EMULATE_RNE: tl.constexpr,
):  # fmt: skip
    """One program normalizes BLOCK_M whole rows (one row when it needs a column loop of C0)."""
    pid = tl.program_id(0).to(tl.int64)
    x_dtype = X.dtype.element_ty
    y_dtype = Y.dtype.element_ty
    if SINGLE_BLOCK:
        # The row is held as up to three power-of-2 column chunks (C0 >= C1 >= C2, 0 = unused),
        # e.g. 5120 = 4096 + 1024: no registers spent on a padded 8192-wide block.
        # One row in one chunk per program: 1-D vectors, as Liger does (measured ~1-2% faster at
        # 4096 on an H200 than the same work as a [1, N] tile; rows held as several chunks,
        # 5120 and 6656, measured slower as 1-D vectors and keep the [1, chunk] tiles).
        ONE_ROW: tl.constexpr = (BLOCK_M == 1) and (C1 == 0)
        # Weight multiply as fp32 mul.rn where that measured faster (see _weight_mul); the
        # interpreter has no libdevice and multiplies plainly (same value).
        KEEP_FP32: tl.constexpr = (C1 == 0) and (not HAS_RESIDUAL) and ACCURATE
        if ONE_ROW:
            rows = pid
            row_ok = pid < n_rows
        else:
            rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = rows < n_rows
        # A one-chunk row loads its weight before the reduction (+2% at 4096); rows of several
        # chunks load each chunk's weight at its store, which measured 3% faster at 5120/6656
        # (fewer registers live across the reduction).
        if C1 == 0:
            w0 = _fwd_weight(W, n_cols, stride_w, 0, C0)
        h0 = _fwd_load(X, R, H, rows, row_ok, n_cols, stride_x, stride_r, stride_h, 0, C0,
                       HAS_RESIDUAL, EMULATE_RNE, ONE_ROW)  # fmt: skip
        ss = tl.sum(h0 * h0, axis=len(h0.shape) - 1)
        if C1 > 0:
            h1 = _fwd_load(X, R, H, rows, row_ok, n_cols, stride_x, stride_r, stride_h, C0, C1,
                           HAS_RESIDUAL, EMULATE_RNE, ONE_ROW)  # fmt: skip
            ss += tl.sum(h1 * h1, axis=len(h1.shape) - 1)
        if C2 > 0:
            h2 = _fwd_load(X, R, H, rows, row_ok, n_cols, stride_x, stride_r, stride_h, C0 + C1,
                           C2, HAS_RESIDUAL, EMULATE_RNE, ONE_ROW)  # fmt: skip
            ss += tl.sum(h2 * h2, axis=len(h2.shape) - 1)
        rstd = rsqrt(ss * inv_n + eps, ACCURATE)
        if STORE_RSTD:
            tl.store(RSTD + rows, rstd, mask=row_ok)
        if C1 > 0:
            w0 = _fwd_weight(W, n_cols, stride_w, 0, C0)
        _fwd_store(w0, Y, h0, rstd, rows, row_ok, n_cols, stride_y, 0, C0, CAST_META, EMULATE_RNE,
                   x_dtype, ONE_ROW, KEEP_FP32)  # fmt: skip
        if C1 > 0:
            _fwd_store(_fwd_weight(W, n_cols, stride_w, C0, C1), Y, h1, rstd, rows, row_ok,
                       n_cols, stride_y, C0, C1, CAST_META, EMULATE_RNE, x_dtype, ONE_ROW,
                       KEEP_FP32)  # fmt: skip
        if C2 > 0:
            _fwd_store(_fwd_weight(W, n_cols, stride_w, C0 + C1, C2), Y, h2, rstd, rows, row_ok,
                       n_cols, stride_y, C0 + C1, C2, CAST_META, EMULATE_RNE, x_dtype, ONE_ROW,
                       KEEP_FP32)  # fmt: skip
    else:
        # Row wider than one block: pass 1 sums squares (and writes h), pass 2 normalizes.
        # Pass 2 recomputes h from x and residual rather than reading back what pass 1 wrote.
        # Pass 1 asks L2 to keep the row (evict_last) and pass 2 to drop it (evict_first), so
        # pass 2 reads it from L2, not DRAM: 1.08-1.2x faster at 6656 and 8192 on an H200
        # (results/nvidia-h200/ab/ab15), the hints torch.compile's looped reductions use.
        row = pid
        cols = tl.arange(0, C0)
        acc = tl.zeros([C0], dtype=tl.float32)
        for start in range(0, n_cols, C0):
            c = start + cols
            mask = c < n_cols
            h = tl.load(X + row * stride_x + c, mask=mask, other=0.0, eviction_policy="evict_last")
            h = h.to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(
                    R + row * stride_r + c, mask=mask, other=0.0, eviction_policy="evict_last"
                )
                r = r.to(tl.float32)
                h_low = round_to(h + r, x_dtype, EMULATE_RNE)
                tl.store(H + row * stride_h + c, h_low, mask=mask)
                h = h_low.to(tl.float32)
            acc += h * h
        rstd = rsqrt(tl.sum(acc, axis=0) * inv_n + eps, ACCURATE)
        if STORE_RSTD:
            tl.store(RSTD + row, rstd)
        for start in range(0, n_cols, C0):
            c = start + cols
            mask = c < n_cols
            h = tl.load(X + row * stride_x + c, mask=mask, other=0.0, eviction_policy="evict_first")
            h = h.to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(
                    R + row * stride_r + c, mask=mask, other=0.0, eviction_policy="evict_first"
                )
                h = round_to(h + r.to(tl.float32), x_dtype, EMULATE_RNE).to(tl.float32)
            w = tl.load(W + c * stride_w, mask=mask, other=0.0, eviction_policy="evict_last")
            w = w.to(tl.float32)
            n = h * rstd
            if CAST_META:
                y = round_to(n, x_dtype, EMULATE_RNE).to(tl.float32) * w
            else:
                y = w * n
            tl.store(Y + row * stride_y + c, round_to(y, y_dtype, EMULATE_RNE), mask=mask)


@triton.jit
def _bwd_load(
    DY, H, W, rows, row_ok, rstd, n_cols, stride_dy, stride_h, stride_w,
    START: tl.constexpr, SIZE: tl.constexpr,
):  # fmt: skip
    """A tile's columns ``[START, START + SIZE)``: (dy, n = h * rstd, dn = dy * w), all fp32."""
    cols = START + tl.arange(0, SIZE)
    col_ok = cols < n_cols
    mask = row_ok[:, None] & col_ok[None, :]
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    h = tl.load(H + rows[:, None] * stride_h + cols[None, :], mask=mask, other=0.0)
    w = tl.load(W + cols * stride_w, mask=col_ok, other=0.0).to(tl.float32)
    dy = dy.to(tl.float32)
    n = h.to(tl.float32) * rstd[:, None]
    return dy, n, dy * w[None, :]


@triton.jit
def _bwd_store(
    DH_OUT, DX, DR, dy, n, dn, rstd, dot, rows, row_ok, n_cols,
    stride_dh_out, stride_dx, stride_dr, START: tl.constexpr, SIZE: tl.constexpr,
    HAS_DH_OUT: tl.constexpr, HAS_DR: tl.constexpr, CAST_META: tl.constexpr,
    COMPUTE_DW: tl.constexpr, EMULATE_RNE: tl.constexpr, h_dtype: tl.constexpr,
):  # fmt: skip
    """dh of a tile's columns (stored to DX and DR); returns the tile's dw contribution."""
    cols = START + tl.arange(0, SIZE)
    mask = row_ok[:, None] & (cols < n_cols)[None, :]
    dh = rstd[:, None] * (dn - n * dot[:, None])
    if HAS_DH_OUT:
        dho = tl.load(DH_OUT + rows[:, None] * stride_dh_out + cols[None, :], mask=mask, other=0.0)
        dh += dho.to(tl.float32)
    dh_low = round_to(dh, DX.dtype.element_ty, EMULATE_RNE)
    tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dh_low, mask=mask)
    if HAS_DR:
        tl.store(DR + rows[:, None] * stride_dr + cols[None, :], dh_low, mask=mask)
    if COMPUTE_DW:
        if CAST_META:
            n_used = round_to(n, h_dtype, EMULATE_RNE).to(tl.float32)
        else:
            n_used = n
        part = tl.sum(dy * n_used, axis=0)
    else:
        part = tl.zeros([SIZE], dtype=tl.float32)
    return part


@triton.jit
def _rms_norm_bwd_kernel(
    DY, H, W, RSTD, DH_OUT, DX, DR, DW_PARTIAL, DOT,
    n_rows, n_cols, stride_dy, stride_h, stride_w, stride_dh_out, stride_dx, stride_dr,
    inv_n, rows_per_program,
    HAS_DH_OUT: tl.constexpr, HAS_DR: tl.constexpr, CAST_META: tl.constexpr,
    COMPUTE_DW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr, EMULATE_RNE: tl.constexpr,
):  # fmt: skip
    """dh = rstd * (dn - n * mean(dn * n)), dn = dy * w, n = h * rstd; dw = sum_rows dy * n.

    Each program owns one row of DW_PARTIAL (fp32), so the weight gradient needs no atomics.
    """
    pid = tl.program_id(0).to(tl.int64)
    h_dtype = H.dtype.element_ty
    dx_dtype = DX.dtype.element_ty
    if SINGLE_BLOCK:
        # Tiles of BLOCK_M rows, interleaved over programs (tile pid, pid + programs, ...), so
        # the programs running at one moment stream through neighbouring rows. The row is held
        # in one padded block of BLOCK_N columns.
        num_programs = tl.num_programs(0)
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        for tile in range(pid, tl.cdiv(n_rows, BLOCK_M), num_programs):
            rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = rows < n_rows
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
            dy, n, dn = _bwd_load(DY, H, W, rows, row_ok, rstd, n_cols, stride_dy, stride_h,
                                  stride_w, 0, BLOCK_N)  # fmt: skip
            dot = tl.sum(dn * n, axis=1)
            dot = dot * inv_n
            dw += _bwd_store(DH_OUT, DX, DR, dy, n, dn, rstd, dot, rows, row_ok, n_cols,
                             stride_dh_out, stride_dx, stride_dr, 0, BLOCK_N, HAS_DH_OUT, HAS_DR,
                             CAST_META, COMPUTE_DW, EMULATE_RNE, h_dtype)  # fmt: skip
        if COMPUTE_DW:
            c = tl.arange(0, BLOCK_N)
            tl.store(DW_PARTIAL + pid * n_cols + c, dw, mask=c < n_cols)
    else:
        # Row wider than one block; each program owns a contiguous chunk of rows. Phase A:
        # per-row dot(dn, n) into DOT[row]. Phase B: one column block at a time over the
        # chunk, so the weight-gradient partial stays in registers.
        row_start = pid * rows_per_program
        row_end = tl.minimum(row_start + rows_per_program, n_rows)
        cols = tl.arange(0, BLOCK_N)
        for row in range(row_start, row_end):
            rstd = tl.load(RSTD + row)
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_N):
                c = start + cols
                col_ok = c < n_cols
                dy = tl.load(DY + row * stride_dy + c, mask=col_ok, other=0.0).to(tl.float32)
                h = tl.load(H + row * stride_h + c, mask=col_ok, other=0.0).to(tl.float32)
                w = tl.load(W + c * stride_w, mask=col_ok, other=0.0).to(tl.float32)
                acc += dy * w * (h * rstd)
            tl.store(DOT + row, tl.sum(acc, axis=0) * inv_n)
        tl.debug_barrier()  # DOT written above must be visible to every thread below
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            col_ok = c < n_cols
            w = tl.load(W + c * stride_w, mask=col_ok, other=0.0).to(tl.float32)
            dw = tl.zeros([BLOCK_N], dtype=tl.float32)
            for row in range(row_start, row_end):
                rstd = tl.load(RSTD + row)
                dot = tl.load(DOT + row)
                dy = tl.load(DY + row * stride_dy + c, mask=col_ok, other=0.0).to(tl.float32)
                h = tl.load(H + row * stride_h + c, mask=col_ok, other=0.0).to(tl.float32)
                n = h * rstd
                dh = rstd * (dy * w - n * dot)
                if HAS_DH_OUT:
                    dho = tl.load(DH_OUT + row * stride_dh_out + c, mask=col_ok, other=0.0)
                    dh += dho.to(tl.float32)
                dh_low = round_to(dh, dx_dtype, EMULATE_RNE)
                tl.store(DX + row * stride_dx + c, dh_low, mask=col_ok)
                if HAS_DR:
                    tl.store(DR + row * stride_dr + c, dh_low, mask=col_ok)
                if COMPUTE_DW:
                    if CAST_META:
                        dw += dy * round_to(n, h_dtype, EMULATE_RNE).to(tl.float32)
                    else:
                        dw += dy * n
            if COMPUTE_DW:
                tl.store(DW_PARTIAL + pid * n_cols + c, dw, mask=col_ok)


# ----------------------------------------------------------------------------------------------
# 2. Row layout and launch configuration
# ----------------------------------------------------------------------------------------------

MIN_CHUNK = 256  # smallest column chunk of a split row
# Forward rows that need three chunks (e.g. 6656 = 4096 + 2048 + 512) and no residual loop
# over column blocks of this width instead, in two passes (the second reads the row back from
# L2): 3% faster at 6656 on an H200 and level with torch.compile's looped kernel, where every
# chunked launch configuration measured slower (results/nvidia-h200/ab/ab14, ab15). With the
# residual add the chunked rows stay (97-99% of copy bandwidth at 6656 in the sweep); the loop
# was not measured with the residual, where its second pass re-reads x and the residual.
LOOPED_THREE_CHUNK_BLOCK = 2048


def column_chunks(n_cols: int) -> tuple[int, int, int]:
    """Up to three power-of-2 column chunks, largest first, that hold a row of ``n_cols``.

    Why: one power-of-2 block pads 5120 to 8192 (and 6656 to 8192), so registers and threads
    are spent on masked lanes; 4096 + 1024 (and 4096 + 2048 + 512) cover those rows exactly.
    Widths are rounded up to MIN_CHUNK; a remainder needing more than three chunks is padded.
    """
    m = -(-n_cols // MIN_CHUNK) * MIN_CHUNK
    chunks = []
    while m and len(chunks) < 2:
        c = 1 << (m.bit_length() - 1)
        chunks.append(c)
        m -= c
    if m:
        chunks.append(triton.next_power_of_2(m))
    if n_cols <= MIN_CHUNK:
        chunks = [triton.next_power_of_2(n_cols)]
    return tuple(chunks + [0] * (3 - len(chunks)))


def _layout(
    n_cols: int, block_n: int | None, split_rows: bool = True
) -> tuple[tuple[int, int, int], bool]:
    """``((C0, C1, C2), single)``: the chunks of a row held at once, or (block, 0, 0) and
    False when the kernels loop over column blocks. ``block_n`` forces one block of that size;
    ``split_rows=False`` holds the row in one padded power-of-2 block.
    """
    if block_n is not None:
        return (block_n, 0, 0), block_n >= n_cols
    full = triton.next_power_of_2(n_cols)
    if full > MAX_SINGLE_BLOCK:
        return (MULTI_BLOCK_N, 0, 0), False
    return (column_chunks(n_cols) if split_rows else (full, 0, 0)), True


def _fwd_layout(
    n_cols: int, block_n: int | None, has_residual: bool
) -> tuple[tuple[int, int, int], bool]:
    """The forward's layout: ``_layout``, except that rows of three chunks without a residual
    loop over LOOPED_THREE_CHUNK_BLOCK-wide blocks (see above)."""
    chunks, single = _layout(n_cols, block_n)
    if block_n is None and single and chunks[2] and not has_residual:
        return (LOOPED_THREE_CHUNK_BLOCK, 0, 0), False
    return chunks, single


# Launch configurations by (kernel, row width held = sum of the column chunks), chosen by
# ``kernel_benchmark/bench_rmsnorm.py --tune`` on an NVIDIA H200 (16K rows, bf16;
# results/nvidia-h200/rmsnorm_tune.csv); the forward at 4096 from interleaved A/B runs
# (results/nvidia-h200/ab/ab5_rmsnorm_layouts.json: one 1-D row per program, 8 warps, beat the
# [2, 4096] tile by ~1.5%). The bench rewrites these entries for its own run; the values kept
# here are the ones its published results used. Other widths follow ``_rule``. ``_TUNE``
# overrides BLOCK_M / num_warps / PROGRAMS_PER_SM, and sets BLOCK_N (rows laid out as one
# column block of that width) and PROGRAMS (backward grid); set by the benchmark and tests only.
_CONFIGS: dict[tuple[str, int], dict[str, int]] = {
    ("fwd", 4096): dict(BLOCK_M=1, num_warps=8),
    ("fwd", 5120): dict(BLOCK_M=1, num_warps=4),
    ("fwd", 6656): dict(BLOCK_M=1, num_warps=4),
    ("fwd", 8192): dict(BLOCK_M=2, num_warps=16),
    ("bwd", 4096): dict(BLOCK_M=2, num_warps=8, PROGRAMS_PER_SM=2),
    ("bwd", 8192): dict(BLOCK_M=2, num_warps=16, PROGRAMS_PER_SM=1),
}
_TUNE: dict[str, int] = {}


def _rule(kernel: str, held: int, single: bool) -> dict[str, int]:
    """The configuration of a row width the table does not hold (or of the column loop)."""
    if not single:
        block_m, num_warps, per_sm = 1, 8, 4
    elif held >= 8192:
        block_m, num_warps, per_sm = 1, 16, 2
    elif held >= 2048:
        block_m, num_warps, per_sm = 1, 8, 2
    else:
        block_m, num_warps, per_sm = max(1, 2048 // held), 4, 4
    cfg = dict(BLOCK_M=block_m, num_warps=num_warps)
    return (cfg | dict(PROGRAMS_PER_SM=per_sm)) if kernel == "bwd" else cfg


def _config(kernel: str, n_cols: int, has_residual: bool = False) -> dict[str, int]:
    """Row layout (C0, C1, C2, SINGLE_BLOCK) and launch values of the ``"fwd"`` or ``"bwd"``
    kernel for rows of ``n_cols``: the table entry of the width held, else ``_rule``, then
    ``_TUNE``. The backward holds a row in one padded block (C1 = C2 = 0): on an H200 (16K
    rows, bf16) rows split into chunks as in the forward were no faster at 5120 (196 vs
    200 us) and slower at 6656 (248 vs 213 us), so that variant was removed."""
    block_n = _TUNE.get("BLOCK_N")
    if kernel == "fwd":
        chunks, single = _fwd_layout(n_cols, block_n, has_residual)
    else:
        chunks, single = _layout(n_cols, block_n, split_rows=False)
    cfg = dict(_CONFIGS.get((kernel, sum(chunks)), {})) if single else {}
    cfg = {**(cfg or _rule(kernel, sum(chunks), single)), **_TUNE}
    cfg["BLOCK_M"] = cfg["BLOCK_M"] if single else 1
    return cfg | dict(C0=chunks[0], C1=chunks[1], C2=chunks[2], SINGLE_BLOCK=single)


# ----------------------------------------------------------------------------------------------
# 3. Launchers and input checks
# ----------------------------------------------------------------------------------------------


def _check_cast(cast: object) -> bool:
    """True for Meta's rounding order, False for all-fp32."""
    if cast not in CAST_MODES:
        raise ValueError(f"cast must be one of {CAST_MODES}, got {cast!r}")
    return cast == "meta"


def _check_eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    return float(eps)


def _rows_view(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, N]`` (``rows_view``), with a non-empty last dimension."""
    if t.dim() < 1 or t.shape[-1] == 0:
        raise ValueError(f"{name} must have a non-empty last dimension, got shape {tuple(t.shape)}")
    return rows_view(name, t, "hidden")


def _check_args(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Validate a forward call; returns x and residual as ``[rows, N]`` views."""
    check_tensor("x", x)
    check_tensor("weight", weight)
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("weight", weight, FLOAT_DTYPES)
    n = x.shape[-1] if x.dim() else 0
    if weight.dim() != 1 or weight.shape[0] != n:
        raise ValueError(
            f"weight must have shape ({n},) to match the last dim of x {tuple(x.shape)}, "
            f"got {tuple(weight.shape)}"
        )
    if not 1 <= n <= MAX_HIDDEN:
        raise ValueError(f"x last dim must be in [1, {MAX_HIDDEN}], got {n}")
    if residual is not None:
        check_tensor("residual", residual)
        if residual.shape != x.shape:
            raise ValueError(
                f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}"
            )
        if residual.dtype != x.dtype:
            raise TypeError(f"residual must have the dtype of x ({x.dtype}), got {residual.dtype}")
    check_same_device(x=x, weight=weight, residual=residual)
    check_triton_device("x", x)
    x2 = _rows_view("x", x)
    r2 = _rows_view("residual", residual) if residual is not None else None
    return x2, r2


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
    residual: torch.Tensor | None = None, cast: str = "meta", store_rstd: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """Launch the forward kernel: ``(y, h or None, rstd or None)``."""
    cast_meta = _check_cast(cast)
    eps = _check_eps(eps)
    x2, r2 = _check_args(x, weight, residual)
    n_rows, n_cols = x2.shape
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device) if r2 is not None else None
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device) if store_rstd else None
    if n_rows == 0:
        return y, h, rstd
    cfg = _config("fwd", n_cols, r2 is not None)
    y2 = y.view(-1, n_cols)
    h2 = h.view(-1, n_cols) if h is not None else y2
    interp = interpreter_enabled()
    _rms_norm_fwd_kernel[(triton.cdiv(n_rows, cfg["BLOCK_M"]),)](
        x2, r2 if r2 is not None else x2, weight, y2, h2, rstd if rstd is not None else y2,
        n_rows, n_cols, x2.stride(0), r2.stride(0) if r2 is not None else 0, weight.stride(0),
        y2.stride(0), h2.stride(0), eps, 1.0 / n_cols,
        HAS_RESIDUAL=r2 is not None, STORE_RSTD=rstd is not None, CAST_META=cast_meta,
        BLOCK_M=cfg["BLOCK_M"], C0=cfg["C0"], C1=cfg["C1"], C2=cfg["C2"],
        SINGLE_BLOCK=cfg["SINGLE_BLOCK"], ACCURATE=not interp, EMULATE_RNE=interp,
        num_warps=cfg["num_warps"],
    )  # fmt: skip
    return y, h, rstd


def rms_norm_backward(
    dy: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
    dh_out: torch.Tensor | None = None, cast: str = "meta",
    need_dx: bool = True, need_dr: bool = False, need_dw: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """Launch the backward kernel: ``(dx, dresidual, dweight)`` (None where not needed).

    ``h`` is the normalized input (x, or x + residual), ``rstd`` the forward's fp32 1/rms per
    row, ``dh_out`` the gradient flowing into the returned ``h`` (residual variant only).
    """
    cast_meta = _check_cast(cast)
    h2 = _rows_view("h", h)
    dy2 = _rows_view("dy", dy)
    if dy.shape != h.shape:
        raise ValueError(f"dy must have shape {tuple(h.shape)}, got {tuple(dy.shape)}")
    dho2 = _rows_view("dh_out", dh_out) if dh_out is not None else None
    n_rows, n_cols = h2.shape
    dx = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    dr = torch.empty(h.shape, dtype=h.dtype, device=h.device) if need_dr else None
    cfg = _config("bwd", n_cols)
    single, block_m = cfg["SINGLE_BLOCK"], cfg["BLOCK_M"]
    programs = cfg.get("PROGRAMS") or sm_count(h.device, 4) * cfg["PROGRAMS_PER_SM"]
    # single block: row tiles interleaved over programs; else contiguous chunks of rows
    programs = max(1, min(programs, triton.cdiv(n_rows, block_m)))
    rpp = triton.cdiv(n_rows, programs)
    if not single:
        programs = triton.cdiv(n_rows, rpp) if n_rows else 0
    elif n_rows == 0:
        programs = 0
    f32 = dict(dtype=torch.float32, device=h.device)
    dw_partial = torch.empty((programs, n_cols), **f32) if need_dw else None
    dot = torch.empty(n_rows, **f32) if not single else None
    dx2 = dx.view(-1, n_cols)
    dr2 = dr.view(-1, n_cols) if dr is not None else dx2
    if programs:
        _rms_norm_bwd_kernel[(programs,)](
            dy2, h2, weight, rstd, dho2 if dho2 is not None else dy2, dx2, dr2,
            dw_partial if dw_partial is not None else rstd, dot if dot is not None else rstd,
            n_rows, n_cols, dy2.stride(0), h2.stride(0), weight.stride(0),
            dho2.stride(0) if dho2 is not None else 0, dx2.stride(0), dr2.stride(0),
            1.0 / n_cols, rpp,
            HAS_DH_OUT=dho2 is not None, HAS_DR=dr is not None, CAST_META=cast_meta,
            COMPUTE_DW=need_dw, BLOCK_M=block_m, BLOCK_N=cfg["C0"], SINGLE_BLOCK=single,
            EMULATE_RNE=interpreter_enabled(), num_warps=cfg["num_warps"],
        )  # fmt: skip
    dw = None
    if need_dw:
        dw = dw_partial.sum(0).to(weight.dtype) if programs else torch.zeros_like(weight)
    return (dx if need_dx else None), dr, dw


# ----------------------------------------------------------------------------------------------
# 4. Autograd
# ----------------------------------------------------------------------------------------------


class RMSNormFunction(torch.autograd.Function):
    """``rms_norm`` with a Triton backward; returns ``y`` or ``(y, h)`` with a residual."""

    @staticmethod
    def forward(ctx, x, weight, residual, eps, cast):
        y, h, rstd = rms_norm_forward(x, weight, eps, residual, cast, store_rstd=True)
        ctx.cast = cast
        ctx.has_residual = residual is not None
        ctx.save_for_backward(h if h is not None else x, weight, rstd)
        return y if h is None else (y, h)

    @staticmethod
    def backward(ctx, dy, dh_out=None):
        h, weight, rstd = ctx.saved_tensors
        need_x, need_w, need_r = ctx.needs_input_grad[:3]
        if dy is None:  # only h was used downstream
            dy = torch.zeros(
                h.shape, dtype=torch.promote_types(h.dtype, weight.dtype), device=h.device
            )
        dy, dh_out = grad_rows(dy), grad_rows(dh_out)
        dx, dr, dw = rms_norm_backward(
            dy, h, weight, rstd, dh_out, ctx.cast, need_dx=need_x or need_r,
            need_dr=need_x and need_r, need_dw=need_w,
        )  # fmt: skip
        if need_r and not need_x:
            dr, dx = dx, None
        return dx, dw, dr, None, None


# ----------------------------------------------------------------------------------------------
# 5. Public functions
# ----------------------------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    cast: str = "meta",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim; with ``residual`` returns ``(rms_norm(x + residual), x + residual)``.

    Rounds like Meta's LLaMA with ``cast="meta"``; see the module docstring for ``cast="fp32"``.
    """
    tensors = (x, weight) if residual is None else (x, weight, residual)
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
    )
    if needs_grad:
        return RMSNormFunction.apply(x, weight, residual, eps, cast)
    y, h, _ = rms_norm_forward(x, weight, eps, residual, cast)
    return y if h is None else (y, h)


# ----------------------------------------------------------------------------------------------
# 6. Reference
# ----------------------------------------------------------------------------------------------


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    cast: str = "meta",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch with the same semantics (Meta's code for ``cast="meta"``); any device.

    Computes in fp32 (fp64 for fp64 inputs, which the kernel does not accept but which makes
    this a high-precision reference for gradient checks).
    """
    cast_meta = _check_cast(cast)
    h = x if residual is None else x + residual
    compute = torch.promote_types(h.dtype, torch.float32)
    hf = h.to(compute)
    n = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if cast_meta:
        y = n.type_as(h) * weight
    else:
        y = (weight.to(compute) * n).to(torch.promote_types(h.dtype, weight.dtype))
    return y if residual is None else (y, h)
