"""The model's kernels from two checkouts, timed side by side in one process: did a change
(a refactor, a config table) make anything slower, or change any output bit?

    python -m kernel_benchmark.before_after --before OLD_CHECKOUT [--out DIR]

Both trees' ``nakta_model.kernels`` modules are imported into this process (the old one under
its own module objects, see :func:`load_kernels`), then every case runs both on the same
inputs: outputs compared bit for bit, GPU time measured by ``rotated_ms`` (CUDA graphs, the two
trees alternating over 5 rounds, so drift cancels). Cases are the calls the model makes at
LLaMA-7B shapes in bf16: RMSNorm (plain, fused residual, forward + backward), SwiGLU (forward,
forward + backward), the fused in-place QK RoPE, the TE-API RoPE, packed attention over a
16K-token HellaSwag-like stream, and the five decode GEMVs at batch 1 and 32. GB/s count the
minimal bytes (same for both trees) and are given as % of the copy bandwidth measured in the run.

On a CPU (``TRITON_INTERPRET=1``) the cases shrink to a few rows and only the outputs are
compared: a smoke test of the loading and of each call.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import random
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

if not __package__:  # run by path: import from the repo root, not from this script's folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import pandas as pd
import torch

from bench_common.ceilings import copy_bandwidth_gbps, device_slug
from bench_common.report import results_dir, save_figure, write_table
from bench_common.timing import input_sets, rotated_ms

KERNELS = ("rmsnorm", "swiglu", "rope", "rope_te", "packed_attention", "decode_linear")


def load_kernels(root: Path | None) -> dict[str, ModuleType]:
    """The kernel modules of the checkout at ``root`` (None: this one), by short name.

    An old tree is imported with this tree's ``nakta_model`` modules set aside, then its own
    are set aside in turn: its functions keep their module globals, so both trees' kernels
    live side by side. A module the tree lacks (``rope_te`` before the split) is left out."""
    if root is None:
        return _import_all()
    ours = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] == "nakta_model"}
    sys.path.insert(0, str(Path(root).resolve()))
    try:
        mods = _import_all()
        origin = Path(sys.modules["nakta_model"].__file__).resolve()
        if not origin.is_relative_to(Path(root).resolve()):
            raise ValueError(f"--before {root}: imported nakta_model from {origin}")
    finally:
        sys.path.remove(str(Path(root).resolve()))
        for k in [k for k in sys.modules if k.split(".")[0] == "nakta_model"]:
            del sys.modules[k]
        sys.modules.update(ours)
    return mods


def _import_all() -> dict[str, ModuleType]:
    mods = {}
    for name in KERNELS:
        with contextlib.suppress(ModuleNotFoundError):  # rope_te before the rope split
            mods[name] = importlib.import_module(f"nakta_model.kernels.{name}")
    return mods


# ----------------------------------------------------------------------------- cases


def _rand(*shape, device, dtype=torch.bfloat16, grad=False) -> torch.Tensor:
    return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(grad)


def cases(device: torch.device, small: bool) -> list[tuple[str, int, Callable]]:
    """``(name, minimal bytes per call, make)``; ``make(mods, i)`` returns the call on input
    set ``i`` (the same inputs for both trees: seeded by ``i``)."""
    n = 48 if small else 16384  # scoring tokens per forward
    d, f = (64, 96) if small else (4096, 11008)
    hq, hkv, hd = (4, 4, 16) if small else (32, 32, 128)
    vocab = 256 if small else 32000
    e = 2  # bf16
    out: list[tuple[str, int, Callable]] = []

    def seeded(i: int) -> None:
        torch.manual_seed(1000 + i)

    def rms(residual: bool, backward: bool):
        def make(m, i):
            seeded(i)
            x, w = _rand(n, d, device=device, grad=backward), _rand(d, device=device)
            r = _rand(n, d, device=device) if residual else None
            g = _rand(n, d, device=device)
            if backward:
                return lambda: torch.autograd.grad(m["rmsnorm"].rms_norm(x, w, 1e-6), (x,), g)
            return lambda: m["rmsnorm"].rms_norm(x, w, 1e-6, residual=r)

        return make

    out.append(("rmsnorm fwd", 2 * n * d * e, rms(False, False)))
    out.append(("rmsnorm fwd +residual", 4 * n * d * e, rms(True, False)))
    out.append(("rmsnorm fwd+bwd", 5 * n * d * e, rms(False, True)))

    def swiglu(backward: bool):
        def make(m, i):
            seeded(i)
            gu = _rand(n, 2 * f, device=device, grad=backward)
            g = _rand(n, f, device=device)
            if backward:
                return lambda: torch.autograd.grad(m["swiglu"].swiglu(gu), (gu,), g)
            return lambda: m["swiglu"].swiglu(gu)

        return make

    out.append(("swiglu fwd", 3 * n * f * e, swiglu(False)))
    out.append(("swiglu fwd+bwd", 8 * n * f * e, swiglu(True)))

    def rope_qkv(m, i):
        seeded(i)
        qkv = _rand(n, (hq + 2 * hkv) * hd, device=device)
        pos = torch.arange(n, device=device) % 2048
        cos, sin = m["rope"].build_rope_cache(2048, hd, device=device)
        rotate = m["rope"].apply_rope_qkv_
        return lambda: (rotate(qkv, pos, cos, sin, hq, hkv, hd, interleaved=True), qkv)[
            1
        ]  # in place: qkv

    out.append(("rope qkv in place", 2 * n * (hq + hkv) * hd * e, rope_qkv))

    s, b = (32, 2) if small else (4096, 16)

    def rope_te(m, i):
        seeded(i)
        te = m.get("rope_te", m["rope"])
        t = _rand(s, b, hq, hd, device=device)
        freqs = te.RotaryPositionEmbedding(hd)(s).to(device)
        return lambda: te.apply_rotary_pos_emb(t, freqs, tensor_format="sbhd")

    out.append(("rope TE fwd sbhd", 2 * s * b * hq * hd * e, rope_te))

    def attention(m, i):
        rng = random.Random(i)
        starts, branches, spans = [], [], []
        while True:  # HellaSwag-like trees (context + 4 endings) while they fit, then pads
            st, ctx = len(starts), rng.randint(*((3, 12) if small else (20, 120)))
            ends = [rng.randint(*((1, 5) if small else (5, 40))) for _ in range(4)]
            if st + ctx + sum(ends) > n:
                break
            starts += [st] * (ctx + sum(ends))
            branches += [0] * ctx + [k for k, L in enumerate(ends, 1) for _ in range(L)]
            spans += [st + ctx + sum(ends)] * ctx
            for j, L in enumerate(ends):
                spans += [st + ctx + sum(ends[: j + 1])] * L
        pad = n - len(starts)
        starts += range(len(starts), n)
        branches += [0] * pad
        spans += range(len(spans) + 1, n + 1)
        seq = torch.tensor(starts, dtype=torch.int32, device=device)
        # a tree of the kernel's own kind: branch ids before the token tries, span ends after
        params = inspect.signature(m["packed_attention"].packed_attention).parameters
        tree = spans if "span_end" in params else branches
        tree = torch.tensor(tree, dtype=torch.int32, device=device)
        seeded(i)
        qkv = _rand(n, (hq + 2 * hkv) * hd, device=device)
        return lambda: m["packed_attention"].packed_attention(qkv, seq, tree, hq, hkv, hd)

    out.append(("packed attention 16K", 0, attention))

    def gemv(batch: int, n_out: int, k: int, kind: str):
        def make(m, i):
            seeded(i)
            x, wt = _rand(batch, k, device=device), _rand(n_out, k, device=device) * 0.02
            kw = {}
            if kind in ("norm", "swiglu"):
                kw = dict(norm_weight=_rand(k, device=device), eps=1e-6)
            if kind == "swiglu":
                kw["swiglu"] = True
            if kind == "residual":
                kw["residual"] = _rand(batch, n_out, device=device)
            return lambda: m["decode_linear"].decode_linear(x, wt, **kw)

        return make

    for batch in (1, 32):
        for label, n_out, k, kind in (
            ("wqkv+norm", 3 * d, d, "norm"),
            ("wo+residual", d, d, "residual"),
            ("w13+norm+swiglu", 2 * f, d, "swiglu"),
            ("w2+residual", d, f, "residual"),
            ("head+norm", vocab, d, "norm"),
        ):
            out.append((f"decode b{batch} {label}", n_out * k * e, gemv(batch, n_out, k, kind)))
    return out


# ----------------------------------------------------------------------------- running
def _outputs(call: Callable[[], object]) -> list[torch.Tensor]:
    got = call()
    items = got if isinstance(got, (tuple, list)) else [got]
    return [t.detach().clone() for t in items if isinstance(t, torch.Tensor)]


def identical(before: Callable[[], object], after: Callable[[], object]) -> bool:
    """Both trees' outputs, bit for bit (in-place kernels: each on its own fresh inputs)."""
    a, b = _outputs(before), _outputs(after)
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def run(
    before_root: Path,
    device: torch.device,
    only: str | None = None,
    on_row: Callable[[pd.DataFrame, float], None] | None = None,
) -> tuple[pd.DataFrame, float]:
    """Every case (``only``: those whose name contains it); ``on_row(rows so far, copy GB/s)``
    after each, so a run cut short still leaves its results."""
    mods = {"before": load_kernels(before_root), "after": load_kernels(None)}
    on_gpu = device.type == "cuda"
    copy = copy_bandwidth_gbps(device=str(device)) if on_gpu else float("nan")
    rows = []
    for name, nbytes, make in cases(device, small=not on_gpu):
        if only and only not in name:
            continue
        same = identical(make(mods["before"], 0), make(mods["after"], 0))
        row = {"case": name, "identical_outputs": same}
        if on_gpu:
            sets = input_sets(device, max(nbytes, 1)) if nbytes else 1
            calls = {t: [make(mods[t], i) for i in range(sets)] for t in ("before", "after")}
            ms, errors = rotated_ms(calls, rounds=5)
            for t in ("before", "after"):
                us = ms.get(t, float("nan")) * 1e3
                row[f"{t}_us"] = us
                gbps = nbytes / (us * 1e-6) / 1e9 if nbytes else float("nan")
                row[f"{t}_pct_copy"] = 100 * gbps / copy
                if t in errors:
                    row[f"{t}_error"] = errors[t]
            row["speed_after_vs_before"] = row["before_us"] / row["after_us"]
            del calls
            torch.cuda.empty_cache()
        rows.append(row)
        print(row, flush=True)
        if on_row is not None:
            on_row(pd.DataFrame(rows), copy)
    return pd.DataFrame(rows), copy


