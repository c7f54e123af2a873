"""speed_bench/lm_eval_speed.py: lm-eval's hf vs nakta through the project's entry, end to end
at tiny size on the CPU (same random weights: both must report the same acc), plus its rules.

Here too, the other lm-eval benches of speed_bench: lm_eval_gsm8k (generate_until on the full
GSM8K-shaped task), lm_eval_one_pool's pure parts and lm_eval_quant's bf16-vs-FP8 table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from speed_bench import lm_eval_gsm8k as gsm8k_bench  # noqa: E402
from speed_bench import lm_eval_gsm8k_report as report  # noqa: E402
from speed_bench import lm_eval_one_pool as op  # noqa: E402
from speed_bench import lm_eval_quant as lq  # noqa: E402
from speed_bench import (
    lm_eval_report,  # noqa: E402
    lm_eval_weights,  # noqa: E402
)
from speed_bench import lm_eval_speed as bench  # noqa: E402
from speed_bench.lm_eval_weights import UsageError, Weights  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RUN_KEYS = {"model", "num_fewshot", "batch_size", "tasks", "wall_s", "load_s", "scoring_s"}
RUN_KEYS |= {"acc", "acc_norm"}


@pytest.mark.slow  # four lm-eval child processes (hf and nakta, 0- and 1-shot): ~90 s here
def test_end_to_end_tiny_cpu_hf_and_nakta_agree(shared_data, tmp_path):
    out = tmp_path / "res"
    cmd = [sys.executable, "speed_bench/lm_eval_speed.py", "--preset", "tiny"]
    cmd += ["--tokenizer", str(shared_data / "stories260K" / "tokenizer.model")]
    cmd += ["--data", str(shared_data / "hellaswag_val_full.jsonl"), "--limit", "4"]
    cmd += ["--fewshot", "0,1", "--batch-sizes", "default", "--device", "cpu"]
    cmd += ["--out", str(out), "--local-tasks-only", "--work", str(tmp_path / "work")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "lm_eval_summary.json").read_text())
    runs = summary["runs"]
    assert [(r["model"], r["num_fewshot"]) for r in runs] == [
        ("hf", 0),
        ("nakta", 0),
        ("hf", 1),
        ("nakta", 1),
    ]
    for r in runs:
        assert set(r) >= RUN_KEYS and r["error"] is None and r["n"] == 4
        assert r["batch_size"] == "default" and r["tasks"] == "hellaswag_local"
        assert 0 < r["load_s"] < r["wall_s"] and 0 < r["scoring_s"] < r["wall_s"]
        assert 0 < r["requests_s"] < r["scoring_s"] and 0 < r["first_request_s"] < r["wall_s"]
        assert r["load_wait_s"] is None  # nakta loads in its constructor (no background wait)
        assert (out / r["log"]).is_file()
    for shot in (0, 1):
        hf, nakta = (r for r in runs if r["num_fewshot"] == shot)
        assert (nakta["acc"], nakta["acc_norm"]) == (hf["acc"], hf["acc_norm"])  # same weights
    assert summary["device"] == "cpu" and summary["dtype"] == "fp32"
    assert summary["preset"] == "tiny" and summary["vocab_size"] == 512  # the tokenizer's
    assert (summary["limit"], summary["fewshot_limit"]) == (4, 4)
    assert summary["lm_eval"] == "0.4.13" and summary["convert_s"] > 0
    assert [r["num_fewshot"] for r in summary["ratios"]] == [0, 1]
    md = (out / "lm_eval_summary.md").read_text()
    assert "| nakta | 1 | default |" in md and "0-shot: nakta/hf at default:" in md
    assert (out / "lm_eval_summary.png").stat().st_size > 0
    assert (tmp_path / "work" / "nakta").is_dir() and (out / "logs" / "convert.log").is_file()


def test_plan_orders_shots_then_batch_sizes_then_models():
    a = bench.parse_args(
        ["--preset", "tiny", "--tokenizer", "t", "--fewshot", "0,10"]
        + ["--batch-sizes", "default,64,auto:2", "--limit", "30", "--fewshot-limit", "5"]
    )
    specs = bench.plan(a)
    assert [(s.num_fewshot, s.batch_size, s.model) for s in specs[:3]] == [
        (0, "default", "hf"),
        (0, "default", "nakta"),
        (0, "64", "hf"),
    ]
    assert {s.limit for s in specs if s.num_fewshot == 0} == {30}
    assert {s.limit for s in specs if s.num_fewshot == 10} == {5}
    a.hf_batch_sizes = "64"  # hf at one batch size, nakta at all three
    runs = [(s.num_fewshot, s.batch_size, s.model) for s in bench.plan(a)]
    assert [r for r in runs if r[2] == "hf"] == [(0, "64", "hf"), (10, "64", "hf")]
    assert len([r for r in runs if r[2] == "nakta"]) == 6
    w = bench.Weights(Path("H"), Path("T"), Path("N"), Path("S"))
    default = bench.child_command(specs[1], w, "bf16", "cuda", Path("o"))
    assert "--batch_size" not in default and default[:3] == [
        sys.executable,
        "-m",
        "accuracy_test.lm_eval_cli",
    ]
    assert "checkpoint=N,tokenizer=S,dtype=bf16" in default
    hf64 = bench.child_command(specs[2], w, "bf16", "cuda", Path("o"))
    assert hf64[-2:] == ["--batch_size", "64"] and "pretrained=H,tokenizer=T,dtype=bfloat16" in hf64


def test_warmup_runs_each_shot_counts_first_nakta_run_once_more_first():
    a = bench.parse_args(
        ["--preset", "tiny", "--tokenizer", "t", "--fewshot", "0,10", "--warmup"]
        + ["--batch-sizes", "default,64", "--hf-batch-sizes", "64"]
    )
    specs = bench.plan(a)
    warm = [s for s in specs if s.warmup]
    assert [(s.num_fewshot, s.batch_size, s.model) for s in warm] == [
        (0, "default", "nakta"),
        (10, "default", "nakta"),
    ]
    assert specs[0].warmup and specs[0].slug.endswith("_warmup")
    assert specs[0].slug.removesuffix("_warmup") == specs[1].slug  # its timed twin, next
    assert (
        len(specs)
        == len(
            bench.plan(
                bench.parse_args(
                    [
                        "--preset",
                        "tiny",
                        "--tokenizer",
                        "t",
                        "--fewshot",
                        "0,10",
                        "--batch-sizes",
                        "default,64",
                        "--hf-batch-sizes",
                        "64",
                    ]
                )
            )
        )
        + 2
    )


def test_markdown_reports_warmups_apart_from_the_ratios():
    from speed_bench.lm_eval_report import markdown, ratios

    def run(model, bs, wall, warmup=False):
        r = dict(model=model, num_fewshot=0, batch_size=bs, task="hellaswag_local", wall_s=wall,
                 load_s=1.0, scoring_s=wall / 2, n=10, error=None)  # fmt: skip
        return {**r, "warmup": True} if warmup else r

    runs = [run("nakta", "default", 10.0), run("hf", "64", 30.0)]
    summary = dict(runs=runs, ratios=ratios(runs), warmups=[run("nakta", "default", 15.0, True)])
    summary |= dict(weights="w", dtype="bf16", device="d", data="x", limit=10, fewshot_limit=10)
    summary |= dict(lm_eval="0", transformers="0", torch="0", make_hf_s=None)
    text = markdown(summary)
    assert "First nakta run on this machine" in text
    assert "batch default: wall 15 s, load 1 s, scoring 7.5 s (timed twin: 10 s)" in text
    assert summary["ratios"][0]["best_nakta_over_best_hf"] == pytest.approx(1 / 3)


def test_ratios():
    def run(model, bs, wall, shot=0):
        return {
            "model": model,
            "num_fewshot": shot,
            "batch_size": bs,
            "wall_s": wall,
            "error": None,
        }

    runs = [run("hf", "default", 60.0), run("nakta", "default", 12.0), run("hf", "64", 20.0)]
    runs += [run("nakta", "64", 10.0), run("nakta", "auto", 11.0), run("hf", "default", 9.0, 10)]
    (zero, ten) = lm_eval_report.ratios(runs)
    assert zero["nakta_over_hf"] == {"default": 0.2, "64": 0.5}
    assert zero["best_nakta_over_best_hf"] == 0.5
    assert zero["nakta_best_batch_size"] == "64" and zero["nakta_default_over_best"] == 1.2
    assert ten == {"task": "hellaswag_local", "num_fewshot": 10, "nakta_over_hf": {}}
    other = [{**r, "task": "gsm8k_shaped_local", "wall_s": 1.0} for r in runs[:2]]
    rows = lm_eval_report.ratios(runs + other)
    assert [(r["task"], r["num_fewshot"]) for r in rows] == [
        ("hellaswag_local", 0),
        ("hellaswag_local", 10),
        ("gsm8k_shaped_local", 0),
    ]
    assert rows[2]["nakta_over_hf"] == {"default": 1.0}  # its own runs only


def test_tasks_with_their_own_shots_and_limits():
    argv = ["--preset", "tiny", "--tokenizer", "t", "--batch-sizes", "default", "--limit", "30"]
    argv += ["--task", "hellaswag_local,gsm8k_shaped_local:8:128,bbh_shaped_local:3"]
    specs = bench.plan(bench.parse_args(argv + ["--fewshot", "0,10", "--fewshot-limit", "5"]))
    got = [(s.task, s.num_fewshot, s.limit, s.model) for s in specs]
    assert got == [
        ("hellaswag_local", 0, 30, "hf"),
        ("hellaswag_local", 0, 30, "nakta"),
        ("hellaswag_local", 10, 5, "hf"),
        ("hellaswag_local", 10, 5, "nakta"),
        ("gsm8k_shaped_local", 8, 128, "hf"),
        ("gsm8k_shaped_local", 8, 128, "nakta"),
        ("bbh_shaped_local", 3, 5, "hf"),
        ("bbh_shaped_local", 3, 5, "nakta"),
    ]
    assert len({s.slug for s in specs}) == len(specs)  # every run keeps its own folder and log
    w = bench.Weights(Path("H"), Path("T"), Path("N"), Path("S"))
    cmd = bench.child_command(specs[4], w, "bf16", "cuda", Path("o"))
    assert cmd[cmd.index("--tasks") + 1] == "gsm8k_shaped_local"
    assert cmd[cmd.index("--num_fewshot") + 1] == "8" and cmd[cmd.index("--limit") + 1] == "128"
    for bad in ("a:1:2:3", "a:x", "a:1:0", ":3", ","):
        with pytest.raises(bench.UsageError, match="--task"):
            bench.parse_tasks(bad, "0", None, None)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--batch-sizes", "default,0"], "--batch-sizes: '0' is not default"),
        (["--fewshot", "0,x"], "--fewshot must be comma-separated ints"),
        (["--models", "hf,vllm"], "--models must be a subset of hf,nakta"),
        (["--limit", "0"], "--limit must be >= 1"),
        (["--data", "/nope.jsonl"], "--data /nope.jsonl is not a file"),
        (["--preset", "huge"], "unknown preset 'huge'"),
        (["--reuse-work"], "--reuse-work needs --work with hf, hf_tokenizer, nakta"),
    ],
)
def test_bad_input_is_one_error_line(shared_data, tmp_path, capsys, extra, message):
    argv = ["--tokenizer", str(shared_data / "stories260K" / "tokenizer.model"), "--device", "cpu"]
    argv += ["--data", str(shared_data / "hellaswag_val_full.jsonl"), "--out", str(tmp_path)]
    argv += ["--work", str(tmp_path / "w")]
    if "--preset" not in extra:
        argv += ["--preset", "tiny"]
    assert bench.main(argv + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_hf_dir_with_another_vocabulary_is_refused(shared_data, tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"vocab_size": 32000}))
    argv = ["--hf", str(hf), "--tokenizer", str(shared_data / "stories260K" / "tokenizer.model")]
    argv += ["--data", str(shared_data / "hellaswag_val_full.jsonl"), "--device", "cpu"]
    assert bench.main(argv + ["--out", str(tmp_path / "o"), "--work", str(tmp_path / "w")]) == 2
    assert "has vocab_size 32000 but --tokenizer" in capsys.readouterr().err


def test_runs_as_a_module_and_as_a_script():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for cmd in (["-m", "speed_bench.lm_eval_speed"], ["speed_bench/lm_eval_speed.py"]):
        done = subprocess.run(
            [sys.executable, *cmd, "--help"], cwd=REPO, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0 and "--batch-sizes" in done.stdout, done.stderr


def test_hf_and_nakta_on_the_same_weights_and_the_rolling_bos_convention(shared_data, tmp_path):
    """What the adapter docstring states: ``loglikelihood`` equals hf's default; the rolling
    sum equals hf with ``add_bos_token=False`` (hf's default also scores BOS after BOS)."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    import convert
    from accuracy_test.lm_eval_adapter import NaktaLM

    sp = shared_data / "stories260K" / "tokenizer.model"
    args = lm_eval_weights.preset_args("tiny", 512, 256)
    lm_eval_weights.make_random_hf(tmp_path / "hf", args, "fp32", "cpu", seed=3)
    lm_eval_weights.write_hf_tokenizer(tmp_path / "hf", sp, 256)
    assert convert.main([str(tmp_path / "hf"), str(tmp_path / "nakta"), "--quiet"]) in (None, 0)
    nakta = NaktaLM(checkpoint=str(tmp_path / "nakta"), tokenizer=str(sp), device="cpu")
    hf_kw = dict(pretrained=str(tmp_path / "hf"), device="cpu", dtype="float32", batch_size=4)
    hf, hf_no_bos = HFLM(**hf_kw), HFLM(**hf_kw, add_bos_token=False)
    pairs = [("Once upon a time", " there was a cat."), ("She said", " hello to the dog.")]
    ll = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]
    got = [x[0] for x in nakta.loglikelihood(ll, disable_tqdm=True)]
    assert got == pytest.approx([x[0] for x in hf.loglikelihood(ll, disable_tqdm=True)], abs=1e-4)
    text = [Instance("loglikelihood_rolling", {}, ("The little dog ran to the park.",), 0)]
    rolling = nakta.loglikelihood_rolling(text, disable_tqdm=True)
    assert rolling == pytest.approx(hf_no_bos.loglikelihood_rolling(text, True), abs=1e-4)
    with_bos = hf.loglikelihood_rolling(text, True)
    assert abs(with_bos[0] - rolling[0]) > 1e-3  # + log P(BOS | BOS), text given BOS BOS


