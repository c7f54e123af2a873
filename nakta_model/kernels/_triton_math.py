"""Triton device helpers shared by the kernel files."""

from __future__ import annotations

import triton
import triton.language as tl


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
