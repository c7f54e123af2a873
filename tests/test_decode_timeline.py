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
    label_by_layer,
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
    t = with_floors(df, floors, n_layers=2).set_index("kind")
    assert list(t.index) == ["wqkv", "attention", "wo", "w13", "w2", "tail"]
    assert t.loc["w13", "floor_step_us"] == 4.0  # 2 us a layer, 2 layers
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


def _gemm_path_trace(n_steps: int, n_layers: int) -> list[dict]:
    """The step of 8+ rows: step inputs, then per layer an RMSNorm, the wqkv GEMM, RoPE,
    attention (split + combine), the wo GEMM, an RMSNorm, the w13 GEMM, SwiGLU, the w2 GEMM;
    then the LM head GEMM and the argmax; 2 us each, back to back."""
    layer = ["_rms_norm_kernel", "sm90_xmma_gemm_bf16", "_rope_kernel", "_attn_split_kernel",
             "_attn_combine_kernel", "nvjet_tst_128x64", "_rms_norm_kernel",
             "_fp8_decode_gemm_kernel", "_swiglu_kernel", "cutlass_gemm"]  # fmt: skip
    names = ["prefill_gemm", "packed_attention"]
    for _ in range(n_steps):
        names += ["_step_inputs_kernel"] + layer * n_layers + ["_decode_linear_kernel", "argmax"]
    return [{"name": n, "start": 3.0 * i, "end": 3.0 * i + 2.0} for i, n in enumerate(names)]


def test_layers_of_the_gemm_path_are_found_by_position():
    kernels = _gemm_path_trace(n_steps=5, n_layers=3)
    labels = label_by_layer(kernels, n_layers=3)
    first = labels[3:13]  # the first step's first layer
    assert first == ["other", "wqkv", "other", "attention", "attention", "wo", "other", "w13",
                     "other", "w2"]  # fmt: skip
    assert labels[:3] == ["tail"] * 3  # the prefill and the step's inputs
    assert labels[33:35] == ["tail", "tail"]  # the LM head and the argmax
    steps = steps_of(kernels, labels, n_layers=3)
    assert len(steps) == 5
    df = increments(kernels, labels, steps)
    assert df.loc["other", "calls_per_step"] == 4 * 3
    assert df.loc["w2", "mean_inc_us"] == pytest.approx(3.0)


def test_no_step_inputs_no_layer_labels():
    """With the step kernels off there is no step boundary: ``label_kernels`` reads it."""
    kernels = kernels_from_trace(_trace(n_steps=5, n_layers=2))
    assert label_by_layer(kernels, n_layers=2) is None


def test_the_batch1_chain_reads_the_same_either_way():
    """With the step kernels on, the positional reading of the GEMV chain (wqkv, attention, wo,
    w13, w2) gives the state machine's labels."""
    kernels = []
    for i in range(4):
        names = ["_step_inputs_kernel"] + [LIN, ATT, LIN, LIN, LIN] * 2 + [LIN, "_greedy_advance"]
        kernels += [{"name": n, "start": 100.0 * i + j, "end": 100.0 * i + j + 0.5}
                    for j, n in enumerate(names)]  # fmt: skip
    assert label_by_layer(kernels, n_layers=2) == label_kernels(kernels)


def test_a_trace_without_layers_has_no_steps():
    kernels = [{"name": "gemm", "start": float(i), "end": i + 0.5} for i in range(10)]
    assert steps_of(kernels, label_kernels(kernels), n_layers=2) == []


def test_cublas_split_k_reductions_count_with_their_gemm():
    """bf16 from 8 rows: cuBLAS runs wo and w2 as split-K GEMMs, each followed by its
    reduction launch (``cublasLt::splitKreduce_kernel``): one matmul, two launches."""
    red = "void cublasLt::splitKreduce_kernel<32, 16, int, float>"
    layer = ["_rms_norm_fwd_kernel", "nvjet_sm90_tst_64x8", "_rope_qkv_kernel", ATT,
             "nvjet_sm90_splitK_TNT", red, "_rms_norm_fwd_kernel", "nvjet_sm90_tst_256x8",
             "_silu_mul_fwd_kernel", "nvjet_sm90_splitK_TNT", red]  # fmt: skip
    names = []
    for _ in range(5):
        names += ["_step_inputs_kernel"] + layer * 2 + [LIN, "_greedy_advance"]
    kernels = [{"name": n, "start": 2.0 * i, "end": 2.0 * i + 1} for i, n in enumerate(names)]
    labels = label_by_layer(kernels, n_layers=2)
    assert labels[1:12] == ["other", "wqkv", "other", "attention", "wo", "wo", "other", "w13",
                            "other", "w2", "w2"]  # fmt: skip
    assert len(steps_of(kernels, labels, n_layers=2)) == 5