@pytest.mark.gpu
def test_gpu_every_batch_size_runs_for_both_models(shared_data, tmp_path):
    """On the GPU machine: bf16, default / 64 / auto (hf's auto probes the GPU's memory)."""
    out = tmp_path / "res"
    cmd = [sys.executable, "speed_bench/lm_eval_speed.py", "--preset", "stories260K"]
    cmd += ["--tokenizer", str(shared_data / "stories260K" / "tokenizer.model")]
    cmd += ["--data", str(shared_data / "hellaswag_val_full.jsonl"), "--limit", "40"]
    cmd += ["--fewshot", "0", "--batch-sizes", "default,64,auto", "--device", "cuda"]
    cmd += ["--out", str(out), "--local-tasks-only"]
    # the repo first, then whatever the machine put there (the GPU image's carried wheels)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "lm_eval_summary.json").read_text())
    assert summary["dtype"] == "bf16" and summary["device"] != "cpu"
    assert len(summary["runs"]) == 6 and all(r["error"] is None for r in summary["runs"])
    assert "nakta_default_over_best" in summary["ratios"][0]


def test_read_results_of_a_group_and_a_generation_task(tmp_path):
    """A group's sample count is its tasks' sum; metrics a task lacks are None."""
    group = {
        "results": {
            "mmlu_shaped_local": {"acc,none": 0.25},
            "mmlu_shaped_anatomy": {"acc,none": 0.2},
        },
        "n-samples": {
            "mmlu_shaped_anatomy": {"effective": 3},
            "mmlu_shaped_virology": {"effective": 4},
        },
    }
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "results_1.json").write_text(json.dumps(group))
    got = bench.read_results(tmp_path / "a", "mmlu_shaped_local")
    assert got == {"acc": 0.25, "acc_norm": None, "exact_match": None, "n": 7}
    gen = {"results": {"gsm8k_shaped_local": {"exact_match,none": 0.0}},
           "n-samples": {"gsm8k_shaped_local": {"effective": 5}}}  # fmt: skip
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "results_2.json").write_text(json.dumps(gen))
    got = bench.read_results(tmp_path / "b", "gsm8k_shaped_local")
    assert got["exact_match"] == 0.0 and got["acc"] is None and got["n"] == 5
    a = bench.parse_args(["--preset", "tiny", "--tokenizer", "t", "--task", "mmlu_shaped_local"])
    spec = bench.plan(a)[0]
    w = bench.Weights(Path("H"), Path("T"), Path("N"), Path("S"))
    cmd = bench.child_command(spec, w, "bf16", "cuda", Path("o"), a.task)
    assert cmd[cmd.index("--tasks") + 1] == "mmlu_shaped_local"


