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
