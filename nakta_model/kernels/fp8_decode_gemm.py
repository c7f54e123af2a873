"""FP8 x FP8 GEMM for a decode step's linears at a few rows (up to 64): ``swap AB``, split-K.

``out[rows, N] = round((xq[rows, K] @ wq[N, K]^T) * x_scale[rows, None] * w_scale[None, N])``,
xq and wq e4m3 (``fp8_quant.FP8_DTYPE``), fp32 scales, the fp32 sum scaled in that order (as
``fp8_gemm.fp8_matmul_reference``) and rounded once to the output dtype (bf16 / fp16, or fp32
for tests). With ``residual [rows, N]`` (the decode step's RESIDUAL kind, ``step_gemm._run``):
``out = round(residual + round(y))``, the two roundings of ``decode_linear``'s epilogue;
``out=residual`` writes it in place (each element is read, then written, by one program).

Why: at 8..64 rows a decode linear streams its weight (``N x K`` bytes) for a tiny ``M``;
cuBLASLt's row-wise scaled FP8 GEMM streams the 7B weights at 25-49% of copy bandwidth there
(``kernel_benchmark/bench_decode_gemm.py``). Here the weight
tile is the MMA's M side (``BLOCK_N`` = 64/128 weight rows, wgmma on Hopper) and the rows are
its N side (``BLOCK_R = max(16, next_pow2(rows))``), fp8 x fp8 ``tl.dot`` into an fp32
accumulator, the weight stream pipelined (``num_stages``, loads evicted first). Narrow weights
(``wo``: 4096 rows, 32-64 tiles on 132 SMs) split K (``SPLIT_K`` > 1): each split writes its
fp32 partial sums into a workspace ``[SPLIT_K, rows, N]`` and a second small kernel adds them
in split order, scales, rounds and applies the residual. Both launches are CUDA-graph
capturable: no host sync, the workspace from the caching allocator, a grid of shapes only.

Hopper's fp8 wgmma accumulates in reduced precision unless told otherwise; the sums are moved
into the fp32 accumulator every ``PROMOTE_K`` (128) products, as cuBLASLt without fast
accumulation does, so results differ from the exact fp32 reference by summation order only.

Launch configs: ``_CONFIGS`` per (N, K, rows bucket) (empty: no measured rows yet),
``_DEVICE_CONFIGS`` per device family from ``_fp8_decode_gemm_tuned.json`` (written by
``kernel_benchmark/tune_fp8_decode.py --kernel gemm``), a default derived from the shape (``_config``),
and ``_TUNE`` over all (benchmarks and tests).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from nakta_model.kernels._checks import (
    check_dtype,
    check_ndim,
    check_no_overlap,
    check_same_device,
    check_tensor,
    check_triton_device,
    device_family,
    interpreter_enabled,
    sm_count,
    tracing,
)
from nakta_model.kernels._triton_math import fp8_codes, fp8_row_scales, rotate, round_to
from nakta_model.kernels._tuned_tables import read_tuned
from nakta_model.kernels.fp8_quant import FP8_DTYPE, MIN_AMAX
from nakta_model.kernels.rope import apply_rope_qkv_reference, check_rope_qkv

if TYPE_CHECKING:
    from nakta_model.kernels.decode_linear import RopeArgs

__all__ = [
    "MAX_ROWS",
    "OUT_DTYPES",
    "fp8_decode_gemm",
    "fp8_decode_gemm_reference",
]

MAX_ROWS = 64  # the rows side of the MMA tile: BLOCK_R <= 64
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PROMOTE_K = 128  # fp8 products summed by the MMA before they join the fp32 accumulator
_AMAX_FLOOR = tl.constexpr(MIN_AMAX)  # an all-zero head row's amax (fp8_quant's rule)


# ------------------------------------------------------------------------------------------------
# 1. Kernels
# ------------------------------------------------------------------------------------------------


@triton.jit
def _fp8_decode_gemm_kernel(
    X, W, XS, WS, R, OUT, PART,
    n_rows, N, K, k_split,
    stride_xr, stride_xk, stride_wn, stride_wk, stride_xs, stride_ws,
    stride_rr, stride_rn, stride_or, stride_on, stride_ps, stride_pr,
    POS, COS, SIN, KC, VC, SLOT, KS, VS, q_cols, qk_cols, n_pos, n_slots,
    stride_cp, stride_cc, stride_sp, stride_sc, stride_kcs, stride_kch, stride_vcs, stride_vch,
    stride_kss, stride_vss,
    RESIDUAL: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PROMOTE: tl.constexpr,
    NUM_STAGES: tl.constexpr, EMULATE_RNE: tl.constexpr, ROPE: tl.constexpr = False,
    HEAD_DIM: tl.constexpr = 2, KV_FP8: tl.constexpr = False,
):  # fmt: skip
    """Program (n tile, K split): ``W_tile [BLOCK_N, BLOCK_K] @ x_tile^T [BLOCK_K, BLOCK_R]``
    over its ``k_split`` columns of K; with ``SPLIT`` the raw fp32 sums go to ``PART[split]``,
    else the scaled, rounded (and residual-added, or with ``ROPE`` rotated and cached) tile goes
    to ``OUT``."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    n_ok = n < N
    r_ok = r < n_rows
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = W + n.to(tl.int64)[:, None] * stride_wn + ks[None, :] * stride_wk
    x_ptrs = X + r[:, None] * stride_xr + ks[None, :] * stride_xk
    k_lo = pid_k * k_split
    steps = tl.cdiv(tl.minimum(K - k_lo, k_split), BLOCK_K)
    w_ptrs += k_lo * stride_wk
    x_ptrs += k_lo * stride_xk
    acc = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.float32)
    for i in tl.range(0, steps, num_stages=NUM_STAGES):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=r_ok[:, None], other=0.0)
        else:
            k_ok = k_lo + i * BLOCK_K + ks < K
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                        eviction_policy="evict_first")  # fmt: skip
            x = tl.load(x_ptrs, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=PROMOTE)
        w_ptrs += BLOCK_K * stride_wk
        x_ptrs += BLOCK_K * stride_xk
    if SPLIT:
        p_ptrs = PART + pid_k * stride_ps + r[None, :] * stride_pr + n[:, None]
        tl.store(p_ptrs, acc, mask=n_ok[:, None] & r_ok[None, :])
    elif ROPE:
        _rope_epilogue(acc, XS, WS, OUT, POS, COS, SIN, KC, VC, SLOT, KS, VS, pid_n * BLOCK_N, r,
                       N, n_rows, q_cols, qk_cols, n_pos, n_slots, stride_xs, stride_ws,
                       stride_or, stride_on, stride_cp, stride_cc, stride_sp, stride_sc,
                       stride_kcs, stride_kch, stride_vcs, stride_vch, stride_kss, stride_vss,
                       BLOCK_N, BLOCK_R, HEAD_DIM, KV_FP8, EMULATE_RNE)  # fmt: skip
    else:
        _epilogue(acc, XS, WS, R, OUT, n, r, n_ok, r_ok, stride_xs, stride_ws, stride_rr,
                  stride_rn, stride_or, stride_on, RESIDUAL, EMULATE_RNE)  # fmt: skip


