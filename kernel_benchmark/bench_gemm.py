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
(FLOP-weighted), the MFU a forward made of nothing else would reach. Peers (``triton_gemm.py``),
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

from bench_common.ceilings import device_slug, sustained_ms
from bench_common.report import results_dir, save_figure, write_json, write_table
from bench_common.timing import eager_ms
from nakta_model.config import ModelArgs, preset

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


def peer_rows(weights: dict[str, torch.Tensor], tokens: list[int], device, g) -> list[dict]:
    """In bursts, at every ``M``: the persistent TMA GEMM on each block shape (``tma:*``), its
    w13 with SwiGLU in the epilogue (``tma_swiglu:w13``) against cuBLAS's w13 followed by the
    SwiGLU kernel (``cublas+swiglu:w13``: the unfused pair); at the largest ``M`` the plain
    Triton GEMM's best config (``triton:*``). ``rel_err`` against cuBLAS (fused: the unfused)."""
    from kernel_benchmark.triton_gemm import CONFIGS, tma_linear, triton_linear
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
