"""``y = round(x @ W^T)`` split over K, for the decode step's narrow GEMMs (``wo``, ``w2``).

Why: at 128..512 rows a 7B decode step's ``wo`` (4096 x 4096) and ``w2`` (4096 x 11008) have
4096 output columns, so cuBLAS tiles them into 64-128 programs on a 132-SM GPU and streams the
weights at 47 / 56% of copy bandwidth (H200, 256 rows: 55 / 69% of the bf16 matmul rate,
``kernel_benchmark/results/nvidia-h200/decode_gemm/decode_gemm_blocks.md``), where ``wqkv`` and
``w13`` reach 77 / 83%. Splitting K gives every SM a program: each (tile, split) program sums
its K range in fp32 and stores the partial tile into a workspace ``[SPLIT_K, M, N]``; the last
program of a tile to finish (an acq_rel counter per tile) adds the partials in split order,
rounds once to the output dtype and stores the tile, then zeroes the counter for the next
launch. One launch, deterministic (the split order fixes the sum), the rounding point of
``F.linear`` (one rounding of an fp32 sum); only the summation order differs.

FP8 (W8A8, the step's path for e4m3 weights above ``fp8_decode_gemm``'s 64 rows, where
cuBLASLt's row-wise scaled GEMM runs ``wo`` / ``w2`` at 459 / 719 TFLOP/s at 256 rows on an
H200 against ``wqkv`` / ``w13``'s 735 / 868, the same decode_gemm_blocks run): ``x`` and
``weight`` e4m3 with fp32 ``x_scale [M]`` and ``weight_scale [N]``, the total scaled as
``fp8_gemm.fp8_matmul_reference`` does (``acc * x_scale * w_scale``) and rounded once to
``out_dtype``; Hopper's fp8 MMA sums are moved into the fp32 accumulator every ``PROMOTE_K``
(128) products (or every ``BLOCK_K``, when smaller), as ``fp8_decode_gemm`` and cuBLASLt
without fast accumulation do.

CUDA-graph capturable: the workspace comes from the caching allocator, the counters from a
per-device buffer that every launch leaves zero (``_counters``), the grid from shapes only.
One launch at a time per device may use that buffer: the decode step's GEMMs run in stream
order (prefill beside decode uses ``F.linear``). ``SPLIT_K == 1`` stores the tile directly.

Launch values (``_config``): ``BLOCK_M`` 64 up to 64 rows, else 128; ``BLOCK_N`` 128,
``BLOCK_K`` 64; ``SPLIT_K`` so that tiles x splits covers the SMs (at most K / 512 splits);
then the device family's measured row of ``_splitk_gemm_tuned.json`` for (N, K, rows bucket,
float / fp8), written by ``kernel_benchmark/tune_splitk_gemm.py``; ``_TUNE`` overrides any of
them (benchmarks, tests). The decode step uses it only when asked (``step_gemm``:
``NAKTA_SPLITK_GEMM=1``): measured on an H100 (2026-11-26), its best tuned config runs at
0.73-0.94x cuBLAS at 128-512 rows (``kernel_benchmark/results/nvidia-h100-80gb-hbm3/
splitk_gemm_tune.md``) and a 1,000 x 128/128 run 1-2% slower with it
(``speed_bench/results/nvidia-h100-80gb-hbm3/throughput_ab/``): cuBLAS's narrow tiles lose
less than the split's partial-tile traffic costs.
"""

from __future__ import annotations

from pathlib import Path

import torch
import triton
import triton.language as tl

from nakta_model.kernels._checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_ndim,
    check_same_device,
    check_tensor,
    check_triton_device,
    device_family,
    interpreter_enabled,
    sm_count,
)
from nakta_model.kernels._triton_math import round_to
from nakta_model.kernels._tuned_tables import read_tuned
from nakta_model.kernels.fp8_decode_gemm import PROMOTE_K
from nakta_model.kernels.fp8_gemm import OUT_DTYPES
from nakta_model.kernels.fp8_quant import FP8_DTYPE

__all__ = ["MAX_TILES", "splitk_linear", "splitk_linear_reference"]

