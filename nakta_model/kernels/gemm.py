"""Dense ``x @ w.T`` for many tokens at once, with SwiGLU optionally in the epilogue.

Why a GEMM of our own: the scorer's forward is 88-90% matmul time, and the rest (SwiGLU, norms,
RoPE, attention) already runs at copy bandwidth, so what is left to win lives in the matmuls.
On an H200 this persistent kernel, which brings its tiles in by TMA, runs the 7B block shapes
at 16K tokens at 669-689 TFLOP/s against cuBLAS's 653-675 in the same process
(``kernel_benchmark/bench_gemm.py``; a plain tiled Triton GEMM reaches 509-521), and it can
finish the ``w13`` projection with SwiGLU: each program computes a gate tile and the matching
up tile (rows ``n`` and ``F + n`` of ``w13``) and writes ``silu(gate) * up`` only, so the
``[T, 2F]`` projection never goes to memory and the SwiGLU kernel's pass disappears.

Numerics: fp32 accumulation; the fused epilogue rounds gate and up to the dtype first and then
computes exactly what ``swiglu.py`` computes from them, so it equals ``swiglu(linear(x, w13))``
of this same kernel bit for bit. Against cuBLAS a result differs by the order of the K-sums
(rounding-level). fp32 inputs use IEEE fp32 dots (no tf32).

One program per SM walks tiles ``pid, pid + NUM_SMS, ...`` in grouped order (``GROUP_M`` row
tiles share one column block in L2); the loops are flattened so the next tile's loads overlap
this tile's epilogue. Needs TMA: CUDA compute capability 9.0+, rows 16-byte aligned
(``gemm_supported``); elsewhere the model uses ``F.linear``. The token count is not specialised
on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nakta_model.kernels._checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_same_device,
    check_tensor,
    check_triton_device,
    interpreter_enabled,
)
from nakta_model.kernels._triton_math import round_to, silu

__all__ = ["gemm_supported", "linear", "linear_reference"]

# ------------------------------------------------------------------------------------------------
# 1. Triton kernel
# ------------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """``acc + a @ b`` in fp32: IEEE fp32 operands (fp32 inputs; also half inputs under the
    interpreter, whose half-precision dot is wrong -- their products are exact in fp32), or the
    inputs' dtype on the tensor cores."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(
    a_desc, b_desc, c_desc, M, N, K, UP,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr, SWIGLU: tl.constexpr, FAST_SILU: tl.constexpr,
    ACCURATE: tl.constexpr, IEEE: tl.constexpr, EMULATE_RNE: tl.constexpr,
):  # fmt: skip
    """``C[M, N] = A[M, K] @ B[N, K].T``; with ``SWIGLU``, ``C[M, N] = silu(A @ B[:N].T) *
    (A @ B[UP:UP + N].T)`` rounded as ``swiglu.py`` rounds (``UP`` = F, the up rows' offset)."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    width = GROUP_M * num_n
    dtype = c_desc.dtype
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, flatten=True):
        first_m = (tile // width) * GROUP_M
        size_m = min(num_m - first_m, GROUP_M)
        off_m = (first_m + (tile % width) % size_m) * BLOCK_M
        off_n = ((tile % width) // size_m) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if SWIGLU:
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([off_m, ki * BLOCK_K])
            acc = _dot(a, b_desc.load([off_n, ki * BLOCK_K]).T, acc, IEEE)
            if SWIGLU:
                acc_up = _dot(a, b_desc.load([UP + off_n, ki * BLOCK_K]).T, acc_up, IEEE)
        if SWIGLU:  # the unfused path's roundings: gate, up, silu(gate), the product
            g = round_to(acc, dtype, EMULATE_RNE).to(tl.float32)
            u = round_to(acc_up, dtype, EMULATE_RNE).to(tl.float32)
            s = round_to(silu(g, FAST_SILU, ACCURATE), dtype, EMULATE_RNE).to(tl.float32)
            c_desc.store([off_m, off_n], round_to(s * u, dtype, EMULATE_RNE))
        else:
            c_desc.store([off_m, off_n], round_to(acc, dtype, EMULATE_RNE))


# ------------------------------------------------------------------------------------------------
# 2. Launch configuration, checks and launcher
# ------------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) on an H200 (bench_gemm: 128x256x64, 8
# warps, 3 stages was the best of 5 on all four 7B block shapes). SwiGLU holds two accumulators,
# so its tile is half as wide: the same registers and shared memory per stage.
_CONFIGS: dict[str, dict[str, int]] = {
    "plain": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
    "swiglu": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
}
_TUNE: dict[str, int] = {}
_INTERPRETER_CONFIG = dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=16, num_warps=1, num_stages=1)
_INTERPRETER_SMS = 3  # persistent programs under the interpreter: several tiles each


def _config(kind: str) -> dict[str, int]:
    if interpreter_enabled():
        return {**_INTERPRETER_CONFIG, **_TUNE}
    return {**_CONFIGS[kind], **_TUNE}


def _tma_ok(t: torch.Tensor) -> bool:
    """TMA's layout rules: unit last stride, 16-byte aligned base and row stride."""
    size = t.element_size()
    return (
        t.stride(-1) == 1
        and (t.stride(0) * size) % 16 == 0
        and t.data_ptr() % 16 == 0
        and (t.shape[-1] * size) % 16 == 0
    )


