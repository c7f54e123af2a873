"""The Triton kernel of ``decode_linear.py``: a decode matmul with its prologue and epilogues.

Kept apart from the launcher and its checks so that neither file grows past a readable size;
what the kernel computes and how it rounds is in ``decode_linear.py``'s docstring, and
``decode_linear.py`` chooses every constexpr (``_config``) and launches it.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nakta_model.kernels._triton_math import rotate, round_to, rsqrt, silu


@triton.jit
def _row_rstd(
    X, rows, row_ok, K, stride_xm, eps, inv_k,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ACCURATE: tl.constexpr,
):  # fmt: skip
    """1 / rms of each batch row, fp32 ``[BLOCK_M]`` (``mean`` as ``sum * (1 / K)``, as
    PyTorch's CUDA mean and ``rmsnorm.py`` compute it)."""
    ks = tl.arange(0, BLOCK_K)
    ss = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        mask = row_ok[:, None] & (k < K)[None, :]
        x = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        ss += x * x
    # fp32 scalars: torch.compile's inductor passes Python floats to Triton as fp64
    inv_k, eps = tl.cast(inv_k, tl.float32), tl.cast(eps, tl.float32)
    return rsqrt(tl.sum(ss, axis=1) * inv_k + eps, ACCURATE)


@triton.jit
def _x_tile(
    X, NW, rows, row_ok, k, k_ok, stride_xm, stride_nw, rstd,
    NORM: tl.constexpr, EVEN_K: tl.constexpr, EMULATE_RNE: tl.constexpr,
):  # fmt: skip
    """``[BLOCK_M, BLOCK_K]`` of the matmul's input in x's dtype: x, or with ``NORM`` Meta's
    RMSNorm of it (normalized row rounded, times the weight, rounded)."""
    if EVEN_K:
        mask = row_ok[:, None]
    else:
        mask = row_ok[:, None] & k_ok[None, :]
    x = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=mask, other=0.0)
    if NORM:
        dtype = X.dtype.element_ty
        w = tl.load(NW + k * stride_nw, mask=k_ok, other=0.0).to(tl.float32)
        n = round_to(x.to(tl.float32) * rstd[:, None], dtype, EMULATE_RNE).to(tl.float32)
        x = round_to(n * w[None, :], dtype, EMULATE_RNE)
    return x


@triton.jit
def _w_tile(W, w_rows, w_ok, k, k_ok, stride_wn, EVEN_K: tl.constexpr):
    """``[TILE_N, BLOCK_K]`` of the weight. Weights are read once per step: evict them first so
    the small activations stay in L2."""
    ptrs = W + w_rows.to(tl.int64)[:, None] * stride_wn + k[None, :]
    if EVEN_K:
        mask = w_ok[:, None]
    else:
        mask = w_ok[:, None] & k_ok[None, :]
    return tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")


@triton.jit
def _dot_loop(
    X, W, NW, rows, row_ok, w_rows, w_ok, K, stride_xm, stride_wn, stride_nw, rstd,
    NORM: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, EMULATE_RNE: tl.constexpr,
    W_FP8: tl.constexpr, DOT_F16: tl.constexpr,
):  # fmt: skip
    """``W_tile @ x^T`` over all of K with ``tl.dot``: fp32 ``[TILE_N, BLOCK_M]``.

    ``DOT_F16`` (FP8 weight, bf16 x): both operands go to fp16 and the MMA is fp16 x fp16 ->
    fp32. e4m3 -> fp16 is one ``cvt.rn.f16x2.e4m3x2`` per pair on sm89+, e4m3 -> bf16 adds two
    ``cvt.bf16.f16``; every e4m3 value is exact in fp16 and so is every bf16 x with
    ``6.1e-5 <= |x| <= 65504`` (8 significant bits fit in 11), so the products are the bf16
    path's. Outside: ``|x| > 65504`` becomes inf (the output inf/NaN), ``|x| < 6.1e-5`` an fp16
    subnormal (absolute error <= 2^-25 per element, below the fp32 sum's rounding for LLaMA's
    activations). ``_config`` sets it only where asked (``_TUNE["DOT_F16"] = 0`` allows none).
    ``UPCAST`` (interpreter, bf16) feeds fp32 copies of the operands: Triton 3.9's interpreter
    returns garbage for a bf16 ``tl.dot``; the copies are exact, so the sums are the same."""
    acc = tl.zeros([TILE_N, BLOCK_M], dtype=tl.float32)
    ks = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        x = _x_tile(X, NW, rows, row_ok, k, k_ok, stride_xm, stride_nw, rstd, NORM, EVEN_K,
                    EMULATE_RNE)  # fmt: skip
        w = _w_tile(W, w_rows, w_ok, k, k_ok, stride_wn, EVEN_K)
        if W_FP8 and DOT_F16:
            w = w.to(tl.float16)
            x = x.to(tl.float32).to(tl.float16)
        elif W_FP8:  # e4m3 values are exact in every x dtype
            w = w.to(x.dtype)
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PREC)
    return acc


