"""Attention at HellaSwag scoring shapes and long prefill: Nakta's paths vs Meta's eager attention.

Why: Meta's LLaMA runs attention as ``softmax(q @ k^T / sqrt(d) + mask).float()`` then ``@ v``,
materialising the score matrix; Nakta's cache paths go through SDPA (``nakta_model.attention``)
and its scoring engine through the packed Triton kernel (``kernels/packed_attention.py``).
This sweep times, on the same inputs:

* ``meta_eager``   -- Meta's matmul-softmax-matmul with an additive float mask;
* ``sdpa_flash`` / ``sdpa_efficient`` / ``sdpa_cudnn`` -- the SDPA backends forced one at a time
  (causal only; a backend that refuses the shape is reported as skipped);
* ``nakta_causal`` -- ``nakta_model.attention.causal_attention`` as the model calls it;
* ``sdpa_bias``    -- shared-context scoring as Nakta did it before the packed kernel: one row
  per task holding the context once and the four endings after it, an additive ``[B, 1, L, L]``
  bias (row stride padded to 16) through SDPA, which picks cuDNN and plans per shape;
* ``nakta_packed`` -- the packed kernel on the same tokens laid out as one stream (what the
  scoring engine runs): reads Q/K/V in place from a fused ``[T, 3 H D]`` projection, masks from
  per-token sequence starts and subtree ends; for plain and prefill rows it is varlen causal.

HellaSwag shapes: 4 endings x tasks, context 20-120 tokens, endings 5-40 tokens, about 16K
tokens per call (the scorer's token budget); long prefill: 2K-8K causal. TFLOP/s count only the
work a correct kernel must do: ``4 * head_dim`` FLOPs per allowed (query, key) pair per head,
so causal counts ``s(s+1)/2`` pairs and tree masks count only the pairs they allow; padding and
masked-out pairs count nothing, whatever a path actually computes. Each output is checked
against an fp32 reference (``rel_err``). Results: CSV + markdown + PNG in
``kernel_benchmark/results/<device>/attention.*``.

    python -m kernel_benchmark.bench_attention [--quick]
    python kernel_benchmark/bench_attention.py ...   # by path too; on a CPU a smoke run (--help)
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run by path: import from the repo root, not from this script's folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import pandas as pd
import torch
import torch.nn.functional as F

from bench_common.ceilings import device_slug
from bench_common.report import results_dir, save_figure, write_table
from bench_common.timing import eager_ms
from kernel_benchmark.common import announce, exit_status, tuned
from nakta_model.attention import causal_attention
from nakta_model.kernels import packed_attention as packed

TOKEN_BUDGET = 16384
CPU_NOTE = (
    "On a CPU a run is a smoke test: 4 heads x 32, fp32, ~512 tokens per call and one 256-token "
    "prefill, every path on PyTorch's CPU kernels (the forced sdpa_flash / sdpa_efficient / "
    "sdpa_cudnn backends need a GPU and are left out; nakta_packed runs its PyTorch reference). "
    "Exit status 1 when no path was measured."
)


# ----------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class Shape:
    """One benchmark case. ``kind`` is ``plain`` (one causal row per request), ``tree`` (one
    packed row per task) or ``prefill`` (long causal rows)."""

    kind: str
    batch: int
    ctx: int
    ending: int = 0
    n_endings: int = 4

    @property
    def seq(self) -> int:
        if self.kind == "plain":
            return self.ctx + self.ending - 1  # lm-eval feeds (context + continuation)[:-1]
        if self.kind == "tree":
            return self.ctx + self.n_endings * self.ending
        return self.ctx

    @property
    def tasks(self) -> int:
        if self.kind == "plain":
            return self.batch // self.n_endings
        return self.batch if self.kind == "tree" else 0

    def allowed_pairs(self) -> int:
        """(query, key) pairs a correct kernel must compute, over the whole batch, per head."""
        tri = lambda n: n * (n + 1) // 2
        if self.kind in ("plain", "prefill"):
            return self.batch * tri(self.seq)
        per_ending = self.ending * self.ctx + tri(self.ending)
        return self.batch * (tri(self.ctx) + self.n_endings * per_ending)

    def label(self) -> str:
        if self.kind == "prefill":
            return f"prefill {self.seq}x{self.batch}"
        return f"{self.kind} c{self.ctx}+e{self.ending} x{self.tasks} tasks"


def hellaswag_shapes(quick: bool, budget: int = TOKEN_BUDGET) -> list[Shape]:
    """Plain and tree rows for a grid of context/ending lengths, ~``budget`` tokens per call."""
    grid = [(20, 5), (60, 20), (120, 40)] if quick else [
        (20, 5), (20, 40), (60, 5), (60, 20), (60, 40), (120, 5), (120, 20), (120, 40)
    ]  # fmt: skip
    shapes = []
    for ctx, ending in grid:
        tasks_plain = max(1, budget // (4 * (ctx + ending - 1)))
        shapes.append(Shape("plain", 4 * tasks_plain, ctx, ending))
        tasks_tree = max(1, budget // (ctx + 4 * ending))
        shapes.append(Shape("tree", tasks_tree, ctx, ending))
    return shapes


def prefill_shapes(quick: bool, budget: int = TOKEN_BUDGET) -> list[Shape]:
    lengths = [2048, 8192] if quick else [2048, 4096, 8192]
    return [Shape("prefill", max(1, budget // s // (2 if s >= 8192 else 1)), s) for s in lengths]


def tree_mask(shape: Shape, device: torch.device) -> torch.Tensor:
    """Boolean ``[L, L]``: context causal; ending j sees the context and itself, causally."""
    c, e, n = shape.ctx, shape.ending, shape.n_endings
    length = c + n * e
    pos = torch.arange(length, device=device)
    seg = torch.where(pos < c, -1, (pos - c) // max(e, 1))  # -1 = context
    causal = pos[None, :] <= pos[:, None]
    visible = (seg[None, :] == -1) | (seg[None, :] == seg[:, None])
    return causal & visible


# ----------------------------------------------------------------------------- paths
def meta_eager(q, k, v, mask_add):
    """Meta's LLaMA attention (llama/model.py): scores in the input dtype, softmax in fp32."""
    scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.shape[-1])
    scores = scores + mask_add
    scores = F.softmax(scores.float(), dim=-1).type_as(q)
    return torch.matmul(scores, v)


