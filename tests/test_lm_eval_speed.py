"""speed_bench/lm_eval_speed.py: lm-eval's hf vs nakta through the project's entry, end to end
at tiny size on the CPU (same random weights: both must report the same acc), plus its rules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from speed_bench import (
    lm_eval_report,  # noqa: E402
    lm_eval_weights,  # noqa: E402
)
from speed_bench import lm_eval_speed as bench  # noqa: E402

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