def test_hf_runs_on_lm_eval_as_shipped_next_to_the_fixed_entry():
    """--hf-harness both: each hf run twice, through the entry's harness fixes and with them
    off (what a user of lm_eval meets); nakta once; ratios against each, apart."""
    a = bench.parse_args(
        ["--preset", "tiny", "--tokenizer", "t", "--fewshot", "0", "--batch-sizes", "default"]
        + ["--hf-harness", "both"]
    )
    specs = bench.plan(a)
    assert [(s.model, s.harness) for s in specs] == [
        ("hf", "fixed"),
        ("hf", "plain"),
        ("nakta", "fixed"),
    ]
    assert specs[1].slug.endswith("_plain") and not specs[0].slug.endswith("_plain")
    from speed_bench.lm_eval_report import markdown, ratios

    def run(model, wall, harness="fixed"):
        return dict(model=model, num_fewshot=0, batch_size="default", task="hellaswag_local",
                    wall_s=wall, load_s=1.0, scoring_s=wall / 2, n=10, error=None,
                    harness=harness)  # fmt: skip

    runs = [run("hf", 30.0), run("hf", 40.0, "plain"), run("nakta", 10.0)]
    (row,) = ratios(runs)
    assert row["best_nakta_over_best_hf"] == pytest.approx(1 / 3)
    assert row["best_nakta_over_best_hf_plain"] == pytest.approx(1 / 4)
    summary = dict(runs=runs, ratios=[row], weights="w", dtype="bf16", device="d", data="x")
    summary |= dict(limit=10, fewshot_limit=10, lm_eval="0", transformers="0", torch="0")
    text = markdown(summary | dict(make_hf_s=None))
    assert "| hf (plain lm-eval) | 0 | default |" in text
    assert "best nakta / best hf on lm-eval as shipped: 0.25" in text
    from accuracy_test import lm_eval_cli

    # the harness fixes (PRELOAD_ENV is nakta's own early load, not a fix of lm-eval)
    not_fixes = ("TIMING_ENV", "PRELOAD_ENV")
    fixes = [v for k, v in vars(lm_eval_cli).items() if k.endswith("_ENV") and k not in not_fixes]
    assert dict.fromkeys(fixes, "0") == bench.PLAIN_ENV and len(fixes) == 4  # every fix off