def plot(df: pd.DataFrame, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.32 * len(df) + 1.5))
    ax.barh(df["case"], df["speed_after_vs_before"], color="tab:blue")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("speed after / before (GPU time ratio; > 1 is faster)")
    ax.invert_yaxis()
    ax.set_title(title)
    return fig


def main(argv: list[str] | None = None) -> pd.DataFrame:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", type=Path, required=True, help="the old checkout (repo root)")
    p.add_argument("--device", default=None)
    p.add_argument("--only", default=None, help="cases whose name contains this")
    p.add_argument("--out", type=Path, default=None, help="results folder (GPU runs)")
    a = p.parse_args(argv)
    if not (a.before / "nakta_model" / "kernels").is_dir():
        p.error(f"--before {a.before}: no nakta_model/kernels there (give a checkout's root)")
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        return run(a.before, device, a.only)[0]
    out = a.out or results_dir(__file__, device_slug(device))
    out.mkdir(parents=True, exist_ok=True)

    def write(df: pd.DataFrame, copy: float) -> None:
        notes = (
            f"Before: {a.before}. Copy bandwidth {copy:.0f} GB/s measured in this run; bf16, "
            "LLaMA-7B shapes (16K scoring tokens; decode batch 1 and 32); GPU time of CUDA-graph "
            "replays, the two trees alternating over 5 rounds (median). identical_outputs: both "
            "trees' results bit for bit on the same inputs."
        )
        write_table(df, out, "before_after", "Kernels before / after", notes)

    with torch.cuda.stream(torch.cuda.Stream(device)):
        df, _ = run(a.before, device, a.only, on_row=write)
    import matplotlib.pyplot as plt

    fig = plot(df, f"kernels after vs before, {device_slug(device)}")
    save_figure(fig, out / "before_after.png")
    plt.close(fig)
    print(f"results -> {out}")
    return df


if __name__ == "__main__":
    main()