@triton.jit
def _x_raw(X, NW, rows, row_ok, k, k_ok, stride_xm, stride_nw, NORM: tl.constexpr,
           EVEN_K: tl.constexpr):  # fmt: skip
    """``_x_tile``'s loads alone (x and, with ``NORM``, the norm weight, same masks), for
    ``_x_norm`` to finish an iteration later."""
    if EVEN_K:
        mask = row_ok[:, None]
    else:
        mask = row_ok[:, None] & k_ok[None, :]
    x = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=mask, other=0.0)
    if NORM:
        nw = tl.load(NW + k * stride_nw, mask=k_ok, other=0.0)
    else:
        nw = x
    return x, nw


@triton.jit
def _x_norm(x, nw, rstd, dtype: tl.constexpr, NORM: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """``_x_tile``'s arithmetic on loaded tiles: the same roundings in the same order."""
    if NORM:
        n = round_to(x.to(tl.float32) * rstd[:, None], dtype, EMULATE_RNE).to(tl.float32)
        x = round_to(n * nw.to(tl.float32)[None, :], dtype, EMULATE_RNE)
    return x


# One int32 word of four e4m3 codes (code j in byte j) -> four fp32, as Triton converts an
# e4m3 pair: one cvt.rn.f16x2.e4m3x2 per 16-bit half (sm_89+: F2FP.F16.E4M3.UNPACK_B), one
# cvt.f32.f16 per code (HADD2.F32); no byte extraction or re-pairing around them.
E4M3X4_ASM = tl.constexpr("""{
.reg .b16 lo, hi, f0, f1, f2, f3;
.reg .b32 h01, h23;
mov.b32 {lo, hi}, $4;
cvt.rn.f16x2.e4m3x2 h01, lo;
cvt.rn.f16x2.e4m3x2 h23, hi;
mov.b32 {f0, f1}, h01;
mov.b32 {f2, f3}, h23;
cvt.f32.f16 $0, f0;
cvt.f32.f16 $1, f1;
cvt.f32.f16 $2, f2;
cvt.f32.f16 $3, f3;
}""")


@triton.jit
def _e4m3_code(words, SHIFT: tl.constexpr):
    """Byte ``SHIFT / 8`` of each int32 word read as an e4m3 code, as fp32 (exact)."""
    code = ((words >> SHIFT) & 0xFF).to(tl.uint8)
    return code.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3x4(words, EMULATE: tl.constexpr):
    """Each int32 word's four e4m3 codes as fp32 (exact): ``E4M3X4_ASM`` compiled;
    ``EMULATE`` (the interpreter, which runs no PTX) by Triton bit ops and casts."""
    if EMULATE:
        return (_e4m3_code(words, 0), _e4m3_code(words, 8), _e4m3_code(words, 16),
                _e4m3_code(words, 24))  # fmt: skip
    return tl.inline_asm_elementwise(
        E4M3X4_ASM, "=r,=r,=r,=r,r", [words], dtype=(tl.float32,) * 4, is_pure=True, pack=1
    )


@triton.jit
def _split4(x, KW: tl.constexpr):
    """``[1, 4 KW]`` -> four ``[1, KW]``: columns ``4 i + j`` for ``j`` = 0..3 (the order of an
    int32 word's codes)."""
    even, odd = tl.split(tl.reshape(x, (1, KW, 2, 2)))  # [.., i, q, p]: column 4 i + 2 q + p
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return x0, x1, x2, x3


@triton.jit
def _join4(a0, a1, a2, a3, TILE_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``_split4`` undone: four ``[TILE_N, KW]`` -> ``[TILE_N, 4 KW]``, ``a_j[:, i]`` at column
    ``4 i + j`` (``[.., i, q, p]`` holds ``a(2 q + p)``)."""
    return tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), (TILE_N, BLOCK_K))


@triton.jit
def _w_words(W, w_rows, w_ok, kw, kw_ok, stride_wn, EVEN_K: tl.constexpr):
    """``[TILE_N, BLOCK_K / 4]`` int32 words of the weight (``W`` its int32 view, ``stride_wn``
    in words): ``_w_tile`` four codes a word."""
    ptrs = W + w_rows.to(tl.int64)[:, None] * stride_wn + kw[None, :]
    if EVEN_K:
        mask = w_ok[:, None]
    else:
        mask = w_ok[:, None] & kw_ok[None, :]
    return tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_first")


@triton.jit
def _fma_prefetch_loop(
    X, W, NW, rows, row_ok, w_rows, w_ok, K, stride_xm, stride_wn, stride_nw, rstd,
    NORM: tl.constexpr, EVEN_K: tl.constexpr, TILE_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EMULATE_RNE: tl.constexpr, w_first, HAS_FIRST: tl.constexpr = 0,
):  # fmt: skip
    """``_fma_loop`` at batch 1 for an e4m3 weight read as int32 words (``PREFETCH``), the next
    K tile's loads (weight words, x, norm weight) issued before the current tile's FMAs: a
    hand-written two-stage pipeline (Triton pipelines ``tl.dot`` loops only), so each warp
    has its next tile in flight while it computes. Words carry four codes a register across
    the iteration (an e4m3 tile carried so takes one a register). The last tile is peeled off
    the loop, so the loads keep ``_fma_loop``'s masks. Same products, same order per K lane,
    same final reduction: ``_fma_loop``'s sums bit for bit. fp32 ``[TILE_N, 1]``."""
    KW: tl.constexpr = BLOCK_K // 4
    dtype = X.dtype.element_ty
    ks = tl.arange(0, BLOCK_K)
    kws = tl.arange(0, KW)
    k_words = K // 4
    # x before the weight, here and in the loop: Triton's layout propagation takes the layout
    # of the last load in program order where two meet, and the products must keep the
    # weight's (else every weight tile is moved through shared memory instead of x's)
    x_next, nw_next = _x_raw(X, NW, rows, row_ok, ks, ks < K, stride_xm, stride_nw, NORM, EVEN_K)
    if HAS_FIRST:  # the first tile's words, loaded by the caller (``EARLY_W``)
        w_next = w_first
    else:
        w_next = _w_words(W, w_rows, w_ok, kws, kws < k_words, stride_wn, EVEN_K)
    acc0 = tl.zeros([TILE_N, KW], dtype=tl.float32)
    acc1 = tl.zeros([TILE_N, KW], dtype=tl.float32)
    acc2 = tl.zeros([TILE_N, KW], dtype=tl.float32)
    acc3 = tl.zeros([TILE_N, KW], dtype=tl.float32)
    for k1 in range(BLOCK_K, K, BLOCK_K):  # k1: the tile loaded ahead
        w, x_cur, nw_cur = w_next, x_next, nw_next
        k = k1 + ks
        x_next, nw_next = _x_raw(X, NW, rows, row_ok, k, k < K, stride_xm, stride_nw, NORM,
                                 EVEN_K)  # fmt: skip
        kw = k1 // 4 + kws
        w_next = _w_words(W, w_rows, w_ok, kw, kw < k_words, stride_wn, EVEN_K)
        x0, x1, x2, x3 = _split4(_x_norm(x_cur, nw_cur, rstd, dtype, NORM, EMULATE_RNE), KW)
        c0, c1, c2, c3 = _e4m3x4(w, EMULATE_RNE)
        acc0 += c0 * x0.to(tl.float32)
        acc1 += c1 * x1.to(tl.float32)
        acc2 += c2 * x2.to(tl.float32)
        acc3 += c3 * x3.to(tl.float32)
    x0, x1, x2, x3 = _split4(_x_norm(x_next, nw_next, rstd, dtype, NORM, EMULATE_RNE), KW)
    c0, c1, c2, c3 = _e4m3x4(w_next, EMULATE_RNE)
    acc0 += c0 * x0.to(tl.float32)
    acc1 += c1 * x1.to(tl.float32)
    acc2 += c2 * x2.to(tl.float32)
    acc3 += c3 * x3.to(tl.float32)
    return tl.sum(_join4(acc0, acc1, acc2, acc3, TILE_N, BLOCK_K), axis=1)[:, None]


@triton.jit
def _fma_loop(
    X, W, NW, rows, row_ok, w_rows, w_ok, K, stride_xm, stride_wn, stride_nw, rstd,
    NORM: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EMULATE_RNE: tl.constexpr, PREFETCH: tl.constexpr = 0,
    w_first=None, HAS_FIRST: tl.constexpr = 0,
):  # fmt: skip
    """``W_tile @ x^T`` on the CUDA cores: fp32 products accumulated per K lane, reduced over
    K once at the end (no cross-thread reduction inside the loop). fp32 ``[TILE_N, BLOCK_M]``.
    ``PREFETCH`` (batch 1, ``W`` the e4m3 weight's int32 view): ``_fma_prefetch_loop``.
    ``HAS_FIRST`` (batch 1): ``w_first`` is the first K tile (words with ``PREFETCH``), loaded
    by the caller; the same products in the same order per K lane."""
    ks = tl.arange(0, BLOCK_K)
    if BLOCK_M == 1 and PREFETCH:
        acc = _fma_prefetch_loop(X, W, NW, rows, row_ok, w_rows, w_ok, K, stride_xm, stride_wn,
                                 stride_nw, rstd, NORM, EVEN_K, TILE_N, BLOCK_K, EMULATE_RNE,
                                 w_first, HAS_FIRST)  # fmt: skip
    elif BLOCK_M == 1:
        acc2 = tl.zeros([TILE_N, BLOCK_K], dtype=tl.float32)
        start = 0
        if HAS_FIRST:
            x = _x_tile(X, NW, rows, row_ok, ks, ks < K, stride_xm, stride_nw, rstd, NORM,
                        EVEN_K, EMULATE_RNE)  # fmt: skip
            acc2 += w_first.to(tl.float32) * x.to(tl.float32)
            start = BLOCK_K
        for k0 in range(start, K, BLOCK_K):
            k = k0 + ks
            k_ok = k < K
            x = _x_tile(X, NW, rows, row_ok, k, k_ok, stride_xm, stride_nw, rstd, NORM, EVEN_K,
                        EMULATE_RNE)  # fmt: skip
            w = _w_tile(W, w_rows, w_ok, k, k_ok, stride_wn, EVEN_K)
            acc2 += w.to(tl.float32) * x.to(tl.float32)
        acc = tl.sum(acc2, axis=1)[:, None]
    else:
        acc3 = tl.zeros([TILE_N, BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            k_ok = k < K
            x = _x_tile(X, NW, rows, row_ok, k, k_ok, stride_xm, stride_nw, rstd, NORM, EVEN_K,
                        EMULATE_RNE)  # fmt: skip
            w = _w_tile(W, w_rows, w_ok, k, k_ok, stride_wn, EVEN_K)
            acc3 += w.to(tl.float32)[:, None, :] * x.to(tl.float32)[None, :, :]
        acc = tl.sum(acc3, axis=2)
    return acc


@triton.jit
def _store_cols(OUT, y, cols, col_ok, rows, row_ok, stride_om):
    """Store a ``[columns, batch rows]`` tile into ``OUT[row, col]``."""
    ptrs = OUT + rows[None, :] * stride_om + cols[:, None]
    tl.store(ptrs, y, mask=col_ok[:, None] & row_ok[None, :])


@triton.jit
def _rope_epilogue(
    acc, OUT, POS, COS, SIN, KC, VC, SLOT, n0, rows, row_ok, n_w_rows, q_cols, qk_cols, n_pos,
    n_slots, stride_om, stride_cp, stride_cc, stride_sp, stride_sc, stride_kcs, stride_kch,
    stride_vcs, stride_vch,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE_RNE: tl.constexpr,
):  # fmt: skip
    """Round the qkv tile, rotate its Q/K pairs, store Q to OUT and K/V into the caches."""
    dtype = OUT.dtype.element_ty
    HALF_N: tl.constexpr = BLOCK_N // 2
    v = round_to(acc, dtype, EMULATE_RNE).to(tl.float32)
    pairs = tl.permute(tl.reshape(v, (HALF_N, 2, BLOCK_M)), (0, 2, 1))
    a, b = tl.split(pairs)  # rows 2i and 2i + 1 of the tile: [HALF_N, BLOCK_M]
    pair_cols = n0 + 2 * tl.arange(0, HALF_N)
    freq = (pair_cols % HEAD_DIM) // 2

    pos = tl.load(POS + rows, mask=row_ok, other=0).to(tl.int64)
    slot = tl.load(SLOT + rows, mask=row_ok, other=0).to(tl.int64)
    ok = (pos >= 0) & (pos < n_pos) & (slot >= 0) & (slot < n_slots)
    pos = tl.where(ok, pos, 0)
    slot = tl.where(ok, slot, 0)
    fmask = (pair_cols < qk_cols)[:, None] & row_ok[None, :]
    cos = tl.load(COS + pos[None, :] * stride_cp + freq[:, None] * stride_cc, mask=fmask, other=1.0)
    sin = tl.load(SIN + pos[None, :] * stride_sp + freq[:, None] * stride_sc, mask=fmask, other=0.0)
    nan = float("nan")
    cos = tl.where(ok[None, :], cos, nan)
    sin = tl.where(ok[None, :], sin, nan)
    ya, yb = rotate(a, b, cos, sin, cos, sin, False)
    rot = (pair_cols < qk_cols)[:, None]
    ya = tl.where(rot, ya, a)
    yb = tl.where(rot, yb, b)
    y = tl.reshape(tl.permute(tl.join(ya, yb), (0, 2, 1)), (BLOCK_N, BLOCK_M))
    y = round_to(y, dtype, EMULATE_RNE)

    cols = n0 + tl.arange(0, BLOCK_N)
    _store_cols(OUT, y, cols, cols < q_cols, rows, row_ok, stride_om)
    store_ok = row_ok & ok
    is_k = (cols >= q_cols) & (cols < qk_cols)
    kcol = tl.where(is_k, cols - q_cols, 0)
    k_ptrs = (
        KC
        + slot[None, :] * stride_kcs
        + (kcol // HEAD_DIM).to(tl.int64)[:, None] * stride_kch
        + (kcol % HEAD_DIM)[:, None]
    )
    tl.store(k_ptrs, y, mask=is_k[:, None] & store_ok[None, :])
    is_v = (cols >= qk_cols) & (cols < n_w_rows)
    vcol = tl.where(is_v, cols - qk_cols, 0)
    v_ptrs = (
        VC
        + slot[None, :] * stride_vcs
        + (vcol // HEAD_DIM).to(tl.int64)[:, None] * stride_vch
        + (vcol % HEAD_DIM)[:, None]
    )
    tl.store(v_ptrs, y, mask=is_v[:, None] & store_ok[None, :])


@triton.jit
def _decode_linear_kernel(
    X, W, WS, NW, R, OUT, POS, COS, SIN, KC, VC, SLOT,
    n_rows, K, n_w_rows, n_out_cols, stride_xm, stride_wn, stride_ws, stride_nw, stride_rm,
    stride_om,
    eps, inv_k, q_cols, qk_cols, n_pos, n_slots,
    stride_cp, stride_cc, stride_sp, stride_sc, stride_kcs, stride_kch, stride_vcs, stride_vch,
    HEAD_DIM: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr,
    ROPE: tl.constexpr, W_FP8: tl.constexpr, USE_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr, FAST_SILU: tl.constexpr, ACCURATE: tl.constexpr,
    EMULATE_RNE: tl.constexpr, PDL: tl.constexpr, DOT_F16: tl.constexpr = False,
    PREFETCH: tl.constexpr = 0, NORM_BLOCK: tl.constexpr = 0, EARLY_W: tl.constexpr = 0,
):  # fmt: skip
    """One program: output columns ``[n0, n0 + BLOCK_N)`` for every batch row.

    Switches (constexpr): ``W_FP8`` e4m3 weight with fp32 row scales ``WS`` (codes converted in
    registers, the sums scaled before the epilogue; ``DOT_F16``: fp16 MMA operands, see
    ``_dot_loop``); ``NORM`` RMSNorm prologue; at most one of
    ``RESIDUAL`` / ``SWIGLU``
    (the tile holds ``TILE_N = 2 * BLOCK_N`` rows: gate rows, then the matching up rows) /
    ``ROPE``; ``USE_DOT`` tensor cores vs CUDA-core products; ``EVEN_K`` drops the K mask;
    ``PREFETCH`` (FP8, batch 1, CUDA cores: ``W`` is the weight's int32 view, ``stride_wn`` in
    words) loads each K tile an iteration ahead (``_fma_prefetch_loop``);
    ``NORM_BLOCK``: x elements per step of the RMSNorm prologue (0: ``BLOCK_K``).
    ``PDL`` (launched as a programmatic dependent): let the next kernel's blocks launch now,
    and wait for the previous kernel's results before the first load or store of them.
    ``EARLY_W`` (batch 1, CUDA cores): the first K tile of the weight (no kernel's output) is
    loaded before that wait, so its memory latency overlaps the previous kernel's tail.
    The accumulator is ``[TILE_N, BLOCK_M]``: output columns down, batch rows across.
    """
    if PDL:
        gdc_launch_dependents()
        if not EARLY_W:
            gdc_wait()  # x, residual, positions and slots are the previous kernels' outputs
    n0 = tl.program_id(0) * BLOCK_N
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    if SWIGLU:
        j = tl.arange(0, TILE_N)
        col = n0 + j % BLOCK_N
        w_rows = tl.where(j < BLOCK_N, col, col + n_out_cols)
        w_ok = col < n_out_cols
    else:
        w_rows = n0 + tl.arange(0, TILE_N)
        w_ok = w_rows < n_w_rows
    if EARLY_W:
        if PREFETCH:
            kw0 = tl.arange(0, BLOCK_K // 4)
            w_first = _w_words(W, w_rows, w_ok, kw0, kw0 < K // 4, stride_wn, EVEN_K)
        else:
            k0s = tl.arange(0, BLOCK_K)
            w_first = _w_tile(W, w_rows, w_ok, k0s, k0s < K, stride_wn, EVEN_K)
        if PDL:
            gdc_wait()  # now the inputs: the first weight tile is on its way
    else:
        w_first = tl.zeros([1], dtype=tl.float32)  # unused
    if NORM:
        rstd = _row_rstd(X, rows, row_ok, K, stride_xm, eps, inv_k, BLOCK_M,
                         NORM_BLOCK if NORM_BLOCK > 0 else BLOCK_K, ACCURATE)  # fmt: skip
    else:
        rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_DOT:
        acc = _dot_loop(X, W, NW, rows, row_ok, w_rows, w_ok, K, stride_xm, stride_wn, stride_nw,
                        rstd, NORM, EVEN_K, BLOCK_M, TILE_N, BLOCK_K, PREC, UPCAST, EMULATE_RNE,
                        W_FP8, DOT_F16)  # fmt: skip
    else:
        acc = _fma_loop(X, W, NW, rows, row_ok, w_rows, w_ok, K, stride_xm, stride_wn, stride_nw,
                        rstd, NORM, EVEN_K, BLOCK_M, TILE_N, BLOCK_K, EMULATE_RNE, PREFETCH,
                        w_first, EARLY_W)  # fmt: skip
    if W_FP8:  # dequantize the sums: each weight row's scale, before any rounding
        ws = tl.load(WS + w_rows.to(tl.int64) * stride_ws, mask=w_ok, other=0.0)
        acc = acc * ws[:, None]

    dtype = OUT.dtype.element_ty
    cols = n0 + tl.arange(0, BLOCK_N)
    if ROPE:
        _rope_epilogue(acc, OUT, POS, COS, SIN, KC, VC, SLOT, n0, rows, row_ok, n_w_rows, q_cols,
                       qk_cols, n_pos, n_slots, stride_om, stride_cp, stride_cc, stride_sp,
                       stride_sc, stride_kcs, stride_kch, stride_vcs, stride_vch, HEAD_DIM,
                       BLOCK_M, BLOCK_N, EMULATE_RNE)  # fmt: skip
    elif SWIGLU:
        gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
        gate = round_to(gate, dtype, EMULATE_RNE).to(tl.float32)
        up = round_to(up, dtype, EMULATE_RNE).to(tl.float32)
        s = round_to(silu(gate, FAST_SILU, ACCURATE), dtype, EMULATE_RNE).to(tl.float32)
        y = round_to(s * up, dtype, EMULATE_RNE)
        _store_cols(OUT, y, cols, cols < n_out_cols, rows, row_ok, stride_om)
    elif RESIDUAL:
        col_ok = cols < n_out_cols
        r_ptrs = R + rows[None, :] * stride_rm + cols[:, None]
        r = tl.load(r_ptrs, mask=col_ok[:, None] & row_ok[None, :], other=0.0).to(tl.float32)
        y = round_to(r + round_to(acc, dtype, EMULATE_RNE).to(tl.float32), dtype, EMULATE_RNE)
        _store_cols(OUT, y, cols, col_ok, rows, row_ok, stride_om)
    else:
        y = round_to(acc, dtype, EMULATE_RNE)
        _store_cols(OUT, y, cols, cols < n_out_cols, rows, row_ok, stride_om)