def test_phases_reads_the_childs_timing_file():
    timing = {
        "requests_s": 9.0,
        "entry_unix": 100.0,
        "events": {"first_request": 10.5},
        "loglikelihood": {"tokenize_s": 0.4, "score_s": 8.5},
        "nakta_load": {"read_s": 0.7},
    }
    got = bench.phases(timing, spawn_unix=99.5)
    assert got == {"requests_s": 9.0, "tokenize_s": 0.4, "first_request_s": 11.0,
                   "load_wait_s": None}  # fmt: skip
    assert bench.phases({}, 0.0) == dict.fromkeys(got)  # hf: none of them written


# ------------------------------------------------------------------------------------------------
# speed_bench/lm_eval_gsm8k.py: lm-eval generate_until on the full GSM8K-shaped task, nakta vs hf
# through the entry in fresh processes (end to end at tiny size on the CPU), its plan, command
# lines, deadline, extrapolation and summary schema.
# ------------------------------------------------------------------------------------------------


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
    a = gsm8k_bench.parse_args(["--preset", "7B", "--tokenizer", "t.model", *extra])
    a.device, a.dtype = "cuda", "bf16"
    return a


def test_plan_nakta_first_then_hf_per_batch_size_then_nakta_on_hfs_docs():
    a = _args("--hf-batch-sizes", "64,auto", "--hf-limit", "256", "--nakta-on-hf-docs")
    assert [(r.model, r.batch_size, r.limit) for r in gsm8k_bench.plan(a)] == [
        ("nakta", "default", None),
        ("hf", "64", 256),
        ("hf", "auto", 256),
        ("nakta", "default", 256),
    ]
    assert [r.timeout_s for r in gsm8k_bench.plan(a)] == [300.0, 600.0, 600.0, 120.0]
    # --limit bounds every run; hf's subset never asks for more docs than that
    a = _args("--limit", "100", "--hf-limit", "256", "--nakta-on-hf-docs")
    assert [(r.model, r.limit) for r in gsm8k_bench.plan(a)] == [("nakta", 100), ("hf", 100)]
    assert [r.model for r in gsm8k_bench.plan(_args("--models", "hf"))] == ["hf"]


