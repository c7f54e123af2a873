"""Device helpers shared by the kernel files: rounding, libdevice functions, RoPE pairs.

One module for every ``@triton.jit`` helper that more than one kernel file calls, so each piece
of arithmetic that must match PyTorch bit for bit is written once: the fp32 -> half rounding
(emulated under the interpreter), the libdevice functions PyTorch's CUDA kernels call (numpy
stand-ins under the interpreter, which has no libdevice), SiLU with the arithmetic found to round
like eager per dtype, and the RoPE pair load / rotate / store used by ``rope.py``, ``rope_te.py``
and the RoPE epilogue of ``decode_linear.py``.

``ACCURATE`` is True on the GPU (libdevice) and False under the interpreter; ``EMULATE_RNE`` is
True under the interpreter only. ``to_e4m3`` is the fp32 -> FP8 e4m3 rounding (hardware cast on
the GPU, an exact bit-level emulation under the interpreter, whose own cast rounds wrongly).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def round_to(x, dtype: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """fp32 -> ``dtype`` rounding to nearest even.

    The Triton interpreter truncates fp32 -> bf16 instead of rounding; ``EMULATE_RNE`` (set only
    under the interpreter) does the rounding by hand so CPU tests see the GPU's bits.
    """
    if EMULATE_RNE:  # noqa: SIM102 (nested: keep the dtype test out of compiled kernels)
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            x = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def to_e4m3(x, EMULATE_RNE: tl.constexpr):
    """fp32 ``x`` with ``|x| <= 448`` (the caller clamps) -> ``tl.float8e4nv`` (e4m3fn),
    rounding to nearest even.

    On the GPU this is the hardware cast (``cvt.rn.satfinite.e4m3x2.f32``). Triton 3.9's
    interpreter casts wrongly (125.98 -> 64, 0.001 -> 0 instead of 128 and 2^-9), so with
    ``EMULATE_RNE`` the byte is built from the fp32 bit pattern: normal results (|x| >= 2^-6)
    keep 3 of the 23 mantissa bits (round to nearest even by the bf16 trick: add 0x7FFFF plus
    the lowest kept bit, carry into the exponent), rebias the exponent 127 -> 7; subnormal
    results are ``m * 2^-9`` with ``m`` the significand shifted right with RNE (``m = 8`` is
    2^-6, whose code is the next one up). Checked against PyTorch's cast on every fp32 value
    of a dense sweep with all rounding midpoints (tests/test_fp8_kernels.py).
    """
    if EMULATE_RNE:
        bits = x.to(tl.uint32, bitcast=True)
        sign = (bits >> 24) & 0x80
        a = bits & 0x7FFFFFFF
        e = a >> 23
        # normal: round away 20 mantissa bits, then (exponent - 120, 3 mantissa bits)
        r = (a + 0x7FFFF + ((a >> 20) & 1)) >> 20
        normal = r - (120 << 3)
        # subnormal: m = round(significand * 2^(e - 141)); shifts past 25 give 0 like 25 does
        sig = (a & 0x7FFFFF) | 0x800000
        shift = tl.minimum(141 - tl.minimum(e, 120), 25)
        q = sig >> shift
        rem = sig - (q << shift)
        half = 1 << (shift - 1)
        q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.uint32)
        q = tl.where(e == 0, 0, q)
        byte = tl.where(e >= 121, normal, q) | sign
        return byte.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    else:
        return x.to(tl.float8e4nv)


@triton.jit
def fp8_row_scales(amax, MIN_AMAX: tl.constexpr):
    """``(inv, scale)`` of rows whose largest magnitude is ``amax`` (fp32): ``448 / amax`` and
    ``amax / 448``, both correctly rounded (``div_rn``) as PyTorch divides; ``amax`` is first
    raised to ``MIN_AMAX`` so an all-zero row stays finite (``fp8_quant.py``'s rule)."""
    amax = tl.maximum(amax, MIN_AMAX)
    return tl.math.div_rn(448.0, amax), tl.math.div_rn(amax, 448.0)


@triton.jit
def fp8_codes(v, inv, EMULATE_RNE: tl.constexpr):
    """``e4m3_rne(clamp(v * inv, -448, 448))``: fp32 values to FP8 codes (``inv`` broadcast)."""
    y = v * inv
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    return to_e4m3(y, EMULATE_RNE)


@triton.jit
def rsqrt(x, ACCURATE: tl.constexpr):
    """libdevice ``rsqrtf`` on the GPU (what ``torch.rsqrt`` calls); numpy in the interpreter."""
    if ACCURATE:
        return libdevice.rsqrt(x)
    else:
        return tl.rsqrt(x)


@triton.jit
def exp(x, ACCURATE: tl.constexpr):
    """libdevice ``expf`` on the GPU (what PyTorch's ``::exp`` is); numpy in the interpreter."""
    if ACCURATE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def silu(g, FAST: tl.constexpr, ACCURATE: tl.constexpr):
    """``g / (1 + exp(-g))`` in fp32, rounding (once cast to the dtype) like PyTorch eager.

    ``FAST``: the hardware ex2 and an approximate division (Liger's arithmetic), eager's bits
    in bf16 on every gate (``swiglu.py``'s docstring). Otherwise libdevice ``expf`` and the
    IEEE division, what PyTorch's CUDA kernel compiles to (fp16, fp32).
    """
    if FAST:
        s = tl.fdiv(g, 1.0 + tl.exp(-g), ieee_rounding=False)
    else:
        s = tl.math.div_rn(g, 1.0 + exp(-g, ACCURATE))
    return s


# ------------------------------------------------------------------------------------------------
# RoPE pairs: the two members of each rotated pair of channels, in fp32
# ------------------------------------------------------------------------------------------------


@triton.jit
def load_pairs(
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
def store_pairs(
    ptrs_base,
    ya,
    yb,
    mask_row,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    JOINT: tl.constexpr,
):
    """Store the two pair members back to unit-stride channels (the inverse of ``load_pairs``)."""
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
def rotate(xa, xb, cos_a, sin_a, cos_b, sin_b, BACKWARD: tl.constexpr):
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