MAX_TILES = 8192  # output tiles one launch may have (the counter buffer's length)
KNOBS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")
ROWS_BUCKETS = (64, 128, 256, 384, 512)  # the decode step's graph sizes from 64 rows
TUNED_JSON = Path(__file__).with_name("_splitk_gemm_tuned.json")
_TUNE: dict[str, int] = {}
_DEFAULT_SMS = 132  # H100 SXM / H200; off the GPU, so interpreter runs pick GPU-like splits
_COUNTERS: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _splitk_gemm_kernel(
    X, W, XS, WS, Y, PART, COUNT, M, N, K, k_split,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr,
    PROMOTE: tl.constexpr, EMULATE_RNE: tl.constexpr,
):  # fmt: skip
    """Program (tile, split): ``x[tile rows, K range] @ W[tile cols, K range]^T`` in fp32; the
    tile's last split to finish sums the partials in split order and stores the rounded tile."""
    tile = tl.program_id(0)
    split = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    rm = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    k_lo = split * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    x_ptrs = X + rm.to(tl.int64)[:, None] * stride_xm + (k_lo + rk)[None, :] * stride_xk
    w_ptrs = W + rn.to(tl.int64)[:, None] * stride_wn + (k_lo + rk)[None, :] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        k_ok = k + rk < k_hi
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                    eviction_policy="evict_first")  # fmt: skip
        if UPCAST:  # the interpreter's bf16 dot (numpy has no bf16): exact products in fp32
            x, w = x.to(tl.float32), w.to(tl.float32)
        if FP8:
            acc = tl.dot(x, tl.trans(w), acc, max_num_imprecise_acc=PROMOTE)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    mask = m_ok[:, None] & n_ok[None, :]
    y_ptrs = Y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :] * stride_yn
    if SPLIT_K == 1:
        acc = _scaled(acc, XS, WS, rm, rn, m_ok, n_ok, FP8)
        tl.store(y_ptrs, round_to(acc, Y.dtype.element_ty, EMULATE_RNE), mask=mask)
    else:
        plane = M * N
        p_ptrs = PART + rm.to(tl.int64)[:, None] * N + rn[None, :]
        tl.store(p_ptrs + split * plane, acc, mask=mask)
        tl.debug_barrier()  # every warp's partial stores before the tile is counted
        if tl.atomic_add(COUNT + tile, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            # other programs' partials: read from L2 (.cg), never an SM's stale L1 line
            total = tl.load(p_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            for s in range(1, SPLIT_K):  # split order: the same sum whatever finished first
                total += tl.load(p_ptrs + s * plane, mask=mask, other=0.0, cache_modifier=".cg")
            total = _scaled(total, XS, WS, rm, rn, m_ok, n_ok, FP8)
            tl.store(y_ptrs, round_to(total, Y.dtype.element_ty, EMULATE_RNE), mask=mask)
            tl.atomic_xchg(COUNT + tile, 0, sem="relaxed", scope="gpu")  # for the next launch


@triton.jit
def _scaled(acc, XS, WS, rm, rn, m_ok, n_ok, FP8: tl.constexpr):
    """FP8: the fp32 total times x's row scales, then w's column scales (the reference's
    order); float inputs: the total as it is."""
    if FP8:
        xs = tl.load(XS + rm, mask=m_ok, other=0.0)
        ws = tl.load(WS + rn, mask=n_ok, other=0.0)
        acc = acc * xs[:, None] * ws[None, :]
    return acc


def rows_bucket(rows: int) -> int:
    """The tuned table's rows key: the smallest of ``ROWS_BUCKETS`` holding ``rows``, past them
    the next power of two."""
    return next((b for b in ROWS_BUCKETS if rows <= b), triton.next_power_of_2(rows))


def tuned_key(n: int, k: int, bucket: int, fp8: bool) -> str:
    """The tuned JSON's key of one row: ``"N/K/bucket/float"`` or ``".../fp8"``."""
    return f"{n}/{k}/{bucket}/{'fp8' if fp8 else 'float'}"


def load_tuned(path: Path) -> dict[str, dict[str, dict[str, int]]]:
    """``{family: {tuned_key: config}}`` of a tuned JSON ({} when the file is absent); every
    entry names every knob of ``KNOBS`` with an int, or the file is refused."""

    def key(text: str) -> str:
        n, k, bucket, kind = text.split("/")
        if kind not in ("float", "fp8"):
            raise ValueError(f"entry {text!r}: expected N/K/bucket/float|fp8")
        return tuned_key(int(n), int(k), int(bucket), kind == "fp8")

    return read_tuned(path, "tuned splitk_gemm", key, KNOBS)


_DEVICE_CONFIGS = load_tuned(TUNED_JSON)


def _config(
    m: int, n: int, k: int, sms: int, fp8: bool = False, family: str | None = None
) -> dict[str, int]:
    """Launch values (module docstring; FP8: ``BLOCK_K`` 128, the same bytes a stage), the
    device ``family``'s tuned row, then ``_TUNE``."""
    cfg = {"BLOCK_M": 64 if m <= 64 else 128, "BLOCK_N": 128, "BLOCK_K": 128 if fp8 else 64,
           "num_warps": 8, "num_stages": 3}  # fmt: skip
    tuned = _DEVICE_CONFIGS.get(family or "", {}).get(tuned_key(n, k, rows_bucket(m), fp8), {})
    cfg.update(tuned)
    cfg.update({key: v for key, v in _TUNE.items() if key != "SPLIT_K"})
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    split = max(1, min(triton.cdiv(sms, tiles), k // 512))
    cfg["SPLIT_K"] = int(_TUNE.get("SPLIT_K", tuned.get("SPLIT_K", split)))
    for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        v = cfg[key]
        if v < 16 or v & (v - 1):
            raise ValueError(f"splitk_gemm {key} must be a power of two >= 16, got {v}")
    if cfg["SPLIT_K"] < 1:
        raise ValueError(f"splitk_gemm SPLIT_K must be >= 1, got {cfg['SPLIT_K']}")
    return cfg


def _counters(device: torch.device) -> torch.Tensor:
    """The device's tile counters: zeros, left zero by every launch, never freed (a captured
    graph keeps their address)."""
    buf = _COUNTERS.get(device)
    if buf is None:
        buf = _COUNTERS[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return buf


def _check(x: object, weight: object, x_scale: object, weight_scale: object,
           out_dtype: object) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:  # fmt: skip
    """The operands (module docstring); returns them and the product's dtype."""
    x, weight = check_tensor("x", x), check_tensor("weight", weight)
    check_ndim("x", x, 2)
    check_ndim("weight", weight, 2)
    check_dtype("x", x, (*FLOAT_DTYPES, FP8_DTYPE))
    if weight.dtype != x.dtype:
        raise TypeError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"weight must be [N, K={x.shape[1]}] (x is [M, K]), got {tuple(weight.shape)}"
        )
    if 0 in x.shape or 0 in weight.shape:
        raise ValueError(f"x and weight must not be empty, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")  # fmt: skip
    fp8 = x.dtype == FP8_DTYPE
    if not fp8:
        if x_scale is not None or weight_scale is not None:
            raise ValueError("x_scale / weight_scale go with FP8 (e4m3) x and weight only")
        if out_dtype not in (None, x.dtype):
            raise TypeError(f"out_dtype must be None or x's dtype {x.dtype}, got {out_dtype}")
        check_same_device(x=x, weight=weight)
        return x, weight, x.dtype
    for name, t, n in (("x_scale", x_scale, x.shape[0]), ("weight_scale", weight_scale,
                                                          weight.shape[0])):  # fmt: skip
        t = check_tensor(name, t)
        check_dtype(name, t, (torch.float32,))
        if t.shape != (n,) or t.stride(0) != 1:
            raise ValueError(f"{name} must be a contiguous [{n}] fp32 tensor, got "
                             f"{tuple(t.shape)}")  # fmt: skip
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES} for FP8 inputs, got {out_dtype}")
    check_same_device(x=x, weight=weight, x_scale=x_scale, weight_scale=weight_scale)
    return x, weight, out_dtype


def splitk_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    x_scale: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``round(x @ weight^T)``: ``x [M, K]``, ``weight [N, K]`` (any strides), one float dtype
    (bf16 / fp16 / fp32): ``[M, N]`` in it; or both e4m3 with ``x_scale [M]`` and
    ``weight_scale [N]`` (fp32): ``round(x @ weight^T * x_scale * weight_scale)`` in
    ``out_dtype`` (bf16 by default). Module docstring."""
    x, weight, out_dtype = _check(x, weight, x_scale, weight_scale, out_dtype)
    check_triton_device("x", x)
    m, k = x.shape
    n = weight.shape[0]
    fp8 = x.dtype == FP8_DTYPE
    sms = sm_count(x.device, _DEFAULT_SMS)
    cfg = _config(m, n, k, sms, fp8, device_family(x.device))
    bm, bn, bk, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if tiles > MAX_TILES:
        raise ValueError(f"splitk_linear: {tiles} output tiles, at most {MAX_TILES}")
    k_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, k_split)  # no empty split
    y = torch.empty(m, n, dtype=out_dtype, device=x.device)
    interp = interpreter_enabled()
    upcast = interp and x.dtype == torch.bfloat16
    part = (
        torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    )  # fmt: skip
    scales = (x_scale, weight_scale) if fp8 else (y, y)  # unread without FP8
    _splitk_gemm_kernel[(tiles, split)](
        x, weight, *scales, y, part, _counters(x.device), m, n, k, k_split,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1),
        SPLIT_K=split, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        PREC="ieee" if x.dtype == torch.float32 or upcast else None, UPCAST=upcast, FP8=fp8,
        PROMOTE=min(PROMOTE_K, bk) if fp8 else None, EMULATE_RNE=interp, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )  # fmt: skip
    return y


def splitk_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    x_scale: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Plain PyTorch: the fp32 product (scaled as ``fp8_matmul_reference`` for FP8 inputs)
    rounded once to the product's dtype; any device."""
    x, weight, out_dtype = _check(x, weight, x_scale, weight_scale, out_dtype)
    acc = x.float() @ weight.float().T
    if x.dtype == FP8_DTYPE:
        acc = acc * x_scale[:, None] * weight_scale[None, :]
    return acc.to(out_dtype)