def test_child_commands_nakta_at_its_default_hf_at_its_batch_size(tmp_path):
    a = _args("--max-gen-toks", "64")
    w = Weights(tmp_path / "hf", tmp_path / "hf_tok", tmp_path / "nakta", tmp_path / "t.model")
    nakta, hf = (
        gsm8k_bench.Run("nakta", "default", None, 1.0),
        gsm8k_bench.Run("hf", "auto", 256, 1.0),
    )
    n_cmd = gsm8k_bench.child_command(
        nakta, gsm8k_bench.model_args("nakta", w, None, a), a, tmp_path
    )
    h_cmd = gsm8k_bench.child_command(hf, gsm8k_bench.model_args("hf", w, None, a), a, tmp_path)
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
    assert gsm8k_bench.model_args("hf", None, tmp_path, a) is None  # a Nakta checkpoint only


def test_a_run_that_cannot_end_before_the_deadline_is_skipped(tmp_path):
    a = _args("--deadline-s", "150")
    runner = gsm8k_bench.Runner(a, tmp_path, tmp_path, started=time.perf_counter() - 100)
    rec = runner.run(gsm8k_bench.Run("hf", "64", 256, 60.0), "pretrained=x")
    assert rec["error"].startswith("skipped: a 60 s run would end past --deadline-s")
    assert rec["wall_s"] is None and rec["log"] is None and list(rec) == list(report.RUN_KEYS)
    assert (rec["docs"], rec["full_docs"], rec["max_gen_toks"]) == (256, 1319, 256)
    assert runner.fits(40.0) and not runner.fits(60.0)
    runner.a.limit = 5000  # more than the task has: all of it
    assert runner.record(gsm8k_bench.Run("nakta", "default", 5000, 1.0))["full_docs"] == 1319
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
def test_gsm8k_bad_input_is_one_error_line(argv, message, capsys, tmp_path):
    assert gsm8k_bench.main([*argv, "--out", str(tmp_path)]) == 2
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

    assert gsm8k_bench.TASK_DOCS["gsm8k_shaped_full_local"] == GSM8K_TEST_SIZE
    yaml = (REPO / "accuracy_test/tasks/gsm8k_shaped_local/gsm8k_shaped_local.yaml").read_text()
    assert f"max_gen_toks: {gsm8k_bench.TASK_MAX_GEN}\n" in yaml
    assert (
        "def load(n_test: int = 250"
        in (REPO / "accuracy_test/tasks/gsm8k_shaped_local/utils.py").read_text()
    )


