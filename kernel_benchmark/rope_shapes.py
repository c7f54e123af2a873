"""The rope bench's cases (the TransformerEngine-shaped sweep, the fused QK shapes) and its
CUDA-graph timer: a lower layer that ``bench_rope`` and ``tune_rope`` both import, so neither
imports the other."""

from __future__ import annotations

from collections.abc import Callable

DEFAULT = dict(seq_length=4096, batch=16, heads=32, hidden=128, rotary_percent=1.0, margin=0)
SWEEPS = {
    "seq_length": [512, 1024, 2048, 4096],
    "hidden": [128, 256, 512],
    "rotary_percent": [0.5, 1.0],
    "batch": [2, 4, 8, 16],
    "heads": [8, 16, 32, 64],
    "margin": [0, 10, 100],
}
QUICK_SWEEPS = {"seq_length": [512, 4096], "hidden": [512], "rotary_percent": [0.5], "margin": [10]}
LLAMA_HEADS = {"7B": 32, "13B": 40, "65B": 64}
QKV_TOKENS = 16384


def graph_ms(fn: Callable[[], object], quick: bool) -> float:
    """Median milliseconds per call replaying a CUDA graph of back-to-back calls: the GPU time,
    free of host overhead (no L2 flush; every sweep tensor is larger than L2 or nearly so)."""
    import triton.testing

    return float(
        triton.testing.do_bench_cudagraph(fn, rep=15 if quick else 25, return_mode="median")
    )
