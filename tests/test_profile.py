"""model_profile: categorisation rules, GPU-trace summarising, and a tiny CPU profile end to end.

Here too: compile_profile, throughput_profile and decode_timeline, the parts that run without a GPU.
"""

from __future__ import annotations

import json

import pytest
import torch
from triton.compiler import ASTSource

from model_profile import throughput_profile as tp
from model_profile.compile_profile import parse_args, specialization
from model_profile.decode_timeline import (
    floors_us,
    increments,
    kernels_from_trace,
    label_by_layer,
    label_kernels,
    steps_of,
    with_floors,
)
from model_profile.profile import (
    CATEGORIES,
    categorize,
    summarize_gemms,
    summarize_gpu_trace,
    top_table,
)
from nakta_model.kernels.packed_attention import _packed_attention_kernel


@pytest.mark.parametrize(
    ("name", "op", "expected"),
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "aten::mm", "gemm"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", None, "gemm"),
        ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_tn", "aten::bmm", "attention"),
        ("void at::native::(anonymous)::cunn_SoftMaxForward<4, float>", "aten::_softmax", "attention"),
        ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", None, "attention"),
        ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "aten::_efficient_attention_forward", "attention"),
        ("_rms_norm_fwd_kernel", None, "elementwise"),
        ("void at::native::vectorized_elementwise_kernel<4, silu>", "aten::silu", "elementwise"),
        ("Memcpy HtoD (Pageable -> Device)", None, "memcpy"),
    ],
)  # fmt: skip
def test_categorize(name, op, expected):
    assert categorize(name, op) == expected


def _event(cat: str, name: str, ts: float, dur: float, ext=None, dims=None) -> dict:
    """A complete ("X") Chrome-trace event as torch.profiler writes it; ``ext`` links a kernel
    to the op that launched it, ``dims`` is the op's recorded input shapes."""
    args = {} if ext is None else {"External id": ext}
    if dims is not None:
        args["Input Dims"] = dims
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def test_summarize_gpu_trace_counts_busy_time_and_gaps():
    trace = {
        "traceEvents": [
            _event("cpu_op", "aten::mm", 0, 5, ext=7),
            _event("kernel", "some_gemm_kernel", 10, 20, ext=7),
            # overlapping second stream: counted in its category, once in the busy timeline
            _event("kernel", "_rope_kernel", 25, 10),
            _event("gpu_memcpy", "Memcpy HtoD", 50, 5),
            _event("kernel", "some_gemm_kernel", 60, 20, ext=7),
        ]
    }
    df, cats = summarize_gpu_trace(trace)
    assert cats["gemm"] == 40 and cats["elementwise"] == 10 and cats["memcpy"] == 5
    # span 10..80 = 70; busy = [10,35) + [50,55) + [60,80) = 25 + 5 + 20 = 50
    assert cats["gaps"] == 20
    assert cats["attention"] == 0
    gemm = df[df["name"] == "some_gemm_kernel"].iloc[0]
    assert gemm["calls"] == 2 and gemm["op"] == "aten::mm"
    top = top_table(df, cats, top=2)
    assert list(top["name"])[0] == "some_gemm_kernel" and len(top) == 2
    assert abs(top["share"].iloc[0] - 40 / 75) < 1e-9


def test_summarize_gemms_rates_each_shape_against_the_peak():
    mm_dims = [[1000, 4096], [4096, 12288]]
    trace = {
        "traceEvents": [
            _event("cpu_op", "aten::mm", 0, 5, ext=1, dims=mm_dims),
            _event("kernel", "gemm_a", 10, 200, ext=1),
            # a second call of the same shape, split over two kernels (split-K + reduction)
            _event("cpu_op", "aten::mm", 300, 5, ext=2, dims=mm_dims),
            _event("kernel", "gemm_a", 310, 150, ext=2),
            _event("kernel", "reduce", 460, 50, ext=2),
            # addmm: bias first; an op that is no matmul and a kernel with no op are ignored
            _event("cpu_op", "aten::addmm", 600, 5, ext=3, dims=[[64], [7, 32], [32, 64]]),
            _event("kernel", "gemm_b", 610, 1, ext=3),
            _event("cpu_op", "aten::add", 700, 5, ext=4, dims=[[7, 32], [7, 32]]),
            _event("kernel", "add", 710, 9, ext=4),
            _event("kernel", "orphan", 720, 9),
        ]
    }
    df = summarize_gemms(trace, peak_tflops=500.0)
    assert list(zip(df["M"], df["K"], df["N"])) == [(1000, 4096, 12288), (7, 32, 64)]
    big = df.iloc[0]
    assert big["calls"] == 2 and big["total_ms"] == pytest.approx(0.4)
    flop = 2 * 1000 * 4096 * 12288 * 2
    assert big["tflops"] == pytest.approx(flop / 400e-6 / 1e12)
    assert big["of_peak"] == pytest.approx(big["tflops"] / 500.0)
    assert df["share"].sum() == pytest.approx(1.0)
    assert summarize_gemms({"traceEvents": []}, 500.0).empty