def meta_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Meta's additive mask: ``-inf`` where not allowed, broadcast ``[1 or B, 1, L, L]``."""
    add = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    add.masked_fill_(~allowed, float("-inf"))
    return add.view(-1, 1, *allowed.shape[-2:]) if allowed.dim() == 3 else add[None, None]


def sdpa_bias(allowed: torch.Tensor, batch: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive ``[B, 1, L, L]`` bias the pre-packed scorer built once per batch (row stride
    padded to a multiple of 16 so the efficient kernel takes it without a copy)."""
    length = allowed.shape[-1]
    padded = -(-length // 16) * 16
    bias = torch.full((batch, 1, length, padded), float("-inf"), dtype=dtype, device=allowed.device)
    bias = bias[..., :length]
    bias.masked_fill_(allowed[None, None], 0.0)
    return bias


def packed_layout(q, k, v, shape: Shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(qkv [T, 3 H D], seq_start [T], span_end [T] or None)``: the batch's rows as one token
    stream; a tree row's context is seen by the whole row, each ending by itself (None: causal
    rows)."""
    b, h, length, d = q.shape
    qkv = torch.cat([q, k, v], dim=1).permute(0, 2, 1, 3).reshape(b * length, 3 * h * d)
    start = (torch.arange(b, device=q.device, dtype=torch.int32) * length).repeat_interleave(length)
    span = None
    if shape.kind == "tree":
        pos = torch.arange(length, device=q.device)
        ending = max(shape.ending, 1)
        own_end = shape.ctx + ((pos - shape.ctx) // ending + 1) * ending
        span = (torch.where(pos < shape.ctx, length, own_end).to(torch.int32).repeat(b)) + start
    return qkv.contiguous(), start, span


def sdpa_backend(name: str) -> Callable:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }[name]

    def run(q, k, v):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return run


# ----------------------------------------------------------------------------- timing
def time_ms(fn: Callable[[], object], device: torch.device, quick: bool) -> float:
    """Median milliseconds (CUDA events through triton's do_bench; wall clock on the CPU)."""
    return eager_ms(fn, device, warmup=10 if quick else 25, rep=40 if quick else 100)


def rel_err(out: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor | None = None) -> float:
    """``||out - ref|| / ||ref||`` in fp64 (optionally over valid query rows only)."""
    diff = out.double() - ref.double()
    if rows is not None:
        diff, ref = diff[..., rows, :], ref[..., rows, :]
    return float(diff.norm() / ref.double().norm())


# ----------------------------------------------------------------------------- sweep
def bench_shape(
    shape: Shape, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, quick: bool
) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(shape.seq * 131 + shape.batch)
    size = (shape.batch, heads, shape.seq, head_dim)
    q = torch.randn(size, generator=g, device=device, dtype=dtype)
    k = torch.randn(size, generator=g, device=device, dtype=dtype)
    v = torch.randn(size, generator=g, device=device, dtype=dtype)
    pairs = shape.allowed_pairs() * heads
    flops = 4 * head_dim * pairs
    if shape.kind == "tree":
        allowed = tree_mask(shape, device)
        mask_add = meta_mask(allowed, dtype)
        bias = sdpa_bias(allowed, shape.batch, dtype)
        paths = {
            "meta_eager": lambda: meta_eager(q, k, v, mask_add),
            "sdpa_bias": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias),
        }
    else:
        pos = torch.arange(shape.seq, device=device)
        allowed = pos[None, :] <= pos[:, None]
        mask_add = meta_mask(allowed, dtype)
        paths = {
            "meta_eager": lambda: meta_eager(q, k, v, mask_add),
            "nakta_causal": lambda: causal_attention(q, k, v),
        }
        if device.type == "cuda":
            for name in ("flash", "efficient", "cudnn"):
                paths[f"sdpa_{name}"] = (lambda f: lambda: f(q, k, v))(sdpa_backend(name))
    qkv, start, span = packed_layout(q, k, v, shape)
    run_packed = (
        packed.packed_attention if device.type == "cuda" else packed.packed_attention_reference
    )
    h = heads
    paths["nakta_packed"] = lambda: (
        run_packed(qkv, start, span, h, h, head_dim)
        .view(shape.batch, shape.seq, h, head_dim)
        .transpose(1, 2)
    )
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=allowed)
    rows, base_ms = [], None
    for name, fn in paths.items():
        row = {
            "case": shape.label(),
            "kind": shape.kind,
            "path": name,
            "batch": shape.batch,
            "seq": shape.seq,
            "ctx": shape.ctx,
            "ending": shape.ending,
            "tasks": shape.tasks,
            "heads": heads,
            "head_dim": head_dim,
            "allowed_pairs": pairs,
        }
        try:
            err = rel_err(fn(), ref)
            ms = time_ms(fn, device, quick)
        except RuntimeError as e:  # a backend that does not take this shape/dtype/device
            rows.append({**row, "status": f"skipped: {str(e).splitlines()[0][:80]}"})
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        if name == "meta_eager":
            base_ms = ms
        rows.append(
            {
                **row,
                "status": "ok",
                "ms": ms,
                "tflops": flops / (ms * 1e-3) / 1e12,
                "us_per_task": ms * 1e3 / shape.tasks if shape.tasks else float("nan"),
                "speedup_vs_meta": (base_ms / ms) if base_ms else float("nan"),
                "rel_err": err,
            }
        )
    return rows


