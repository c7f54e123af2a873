"""The Triton kernels of ``rmsnorm.py``: forward (+ residual add) and backward.

Kept apart from the launchers so that neither file grows past a readable size; what they compute
and how they round is in ``rmsnorm.py``'s docstring, and ``rmsnorm.py`` chooses every constexpr
(row layout ``C0/C1/C2`` or ``BLOCK_N``, ``SINGLE_BLOCK``, ``BLOCK_M``) and launches them.
Rows held in registers are split into up to three power-of-2 column chunks ``C0 >= C1 >= C2``
(0 = unused); rows that are not loop over column blocks in two passes.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from nakta_model.kernels._triton_math import fp8_codes, fp8_row_scales, round_to, rsqrt

# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


@triton.jit
def _weight_mul(a, b, KEEP_FP32: tl.constexpr):
    """``a * b`` in fp32 where both operands are exact half-precision values (the rounded
    normalized row and the weight). LLVM turns such a product, rounded to bf16/fp16 right
    after, into one packed half multiply (HMUL2, same bits). ``KEEP_FP32`` issues ``mul.rn.f32``
    instead, which it leaves alone: on an H200 that measured 0.3-0.9% faster for rows held in
    one chunk without the residual add (4096, 8192), 2.5% slower for rows of several chunks
    (5120, 6656) and 0.4% slower with the residual add."""
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
def _fwd_offsets(rows, row_ok, n_cols, stride, START: tl.constexpr, SIZE: tl.constexpr,
                 ONE_ROW: tl.constexpr):  # fmt: skip
    """Offsets and mask of one column chunk of the output rows."""
    cols = START + tl.arange(0, SIZE)
    col_ok = cols < n_cols
    if ONE_ROW:
        return rows * stride + cols, col_ok
    else:
        return rows[:, None] * stride + cols[None, :], row_ok[:, None] & col_ok[None, :]


@triton.jit
def _fwd_value(
    w, h, rstd, CAST_META: tl.constexpr, EMULATE_RNE: tl.constexpr, x_dtype: tl.constexpr,
    y_dtype: tl.constexpr, ONE_ROW: tl.constexpr, KEEP_FP32: tl.constexpr,
):  # fmt: skip
    """Normalize one column chunk and multiply by the (preloaded, fp32) weight, rounded to
    ``y_dtype``."""
    if ONE_ROW:
        n = h * rstd
        wb = w
    else:
        n = h * rstd[:, None]
        wb = w[None, :]
    if CAST_META:
        y = _weight_mul(round_to(n, x_dtype, EMULATE_RNE).to(tl.float32), wb, KEEP_FP32)
    else:
        y = wb * n
    return round_to(y, y_dtype, EMULATE_RNE)


@triton.jit
def _fwd_store(
    w, Y, h, rstd, rows, row_ok, n_cols, stride_y,
    START: tl.constexpr, SIZE: tl.constexpr, CAST_META: tl.constexpr, EMULATE_RNE: tl.constexpr,
    x_dtype: tl.constexpr, ONE_ROW: tl.constexpr, KEEP_FP32: tl.constexpr,
):  # fmt: skip
    """Normalize one column chunk, multiply by the (preloaded, fp32) weight, round and store."""
    y = _fwd_value(w, h, rstd, CAST_META, EMULATE_RNE, x_dtype, Y.dtype.element_ty, ONE_ROW,
                   KEEP_FP32)  # fmt: skip
    y_off, mask = _fwd_offsets(rows, row_ok, n_cols, stride_y, START, SIZE, ONE_ROW)
    tl.store(Y + y_off, y, mask=mask)


@triton.jit
def _row_amax(y):
    """Largest magnitude of each row of a chunk (of the 1-D chunk with one row)."""
    return tl.max(tl.abs(y), axis=len(y.shape) - 1)


@triton.jit
def _fwd_store_codes(
    Q, y, inv, rows, row_ok, n_cols, stride_q, START: tl.constexpr, SIZE: tl.constexpr,
    ONE_ROW: tl.constexpr, EMULATE_RNE: tl.constexpr,
):  # fmt: skip
    """Store one chunk of fp32 values ``y`` as FP8 codes at the rows' ``inv = 448 / amax``."""
    q_off, mask = _fwd_offsets(rows, row_ok, n_cols, stride_q, START, SIZE, ONE_ROW)
    if ONE_ROW:
        q = fp8_codes(y, inv, EMULATE_RNE)
    else:
        q = fp8_codes(y, inv[:, None], EMULATE_RNE)
    tl.store(Q + q_off, q, mask=mask)


