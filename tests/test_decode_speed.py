"""speed_bench/decode_speed.py end to end on the CPU (tiny model): schema and sane numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


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