def test_usage_error_is_the_shared_one():
    assert gsm8k_bench.UsageError is UsageError


# ------------------------------------------------------------------------------------------------
# ``speed_bench/lm_eval_one_pool.py``'s pure parts: lm-eval samples read back, the one call's
# answers compared with the runs alone, metrics compared without the sample count, its command
# line. (On a GPU, ``scripts/reproduce_lm_eval.sh one_pool`` runs the whole driver.)
# ------------------------------------------------------------------------------------------------


def _samples(folder, task, docs):
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"doc_id": i, "resps": r}) for i, r in docs.items()]
    (folder / f"samples_{task}_2026-01-01T00-00-00.123456.jsonl").write_text("\n".join(lines))


def test_samples_are_read_per_task_and_compared_per_requested_task(tmp_path):
    one, alone = tmp_path / "one" / "model", tmp_path / "alone" / "model"
    ll = {0: [[[-1.0, True]], [[-2.0, False]]], 1: [[[-3.0, False]], [[-0.5, True]]]}
    _samples(one, "mmlu_shaped_anatomy", ll)
    _samples(alone, "mmlu_shaped_anatomy",
             {0: [[[-1.25, True]], [[-2.0, False]]], 1: [[[-3.0, True]], [[-0.5, True]]]})  # fmt: skip
    _samples(one, "gsm8k_shaped_local", {0: [["a b"]], 1: [["c"]]})
    _samples(alone, "gsm8k_shaped_local", {0: [["a b"]], 1: [["d"]], 2: [["e"]]})
    got, want = op.read_samples(tmp_path / "one"), op.read_samples(tmp_path / "alone")
    assert set(got) == {"mmlu_shaped_anatomy", "gsm8k_shaped_local"}
    assert got["gsm8k_shaped_local"] == {0: [["a b"]], 1: [["c"]]}
    res = op.compare(
        {"samples": got}, {"samples": want}, ["gsm8k_shaped_local", "mmlu_shaped_local"]
    )
    assert res["mmlu_shaped_local"] == {
        "docs": 2, "max_abs_dll": 0.25, "greedy_flips": 1, "answers_differ": 0
    }  # fmt: skip
    assert res["gsm8k_shaped_local"] == {
        "docs": 2, "max_abs_dll": 0.0, "greedy_flips": 0, "answers_differ": 1
    }  # fmt: skip