PACKED_GRID = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages) tried by --tune
    (bm, bn, w, st)
    for bm in (64, 128)
    for bn in (32, 64, 128)
    for w in (4, 8)
    for st in (2, 3, 4)
    if not (bm == 128 and bn == 128 and st == 4)
]


def tune_packed(shapes: list[Shape], heads: int, head_dim: int, dtype, device) -> pd.DataFrame:
    """Time the packed kernel over PACKED_GRID on every shape; one row per (shape, config)."""
    from tqdm import tqdm

    rows = []
    for shape in tqdm(shapes, desc="tune packed"):
        g = torch.Generator(device=device).manual_seed(7)
        size = (shape.batch, heads, shape.seq, head_dim)
        q, k, v = (torch.randn(size, generator=g, device=device, dtype=dtype) for _ in range(3))
        qkv, start, span = packed_layout(q, k, v, shape)
        flops = 4 * head_dim * shape.allowed_pairs() * heads
        fn = functools.partial(packed.packed_attention, qkv, start, span, heads, heads, head_dim)
        for bm, bn, w, st in PACKED_GRID:
            try:
                with tuned(packed, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st):
                    ms = time_ms(fn, device, quick=True)
            except Exception as e:  # noqa: BLE001 -- out of resources for this config
                rows.append(
                    {"case": shape.label(), "config": (bm, bn, w, st), "status": str(e)[:60]}
                )
                continue
            rows.append(
                {
                    "case": shape.label(),
                    "config": f"{bm}x{bn} w{w} s{st}",
                    "status": "ok",
                    "ms": ms,
                    "tflops": flops / (ms * 1e-3) / 1e12,
                }
            )
    return pd.DataFrame(rows)


