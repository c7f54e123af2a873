"""speed_bench/throughput.py on the CPU (tiny model): the summary's schema, TTFT, EOS ignored,
nakta's token count, the byte-floor arithmetic and one-line argument errors.

Here too: speed_bench/decode_speed.py end to end on the CPU (tiny model): schema and sane numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from speed_bench import throughput as tp
from speed_bench.throughput_engines import BUILDERS
from speed_bench.weights import RandomWeights, weight_source

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def test_cli_writes_the_issue_schema(tmp_path):
    out = tmp_path / "res"
    cmd = [sys.executable, "-m", "speed_bench.throughput", "--preset", "tiny", "--prompts", "6"]
    cmd += ["--input-len", "6", "--output-len", "5", "--max-batch", "2,4", "--hf-batches", "2"]
    cmd += ["--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "throughput_summary.json").read_text())
    assert set(summary) == {"device_name", "runs"} and summary["device_name"] == "cpu"
    runs = summary["runs"]
    assert all(set(r) == set(tp.SUMMARY_KEYS) for r in runs)
    nakta = {r["max_batch"]: r for r in runs if r["engine"] == "nakta"}
    assert set(nakta) == {2, 4}
    for r in runs:
        assert (r["prompts"], r["input_len"], r["output_len"]) == (6, 6, 5)
        assert r["output_tok_s"] > 0 and r["requests_s"] > 0
        assert abs(r["output_tok_s"] - 5 * r["requests_s"]) < 1e-6 * r["output_tok_s"]
        assert 0 < r["ttft_median_s"] <= r["ttft_p99_s"]
        assert r["peak_mem_gb"] is None  # no GPU
        assert (r["step_floor_pct"] is not None) == (r["engine"] == "nakta")
    assert all(r["step_floor_pct"] > 0 for r in nakta.values())
    assert (out / "throughput.md").is_file() and (out / "throughput.png").is_file()


def test_nakta_generates_every_asked_token_and_later_waves_start_later():
    weights = weight_source("tiny", None, seed=0)
    work = tp.make_workload(7, 6, 5, weights.args.vocab_size, seed=3)
    engine = BUILDERS["nakta"](weights, CPU, torch.float32, 64)
    try:
        row = tp.measure(engine, work, 2, CPU)
    finally:
        engine.close()
    assert row["generated_tokens"] == 7 * 5  # prompts x output_len, exactly
    assert row["nakta_stats"]["generated_tokens"] == 7 * 5
    ttft = row["ttft_s"]
    # equal lengths keep the request order: rows 0, 1 are admitted first, the rest only once
    # a row is free again (after their 5 tokens)
    assert max(ttft[:2]) < min(ttft[2:])
    assert 0 < row["ttft_median_s"] <= row["ttft_p99_s"] <= max(ttft)


class _EosSink(RandomWeights):
    """A model whose greedy token is always 2 (the EOS of Meta's and HF's LLaMA): equal
    embeddings, blocks that add nothing, an LM head that only scores token 2."""

    def tensor(self, name, device, dtype):
        t = super().tensor(name, device, dtype)
        if name == "tok_embeddings.weight":
            return torch.ones_like(t)
        if name.endswith(("wo.weight", "w2.weight")):
            return torch.zeros_like(t)
        if name == "output.weight":
            t = torch.zeros_like(t)
            t[2] = 1.0
        return t


def _sink_weights() -> _EosSink:
    from nakta_model.config import preset

    return _EosSink(preset("tiny"), "eos-sink")


def test_the_sink_model_does_emit_eos():  # else the test below could not fail
    from nakta_model.generation import GenerationRequest, Generator
    from nakta_model.loading import load

    w = _sink_weights()
    model = load(w.source(CPU, torch.float32), CPU, torch.float32)
    work = tp.make_workload(3, 5, 4, w.args.vocab_size, seed=0)
    gen = Generator(model, max_batch=2, max_seq_len=32)
    plain = gen.generate([GenerationRequest(p, 4) for p in work.prompts])
    assert all(r.tokens == [2, 2, 2, 2] for r in plain)
    stopped = gen.generate([GenerationRequest(p, 4, stop_token_ids=(2,)) for p in work.prompts])
    assert all(r.tokens == [] and r.finish == "stop" for r in stopped)


@pytest.mark.parametrize("name", ["nakta", "hf", "llama_org"])
def test_eos_never_ends_a_row(name):
    reason = tp._skip(name, CPU)
    if reason:
        pytest.skip(reason)
    w = _sink_weights()
    work = tp.make_workload(5, 5, 4, w.args.vocab_size, seed=1)
    engine = BUILDERS[name](w, CPU, torch.float32, 64)
    try:
        out = engine.run(work.prompts, work.outputs, 2)
    finally:
        engine.close()
    assert all(g >= 4 for g in out.generated), out.generated
    if name == "nakta":
        assert out.generated == [4] * 5


def test_uniform_lengths_are_drawn_within_their_ranges():
    a = tp.make_workload(200, (3, 9), (2, 5), 100, seed=4)
    lens = [len(p) for p in a.prompts]
    assert min(lens) == 3 and max(lens) == 9 and min(a.outputs) == 2 and max(a.outputs) == 5
    assert all(p[0] == 1 and all(3 <= t < 100 for t in p[1:]) for p in a.prompts)
    assert (a.input_label, a.output_label) == ("uniform:3-9", "uniform:2-5")
    b = tp.make_workload(200, (3, 9), (2, 5), 100, seed=4)
    assert (a.prompts, a.outputs) == (b.prompts, b.outputs)  # seeded


def test_decode_floor_counts_positions_token_by_token():
    from nakta_model.config import preset
    from speed_bench.decode_speed import step_bytes

    args = preset("7B")
    work = tp.Workload([[1] * 10, [1] * 4], [3, 5], "x", "y")
    # request 0 decodes tokens 2, 3 at contexts 11, 12; request 1 tokens 2..5 at 5..8
    positions = 11 + 12 + 5 + 6 + 7 + 8
    stats = {"decode_steps": 4, "decode_s": 0.04}
    f = tp.decode_floor(args, work, stats, 2, 1000.0)
    assert f["mean_rows"] == 6 / 4 and f["mean_context"] == positions / 6
    floor_s = step_bytes(args, 6 / 4, positions / 6, 2) / 1e12
    assert f["step_floor_pct"] == pytest.approx(100 * floor_s / 0.01)
    f8 = tp.decode_floor(args, work, stats, 2, 1000.0, quant="fp8")  # one byte a block weight
    floor8 = step_bytes(args, 6 / 4, positions / 6, 2, quant="fp8") / 1e12
    assert f8["step_floor_pct"] == pytest.approx(100 * floor8 / 0.01)
    assert f8["step_floor_pct"] < f["step_floor_pct"]


def test_the_fp8_engine_generates_every_asked_token():
    """nakta_fp8 (named only, not a default engine): the FP8 model through the same engine."""
    assert "nakta_fp8" in tp.ENGINES and "nakta_fp8" not in tp.DEFAULT_ENGINES
    weights = weight_source("tiny", None, seed=0)
    work = tp.make_workload(3, 6, 4, weights.args.vocab_size, seed=1)
    engine = BUILDERS["nakta_fp8"](weights, CPU, torch.float32, 32)
    assert engine.model.ops.quant == "fp8"
    out = engine.run(work.prompts, work.outputs, 2)
    assert out.generated == work.outputs


def test_a_max_batch_nakta_refuses_is_skipped_and_the_rest_runs(tmp_path):
    s = tp.main(
        ["--preset", "tiny", "--engines", "nakta", "--prompts", "3", "--input-len", "4",
         "--output-len", "3", "--max-batch", "2,2000", "--out", str(tmp_path)]
    )  # fmt: skip
    assert [r["max_batch"] for r in s["runs"]] == [2]
    assert "max_batch 2000" in (tmp_path / "throughput.md").read_text()


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--lengths", "normal:3"], "--lengths"),
        (["--lengths", "uniform:9-3/2-4"], "low-high"),
        (["--lengths", "uniform:3-9/2-4", "--input-len", "5"], "--lengths replaces"),
        (["--engines", "vllm"], "--engines"),
        (["--max-batch", "0"], "--max-batch"),
        (["--hf-batches", "a"], "--hf-batches"),
        (["--prompts", "0"], "--prompts"),
    ],
)
def test_bad_arguments_are_one_error_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        tp.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0]


def test_lengths_past_the_model_are_one_error_line(capsys):
    with pytest.raises(SystemExit) as e:
        tp.main(["--preset", "tiny", "--input-len", "100", "--output-len", "100"])
    assert e.value.code == 2
    assert "max_seq_len 128" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# speed_bench/decode_speed.py end to end on the CPU (tiny model): schema and sane numbers.
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_decode_speed_runs_by_path_and_writes_its_summary(tmp_path):
    out = tmp_path / "res"
    cmd = [sys.executable, str(REPO / "speed_bench" / "decode_speed.py"), "--preset", "tiny"]
    cmd += ["--batches", "1,2", "--lengths", "6:12", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "decode_summary.json").read_text())
    runs = summary["runs"]
    engines = {r["engine"] for r in runs} | set(summary["skipped"])
    assert {"nakta", "llama_org", "hf"} <= engines
    for r in runs:
        assert {"engine", "batch", "prompt", "gen", "tok_s", "floor_tok_s", "ms_per_token"} <= set(
            r
        )
        assert r["tok_s"] > 0 and r["ms_per_token"] > 0
        assert abs(r["tok_s"] - 1e3 * r["batch"] / r["ms_per_token"]) < 1e-6 * r["tok_s"]
    assert {(r["batch"], r["prompt"], r["gen"]) for r in runs if r["engine"] == "nakta"} == {
        (1, 6, 12),
        (2, 6, 12),
    }
    assert (out / "decode.md").is_file() and (out / "decode.png").is_file()


def test_step_bytes_counts_weights_and_the_cache():
    from nakta_model.config import preset
    from speed_bench.decode_speed import step_bytes
    from speed_bench.weights import matmul_params

    args = preset("7B")
    blocks, head = matmul_params(args)
    assert step_bytes(args, 1, 0, 2) == 2 * (blocks + head)  # ~13.2 GB of bf16 weights
    kv = step_bytes(args, 8, 100, 2) - step_bytes(args, 8, 0, 2)
    assert kv == 2 * 2 * 32 * 4096 * 100 * 8  # K and V, 32 layers, 4096 wide, 100 positions
    # a 60-token prefix all 8 rows share is read once: 8 * 40 + 60 positions
    shared = step_bytes(args, 8, 100, 2, shared=60) - step_bytes(args, 8, 0, 2)
    assert shared == 2 * 2 * 32 * 4096 * (8 * 40 + 60)


def test_random_prompts_share_the_asked_prefix_only():
    from speed_bench.decode_speed import random_prompts

    ps = random_prompts(4, 30, 1000, seed=1, shared=12)
    assert all(len(p) == 30 and p[0] == 1 and p[:12] == ps[0][:12] for p in ps)
    assert len({tuple(p[12:]) for p in ps}) == 4
    plain = random_prompts(4, 30, 1000, seed=1)
    assert len({p[1] for p in plain}) > 1  # only BOS in common


def test_nakta_compile_is_an_opt_in_engine(monkeypatch):
    import torch

    from speed_bench import decode_speed as ds

    assert "nakta_compile" not in ds.parse_args([]).engines
    assert ds.parse_args(["--engines", "nakta,nakta_compile"]).engines == ["nakta", "nakta_compile"]
    with pytest.raises(SystemExit):
        ds.parse_args(["--engines", "nakta_compiled"])
    monkeypatch.setattr("shutil.which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    assert "C++ compiler" in ds._skip("nakta_compile", torch.device("cpu"))


@pytest.mark.slow  # torch.compile builds the step's CPU kernels (~20 s)
def test_decode_speed_times_the_compiled_step_next_to_the_captured_one(tmp_path):
    """``--engines nakta,nakta_compile``: a row (or a recorded reason) for each, one ratio."""
    out = tmp_path / "res"
    cmd = [sys.executable, str(REPO / "speed_bench" / "decode_speed.py"), "--preset", "tiny"]
    cmd += ["--engines", "nakta,nakta_compile", "--batches", "1", "--lengths", "4:3"]
    cmd += ["--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "decode_summary.json").read_text())
    runs = {r["engine"] for r in summary["runs"]}
    assert runs | {k.split()[0] for k in summary["skipped"]} == {"nakta", "nakta_compile"}
    for why in summary["skipped"].values():  # 2 CPU steps can drown in noise; nothing else
        assert "not measurable" in why, why
    if runs == {"nakta", "nakta_compile"}:
        assert "nakta_vs_nakta_compile_b1_p4_g3" in summary["ratios"]


def test_the_rowwise_prefix_engine_is_opt_in_and_decodes_like_the_cascade(tmp_path):
    """``nakta_rowwise`` (a shared prefix read row by row, no cascade) next to ``nakta`` with
    ``--shared-prefix``: both rows, one ratio; tiny model on the CPU."""
    from speed_bench import decode_speed as ds

    assert "nakta_rowwise" not in ds.parse_args([]).engines
    out = tmp_path / "rw"
    cmd = [sys.executable, str(REPO / "speed_bench" / "decode_speed.py"), "--preset", "tiny"]
    cmd += ["--engines", "nakta,nakta_rowwise", "--batches", "2", "--lengths", "80:12"]
    cmd += ["--shared-prefix", "70", "--no-budget", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads((out / "decode_summary.json").read_text())
    assert {r["engine"] for r in summary["runs"]} == {"nakta", "nakta_rowwise"}
    assert list(summary["ratios"]) == ["nakta_vs_nakta_rowwise_b2_p80_g12"]