def test_metrics_are_compared_without_the_sample_count():
    one = {"mmlu_shaped_local": {"acc": 0.25, "n": 177}}
    assert op._values(one) == op._values({"mmlu_shaped_local": {"acc": 0.25, "n": 171}})
    assert op._values(one) != op._values({"mmlu_shaped_local": {"acc": 0.3, "n": 177}})


@pytest.mark.parametrize(
    "extra, message", [(["--tasks", ","], "--tasks"), (["--limit", "0"], "--limit")]
)
def test_bad_command_lines_are_refused(extra, message, capsys):
    base = ["--preset", "tiny", "--tokenizer", "t", "--data", "d", "--work", "w", "--out", "o"]
    with pytest.raises(SystemExit):
        op.parse_args(base + extra)
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# speed_bench.lm_eval_quant: the bf16-vs-FP8 lm-eval comparison's arguments, ratio and table.
# ------------------------------------------------------------------------------------------------


def _row(quant, wall, error=None):
    return {"quant": quant, "repeat": 0, "task": "hellaswag_local", "num_fewshot": 0,
            "limit": None, "error": error, "wall_s": wall, "first_request_s": 5.0,
            "scoring_s": wall - 6.0, "after_scoring_s": 1.0, "acc": 0.25, "acc_norm": 0.26}  # fmt: skip


def test_ratio_and_markdown():
    rows = [_row("bf16", 60.0), _row("fp8", 50.0), _row("fp8", 40.0), _row("bf16", 1.0, "x")]
    r = lq._ratio(rows)
    assert r["median_wall_s"] == {"bf16": 60.0, "fp8": 45.0}
    assert r["bf16_over_fp8_wall"] == pytest.approx(60 / 45)
    md = lq.markdown({"checkpoint": "ck", "runs": rows, **r})
    assert "| fp8 | 0 | all | 50.00 |" in md and "1.333x" in md


def test_model_args_and_bad_arguments(tmp_path):
    assert lq.model_args(tmp_path, "fp8").endswith(",dtype=bf16,quant=fp8")
    assert "quant" not in lq.model_args(tmp_path, "bf16")
    with pytest.raises(SystemExit):
        lq.parse_args(["--checkpoint", "x", "--data", "y", "--out", "z", "--repeats", "0"])


def test_a_failed_write_keeps_the_previous_summary(tmp_path, monkeypatch):
    """The summary files are replaced atomically: a write that fails half-way (disk full)
    leaves the previous run's file whole, never a truncated one."""
    from pathlib import Path

    class SkippingRunner:
        def __init__(self, *a):
            pass

        def run(self, name, cmd):
            return {"name": name, "error": "skipped: not enough time left before --deadline-s"}

    monkeypatch.setattr(lq, "Runner", SkippingRunner)
    out = tmp_path / "out"
    out.mkdir()
    (out / "lm_eval_fp8.json").write_text('{"previous": true}\n')

    def half_then_fail(self, data, *a, **k):
        with open(self, "w") as f:
            f.write(data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_fail)
    monkeypatch.setattr("os.fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "full")))
    argv = ["--checkpoint", str(tmp_path), "--data", "d", "--out", str(out), "--warmup-limit", "0"]
    with pytest.raises(OSError):
        lq.main(argv)
    assert (out / "lm_eval_fp8.json").read_text() == '{"previous": true}\n'
