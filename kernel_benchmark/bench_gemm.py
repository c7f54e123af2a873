"""The ceiling under the scoring engine: a block's matmuls at the token counts it runs, against
the ``n x n x n`` bf16 matmul rate measured in the same run, in bursts and sustained.

Why: speed_bench's MFU divides model FLOPs by the rate of an 8192^3 bf16 matmul timed in a
short burst (``bench_common.ceilings.matmul_tflops``). The engine's GEMMs are cuBLAS's, which
Nakta does not write; their rate on the model's own shapes, with every other kernel and gap
gone, is the highest MFU the engine could reach. Each block GEMM (``wqkv``, ``wo``, ``w13``,
``w2`` at ``M`` tokens, as ``F.linear`` on the model's ``[out, in]`` weights) is timed

* ``burst``: the median of short timings (do_bench), the way the ceiling itself is measured;
* ``sustained``: back to back for ``--seconds`` (a scoring run keeps the GPU this busy), the
  rate over the last half, where clocks have settled under the power limit;

and the 8192^3 matmul the same two ways. ``bound_*`` rows: one layer's four GEMMs together
(FLOP-weighted), the MFU a forward made of nothing else would reach. Peers (the Triton GEMMs below),
in bursts: a persistent TMA GEMM (``tma:*``) at every ``M``, with its fused SwiGLU epilogue
against cuBLAS + the SwiGLU kernel on w13, and a plain tiled Triton GEMM (``triton:*``, its best
config) at the largest ``M``.

    python -m kernel_benchmark.bench_gemm [--preset 7B] [--tokens 4096,16384] [--seconds 3]

Outputs ``results/<device>/gemm.{csv,md,png}`` and ``gemm_summary.json``. GPU only (a CPU
run says so and exits 1): cuBLAS rates are what it measures.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

if not __package__:  # run by path: import from the repo root, not from this script's folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import pandas as pd
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench_common.ceilings import device_slug, sustained_ms
from bench_common.report import results_dir, save_figure, write_json, write_table
from bench_common.timing import eager_ms
from nakta_model.config import ModelArgs, preset
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

SQUARE = 8192  # the MFU denominator's matmul (bench_common.ceilings.matmul_tflops)


def block_gemms(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """``name -> (in_features K, out_features N)`` of one block's fused matmuls."""
    d, f, hd = args.dim, args.hidden_dim, args.head_dim
    return {
        "wqkv": (d, (args.n_heads + 2 * args.n_kv_heads) * hd),
        "wo": (args.n_heads * hd, d),
        "w13": (d, 2 * f),
        "w2": (f, d),
    }


def burst_timer(device: torch.device):
    """``fn -> ms``: the median of short timings (do_bench), the way the ceiling is measured."""
    return functools.partial(eager_ms, device=device, warmup=25, rep=100)


def _square_call(device: torch.device, g: torch.Generator):
    a, b = (torch.randn(SQUARE, SQUARE, generator=g, device=device, dtype=torch.bfloat16)
            for _ in range(2))  # fmt: skip
    return lambda: a @ b


def measure(args: ModelArgs, tokens: list[int], seconds: float, device: torch.device) -> list[dict]:
    """One row per (shape, regime): ms per call, TFLOP/s, fraction of both 8192^3 rates."""
    dtype = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    timers = {"burst": burst_timer(device), "sustained": lambda fn: sustained_ms(fn, seconds)}
    rows, peak = [], {}
    square = _square_call(device, g)
    for regime, timer in timers.items():
        ms = timer(square)
        peak[regime] = 2 * SQUARE**3 / (ms * 1e-3) / 1e12
        rows.append({"shape": f"{SQUARE}^3", "M": SQUARE, "K": SQUARE, "N": SQUARE,
                     "regime": regime, "ms": ms, "tflops": peak[regime]})  # fmt: skip
    del square
    weights = {
        name: torch.randn(n, k, generator=g, device=device, dtype=dtype) / k**0.5
        for name, (k, n) in block_gemms(args).items()
    }
    for m in tokens:
        xs = {
            k: torch.randn(m, k, generator=g, device=device, dtype=dtype)
            for k in {args.dim, args.hidden_dim}
        }
        for regime, timer in timers.items():
            total_flop = total_ms = 0.0
            for name, w in weights.items():
                n, k = w.shape
                ms = timer(lambda x=xs[k], w=w: F.linear(x, w))
                flop = 2 * m * k * n
                total_flop, total_ms = total_flop + flop, total_ms + ms
                rows.append({"shape": name, "M": m, "K": k, "N": n, "regime": regime, "ms": ms,
                             "tflops": flop / (ms * 1e-3) / 1e12})  # fmt: skip
            rows.append({"shape": "bound", "M": m, "K": 0, "N": 0, "regime": regime,
                         "ms": total_ms, "tflops": total_flop / (total_ms * 1e-3) / 1e12})  # fmt: skip
        del xs
    rows += peer_rows(weights, tokens, device, g)
    df = pd.DataFrame(rows)
    df["of_burst_peak"] = df["tflops"] / peak["burst"]
    df["of_sustained_peak"] = df["tflops"] / peak["sustained"]
    return df.to_dict("records")


# ------------------------------------------------------------------------------------------------
# The peers: Triton GEMMs, ``x @ w.T``, beside cuBLAS. The scoring engine's non-GEMM kernels
# (RMSNorm, RoPE, SwiGLU) already run at copy bandwidth; the only way left to remove their time
# is to fuse them into the GEMMs' prologues and epilogues, which needs a GEMM of our own. This is
# the GEMM such a fusion would start from (grouped tile order for L2 reuse, ``tl.dot`` on the
# tensor cores, fp32 accumulation); its rate next to cuBLAS's on the block shapes says what a
# fused version would give up first. Benchmark-only: nothing in ``nakta_model`` calls them
# (the TMA section says why).
# ------------------------------------------------------------------------------------------------


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


