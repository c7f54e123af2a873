"""speed_bench/lm_eval_gsm8k.py: lm-eval generate_until on the full GSM8K-shaped task, nakta vs
hf through the entry in fresh processes (end to end at tiny size on the CPU), its plan, command
lines, deadline, extrapolation and summary schema."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from speed_bench import lm_eval_gsm8k as bench  # noqa: E402
from speed_bench import lm_eval_gsm8k_report as report  # noqa: E402
from speed_bench.lm_eval_weights import UsageError, Weights  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _drive(args: list, tmp_path: Path) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "res"
    cmd = [sys.executable, "speed_bench/lm_eval_gsm8k.py", *args, "--device", "cpu"]
    cmd += ["--out", str(out), "--work", str(tmp_path / "work")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    return done, out


def _check_files(out: Path) -> dict:
    summary = json.loads((out / "lm_eval_summary.json").read_text())
    assert list(summary) == list(report.SUMMARY_KEYS)
    assert all(list(r) == list(report.RUN_KEYS) for r in summary["runs"])
    assert (out / "lm_eval_summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "lm_eval_summary.md").read_text() == report.markdown(summary)
    return summary


@pytest.mark.slow  # four lm-eval children and a tiny random model made and converted: ~50 s
def test_end_to_end_tiny_cpu_nakta_and_hf(shared_data, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    args = ["--preset", "tiny", "--tokenizer", str(shared_data / "stories260K" / "tokenizer.model")]
    args += ["--limit", "3", "--max-gen-toks", "8", "--hf-batch-sizes", "2", "--hf-limit", "2"]
    args += ["--nakta-on-hf-docs"]
    done, out = _drive(args, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = _check_files(out)
    runs = summary["runs"]
    assert [(r["model"], r["batch_size"], r["docs"]) for r in runs] == [
        ("nakta", "default", 3),
        ("hf", "2", 2),
        ("nakta", "default", 2),
    ]
    for r in runs:
        assert r["error"] is None and r["task"] == "gsm8k_shaped_full_local"
        assert (r["full_docs"], r["num_fewshot"], r["max_gen_toks"]) == (3, 8, 8)
        assert 0 < r["load_s"] < r["wall_s"] and 0 < r["generate_s"] < r["wall_s"]
        assert r["docs_s"] == pytest.approx(r["docs"] / r["generate_s"])
        assert r["answer_tokens"] > 0 and r["exact_match"] is not None
        assert (out / r["log"]).is_file()
    nakta, hf, nakta_sub = runs
    assert 0 < nakta["engine_tokens"] <= 3 * 8 and hf["engine_tokens"] is None
    # where nakta's time went: the engine's counters, the load's parts, the child's moments
    assert nakta["engine"]["decode_steps"] > 0 and nakta["engine"]["max_batch"] >= 1
    assert 0 < nakta["engine"]["prefilled_tokens"] <= nakta["engine"]["prompt_tokens"]
    assert nakta["nakta_load"]["read_s"] >= 0 and "first_request" in nakta["events"]
    assert hf["engine"] is None and hf["nakta_load"] is None
    assert nakta["extrapolated_full_wall_s"] is None is nakta_sub["extrapolated_full_wall_s"]
    assert hf["extrapolated_full_wall_s"] == pytest.approx(
        hf["wall_s"] + hf["generate_s"] * (3 / 2 - 1)
    )
    assert summary["ratio_hf_over_nakta"] is None  # hf never ran on every doc
    assert summary["ratio_hf_over_nakta_extrapolated"] == pytest.approx(
        hf["extrapolated_full_wall_s"] / nakta["wall_s"]
    )
    assert summary["ratio_hf_over_nakta_same_docs"] == pytest.approx(
        hf["wall_s"] / nakta_sub["wall_s"]
    )
    assert summary["device_name"] == "cpu" and summary["gpus_available"] == 0
    assert summary["setup"]["weights"] == "tiny-random-seed0" and summary["setup"]["convert_s"] > 0
    log = (out / hf["log"]).read_text().splitlines()[0]
    assert "--batch_size 2" in log and "--limit 2" in log and "max_gen_toks=8" in log


@pytest.mark.slow  # one lm-eval child on the real tiny checkpoint: ~15 s
def test_nakta_checkpoint_alone_lists_hf_as_skipped(shared_data, tmp_path):
    args = ["--checkpoint", str(shared_data / "stories260K"), "--limit", "2"]
    args += ["--max-gen-toks", "4", "--task", "gsm8k_shaped_local"]
    done, out = _drive(args, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = _check_files(out)["runs"]
    assert [(r["model"], r["docs"]) for r in runs] == [("nakta", 2), ("hf", 2)]
    assert runs[0]["error"] is None and runs[0]["answer_tokens"] > 0
    assert runs[1]["error"].startswith("skipped: no HF weights") and runs[1]["wall_s"] is None


def _args(*extra: str):
    a = bench.parse_args(["--preset", "7B", "--tokenizer", "t.model", *extra])
    a.device, a.dtype = "cuda", "bf16"
    return a


def test_plan_nakta_first_then_hf_per_batch_size_then_nakta_on_hfs_docs():
    a = _args("--hf-batch-sizes", "64,auto", "--hf-limit", "256", "--nakta-on-hf-docs")
    assert [(r.model, r.batch_size, r.limit) for r in bench.plan(a)] == [
        ("nakta", "default", None),
        ("hf", "64", 256),
        ("hf", "auto", 256),
        ("nakta", "default", 256),
    ]
    assert [r.timeout_s for r in bench.plan(a)] == [300.0, 600.0, 600.0, 120.0]
    # --limit bounds every run; hf's subset never asks for more docs than that
    a = _args("--limit", "100", "--hf-limit", "256", "--nakta-on-hf-docs")
    assert [(r.model, r.limit) for r in bench.plan(a)] == [("nakta", 100), ("hf", 100)]
    assert [r.model for r in bench.plan(_args("--models", "hf"))] == ["hf"]


def test_child_commands_nakta_at_its_default_hf_at_its_batch_size(tmp_path):
    a = _args("--max-gen-toks", "64")
    w = Weights(tmp_path / "hf", tmp_path / "hf_tok", tmp_path / "nakta", tmp_path / "t.model")
    nakta, hf = bench.Run("nakta", "default", None, 1.0), bench.Run("hf", "auto", 256, 1.0)
    n_cmd = bench.child_command(nakta, bench.model_args("nakta", w, None, a), a, tmp_path)
    h_cmd = bench.child_command(hf, bench.model_args("hf", w, None, a), a, tmp_path)
    for cmd in (n_cmd, h_cmd):
        assert cmd[1:3] == ["-m", "accuracy_test.lm_eval_cli"]
        assert cmd[cmd.index("--tasks") + 1] == "gsm8k_shaped_full_local"
        assert cmd[cmd.index("--num_fewshot") + 1] == "8"
        assert cmd[cmd.index("--gen_kwargs") + 1] == "max_gen_toks=64"
    assert "--batch_size" not in n_cmd and "--limit" not in n_cmd
    assert h_cmd[h_cmd.index("--batch_size") + 1] == "auto"
    assert h_cmd[h_cmd.index("--limit") + 1] == "256"
    h_args = h_cmd[h_cmd.index("--model_args") + 1]
    assert h_args == f"pretrained={w.hf_dir},tokenizer={w.hf_tokenizer},dtype=bfloat16"
    n_args = n_cmd[n_cmd.index("--model_args") + 1]
    assert n_args.startswith(f"checkpoint={w.nakta_dir},dtype=bf16,tokenizer=")
    assert bench.model_args("hf", None, tmp_path, a) is None  # a Nakta checkpoint only


def test_a_run_that_cannot_end_before_the_deadline_is_skipped(tmp_path):
    a = _args("--deadline-s", "150")
    runner = bench.Runner(a, tmp_path, tmp_path, started=time.perf_counter() - 100)
    rec = runner.run(bench.Run("hf", "64", 256, 60.0), "pretrained=x")
    assert rec["error"].startswith("skipped: a 60 s run would end past --deadline-s")
    assert rec["wall_s"] is None and rec["log"] is None and list(rec) == list(report.RUN_KEYS)
    assert (rec["docs"], rec["full_docs"], rec["max_gen_toks"]) == (256, 1319, 256)
    assert runner.fits(40.0) and not runner.fits(60.0)
    runner.a.limit = 5000  # more than the task has: all of it
    assert runner.record(bench.Run("nakta", "default", 5000, 1.0))["full_docs"] == 1319
    assert not (tmp_path / "runs").exists()  # nothing was started


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--preset", "7B"], "--preset / --hf need --tokenizer"),
        (["--checkpoint", "c", "--hf-batch-sizes", "0"], "--hf-batch-sizes: '0'"),
        (["--checkpoint", "c", "--limit", "0"], "--limit must be >= 1"),
        (["--checkpoint", "c", "--nakta-on-hf-docs"], "--nakta-on-hf-docs needs --hf-limit"),
        (["--checkpoint", "c", "--models", "vllm"], "--models: nakta and/or hf"),
        (["--checkpoint", "/no/such/dir", "--device", "cpu"], "--checkpoint /no/such/dir is not"),
    ],
)
def test_bad_input_is_one_error_line(argv, message, capsys, tmp_path):
    assert bench.main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {message}"), err


def _run(model: str, docs: int, wall: float, generate: float, **kw) -> dict:
    rec = dict.fromkeys(report.RUN_KEYS)
    rec.update(model=model, batch_size="64" if model == "hf" else "default", task="t")
    rec.update(docs=docs, full_docs=1319, num_fewshot=8, max_gen_toks=256, wall_s=wall)
    rec.update(load_s=2.0, generate_s=generate, exact_match=0.0, **kw)
    if model == "hf":
        rec["extrapolated_full_wall_s"] = report.extrapolate(rec)
    return rec


def test_extrapolation_and_ratios_keep_measured_and_extrapolated_apart(tmp_path):
    nakta = _run("nakta", 1319, 90.0, 75.0)
    hf = _run("hf", 256, 130.0, 110.0)
    nakta_sub = _run("nakta", 256, 30.0, 15.0)
    assert hf["extrapolated_full_wall_s"] == pytest.approx(20.0 + 110.0 * 1319 / 256)
    assert report.extrapolate(_run("hf", 1319, 500.0, 480.0)) is None  # measured on all docs
    assert report.extrapolate({**hf, "error": "exit code 1"}) is None
    got = report.ratios([nakta, hf, nakta_sub])
    assert got["ratio_hf_over_nakta"] is None
    assert got["ratio_hf_over_nakta_extrapolated"] == pytest.approx(
        hf["extrapolated_full_wall_s"] / 90.0
    )
    assert got["ratio_hf_over_nakta_same_docs"] == pytest.approx(130.0 / 30.0)
    slower = _run("hf", 1319, 700.0, 680.0)
    faster = _run("hf", 1319, 600.0, 580.0, batch_size="32")
    failed = _run("hf", 1319, 10.0, 1.0, error="exit code 1")
    full = report.ratios([nakta, slower, faster, failed])  # hf's best working batch size
    assert full["ratio_hf_over_nakta"] == pytest.approx(600.0 / 90.0)
    summary = {"device_name": "NVIDIA H100 80GB HBM3", "gpus_available": 1}
    summary.update(runs=[nakta, hf, nakta_sub], **got)
    summary.update(target_hf_over_nakta=report.TARGET, setup={"weights": "7B-random-seed0"})
    files = report.write_outputs(summary, tmp_path)
    assert [f.name for f in files] == [f"lm_eval_summary.{e}" for e in ("json", "md", "png")]
    text = files[1].read_text()
    assert "| hf | 64 | 256 | 8 | 256 | 130.00 |" in text  # measured wall in its own column
    assert f"| {hf['extrapolated_full_wall_s']:.1f} |" in text
    assert "measured, both on all docs: - (no such pair of finished runs)" in text
    assert "measured, both on hf's subset: **4.33x**" in text and "misses" in text
    assert json.loads(files[0].read_text())["runs"][1]["docs"] == 256
    with pytest.raises(ValueError, match="schema"):
        report.write_outputs({**summary, "runs": [{**nakta, "extra": 1}]}, tmp_path)
    with pytest.raises(ValueError, match="schema"):
        report.write_outputs({**summary, "ratio": 1.0}, tmp_path)


def test_task_table_matches_the_task_files():
    """The driver's doc counts and max_gen_toks are the tasks' own."""
    from nakta_model.tasks.shaped import GSM8K_TEST_SIZE

    assert bench.TASK_DOCS["gsm8k_shaped_full_local"] == GSM8K_TEST_SIZE
    yaml = (REPO / "accuracy_test/tasks/gsm8k_shaped_local/gsm8k_shaped_local.yaml").read_text()
    assert f"max_gen_toks: {bench.TASK_MAX_GEN}\n" in yaml
    assert (
        "def load(n_test: int = 250"
        in (REPO / "accuracy_test/tasks/gsm8k_shaped_local/utils.py").read_text()
    )


def test_usage_error_is_the_shared_one():
    assert bench.UsageError is UsageError