SCORING_GRID = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages) tried by --tune-scoring
    *((bm, bn, w, st) for bm in (64, 128) for bn in (32, 64) for w in (4, 8) for st in (2, 3)),
    (64, 128, 8, 2),
    (128, 128, 8, 2),
]


def scoring_layouts(shots: tuple[int, ...], budget: int, vocab: int = 32000) -> list[tuple]:
    """``(label, seq_start, span_end, allowed pairs)`` of the scoring engine's first full batch
    on HellaSwag-shaped tasks with each number of ``shots``: the very rows, merges and packing
    ``scoring.score`` makes (0-shot: merged trees of ~170-token rows; 10-shot: ~1,100)."""
    from nakta_model.score_batches import build_rows, merge_rows, pack, packed_batches
    from speed_bench.workload import synthetic_workload

    out = []
    for n_shots in shots:
        work = synthetic_workload(2000 if n_shots == 0 else 400, vocab, 0, 2048, shots=n_shots)
        reqs = [(list(ctx), list(cont)) for ctx, cont in work.requests]  # all fit: no truncation
        rows, _ = build_rows(reqs, True, 2048)
        batch = packed_batches(merge_rows(rows, 1024), budget, None)[0]
        b = pack(batch)
        pairs = int((b.positions[: b.n_real] + 1).sum()) + (b.tokens.shape[0] - b.n_real)
        label = f"{n_shots}-shot {len(batch)} trees {b.tokens.shape[0]} tokens"
        out.append((label, b.seq_start, b.span_end, pairs))
    return out


def tune_scoring(heads: int, head_dim: int, budget: int, device) -> pd.DataFrame:
    """The packed kernel on the scorer's own batches (``scoring_layouts``): every launch
    config of SCORING_GRID with each way of skipping other branches' key blocks (``SKIP`` 0
    none, 1 a branch around the block's loads, 2 the loads' mask), checked against the
    shipped config's output."""
    from tqdm import tqdm

    rows = []
    g = torch.Generator(device=device).manual_seed(11)
    for label, start, span, pairs in scoring_layouts((0, 10), budget):
        n = start.shape[0]
        qkv = torch.randn(n, 3 * heads * head_dim, generator=g, device=device, dtype=torch.bfloat16)
        start, span = start.to(device), span.to(device)
        fn = functools.partial(packed.packed_attention, qkv, start, span, heads, heads, head_dim)
        ref = fn().float()
        flops = 4 * head_dim * pairs * heads
        for skip in (0, 1, 2):
            for bm, bn, w, st in tqdm(SCORING_GRID, desc=f"{label} skip {skip}"):
                cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st, SKIP=skip)
                row = {"layout": label, "skip": skip, "config": f"{bm}x{bn} w{w} s{st}"}
                try:
                    with tuned(packed, **cfg):
                        err = float((fn().float() - ref).norm() / ref.norm())
                        ms = eager_ms(fn, device, warmup=25, rep=100)
                except Exception as e:  # noqa: BLE001 -- out of resources for this config
                    rows.append({**row, "status": str(e)[:60]})
                    continue
                rows.append({**row, "status": "ok", "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12,
                             "rel_err_vs_shipped": err})  # fmt: skip
    return pd.DataFrame(rows)


def plot(df: pd.DataFrame, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = df[df["status"] == "ok"]
    table = ok.pivot_table(index="case", columns="path", values="tflops", sort=False)
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(table)), 4.5))
    table.plot.bar(ax=ax, width=0.8)
    ax.set_ylabel("TFLOP/s (allowed pairs only)")
    ax.set_xlabel("")
    ax.set_title(title)
    ax.tick_params(axis="x", labelrotation=35)
    for lab in ax.get_xticklabels():
        lab.set_horizontalalignment("right")
    ax.grid(axis="y", alpha=0.3)
    return fig