def peer_rows(weights: dict[str, torch.Tensor], tokens: list[int], device, g) -> list[dict]:
    """In bursts, at every ``M``: the persistent TMA GEMM on each block shape (``tma:*``), its
    w13 with SwiGLU in the epilogue (``tma_swiglu:w13``) against cuBLAS's w13 followed by the
    SwiGLU kernel (``cublas+swiglu:w13``: the unfused pair); at the largest ``M`` the plain
    Triton GEMM's best config (``triton:*``). ``rel_err`` against cuBLAS (fused: the unfused)."""
    from nakta_model.kernels.swiglu import swiglu

    def row(tag, name, m, k, n, ms, err, config="", flop=None):
        flop = flop or 2 * m * k * n
        return {"shape": f"{tag}:{name}", "M": m, "K": k, "N": n, "regime": "burst", "ms": ms,
                "tflops": flop / (ms * 1e-3) / 1e12, "config": config, "rel_err": err}  # fmt: skip

    def err(got, ref):
        return float((got.float() - ref).norm() / ref.norm())

    burst_ms = burst_timer(device)
    rows = []
    for m in tokens:
        xs = {}
        for name, w in weights.items():
            n, k = w.shape
            x = xs.setdefault(k, torch.randn(m, k, generator=g, device=device, dtype=w.dtype))
            ref = F.linear(x, w).float()
            ms = burst_ms(lambda x=x, w=w: tma_linear(x, w))
            rows.append(row("tma", name, m, k, n, ms, err(tma_linear(x, w), ref)))
            if name == "w13":
                unfused = swiglu(F.linear(x, w)).float()
                ms = burst_ms(lambda x=x, w=w: tma_linear(x, w, swiglu=True))
                fused_err = err(tma_linear(x, w, swiglu=True), unfused)
                rows.append(row("tma_swiglu", name, m, k, n, ms, fused_err))
                ms = burst_ms(lambda x=x, w=w: swiglu(F.linear(x, w)))
                rows.append(row("cublas+swiglu", name, m, k, n, ms, 0.0))
            if m != max(tokens):
                continue
            best = None
            for cfg in CONFIGS:
                try:
                    ms = burst_ms(lambda x=x, w=w, cfg=cfg: triton_linear(x, w, cfg))
                except Exception as e:  # noqa: BLE001 -- a config out of resources here
                    print(f"triton {name} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                if best is None or ms < best[0]:
                    best = (ms, cfg)
            if best is not None:
                ms, cfg = best
                label = "x".join(map(str, cfg[:3])) + f" w{cfg[3]} s{cfg[4]}"
                rows.append(row("triton", name, m, k, n, ms,
                                err(triton_linear(x, w, cfg), ref), label))  # fmt: skip
        del xs
    return rows


def plot(df: pd.DataFrame, title: str):
    """Each case's rate as a fraction of the burst 8192^3 rate, bursts and sustained side by
    side (horizontal bars: the case names are long)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sub = df[df["shape"] != f"{SQUARE}^3"].copy()
    sub["case"] = sub["shape"] + " M=" + sub["M"].astype(str)
    table = sub.pivot_table(index="case", columns="regime", values="of_burst_peak", sort=False)
    fig, ax = plt.subplots(figsize=(8, 0.28 * len(table) + 1.5))
    table.plot.barh(ax=ax, width=0.75)
    ax.axvline(0.85, color="k", ls="--", lw=1, label="85%")
    ax.set_xlabel(f"of the burst {SQUARE}^3 rate")
    ax.set_xlim(0.3, 1.05)
    ax.invert_yaxis()
    ax.set_ylabel("")
    ax.set_title(title)
    ax.legend(loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="7B")
    p.add_argument("--tokens", default="1024,4096,16384", help="M values: tokens per forward")
    p.add_argument("--seconds", type=float, default=3.0, help="length of a sustained timing")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    try:
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        p.error(f"--tokens must be comma-separated ints, got {args.tokens!r}")
    if not tokens or min(tokens) < 1:
        p.error("--tokens needs at least one positive int")
    if args.seconds <= 0:
        p.error("--seconds must be > 0")
    margs = preset(args.preset)
    if not torch.cuda.is_available():
        print("bench_gemm measures cuBLAS on a GPU; none here: nothing measured", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    slug = device_slug(device)
    out = args.out or results_dir(__file__, slug)
    out.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame(measure(margs, tokens, args.seconds, device))
    notes = (
        f"{slug}, torch {torch.__version__}, preset {args.preset} (bf16 F.linear on [out, in] "
        f"weights, random data). burst: do_bench median; sustained: {args.seconds:g} s back to "
        "back, the rate over its second half. bound: one layer's four GEMMs, FLOP-weighted -- "
        "the MFU of a forward with every other kernel and gap removed."
    )
    write_table(df, out, "gemm", "Block GEMMs vs the matmul ceiling", notes)
    fig = plot(df, f"{args.preset} block GEMMs on {slug}")
    save_figure(fig, out / "gemm.png")
    bound = df[df["shape"] == "bound"]
    summary = {
        "device": slug,
        "preset": args.preset,
        "peak_tflops": {
            r: float(df[(df["shape"] == f"{SQUARE}^3") & (df["regime"] == r)]["tflops"].iloc[0])
            for r in ("burst", "sustained")
        },
        "bound_of_burst_peak": {
            f"{r.regime}_M{r.M}": float(r.of_burst_peak) for r in bound.itertuples()
        },
    }
    write_json(summary, out / "gemm_summary.json")
    print(df.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"results -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