def test_profile_tiny_cpu_end_to_end(tmp_path):
    from model_profile.profile import main

    result = main(["--preset", "tiny", "--tasks", "2", "--device", "cpu", "--out", str(tmp_path)])
    engines = ("llama_org", "nakta", "nakta_cache")
    assert set(result["engines"]) == set(engines)
    for name in engines:
        trace = json.loads((tmp_path / f"{name}.pt.trace.json").read_text())
        assert trace["traceEvents"]
        assert (tmp_path / f"kernels_{name}.md").read_text().startswith("# Top ops")
        r = result["engines"][name]
        assert set(r["categories_ms"]) == set(CATEGORIES)
        assert r["categories_ms"]["gemm"] > 0  # the projections are matmuls
        assert abs(sum(r["categories_ms"].values()) - r["profiled_ms"]) < 1e-6
        assert r["top"] and all(0 <= t["share"] <= 1 for t in r["top"])
    for f in ("categories.csv", "categories.md", "profile.png", "summary.json"):
        assert (tmp_path / f).stat().st_size > 0


def test_runs_by_path_from_its_folder():
    """``cd model_profile && python profile.py``: the bootstrap puts the repo root where the
    script's folder was, so neither the packages nor the stdlib ``profile`` module go missing."""
    from cli_helpers import REPO, run_script

    proc = run_script(["profile.py", "--help"], REPO / "model_profile")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: profile.py")


# ------------------------------------------------------------------------------------------------
# model_profile.compile_profile: what a first run compiles, named.
#
# The GPU run itself needs CUDA; here: the argument checks and how a compile is named.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "match"),
    [(["--phases", "score,train"], "--phases takes"), (["--prompts", "0"], "--prompts must be")]
    + [(["--shared-prefix", "925"], "--shared-prefix must be in")],
)
def test_bad_arguments_are_refused(argv, match, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert match in capsys.readouterr().err


def test_a_compile_is_named_by_its_constexprs_and_specialised_arguments():
    names = list(_packed_attention_kernel.arg_names)
    src = ASTSource(
        _packed_attention_kernel, {n: "i32" for n in names}, constexprs={"TREE": True, "N_Q": 32},
        attrs={(names.index("stride_qt"),): [["tt.divisibility", 16]]},
    )  # fmt: skip
    assert specialization(src) == "TREE=True N_Q=32 stride_qt:16"


# ------------------------------------------------------------------------------------------------
# model_profile.throughput_profile's pieces that run without a GPU: its argument checks and the
# per-kernel table it builds from the profiler's averages.
# ------------------------------------------------------------------------------------------------


class _Event:
    def __init__(self, key, us, count):
        self.key, self.self_device_time_total, self.count = key, us, count


class _Prof:
    def key_averages(self):
        return [
            _Event("_attn_split_kernel", 300.0, 3),
            _Event("nvjet_sm90_tst_128x64_TNT", 100.0, 2),
            _Event("aten::mm", 100.0, 2),  # a host op: its kernels are counted under their names
            _Event("cudaGraphLaunch", 5.0, 1),
            _Event("_rms_norm_fwd_kernel", 0.0, 4),  # no device time
        ]


def test_kernel_table_counts_device_kernels_only():
    df = tp.kernel_table(_Prof())
    assert list(df["name"]) == ["_attn_split_kernel", "nvjet_sm90_tst_128x64_TNT"]
    assert list(df["category"]) == ["attention", "gemm"]
    assert df["share"].sum() == pytest.approx(1.0)
    assert df.loc[0, "mean_us"] == pytest.approx(100.0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompts", "0"], "--prompts must be >= 1"),
        (["--input-len", "8", "--shared-prefix", "8"], "--shared-prefix must be in"),
        (["--shared-prefix", "-1"], "--shared-prefix must be in"),
    ],
)
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        tp.parse_args(argv)
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# model_profile.decode_timeline's reading of a profiler trace, without a GPU: kernels labelled by
# their place in a decode layer, steps cut at every n_layers-th wqkv, increments (end minus the
# previous end) averaged over the steady steps, and byte floors from the model's own tensors.
# ------------------------------------------------------------------------------------------------


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
