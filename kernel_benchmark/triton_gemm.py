"""Triton GEMMs, ``x @ w.T``, as peers of cuBLAS in ``bench_gemm``: a plain tiled one, and a
persistent one that loads its tiles by TMA (Hopper) with SwiGLU optionally in its epilogue.

Why: the scoring engine's non-GEMM kernels (RMSNorm, RoPE, SwiGLU) already run at copy
bandwidth; the only way left to remove their time is to fuse them into the GEMMs' prologues and
epilogues, which needs a GEMM of our own. This is the GEMM such a fusion would start from
(grouped tile order for L2 reuse, ``tl.dot`` on the tensor cores, fp32 accumulation); its rate
next to cuBLAS's on the block shapes says what a fused version would give up first.
Benchmark-only: nothing in ``nakta_model`` calls them (the TMA section says why).
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
    sm_count,
)
from nakta_model.kernels._triton_math import round_to, silu

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) tried on each shape; the best is reported
CONFIGS = [
    (128, 256, 64, 8, 3),
    (128, 256, 64, 8, 4),
    (256, 128, 64, 8, 3),
    (128, 128, 64, 4, 4),
    (128, 128, 64, 8, 4),
    (128, 128, 128, 8, 3),
]


@triton.jit
def _matmul_kernel(
    A, B, C, M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """One ``BLOCK_M x BLOCK_N`` tile of ``C = A @ B.T`` (``B`` is ``[N, K]``); tiles in groups
    of ``GROUP_M`` rows so consecutive programs share B's columns in L2."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptr = A + rm[:, None].to(tl.int64) * stride_am + rk[None, :] * stride_ak
    b_ptr = B + rn[None, :].to(tl.int64) * stride_bn + rk[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        left = K - k * BLOCK_K
        a = tl.load(a_ptr, mask=(rm[:, None] < M) & (rk[None, :] < left), other=0.0)
        b = tl.load(b_ptr, mask=(rn[None, :] < N) & (rk[:, None] < left), other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptr += BLOCK_K * stride_ak
        b_ptr += BLOCK_K * stride_bk
    c_ptr = C + rm[:, None].to(tl.int64) * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptr, acc.to(C.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def triton_linear(x: torch.Tensor, w: torch.Tensor, config: tuple = CONFIGS[0]) -> torch.Tensor:
    """``x @ w.T`` (``F.linear`` without bias) for 2-D ``x [M, K]`` and ``w [N, K]`` (fp32
    inputs: tf32 dots, Triton's default)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"need x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != w.dtype:
        raise TypeError(f"x and w must share a dtype, got {x.dtype} and {w.dtype}")
    bm, bn, bk, warps, stages = config
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _matmul_kernel[grid](
        x, w, out, m, n, k, *x.stride(), *w.stride(), *out.stride(),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------------
# The persistent TMA GEMM, with SwiGLU optionally fused into its epilogue
# ------------------------------------------------------------------------------------------------
# One program per SM walks tiles ``pid, pid + NUM_SMS, ...`` in grouped order; A and B tiles
# arrive by TMA, C leaves by TMA; the loops are flattened so the next tile's loads overlap this
# tile's epilogue. With SwiGLU each program computes a gate tile and the matching up tile (rows
# ``n`` and ``F + n`` of ``w13``) and writes ``silu(gate) * up`` only, rounded as swiglu.py
# rounds (gate and up first), so it equals the unfused path of this same kernel bit for bit.
# Measured on an H200 (results/nvidia-h200/gemm.md): the plain kernel at cuBLAS's rate (645-689
# vs 653-675 TFLOP/s over two runs), the fused one slower than cuBLAS + the SwiGLU kernel
# (16K tokens: 5.40 vs 4.65 ms), and the scorer built on them slower than on cuBLAS (221.6 vs
# 248 tasks/s, commit ffc02ad): it stays a benchmark peer.


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


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) on an H200 (128x256x64, 8 warps, 3 stages
# was the best of 5 on all four 7B block shapes). SwiGLU holds two accumulators, so its tile is
# half as wide. Half dtypes only on a GPU (fp32 tiles overflow shared memory); fp32 in the
# interpreter (tests).
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


def tma_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`tma_linear` can run ``x @ w.T`` here (TMA hardware with a half dtype, or
    the interpreter; both 2-D and TMA-aligned, one float dtype)."""
    if x.dim() != 2 or w.dim() != 2 or x.dtype != w.dtype or x.dtype not in FLOAT_DTYPES:
        return False
    if x.is_cuda:
        if torch.cuda.get_device_capability(x.device)[0] < 9 or x.dtype == torch.float32:
            return False
    elif not interpreter_enabled():
        return False
    return _tma_ok(x) and _tma_ok(w)


def tma_linear(
    x: torch.Tensor, w: torch.Tensor, *, swiglu: bool = False, fast_silu: bool | None = None
) -> torch.Tensor:
    """``x @ w.T`` for ``x [M, K]`` and ``w [N, K]`` (``F.linear`` without bias); with
    ``swiglu``, ``w`` is the fused ``[2F, K]`` gate/up projection and the result is
    ``silu(x @ w[:F].T) * (x @ w[F:].T)``, ``[M, F]``, rounded as ``swiglu.swiglu`` rounds
    (``fast_silu`` as there: default on for bf16). See :func:`tma_supported`."""
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
        raise ValueError("tma_linear needs TMA: a GPU of compute capability 9.0+")
    if x.is_cuda and x.dtype == torch.float32:
        raise TypeError("tma_linear takes bf16/fp16 on a GPU (fp32 tiles overflow shared memory)")
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
    sms = sm_count(x.device, _INTERPRETER_SMS)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    _gemm_kernel[(min(sms, tiles),)](
        TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn]), m, n, k, n if swiglu else 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_SMS=sms, SWIGLU=swiglu,
        FAST_SILU=fast_silu, ACCURATE=not interp, IEEE=x.dtype == torch.float32 or interp,
        EMULATE_RNE=interp, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


def linear_reference(x: torch.Tensor, w: torch.Tensor, *, swiglu: bool = False) -> torch.Tensor:
    """``F.linear(x, w)``, then ``silu(gate) * up`` over its halves with ``swiglu`` (PyTorch's
    roundings: gate and up rounded, silu rounded, the product rounded); also takes fp64."""
    y = F.linear(x, w)
    if not swiglu:
        return y
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up
