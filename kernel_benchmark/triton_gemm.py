"""A plain tiled Triton GEMM, ``x @ w.T``, as a peer in ``bench_gemm`` (next to cuBLAS and
Nakta's persistent TMA GEMM, ``nakta_model/kernels/gemm.py``).

Why: the scoring engine's non-GEMM kernels (RMSNorm, RoPE, SwiGLU) already run at copy
bandwidth; the only way left to remove their time is to fuse them into the GEMMs' prologues and
epilogues, which needs a GEMM of our own. This is the GEMM such a fusion would start from
(grouped tile order for L2 reuse, ``tl.dot`` on the tensor cores, fp32 accumulation); its rate
next to cuBLAS's on the block shapes says what a fused version would give up first.
Benchmark-only: nothing in ``nakta_model`` calls it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