@triton.jit
def _epilogue(
    acc, XS, WS, R, OUT, n, r, n_ok, r_ok, stride_xs, stride_ws, stride_rr, stride_rn,
    stride_or, stride_on, RESIDUAL: tl.constexpr, EMULATE_RNE: tl.constexpr,
):  # fmt: skip
    """``acc [n, r]`` (fp32 sums) -> ``OUT[r, n]``: times x's scale, then w's (the reference's
    order), rounded; with ``RESIDUAL`` the rounded product is added to ``R`` and rounded again."""
    xs = tl.load(XS + r * stride_xs, mask=r_ok, other=0.0)
    ws = tl.load(WS + n.to(tl.int64) * stride_ws, mask=n_ok, other=0.0)
    acc = acc * xs[None, :] * ws[:, None]
    dtype = OUT.dtype.element_ty
    mask = n_ok[:, None] & r_ok[None, :]
    y = round_to(acc, dtype, EMULATE_RNE)
    if RESIDUAL:
        res = tl.load(R + r[None, :] * stride_rr + n[:, None] * stride_rn, mask=mask, other=0.0)
        y = round_to(res.to(tl.float32) + y.to(tl.float32), dtype, EMULATE_RNE)
    tl.store(OUT + r[None, :] * stride_or + n[:, None] * stride_on, y, mask=mask)