@triton.jit
def _loop_value(
    X, R, W, row, c, mask, stride_x, stride_r, stride_w, rstd,
    HAS_RESIDUAL: tl.constexpr, CAST_META: tl.constexpr, EMULATE_RNE: tl.constexpr,
    x_dtype: tl.constexpr, y_dtype: tl.constexpr, EVICT: tl.constexpr,
):  # fmt: skip
    """The looped layout's normalized values of columns ``c`` of ``row``, recomputed from x
    (and the residual), rounded to ``y_dtype``, in fp32."""
    h = tl.load(X + row * stride_x + c, mask=mask, other=0.0, eviction_policy=EVICT)
    h = h.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + c, mask=mask, other=0.0, eviction_policy=EVICT)
        h = round_to(h + r.to(tl.float32), x_dtype, EMULATE_RNE).to(tl.float32)
    w = tl.load(W + c * stride_w, mask=mask, other=0.0, eviction_policy="evict_last")
    w = w.to(tl.float32)
    n = h * rstd
    if CAST_META:
        y = round_to(n, x_dtype, EMULATE_RNE).to(tl.float32) * w
    else:
        y = w * n
    return round_to(y, y_dtype, EMULATE_RNE).to(tl.float32)


# The row/token count is not specialised on: every batch size runs one compiled kernel.
@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_fwd_kernel(
    X, R, W, Y, H, RSTD, S,
    n_rows, n_cols, stride_x, stride_r, stride_w, stride_y, stride_h, eps, inv_n,
    HAS_RESIDUAL: tl.constexpr, STORE_RSTD: tl.constexpr, CAST_META: tl.constexpr,
    BLOCK_M: tl.constexpr, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr, ACCURATE: tl.constexpr, EMULATE_RNE: tl.constexpr,
    QUANT: tl.constexpr, Y_DTYPE: tl.constexpr, MIN_AMAX: tl.constexpr,
):  # fmt: skip
    """One program normalizes BLOCK_M whole rows (one row when it needs a column loop of C0).

    ``QUANT``: ``Y`` is FP8 and ``S`` the fp32 row scales: each row's normalized values are
    rounded to ``Y_DTYPE`` (what the unquantized kernel stores), then quantized by
    ``fp8_quant.py``'s rule over the whole row (held in registers, or one more column pass).
    """
    pid = tl.program_id(0).to(tl.int64)
    x_dtype = X.dtype.element_ty
    y_dtype = Y_DTYPE
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
        if QUANT:
            y0 = _fwd_value(w0, h0, rstd, CAST_META, EMULATE_RNE, x_dtype, y_dtype, ONE_ROW,
                            KEEP_FP32).to(tl.float32)  # fmt: skip
            amax = _row_amax(y0)
            if C1 > 0:
                y1 = _fwd_value(_fwd_weight(W, n_cols, stride_w, C0, C1), h1, rstd, CAST_META,
                                EMULATE_RNE, x_dtype, y_dtype, ONE_ROW, KEEP_FP32).to(tl.float32)  # fmt: skip
                amax = tl.maximum(amax, _row_amax(y1))
            if C2 > 0:
                y2 = _fwd_value(_fwd_weight(W, n_cols, stride_w, C0 + C1, C2), h2, rstd,
                                CAST_META, EMULATE_RNE, x_dtype, y_dtype, ONE_ROW,
                                KEEP_FP32).to(tl.float32)  # fmt: skip
                amax = tl.maximum(amax, _row_amax(y2))
            inv, scale = fp8_row_scales(amax, MIN_AMAX)
            _fwd_store_codes(Y, y0, inv, rows, row_ok, n_cols, stride_y, 0, C0, ONE_ROW,
                             EMULATE_RNE)  # fmt: skip
            if C1 > 0:
                _fwd_store_codes(Y, y1, inv, rows, row_ok, n_cols, stride_y, C0, C1, ONE_ROW,
                                 EMULATE_RNE)  # fmt: skip
            if C2 > 0:
                _fwd_store_codes(Y, y2, inv, rows, row_ok, n_cols, stride_y, C0 + C1, C2,
                                 ONE_ROW, EMULATE_RNE)  # fmt: skip
            tl.store(S + rows, scale, mask=row_ok)
        else:
            _fwd_store(w0, Y, h0, rstd, rows, row_ok, n_cols, stride_y, 0, C0, CAST_META,
                       EMULATE_RNE, x_dtype, ONE_ROW, KEEP_FP32)  # fmt: skip
            if C1 > 0:
                _fwd_store(_fwd_weight(W, n_cols, stride_w, C0, C1), Y, h1, rstd, rows, row_ok,
                           n_cols, stride_y, C0, C1, CAST_META, EMULATE_RNE, x_dtype, ONE_ROW,
                           KEEP_FP32)  # fmt: skip
            if C2 > 0:
                _fwd_store(_fwd_weight(W, n_cols, stride_w, C0 + C1, C2), Y, h2, rstd, rows,
                           row_ok, n_cols, stride_y, C0 + C1, C2, CAST_META, EMULATE_RNE, x_dtype,
                           ONE_ROW, KEEP_FP32)  # fmt: skip
    else:
        # Row wider than one block: pass 1 sums squares (and writes h), pass 2 normalizes.
        # Pass 2 recomputes h from x and residual rather than reading back what pass 1 wrote.
        # Pass 1 asks L2 to keep the row (evict_last) and pass 2 to drop it (evict_first), so
        # pass 2 reads it from L2, not DRAM: 1.08-1.2x faster at 6656 and 8192 on an H200, the
        # hints torch.compile's looped reductions use.
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
        if QUANT:
            # pass 2: the row's amax (keeping it in L2); pass 3: the codes (dropping it)
            amax_v = tl.zeros([C0], dtype=tl.float32)
            for start in range(0, n_cols, C0):
                c = start + cols
                y = _loop_value(X, R, W, row, c, c < n_cols, stride_x, stride_r, stride_w, rstd,
                                HAS_RESIDUAL, CAST_META, EMULATE_RNE, x_dtype, y_dtype,
                                "evict_last")  # fmt: skip
                amax_v = tl.maximum(amax_v, tl.abs(y))
            inv, scale = fp8_row_scales(tl.max(amax_v, axis=0), MIN_AMAX)
            for start in range(0, n_cols, C0):
                c = start + cols
                y = _loop_value(X, R, W, row, c, c < n_cols, stride_x, stride_r, stride_w, rstd,
                                HAS_RESIDUAL, CAST_META, EMULATE_RNE, x_dtype, y_dtype,
                                "evict_first")  # fmt: skip
                tl.store(Y + row * stride_y + c, fp8_codes(y, inv, EMULATE_RNE), mask=c < n_cols)
            tl.store(S + row, scale)
        else:
            for start in range(0, n_cols, C0):
                c = start + cols
                mask = c < n_cols
                h = tl.load(
                    X + row * stride_x + c, mask=mask, other=0.0, eviction_policy="evict_first"
                )
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


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


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