def main(argv: list[str] | None = None) -> pd.DataFrame:
    p = argparse.ArgumentParser(
        description="Attention paths vs Meta's eager attention.", epilog=CPU_NOTE
    )
    p.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    p.add_argument("--heads", type=int, default=None, help="default 32 (4 on the CPU)")
    p.add_argument("--head-dim", type=int, default=None, help="default 128 (32 on the CPU)")
    p.add_argument("--budget", type=int, default=None, help="tokens per call (default 16384)")
    p.add_argument("--no-prefill", action="store_true", help="skip the 2K-8K prefill rows")
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="results folder (default results/<device>)")
    p.add_argument(
        "--tune", action="store_true", help="GPU: sweep the packed kernel's launch configs first"
    )
    p.add_argument(
        "--tune-scoring",
        action="store_true",
        help="GPU: only sweep the packed kernel's configs and block skipping on the scorer's "
        "own 0- and 10-shot batches (attention_scoring_tune.*)",
    )
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    heads = args.heads or (32 if on_gpu else 4)
    head_dim = args.head_dim or (128 if on_gpu else 32)
    budget = args.budget or (TOKEN_BUDGET if on_gpu else 512)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    announce(device, CPU_NOTE)
    shapes = hellaswag_shapes(args.quick, budget)
    from pathlib import Path

    slug = device_slug(device)
    out = Path(args.out) if args.out else results_dir(__file__, slug)
    if args.tune_scoring:
        if not on_gpu:
            p.error("--tune-scoring times the Triton kernel: it needs a GPU")
        df = tune_scoring(heads, head_dim, budget, device)
        notes = f"{slug}; {heads} heads x {head_dim}, bf16; the scorer's first batch of each layout"
        write_table(df, out, "attention_scoring_tune", "Packed attention on scoring batches", notes)
        ok = df[df["status"] == "ok"].sort_values("ms")
        for layout, grp in ok.groupby("layout"):
            print(layout)
            print(grp.head(8).to_string(index=False, float_format=lambda x: f"{x:.3g}"))
        return df
    if args.tune and on_gpu:
        long_rows = [  # 10-shot HellaSwag rows (~1,100 tokens) and long prompts
            Shape("tree", max(1, budget // (960 + 4 * 33)), 960, 33),
            Shape("tree", max(1, budget // (480 + 4 * 33)), 480, 33),
            Shape("prefill", max(1, budget // 2048), 2048),
        ]
        tuned = tune_packed(shapes + long_rows, heads, head_dim, dtype, device)
        write_table(tuned, out, "attention_tune", "Packed attention launch configs", slug)
        ok = tuned[tuned["status"] == "ok"]
        mean = ok.groupby("config")["ms"].apply(lambda x: x.prod() ** (1 / len(x)))
        print("packed attention configs, geometric-mean ms over shapes (best 8):")
        print(mean.sort_values().head(8).to_string())
    if not args.no_prefill:
        shapes += prefill_shapes(args.quick, budget) if on_gpu else [Shape("prefill", 1, 256)]
    from tqdm import tqdm

    rows = []
    for shape in tqdm(shapes, desc="attention shapes"):
        rows += bench_shape(shape, heads, head_dim, dtype, device, args.quick)
        if on_gpu:
            torch.cuda.empty_cache()  # the last shape's tensors are gone; return their blocks
    df = pd.DataFrame(rows)
    notes = (
        f"Device: {slug}; {heads} heads x {head_dim}, {str(dtype).removeprefix('torch.')}; "
        f"~{budget} tokens per call. TFLOP/s = 4 * head_dim * allowed (query, key) pairs / time: "
        "causal counts s(s+1)/2 pairs, tree masks only the pairs they allow, padding nothing. "
        "`plain` = one causal row per request (context + ending - 1 tokens, 4 rows per task); "
        "`tree` = one row per task, context once + 4 endings, tree mask. `us_per_task` compares "
        "the two ways to score the same tasks. `nakta_packed` runs the same rows as one packed "
        "stream (the scoring engine's kernel; on the CPU its PyTorch reference). `rel_err` vs an "
        "fp32 reference."
    )
    write_table(df, out, "attention", "Attention: Nakta paths vs Meta eager", notes)
    ok = df[df["status"] == "ok"]
    if len(ok):  # nothing to plot or show when every path failed
        save_figure(plot(df, f"Attention TFLOP/s on {slug}"), out / "attention.png")
        show = ok[["case", "path", "ms", "tflops", "speedup_vs_meta", "rel_err"]]
        print(show.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    skipped = df[df["status"] != "ok"]
    for _, r in skipped.iterrows():
        print(f"{r['case']} {r['path']}: {r['status']}")
    print(f"results -> {out}")
    return df


if __name__ == "__main__":
    sys.exit(exit_status(main()))