@triton.jit
def _rope_epilogue(
    acc, XS, WS, OUT, POS, COS, SIN, KC, VC, SLOT, KS, VS, n0, r, N, n_rows, q_cols, qk_cols,
    n_pos, n_slots, stride_xs, stride_ws, stride_or, stride_on, stride_cp, stride_cc, stride_sp,
    stride_sc, stride_kcs, stride_kch, stride_vcs, stride_vch, stride_kss, stride_vss,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr, KV_FP8: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):  # fmt: skip
    """``wqkv``'s tile as ``apply_rope_qkv_`` (Meta's pairs, whole heads rotated) leaves the
    product: rounded to OUT's dtype as the plain epilogue stores it, then in fp32 the Q and K
    pairs (2i, 2i+1) of the tile's weight rows rotated by each row's position and rounded
    again; every column to ``OUT``, K (rotated) and V to their cache slots. A position or slot
    outside its table makes that row's Q/K NaN and skips its cache write, as the rope kernel
    does. The pairs are the tile's adjacent weight rows: ``BLOCK_N`` even, tiles start even.
    ``KV_FP8``: e4m3 caches, each (row, KV head) quantized from its fp32 values (rotated K, V)
    with one scale ``amax / 448`` into ``KS`` / ``VS``, the rope kernel's rule; the tile then
    holds whole heads (``BLOCK_N`` a multiple of ``HEAD_DIM``)."""
    HALF_N: tl.constexpr = BLOCK_N // 2
    r_ok = r < n_rows
    xs = tl.load(XS + r * stride_xs, mask=r_ok, other=0.0)
    pe = n0 + 2 * tl.arange(0, HALF_N)  # each pair's first column
    p_ok = pe < N
    ws_a = tl.load(WS + pe.to(tl.int64) * stride_ws, mask=p_ok, other=0.0)
    ws_b = tl.load(WS + (pe + 1).to(tl.int64) * stride_ws, mask=p_ok, other=0.0)
    acc = tl.permute(tl.reshape(acc, (HALF_N, 2, BLOCK_R)), (0, 2, 1))
    sa, sb = tl.split(acc)  # [HALF_N, BLOCK_R]: the pairs' two members
    dtype = OUT.dtype.element_ty
    ya = round_to(sa * xs[None, :] * ws_a[:, None], dtype, EMULATE_RNE).to(tl.float32)
    yb = round_to(sb * xs[None, :] * ws_b[:, None], dtype, EMULATE_RNE).to(tl.float32)
    pos = tl.load(POS + r, mask=r_ok, other=0).to(tl.int64)
    slot = tl.load(SLOT + r, mask=r_ok, other=0).to(tl.int64)
    ok = (pos >= 0) & (pos < n_pos) & (slot >= 0) & (slot < n_slots)
    pos = tl.where(ok, pos, 0)
    f = (pe % HEAD_DIM) // 2  # the pair's angle within its head
    cmask = p_ok[:, None] & r_ok[None, :]
    cos = tl.load(COS + pos[None, :] * stride_cp + f[:, None] * stride_cc, mask=cmask, other=0.0)
    sin = tl.load(SIN + pos[None, :] * stride_sp + f[:, None] * stride_sc, mask=cmask, other=0.0)
    nan = float("nan")
    cos = tl.where(ok[None, :], cos, nan)
    sin = tl.where(ok[None, :], sin, nan)
    ra, rb = rotate(ya, yb, cos, sin, cos, sin, False)
    rot = (pe < qk_cols)[:, None]  # Q and K pairs
    ra = tl.where(rot, ra, ya)
    rb = tl.where(rot, rb, yb)
    z = tl.reshape(tl.permute(tl.join(ra, rb), (0, 2, 1)), (BLOCK_N, BLOCK_R))
    n = n0 + tl.arange(0, BLOCK_N)
    mask = (n < N)[:, None] & r_ok[None, :]
    tl.store(OUT + r[None, :] * stride_or + n[:, None] * stride_on, z.to(dtype), mask=mask)
    is_k = (n >= q_cols) & (n < qk_cols)
    is_v = n >= qk_cols
    d = (n % HEAD_DIM)[:, None]
    kh = tl.where(is_k, (n - q_cols) // HEAD_DIM, 0).to(tl.int64)[:, None]
    vh = tl.where(is_v, (n - qk_cols) // HEAD_DIM, 0).to(tl.int64)[:, None]
    cache_ok = mask & ok[None, :]
    if KV_FP8:  # one scale per (row, head): the tile's heads' amax, codes from the fp32 values
        HEADS: tl.constexpr = BLOCK_N // HEAD_DIM
        amax = tl.max(tl.reshape(tl.abs(z), (HEADS, HEAD_DIM, BLOCK_R)), axis=1)
        inv, scale = fp8_row_scales(amax, _AMAX_FLOOR)  # [HEADS, BLOCK_R]
        inv_n = tl.reshape(tl.broadcast_to(inv[:, None, :], (HEADS, HEAD_DIM, BLOCK_R)),
                           (BLOCK_N, BLOCK_R))  # fmt: skip
        w = fp8_codes(z, inv_n, EMULATE_RNE)
        h = n0 // HEAD_DIM + tl.arange(0, HEADS)  # the tile's heads in wqkv
        h_ok = (h * HEAD_DIM < N)[:, None] & r_ok[None, :] & ok[None, :]
        h_k = (h >= q_cols // HEAD_DIM) & (h < qk_cols // HEAD_DIM)
        h_v = h >= qk_cols // HEAD_DIM
        hk = tl.where(h_k, h - q_cols // HEAD_DIM, 0).to(tl.int64)[:, None]
        hv = tl.where(h_v, h - qk_cols // HEAD_DIM, 0).to(tl.int64)[:, None]
        tl.store(KS + slot[None, :] * stride_kss + hk, scale, mask=h_ok & h_k[:, None])
        tl.store(VS + slot[None, :] * stride_vss + hv, scale, mask=h_ok & h_v[:, None])
    else:
        w = z
    tl.store(KC + slot[None, :] * stride_kcs + kh * stride_kch + d, w.to(KC.dtype.element_ty),
             mask=cache_ok & is_k[:, None])  # fmt: skip
    tl.store(VC + slot[None, :] * stride_vcs + vh * stride_vch + d, w.to(VC.dtype.element_ty),
             mask=cache_ok & is_v[:, None])  # fmt: skip


@triton.jit
def _split_k_reduce_kernel(
    PART, XS, WS, R, OUT, n_rows, N, n_splits,
    stride_ps, stride_pr, stride_xs, stride_ws, stride_rr, stride_rn, stride_or, stride_on,
    RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):  # fmt: skip
    """Program (n tile): the splits' partial sums added in split order, then the epilogue."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    n_ok = n < N
    r_ok = r < n_rows
    mask = n_ok[:, None] & r_ok[None, :]
    ptrs = PART + r[None, :] * stride_pr + n[:, None]
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for s in range(1, n_splits):
        acc += tl.load(ptrs + s * stride_ps, mask=mask, other=0.0)
    _epilogue(acc, XS, WS, R, OUT, n, r, n_ok, r_ok, stride_xs, stride_ws, stride_rr, stride_rn,
              stride_or, stride_on, RESIDUAL, EMULATE_RNE)  # fmt: skip


# ------------------------------------------------------------------------------------------------
# 2. Launch configuration
# ------------------------------------------------------------------------------------------------

KNOBS = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")
TUNED_JSON = Path(__file__).with_name("_fp8_decode_gemm_tuned.json")
_DEFAULT_SMS = 132  # H100 SXM / H200; used off the GPU so interpreter runs pick GPU-like tiles
SMEM_BUDGET = 200 * 1024  # pipelined weight + x tiles a program may hold (Hopper: 227 KiB)
_REDUCE_BLOCK_N = 128  # output columns per program of the split-K reduce


def rows_bucket(rows: int) -> int:
    """The table's rows key: the next power of two (8, 16, 32, 64 for the tuned buckets)."""
    return triton.next_power_of_2(rows)


def tuned_key(n: int, k: int, bucket: int) -> str:
    """The tuned JSON's key of one (N, K, rows bucket) row: ``"N/K/bucket"``."""
    return f"{n}/{k}/{bucket}"


def load_tuned(path: Path) -> dict[str, dict[tuple[int, int, int], dict[str, int]]]:
    """``{family: {(N, K, bucket): config}}`` of a tuned JSON; {} when the file is absent.
    Format: ``{"devices": {family: {"entries": {"N/K/bucket": {knob: int}}, ...}}}``."""

    def key(text: str) -> tuple[int, int, int]:
        n, k, bucket = (int(v) for v in text.split("/"))
        return n, k, bucket

    return read_tuned(path, "tuned fp8_decode_gemm", key, KNOBS)


# (N, K, rows bucket) -> config, any device; measured rows go to the tuned JSON per family.
_CONFIGS: dict[tuple[int, int, int], dict[str, int]] = {}
_DEVICE_CONFIGS = load_tuned(TUNED_JSON)
_TUNE: dict[str, int] = {}


def _default_config(n: int, k: int, bucket: int, sms: int) -> dict[str, int]:
    """From the shape: 128-row weight tiles where they still give a tile per SM, else 64;
    K split (a power of two, each split at least 4 K steps) until ~2 programs per SM; 256
    bytes of each weight row per K step; as many stages as fit ``SMEM_BUDGET`` (at most 4)."""
    block_n = 128 if triton.cdiv(n, 128) >= sms else 64
    block_k = 256
    steps = triton.cdiv(k, block_k)
    split = 1
    while triton.cdiv(n, block_n) * split * 2 < 2 * sms and steps // (split * 2) >= 4:
        split *= 2
    cfg = dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=4, num_stages=4)
    cfg["num_stages"] = stages_that_fit(cfg, max(16, bucket))
    return cfg


def stages_that_fit(cfg: dict[str, int], block_r: int) -> int:
    """``num_stages`` lowered (not below 2) until the pipelined tiles (one stage: a
    ``BLOCK_N x BLOCK_K`` weight tile and a ``BLOCK_R x BLOCK_K`` x tile, one byte each) fit."""
    per_stage = cfg["BLOCK_K"] * (cfg["BLOCK_N"] + block_r)
    stages = cfg["num_stages"]
    while stages > 2 and stages * per_stage > SMEM_BUDGET:
        stages -= 1
    return stages


def _config(n: int, k: int, rows: int, device: torch.device) -> dict[str, int]:
    """The launch config of one call: the shape's default, then ``_CONFIGS``, then this device
    family's tuned row, then ``_TUNE``; ``BLOCK_K`` clipped to K (small test shapes), the
    split count to the K steps there are."""
    bucket = rows_bucket(rows)
    cfg = _default_config(n, k, bucket, sm_count(device, _DEFAULT_SMS))
    cfg.update(_CONFIGS.get((n, k, bucket), {}))
    cfg.update(_DEVICE_CONFIGS.get(device_family(device), {}).get((n, k, bucket), {}))
    cfg.update(_TUNE)
    for key in KNOBS:
        v = cfg[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"launch config {key} must be a positive int, got {v!r}")
    for key in ("BLOCK_N", "BLOCK_K", "num_warps"):
        if cfg[key] & (cfg[key] - 1) or cfg[key] < (1 if key == "num_warps" else 16):
            raise ValueError(f"launch config {key} must be a power of two >= 16, got {cfg[key]}")
    cfg["BLOCK_K"] = min(cfg["BLOCK_K"], max(32, triton.next_power_of_2(k)))
    cfg["SPLIT_K"] = min(cfg["SPLIT_K"], triton.cdiv(k, cfg["BLOCK_K"]))
    return cfg


# ------------------------------------------------------------------------------------------------
# 3. Checks and launcher
# ------------------------------------------------------------------------------------------------


def _check(xq, x_scale, wq, w_scale, out_dtype, residual, out, for_kernel: bool) -> torch.dtype:
    """Every argument named when wrong; returns the output dtype."""
    for name, t in (("xq", xq), ("x_scale", x_scale), ("wq", wq), ("w_scale", w_scale)):
        check_tensor(name, t)
    check_dtype("xq", xq, (FP8_DTYPE,))
    check_dtype("wq", wq, (FP8_DTYPE,))
    check_dtype("x_scale", x_scale, (torch.float32,))
    check_dtype("w_scale", w_scale, (torch.float32,))
    check_ndim("xq", xq, 2)
    check_ndim("wq", wq, 2)
    rows, k = xq.shape
    n = wq.shape[0]
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"xq must have 1..{MAX_ROWS} rows (a decode step's), got {rows}")
    if wq.shape[1] != k or k < 1 or n < 1:
        raise ValueError(f"wq must be [N, K={k}] with N >= 1, got {tuple(wq.shape)}")
    if x_scale.shape != (rows,):
        raise ValueError(
            f"x_scale must have shape ({rows},) (one per row), got {tuple(x_scale.shape)}"
        )
    if w_scale.shape != (n,):
        raise ValueError(
            f"w_scale must have shape ({n},) (one per weight row), got {tuple(w_scale.shape)}"
        )
    if residual is not None:
        check_tensor("residual", residual)
        out_dtype = out_dtype or residual.dtype
        if residual.dtype != out_dtype:
            raise TypeError(
                f"residual must have the output dtype {out_dtype}, got {residual.dtype}"
            )
        if residual.shape != (rows, n):
            raise ValueError(f"residual must have shape {(rows, n)}, got {tuple(residual.shape)}")
    out_dtype = out_dtype or torch.bfloat16
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if out is not None:
        check_tensor("out", out)
        if out.dtype != out_dtype or out.shape != (rows, n):
            raise ValueError(
                f"out must be [{rows}, {n}] of {out_dtype}, got {tuple(out.shape)} of {out.dtype}"
            )
    check_same_device(xq=xq, x_scale=x_scale, wq=wq, w_scale=w_scale, residual=residual, out=out)
    if out is not None and not tracing():
        for name, t in (("xq", xq), ("x_scale", x_scale), ("wq", wq), ("w_scale", w_scale)):
            check_no_overlap("out", out, name, t)
        if residual is not None and not (
            out.data_ptr() == residual.data_ptr() and out.stride() == residual.stride()
        ):
            check_no_overlap("out", out, "residual", residual)
    if for_kernel:
        check_triton_device("xq", xq)
    return out_dtype


def _rope_args(rope, out: torch.Tensor) -> tuple[tuple, tuple, int]:
    """The ROPE epilogue's pointers, ints and strides (dummies without ``rope``), and its
    head_dim constexpr."""
    if rope is None:
        return (out,) * 8, (0, 0, 0, 0), (0,) * 10
    r = rope
    ks, vs = _scales(r)
    sc = (ks, vs) if ks is not None else (out, out)
    sc_strides = (ks.stride(0), vs.stride(0)) if ks is not None else (0, 0)
    q_cols = r.n_q_heads * r.head_dim
    ints = (q_cols, q_cols + r.n_kv_heads * r.head_dim, r.cos.shape[0],
            min(r.k_cache.shape[0], r.v_cache.shape[0]))  # fmt: skip
    strides = (r.cos.stride(0), r.cos.stride(1), r.sin.stride(0), r.sin.stride(1),
               r.k_cache.stride(0), r.k_cache.stride(1), r.v_cache.stride(0),
               r.v_cache.stride(1), *sc_strides)  # fmt: skip
    ptrs = (r.positions, r.cos, r.sin, r.k_cache, r.v_cache, r.cache_slots, *sc)
    return ptrs, ints, strides


def _scales(rope) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """An e4m3 cache's scales (``RopeArgs.k_scale`` / ``v_scale``), None for a float cache."""
    return getattr(rope, "k_scale", None), getattr(rope, "v_scale", None)


def _launch(xq, x_scale, wq, w_scale, residual, out, cfg: dict[str, int], rope=None) -> None:
    rows, k = xq.shape
    n = wq.shape[0]
    block_r = max(16, triton.next_power_of_2(rows))
    block_n, block_k, split = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    steps = triton.cdiv(k, block_k)
    k_split = triton.cdiv(steps, split) * block_k  # columns of K per split, whole K steps
    split = triton.cdiv(k, k_split)  # no empty split
    interp = interpreter_enabled()
    promote = min(PROMOTE_K, block_k)
    r = residual if residual is not None else out
    r_strides = (r.stride(0), r.stride(1))
    part = torch.empty(split, rows, n, dtype=torch.float32, device=xq.device) if split > 1 else out
    p_strides = (part.stride(0), part.stride(1)) if split > 1 else (0, 0)
    stages = stages_that_fit(cfg, block_r)
    rope_ptrs, rope_ints, rope_strides = _rope_args(rope, out)
    _fp8_decode_gemm_kernel[(triton.cdiv(n, block_n), split)](
        xq, wq, x_scale, w_scale, r, out, part, rows, n, k, k_split,
        xq.stride(0), xq.stride(1), wq.stride(0), wq.stride(1), x_scale.stride(0),
        w_scale.stride(0), *r_strides, out.stride(0), out.stride(1), *p_strides,
        *rope_ptrs, *rope_ints, *rope_strides,
        RESIDUAL=residual is not None, SPLIT=split > 1, BLOCK_N=block_n, BLOCK_R=block_r,
        BLOCK_K=block_k, EVEN_K=k % block_k == 0, PROMOTE=promote, NUM_STAGES=stages,
        EMULATE_RNE=interp, ROPE=rope is not None, HEAD_DIM=rope.head_dim if rope else 2,
        KV_FP8=rope is not None and _scales(rope)[0] is not None,
        num_warps=cfg["num_warps"], num_stages=stages,
    )  # fmt: skip
    if split > 1:
        _split_k_reduce_kernel[(triton.cdiv(n, _REDUCE_BLOCK_N),)](
            part, x_scale, w_scale, r, out, rows, n, split, *p_strides, x_scale.stride(0),
            w_scale.stride(0), *r_strides, out.stride(0), out.stride(1),
            RESIDUAL=residual is not None, BLOCK_N=_REDUCE_BLOCK_N, BLOCK_R=block_r,
            EMULATE_RNE=interp, num_warps=4,
        )  # fmt: skip


def _check_rope(rope, out: torch.Tensor, residual, for_kernel: bool = True) -> None:
    """``rope``: ``apply_rope_qkv_``'s arguments for ``out`` as the qkv matrix (full rotary,
    Meta's pairs; an e4m3 cache with its scales and a power-of-two head), no residual."""
    if residual is not None:
        raise ValueError("residual and rope are exclusive epilogues: give at most one")
    r = rope
    ks, vs = _scales(r)
    if ks is not None and (r.head_dim & (r.head_dim - 1) or r.head_dim > 256):
        raise ValueError(
            f"rope into an e4m3 cache needs a power-of-two head_dim <= 256 (a head per tile), "
            f"got {r.head_dim}"
        )
    check_rope_qkv(
        out, r.positions, r.cos, r.sin, r.n_q_heads, r.n_kv_heads, r.head_dim, k_cache=r.k_cache,
        v_cache=r.v_cache, cache_slots=r.cache_slots, k_scale=ks, v_scale=vs,
        for_kernel=for_kernel,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------
# 4. Public function and reference
# ------------------------------------------------------------------------------------------------


def fp8_decode_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    *,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    rope: RopeArgs | None = None,
) -> torch.Tensor:
    """``[rows, N]``: ``round((xq @ wq^T) * x_scale[:, None] * w_scale[None, :])`` (fp32 sums),
    with ``residual`` ``round(residual + round(...))``; rows 1..``MAX_ROWS``. ``out_dtype``
    defaults to the residual's dtype, else bf16; ``out`` (allocated when None) may be
    ``residual`` itself for the in-place form. Any strides (xq's rows may be a strided view).
    ``rope`` (``wqkv``, Meta's pairs): the product as ``apply_rope_qkv_(product, ...,
    interleaved=True)`` leaves it, Q and K rotated and K/V in the cache slots (an e4m3 cache:
    quantized, with ``rope.k_scale`` / ``v_scale``), in this one launch (no split K; with an
    e4m3 cache, tiles of whole heads)."""
    out_dtype = _check(xq, x_scale, wq, w_scale, out_dtype, residual, out, for_kernel=True)
    if out is None:
        out = torch.empty(xq.shape[0], wq.shape[0], dtype=out_dtype, device=xq.device)
    cfg = _config(wq.shape[0], xq.shape[1], xq.shape[0], xq.device)
    if rope is not None:
        _check_rope(rope, out, residual)
        cfg["SPLIT_K"] = 1  # the rotation needs the whole sum
        if _scales(rope)[0] is not None:  # a head's scale needs the whole head in one tile
            cfg["BLOCK_N"] = max(cfg["BLOCK_N"], rope.head_dim)
    _launch(xq, x_scale, wq, w_scale, residual, out, cfg, rope)
    return out


def fp8_decode_gemm_reference(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    *,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    rope: RopeArgs | None = None,
) -> torch.Tensor:
    """Plain PyTorch, any device: the e4m3 codes in fp64 (products and sums exact at these
    sizes), scaled in fp32 in the kernel's order, rounded, then the residual add or
    ``apply_rope_qkv_reference``."""
    out_dtype = _check(xq, x_scale, wq, w_scale, out_dtype, residual, out, for_kernel=False)
    acc = (xq.double() @ wq.double().t()).float()
    y = (acc * x_scale[:, None] * w_scale[None, :]).to(out_dtype)
    if residual is not None:
        y = (residual.float() + y.float()).to(out_dtype)
    if rope is not None:
        _check_rope(rope, y, residual, for_kernel=False)
        r = rope
        apply_rope_qkv_reference(
            y, r.positions, r.cos, r.sin, r.n_q_heads, r.n_kv_heads, r.head_dim,
            interleaved=True, k_cache=r.k_cache, v_cache=r.v_cache, cache_slots=r.cache_slots,
            k_scale=_scales(r)[0], v_scale=_scales(r)[1],
        )  # fmt: skip
    if out is None:
        return y
    out.copy_(y)
    return out
