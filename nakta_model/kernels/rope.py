"""Rotary position embedding (RoPE), the model's path: Q and K of the fused QKV, in place.

``apply_rope_qkv_`` rotates the Q and K heads of a fused ``wqkv`` projection output IN PLACE in
one launch (V untouched), reading per-token positions and a precomputed cos/sin table
(``build_rope_cache``); optionally the same launch writes the rotated K and the V of every token
into the KV cache. Math in fp32, stored in the caller's dtype. Backward of a rotation by angle
theta is the rotation by -theta: the kernel takes a ``BACKWARD`` flag instead of a second kernel.

The TransformerEngine-compatible API (``apply_rotary_pos_emb``) is ``rope_te.py``; both use the
pair load / rotate / store of ``_triton_math.py``.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import triton
import triton.language as tl

from nakta_model.kernels._checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_index,
    check_ndim,
    check_positive_int,
    check_range,
    check_same_device,
    check_tensor,
    check_triton_device,
    debug_checks,
    interpreter_enabled,
)
from nakta_model.kernels._triton_math import (
    fp8_codes,
    fp8_row_scales,
    load_pairs,
    rotate,
    store_pairs,
)
from nakta_model.kernels.fp8_quant import FP8_DTYPE, MIN_AMAX, quantize_rows_reference

# ------------------------------------------------------------------------------------------------
# 1. Triton kernel
# ------------------------------------------------------------------------------------------------


# The row (token) count is not specialised on: every batch size runs one compiled kernel.
@triton.jit(do_not_specialize=["n_rows"])
def _rope_qkv_kernel(
    X, OUT, POS, COS, SIN, KC, VC, SLOT, KS, VS,
    n_rows, n_heads_launch, n_q, n_kv, n_pos, n_slots,
    stride_xt, stride_xc, stride_ot, stride_cp, stride_cc, stride_sp, stride_sc,
    stride_kcs, stride_kch, stride_vcs, stride_vch, stride_kss, stride_vss,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    PASS: tl.constexpr, PASS_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr, JOINT: tl.constexpr, BACKWARD: tl.constexpr,
    WRITE_CACHE: tl.constexpr, COPY_ALL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, HEADS_FASTEST: tl.constexpr,
    KV_FP8: tl.constexpr = False, EMULATE_RNE: tl.constexpr = False,
    AMAX_FLOOR: tl.constexpr = 1e-12,
):  # fmt: skip
    """One program: BLOCK_M tokens (rows) x BLOCK_H heads of the fused QKV matrix.

    Heads [0, n_q) are Q, [n_q, n_q + n_kv) K (both rotated), the rest V (copied only when
    writing the cache or producing a separate output). An out-of-range position or cache slot
    turns that token's rotated values into NaN instead of reading or writing out of bounds:
    a loud failure without a host synchronisation.

    Switches: ``INTERLEAVED`` pairs (2i, 2i+1) (Meta) or (i, i + HALF) (HF), loaded with one
    ``[2, HALF_PAD]`` load per row when ``JOINT``; ``BACKWARD`` rotates by -theta;
    ``WRITE_CACHE`` writes K/V to their cache slots; ``KV_FP8``: the caches are e4m3 and each
    (token, KV head) row is quantized from the fp32 values (rotated K, V as read) with one
    fp32 scale ``amax / 448`` written to ``KS``/``VS`` ``[slots, n_kv]`` (``fp8_quant.py``'s
    rule); ``COPY_ALL`` (OUT is not X) copies every head; ``HEADS_FASTEST`` orders a 1-D grid
    with the head blocks fastest.
    """
    if HEADS_FASTEST:  # 1-D grid, head blocks fastest: programs in flight stream whole rows
        n_h_blocks = tl.cdiv(n_heads_launch, BLOCK_H)
        pid_t = tl.program_id(0) // n_h_blocks
        pid_h = tl.program_id(0) % n_h_blocks
    else:
        pid_t = tl.program_id(0)
        pid_h = tl.program_id(1)
    offs_t = pid_t * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_t = offs_t < n_rows
    mask_h = offs_h < n_heads_launch

    pos = tl.load(POS + offs_t, mask=mask_t, other=0).to(tl.int64)
    ok = (pos >= 0) & (pos < n_pos)
    if WRITE_CACHE:
        slot = tl.load(SLOT + offs_t, mask=mask_t, other=0).to(tl.int64)
        ok = ok & (slot >= 0) & (slot < n_slots)
    pos = tl.where(ok, pos, 0)

    # cos/sin: [BLOCK_M, 1, HALF_PAD], one angle per pair.
    offs_f = tl.arange(0, HALF_PAD)
    fmask = mask_t[:, None, None] & (offs_f < HALF)[None, None, :]
    cos = tl.load(
        COS + pos[:, None, None] * stride_cp + offs_f[None, None, :] * stride_cc,
        mask=fmask,
        other=0.0,
    ).to(tl.float32)
    sin = tl.load(
        SIN + pos[:, None, None] * stride_sp + offs_f[None, None, :] * stride_sc,
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
    x_base = X + rows_t * stride_xt + cols_h * stride_xc
    o_base = OUT + rows_t * stride_ot + cols_h

    xa, xb = load_pairs(x_base, stride_xc, mask_row, HALF, HALF_PAD, INTERLEAVED, JOINT)
    ya, yb = rotate(xa, xb, cos, sin, cos, sin, BACKWARD)
    rot3 = is_rot[None, :, None]
    ya = tl.where(rot3, ya, xa)
    yb = tl.where(rot3, yb, xb)
    if COPY_ALL:
        store_pairs(o_base, ya, yb, mask_row, HALF, HALF_PAD, INTERLEAVED, JOINT)
    else:
        store_pairs(o_base, ya, yb, mask_row & rot3, HALF, HALF_PAD, INTERLEAVED, JOINT)

    if PASS > 0 and (COPY_ALL or WRITE_CACHE):
        offs_p = 2 * HALF + tl.arange(0, PASS_PAD)
        pmask = mask_row & (offs_p < HEAD_DIM)[None, None, :]
        xp = tl.load(x_base + offs_p[None, None, :] * stride_xc, mask=pmask, other=0.0)
        if COPY_ALL:
            tl.store(o_base + offs_p[None, None, :], xp, mask=pmask)

    if WRITE_CACHE:
        slot3 = slot[:, None, None]
        is_k = (offs_h >= n_q) & is_rot
        is_v = offs_h >= n_q + n_kv
        kh1 = tl.where(is_k, offs_h - n_q, 0).to(tl.int64)
        vh1 = tl.where(is_v, offs_h - n_q - n_kv, 0).to(tl.int64)
        kh = kh1[None, :, None]
        vh = vh1[None, :, None]
        ok3 = ok[:, None, None]
        k_base = KC + slot3 * stride_kcs + kh * stride_kch
        v_base = VC + slot3 * stride_vcs + vh * stride_vch
        if KV_FP8:  # one scale per (token, KV head): the amax of the whole head's row
            amax = tl.maximum(tl.max(tl.abs(ya), axis=2), tl.max(tl.abs(yb), axis=2))
            if PASS > 0:
                amax = tl.maximum(amax, tl.max(tl.abs(xp.to(tl.float32)), axis=2))
            inv, scale = fp8_row_scales(amax, AMAX_FLOOR)
            inv3 = inv[:, :, None]
            wa = fp8_codes(ya, inv3, EMULATE_RNE)
            wb = fp8_codes(yb, inv3, EMULATE_RNE)
            ok2 = mask_t[:, None] & mask_h[None, :] & ok[:, None]
            slot2 = slot[:, None]
            tl.store(KS + slot2 * stride_kss + kh1[None, :], scale, mask=ok2 & is_k[None, :])
            tl.store(VS + slot2 * stride_vss + vh1[None, :], scale, mask=ok2 & is_v[None, :])
        else:
            wa, wb = ya, yb
        store_pairs(
            k_base, wa, wb, mask_row & ok3 & is_k[None, :, None], HALF, HALF_PAD, INTERLEAVED, JOINT
        )
        store_pairs(
            v_base, wa, wb, mask_row & ok3 & is_v[None, :, None], HALF, HALF_PAD, INTERLEAVED, JOINT
        )
        if PASS > 0:
            km = pmask & ok3 & is_k[None, :, None]
            vm = pmask & ok3 & is_v[None, :, None]
            if KV_FP8:
                wp = fp8_codes(xp.to(tl.float32), inv3, EMULATE_RNE)
            else:
                wp = xp
            tl.store(k_base + offs_p[None, None, :], wp.to(KC.dtype.element_ty), mask=km)
            tl.store(v_base + offs_p[None, None, :], wp.to(VC.dtype.element_ty), mask=vm)


# ------------------------------------------------------------------------------------------------
# 2. Launch configuration and launcher
# ------------------------------------------------------------------------------------------------

# One configuration for every shape, chosen with ``kernel_benchmark/bench_rope.py --tune`` on an
# H200; HEADS_FASTEST "auto" from interleaved A/B runs (heads fastest for multi-token programs).
# TARGET: rotated pairs per program. ``_TUNE`` overrides any key
# (set by the benchmark and the tests only).
_CONFIGS: dict[str, dict[str, int | str]] = {
    "rope_qkv": dict(TARGET=2048, num_warps=4, JOINT=True, HEADS_FASTEST="auto"),
}
_TUNE: dict[str, int | str] = {}


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _config(n_rows: int, n_heads: int, half_pad: int) -> dict[str, int]:
    """BLOCK_M, BLOCK_H, num_warps, JOINT and HEADS_FASTEST of one launch: ~TARGET pairs per
    program (tuned on an H200).

    BLOCK_H is the largest power of two up to TARGET / half_pad that wastes the fewest masked
    heads (40 + 40 heads of LLaMA-13B take 5 blocks of 16, not 64 + a quarter-used 64).
    """
    cfg = {**_CONFIGS["rope_qkv"], **_TUNE}
    cap = min(_pow2(n_heads), max(1, cfg["TARGET"] // half_pad))
    candidates = [1 << i for i in range(cap.bit_length()) if (1 << i) <= cap]
    block_h = min(
        candidates, key=lambda bh: (triton.cdiv(n_heads, bh) * bh - n_heads) / n_heads - bh * 1e-6
    )
    block_h = cfg.get("BLOCK_H") or block_h
    block_m = cfg.get("BLOCK_M") or max(1, cfg["TARGET"] // (half_pad * block_h))
    block_m = min(block_m, _pow2(n_rows))
    heads_fastest = cfg["HEADS_FASTEST"]
    if heads_fastest == "auto":
        # A program of several tokens covers only a short run of each row: with tokens fastest,
        # the programs in flight would read scattered short runs of many rows. Heads fastest
        # keeps them on the same rows (H200, LLaMA-13B's 2-token programs: 89% -> 94% of copy
        # bandwidth); one-token programs (7B, 65B) measured the same or 1 point better as is.
        heads_fastest = block_m > 1
    return dict(
        BLOCK_M=block_m, BLOCK_H=block_h, num_warps=cfg["num_warps"], JOINT=bool(cfg["JOINT"]),
        HEADS_FASTEST=bool(heads_fastest),
    )  # fmt: skip


def _launch(
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    n_rows = x.shape[0]
    write_cache = k_cache is not None
    copy_all = out.data_ptr() != x.data_ptr()
    n_heads = n_q + 2 * n_kv if (write_cache or copy_all) else n_q + n_kv
    if n_rows == 0:
        return
    half = rotary_dim // 2
    half_pad = _pow2(half)
    pass_ = head_dim - rotary_dim
    cfg = _config(n_rows, n_heads, half_pad)
    grid = (triton.cdiv(n_rows, cfg["BLOCK_M"]), triton.cdiv(n_heads, cfg["BLOCK_H"]))
    if cfg["HEADS_FASTEST"]:
        grid = (grid[0] * grid[1],)
    kc = k_cache if write_cache else x
    vc = v_cache if write_cache else x
    slots = cache_slots if write_cache else positions
    kv_fp8 = write_cache and k_cache.dtype == FP8_DTYPE
    ks = k_scale if kv_fp8 else x
    vs = v_scale if kv_fp8 else x
    _rope_qkv_kernel[grid](
        x, out, positions, cos, sin, kc, vc, slots, ks, vs,
        n_rows, n_heads, n_q, n_kv, cos.shape[0], kc.shape[0] if write_cache else 0,
        x.stride(0), x.stride(1), out.stride(0),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        kc.stride(0) if write_cache else 0, kc.stride(1) if write_cache else 0,
        vc.stride(0) if write_cache else 0, vc.stride(1) if write_cache else 0,
        ks.stride(0) if kv_fp8 else 0, vs.stride(0) if kv_fp8 else 0,
        HEAD_DIM=head_dim, HALF=half, HALF_PAD=half_pad, PASS=pass_, PASS_PAD=_pow2(pass_),
        INTERLEAVED=interleaved, JOINT=cfg["JOINT"], BACKWARD=backward,
        WRITE_CACHE=write_cache, COPY_ALL=copy_all,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_H=cfg["BLOCK_H"], HEADS_FASTEST=cfg["HEADS_FASTEST"],
        KV_FP8=kv_fp8, EMULATE_RNE=kv_fp8 and interpreter_enabled(), AMAX_FLOOR=MIN_AMAX,
        num_warps=cfg["num_warps"],
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------
# 3. Input checks
# ------------------------------------------------------------------------------------------------


def _check_args(
    qkv, positions, cos, sin, n_q_heads, n_kv_heads, head_dim, rotary_dim, k_cache, v_cache,
    cache_slots, *, for_kernel: bool, k_scale=None, v_scale=None,
) -> int:  # fmt: skip
    """Validate ``apply_rope_qkv_`` arguments; returns the effective rotary_dim."""
    qkv = check_tensor("qkv", qkv)
    check_dtype("qkv", qkv, FLOAT_DTYPES)
    check_ndim("qkv", qkv, 2)
    for name, v in (("n_q_heads", n_q_heads), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
        check_positive_int(name, v)
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
    check_index("positions", positions, qkv.shape[0])
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
        check_index("cache_slots", cache_slots, qkv.shape[0])
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            _check_cache(name, c, qkv, n_kv_heads, head_dim)
        _check_scales(k_cache, v_cache, k_scale, v_scale, n_kv_heads)
    elif k_scale is not None or v_scale is not None:
        raise ValueError("k_scale and v_scale go with an e4m3 k_cache/v_cache")
    check_same_device(
        qkv=qkv, positions=positions, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache,
        cache_slots=cache_slots,
    )  # fmt: skip
    if for_kernel:
        check_triton_device("qkv", qkv)
    if not qkv.is_cuda or debug_checks() or not for_kernel:
        check_range("positions", positions, cos.shape[0], "the cos/sin table's rows")
        if all(given):
            n_slots = min(k_cache.shape[0], v_cache.shape[0])
            check_range("cache_slots", cache_slots, n_slots, "the cache's slots")
    return rotary_dim


def check_rope_qkv(
    qkv, positions, cos, sin, n_q_heads: int, n_kv_heads: int, head_dim: int, *, k_cache=None,
    v_cache=None, cache_slots=None, k_scale=None, v_scale=None, for_kernel: bool = True,
) -> None:  # fmt: skip
    """``apply_rope_qkv_``'s checks (full rotary) for a kernel that fuses the same rotation and
    cache write into its epilogue (``fp8_decode_gemm``'s ``rope``)."""
    _check_args(
        qkv, positions, cos, sin, n_q_heads, n_kv_heads, head_dim, None, k_cache, v_cache,
        cache_slots, for_kernel=for_kernel, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip


def _check_cache(name: str, c: object, qkv: torch.Tensor, n_kv_heads: int, head_dim: int) -> None:
    check_tensor(name, c)
    check_ndim(name, c, 3)
    if c.shape[1:] != (n_kv_heads, head_dim):
        raise ValueError(
            f"{name} must have shape [num_slots, n_kv_heads={n_kv_heads}, head_dim={head_dim}], got {tuple(c.shape)}"
        )
    if c.dtype not in (qkv.dtype, FP8_DTYPE):
        raise TypeError(f"{name} must have qkv's dtype {qkv.dtype} or {FP8_DTYPE}, got {c.dtype}")
    if c.stride(2) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got {c.stride()}")


def _check_scales(k_cache, v_cache, k_scale, v_scale, n_kv_heads: int) -> None:
    """An e4m3 cache (both or neither) comes with fp32 scales ``[num_slots, n_kv_heads]``."""
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(
            f"k_cache and v_cache must have one dtype, got {k_cache.dtype} and {v_cache.dtype}"
        )
    if k_cache.dtype != FP8_DTYPE:
        if k_scale is not None or v_scale is not None:
            raise ValueError("k_scale and v_scale go with an e4m3 k_cache/v_cache")
        return
    for name, sc, c in (("k_scale", k_scale, k_cache), ("v_scale", v_scale, v_cache)):
        if sc is None:
            raise ValueError(f"an e4m3 cache needs {name} (fp32 [num_slots, n_kv_heads])")
        check_tensor(name, sc)
        check_dtype(name, sc, (torch.float32,))
        if sc.shape != (c.shape[0], n_kv_heads) or sc.stride(1) != 1:
            raise ValueError(
                f"{name} must be a fp32 [num_slots={c.shape[0]}, n_kv_heads={n_kv_heads}] tensor "
                f"with unit stride in its last dimension, got shape {tuple(sc.shape)}, "
                f"strides {sc.stride()}"
            )
        if sc.device != c.device:
            raise ValueError(f"{name} is on {sc.device}, the cache on {c.device}")


# ------------------------------------------------------------------------------------------------
# 4. Autograd function
# ------------------------------------------------------------------------------------------------


class _RopeQKVFunction(torch.autograd.Function):
    """In-place QK rotation; backward rotates the Q/K gradient by -theta, V's passes through."""

    @staticmethod
    def forward(ctx, qkv, positions, cos, sin, n_q, n_kv, head_dim, rotary_dim, interleaved):
        args = (n_q, n_kv, head_dim, rotary_dim, interleaved)
        _launch(qkv, qkv, positions, cos, sin, *args, backward=False)
        ctx.mark_dirty(qkv)
        ctx.save_for_backward(positions, cos, sin)
        ctx.args = args
        return qkv

    @staticmethod
    def backward(ctx, grad):
        positions, cos, sin = ctx.saved_tensors
        out = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        _launch(grad, out, positions, cos, sin, *ctx.args, backward=True)
        return out, None, None, None, None, None, None, None, None


# ------------------------------------------------------------------------------------------------
# 5. Public functions
# ------------------------------------------------------------------------------------------------


class Llama3Scaling(Protocol):
    """What ``rope_frequencies`` reads of a Llama-3.1 scaling (``config.RopeScaling``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def rope_frequencies(
    rotary_dim: int, base: float = 10000.0, scaling: Llama3Scaling | None = None, device=None
) -> torch.Tensor:
    """fp64 ``[rotary_dim // 2]`` inverse frequencies ``base**(-2i/rotary_dim)``, with
    Llama-3.1's scaling when ``scaling`` is given (Meta's ``apply_scaling``, transformers'
    ``_compute_llama3_parameters``): wavelengths below ``old / high_freq_factor`` kept, above
    ``old / low_freq_factor`` divided by ``factor``, the band between interpolated."""
    if not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even int, got {rotary_dim!r}")
    if not base > 0:
        raise ValueError(f"base must be positive, got {base!r}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    half = rotary_dim // 2
    inv = float(base) ** (
        -2.0 * torch.arange(half, dtype=torch.float64, device=device) / rotary_dim
    )
    if scaling is None:
        return inv
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old = scaling.original_max_position_embeddings
    if not (factor > 0 and low > 0 and high > low and old > 0):
        raise ValueError(
            f"scaling must have factor > 0 and high_freq_factor > low_freq_factor > 0, got {scaling!r}"
        )
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def te_inv_freq(
    rotary_dim: int, base: float, scaling: Llama3Scaling | None = None, device=None
) -> torch.Tensor:
    """fp32 inverse frequencies as TransformerEngine's ``RotaryPositionEmbedding`` forms them
    (``base**(-2i/d)`` in fp32), or Llama-3.1's scaled ones (:func:`rope_frequencies`)."""
    if scaling is not None:
        return rope_frequencies(rotary_dim, base, scaling, device).float()
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
    return 1.0 / (base**exponents)


def build_rope_cache(
    max_positions: int,
    rotary_dim: int,
    base: float = 10000.0,
    device=None,
    *,
    scaling: Llama3Scaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: fp32 ``[max_positions, rotary_dim // 2]``, angle[p, i] = p * inv_freq[i]
    (``rope_frequencies``: ``base**(-2i/rotary_dim)``, Llama-3.1-scaled with ``scaling``).

    Angles are formed in fp64 and rounded once: in fp32, ``p * inv_freq`` at p ~ 2**20 is off by
    up to ~0.06 rad, which would make long-context positions wrong.
    """
    if not isinstance(max_positions, int) or max_positions <= 0:
        raise ValueError(f"max_positions must be a positive int, got {max_positions!r}")
    inv = rope_frequencies(rotary_dim, base, scaling, device)
    half = rotary_dim // 2
    cos = torch.empty(max_positions, half, dtype=torch.float32, device=inv.device)
    sin = torch.empty_like(cos)
    chunk = max(1, (1 << 22) // half)  # bounds the fp64 temporaries
    for p0 in range(0, max_positions, chunk):
        p = torch.arange(p0, min(p0 + chunk, max_positions), dtype=torch.float64, device=inv.device)
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate the Q and K heads of a fused ``[tokens, (nq + 2 nkv) * head_dim]`` matrix in place.

    One launch rotates Q and K (V untouched) and, with ``k_cache``/``v_cache``/``cache_slots``,
    writes the rotated K and the V of token t into slot ``cache_slots[t]`` of the caches.
    ``interleaved=True`` pairs channels (2i, 2i+1) (Meta checkpoints), False pairs (i, i + r/2)
    (HF). Positions (and cache slots) outside the table are rejected with ValueError on the CPU
    or with ``NAKTA_DEBUG=1``; on CUDA without the flag they are not synchronised on and instead
    turn that token's rotated Q/K into NaN (and skip its cache write), never reading or writing
    out of bounds. An e4m3 cache (``kv_cache="fp8"``) is written quantized: each token's K
    (rotated) and V row of each KV head in e4m3 with one fp32 scale ``amax / 448`` of that row
    in ``k_scale``/``v_scale`` ``[num_slots, n_kv_heads]`` (``fp8_quant.py``'s rule, from the
    fp32 values before they are rounded to qkv's dtype).
    """
    rotary_dim = _check_args(
        qkv, positions, cos, sin, n_q_heads, n_kv_heads, head_dim, rotary_dim, k_cache, v_cache,
        cache_slots, for_kernel=True, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    args = (n_q_heads, n_kv_heads, head_dim, rotary_dim, bool(interleaved))
    if torch.is_grad_enabled() and qkv.requires_grad:
        if k_cache is not None:
            raise ValueError(
                "cache writes are inference-only: call under torch.no_grad() or pass a qkv that does not require grad"
            )
        return _RopeQKVFunction.apply(qkv, positions, cos, sin, *args)
    _launch(
        qkv, qkv, positions, cos, sin, *args, backward=False, k_cache=k_cache, v_cache=v_cache,
        cache_slots=cache_slots, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    return qkv


# ------------------------------------------------------------------------------------------------
# 6. Reference
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch ``apply_rope_qkv_`` (same in-place semantics and cache writes, e4m3 ones
    quantized from the fp32 values by ``quantize_rows_reference``; CPU fallback)."""
    rotary_dim = _check_args(
        qkv, positions, cos, sin, n_q_heads, n_kv_heads, head_dim, rotary_dim, k_cache, v_cache,
        cache_slots, for_kernel=False, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    heads = qkv.unflatten(1, (n_q_heads + 2 * n_kv_heads, head_dim))
    n_rot = n_q_heads + n_kv_heads
    pos = positions.long()
    c = cos[pos][:, None, :]
    s = sin[pos][:, None, :]
    rot = heads[:, :n_rot, :rotary_dim]
    rot32 = _rotate_reference(rot.float(), c, s, interleaved)
    k32 = torch.cat((rot32[:, n_q_heads:], heads[:, n_q_heads:n_rot, rotary_dim:].float()), -1)
    rot.copy_(rot32.to(qkv.dtype))
    if k_cache is not None:
        slots = cache_slots.long()
        if k_cache.dtype == FP8_DTYPE:
            for cache, scale, x in ((k_cache, k_scale, k32), (v_cache, v_scale, heads[:, n_rot:])):
                qr = quantize_rows_reference(x)
                cache[slots] = qr.q.view(x.shape)
                scale[slots] = qr.scale.view(x.shape[:2])
        else:
            k_cache[slots] = heads[:, n_q_heads:n_rot]
            v_cache[slots] = heads[:, n_rot:]
    return qkv
