"""model_profile: categorisation rules, GPU-trace summarising, and a tiny CPU profile end to end."""

from __future__ import annotations

import json

import pytest

from model_profile.profile import (
    CATEGORIES,
    categorize,
    summarize_gemms,
    summarize_gpu_trace,
    top_table,
)


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


def test_summarize_gpu_trace_counts_busy_time_and_gaps():
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5,
             "args": {"External id": 7}},
            {"ph": "X", "cat": "kernel", "name": "some_gemm_kernel", "ts": 10, "dur": 20,
             "args": {"External id": 7}},
            # overlapping second stream: counted in its category, once in the busy timeline
            {"ph": "X", "cat": "kernel", "name": "_rope_kernel", "ts": 25, "dur": 10, "args": {}},
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 50, "dur": 5, "args": {}},
            {"ph": "X", "cat": "kernel", "name": "some_gemm_kernel", "ts": 60, "dur": 20,
             "args": {"External id": 7}},
        ]
    }  # fmt: skip
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
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5,
             "args": {"External id": 1, "Input Dims": [[1000, 4096], [4096, 12288]]}},
            {"ph": "X", "cat": "kernel", "name": "gemm_a", "ts": 10, "dur": 200,
             "args": {"External id": 1}},
            # a second call of the same shape, split over two kernels (split-K + reduction)
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 300, "dur": 5,
             "args": {"External id": 2, "Input Dims": [[1000, 4096], [4096, 12288]]}},
            {"ph": "X", "cat": "kernel", "name": "gemm_a", "ts": 310, "dur": 150,
             "args": {"External id": 2}},
            {"ph": "X", "cat": "kernel", "name": "reduce", "ts": 460, "dur": 50,
             "args": {"External id": 2}},
            # addmm: bias first; an op that is no matmul and a kernel with no op are ignored
            {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "ts": 600, "dur": 5,
             "args": {"External id": 3, "Input Dims": [[64], [7, 32], [32, 64]]}},
            {"ph": "X", "cat": "kernel", "name": "gemm_b", "ts": 610, "dur": 1,
             "args": {"External id": 3}},
            {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 700, "dur": 5,
             "args": {"External id": 4, "Input Dims": [[7, 32], [7, 32]]}},
            {"ph": "X", "cat": "kernel", "name": "add", "ts": 710, "dur": 9,
             "args": {"External id": 4}},
            {"ph": "X", "cat": "kernel", "name": "orphan", "ts": 720, "dur": 9, "args": {}},
        ]
    }  # fmt: skip
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
