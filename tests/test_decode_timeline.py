"""model_profile.decode_timeline's reading of a profiler trace, without a GPU: kernels labelled
by their place in a decode layer, steps cut at every n_layers-th wqkv, increments (end minus the
previous end) averaged over the steady steps, and byte floors from the model's own tensors."""

from __future__ import annotations

import pytest
import torch

from model_profile.decode_timeline import (
    floors_us,
    increments,
    kernels_from_trace,
    label_kernels,
    steps_of,
    with_floors,
)

LIN, ATT, COMB = "_decode_linear_kernel", "_attn_split_kernel", "_attn_combine_kernel"


def _trace(n_steps: int, n_layers: int, combine: bool = False) -> dict:
    """A prefill GEMM, then steps of n_layers layers (wqkv, attention [+ combine], wo, w13, w2)
    and a tail (LM head linear, argmax); each kernel lasts 3 us and starts 1 us after the
    previous one's end, except wo, which starts 2 us before attention ends (PDL)."""
    names = ["sm90_xmma_gemm_prefill"]
    for _ in range(n_steps):
        for _ in range(n_layers):
            names += [LIN, ATT] + ([COMB] if combine else []) + [LIN, LIN, LIN]
        names += [LIN, "argmax_kernel"]
    events, t = [], 0.0
    for i, n in enumerate(names):
        overlap = i > 0 and names[i - 1] in (ATT, COMB) and n == LIN
        start = t - 2.0 if overlap else t + 1.0
        events.append({"cat": "kernel", "name": n, "ts": start, "dur": 3.0})
        t = start + 3.0
    events.append({"cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 1.0})  # not a kernel
    return {"traceEvents": events}


def test_labels_steps_and_increments_of_a_synthetic_trace():
    kernels = kernels_from_trace(_trace(n_steps=6, n_layers=2))
    assert all(k["name"] != "aten::mm" for k in kernels)
    labels = label_kernels(kernels)
    assert labels[:7] == ["tail", "wqkv", "attention", "wo", "w13", "w2", "wqkv"]
    assert labels[11:13] == ["tail", "tail"]  # the LM head's linear and the argmax
    steps = steps_of(kernels, labels, n_layers=2)
    assert len(steps) == 6 and all(len(s) == 12 for s in steps)
    df = increments(kernels, labels, steps)
    assert df.loc["wo", "mean_inc_us"] == pytest.approx(1.0)  # ends 1 us after attention
    assert df.loc["w13", "mean_inc_us"] == pytest.approx(4.0)  # 1 us gap + 3 us
    assert df.loc["wqkv", "calls_per_step"] == 2 and df.loc["tail", "calls_per_step"] == 2
    step = df["step_us"].sum()
    assert step == pytest.approx(kernels[steps[3][0]]["end"] - kernels[steps[2][0]]["end"])
    floors = {"wqkv": 1.0, "attention": 0.5, "wo": 1.0, "w13": 2.0, "w2": 1.0, "tail": 3.0}
    t = with_floors(df, floors).set_index("kind")
    assert list(t.index) == ["wqkv", "attention", "wo", "w13", "w2", "tail"]
    assert t.loc["w13", "floor_step_us"] == 4.0  # 2 us a call, 2 calls a step
    assert t.loc["tail", "floor_step_us"] == 3.0  # the LM head once, whatever the calls
    assert t.loc["wo", "loss_us_per_step"] == pytest.approx(t.loc["wo", "step_us"] - 2.0)


def test_combine_launches_count_as_attention_and_partial_steps_are_dropped():
    kernels = kernels_from_trace(_trace(n_steps=5, n_layers=3, combine=True))
    labels = label_kernels(kernels)
    assert labels.count("attention") == 2 * 5 * 3
    assert labels.count("wo") == labels.count("w2") == 5 * 3
    cut = kernels[: len(kernels) - 4]  # the last step loses its last layer's kernels
    assert len(steps_of(cut, label_kernels(cut), n_layers=3)) == 4


def test_floors_are_the_model_bytes_over_the_bandwidth():
    from nakta_model.config import ModelArgs
    from nakta_model.loading import random_model

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=96, multiple_of=32)
    model = random_model(args, "cpu", torch.bfloat16)
    f = floors_us(model, context=10, bw_gbps=1.0)  # 1 GB/s: 1 byte = 1e-3 us
    layer = model.layers[0]
    assert f["wqkv"] == pytest.approx(layer.attention.wqkv.weight.numel() * 2 / 1e3)
    assert f["attention"] == pytest.approx(2 * 4 * 16 * 10 * 2 / 1e3)
    assert f["tail"] == pytest.approx((96 * 64 + 64) * 2 / 1e3)