def gemm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`linear` can run ``x @ w.T`` here (TMA hardware or the interpreter, both
    2-D and TMA-aligned, one float dtype). The model asks before choosing it over ``F.linear``."""
    if x.dim() != 2 or w.dim() != 2 or x.dtype != w.dtype or x.dtype not in FLOAT_DTYPES:
        return False
    if x.is_cuda:
        if torch.cuda.get_device_capability(x.device)[0] < 9:
            return False
    elif not interpreter_enabled():
        return False
    return _tma_ok(x) and _tma_ok(w)


def linear(
    x: torch.Tensor, w: torch.Tensor, *, swiglu: bool = False, fast_silu: bool | None = None
) -> torch.Tensor:
    """``x @ w.T`` for ``x [M, K]`` and ``w [N, K]`` (``F.linear`` without bias); with
    ``swiglu``, ``w`` is the fused ``[2F, K]`` gate/up projection and the result is
    ``silu(x @ w[:F].T) * (x @ w[F:].T)``, ``[M, F]``, rounded as ``swiglu.swiglu`` rounds
    (``fast_silu`` as there: default on for bf16). See :func:`gemm_supported`."""
    x = check_tensor("x", x)
    w = check_tensor("w", w)
    check_dtype("x", x, FLOAT_DTYPES)
    if w.dtype != x.dtype:
        raise TypeError(f"w must have x's dtype {x.dtype}, got {w.dtype}")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(
            f"need x [M, K] and w [N, K] with the same K, got {tuple(x.shape)} and {tuple(w.shape)}"
        )
    check_same_device(x=x, w=w)
    check_triton_device("x", x)
    for name, t in (("x", x), ("w", w)):
        if not _tma_ok(t):
            raise ValueError(
                f"{name} must have unit last stride and 16-byte aligned rows (TMA), got shape "
                f"{tuple(t.shape)} strides {t.stride()} {t.dtype}"
            )
    if x.is_cuda and torch.cuda.get_device_capability(x.device)[0] < 9:
        raise ValueError("linear needs TMA: a GPU of compute capability 9.0+ (use F.linear)")
    m, k = x.shape
    n = w.shape[0]
    if swiglu:
        if n % 2:
            raise ValueError(f"swiglu needs w with an even row count [2F, K], got {n} rows")
        n //= 2
    if fast_silu is None:
        fast_silu = x.dtype == torch.bfloat16
    cfg = _config("swiglu" if swiglu else "plain")
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if not _tma_ok(out):
        raise ValueError(f"the output's rows ({n} x {out.element_size()} bytes) must be 16-byte "
                         "aligned for TMA")  # fmt: skip
    from triton.tools.tensor_descriptor import TensorDescriptor

    interp = interpreter_enabled()
    sms = _INTERPRETER_SMS if interp else _sm_count(x.device)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    _gemm_kernel[(min(sms, tiles),)](
        TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn]), m, n, k, n if swiglu else 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_SMS=sms, SWIGLU=swiglu,
        FAST_SILU=fast_silu, ACCURATE=not interp, IEEE=x.dtype == torch.float32 or interp,
        EMULATE_RNE=interp, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


_SM_COUNTS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


# ------------------------------------------------------------------------------------------------
# 3. Reference
# ------------------------------------------------------------------------------------------------


def linear_reference(x: torch.Tensor, w: torch.Tensor, *, swiglu: bool = False) -> torch.Tensor:
    """``F.linear(x, w)``, then ``silu(gate) * up`` over its halves with ``swiglu`` (PyTorch's
    roundings: gate and up rounded, silu rounded, the product rounded); also takes fp64."""
    y = F.linear(x, w)
    if not swiglu:
        return y
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up
