"""The lm-eval data-parallel measurement's report (``speed_bench/lm_eval_dp_report.py``) on
fabricated rank timing files, and the driver's command line (``speed_bench/lm_eval_dp.py``).

Here too: the per-rank breakdown (where each rank's time goes between the entry's timing events).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import REPO  # noqa: E402

from accuracy_test import lm_eval_cli  # noqa: E402
from speed_bench import lm_eval_dp
from speed_bench.lm_eval_dp_report import (  # noqa: E402
    BREAKDOWN_KEYS,
    RUN_KEYS,
    markdown,
    rank_breakdown,
    rank_phases,
    rank_rows,
    ratio_rows,
    run_phases,
    summary_record,
    write_outputs,
)
from speed_bench.lm_eval_weights import UsageError

SPAWN = 1_000.0


def _timing(rank: int, entry: float, first: float, last: float, exit_: float, items: int) -> dict:
    """A rank's timing file as lm_eval_cli writes it (events: seconds after entry_unix)."""
    return {
        "rank": rank,
        "world_size": 2,
        "entry_unix": entry,
        "load_s": 3.0,
        "requests_s": last - first,
        "events": {
            "model_start": 1.0,
            "model_end": 4.0,
            "first_request": first,
            "last_request_end": last,
            "exit": exit_,
        },
        "loglikelihood": {"tokenize_s": 0.5, "score_s": 9.0, "gather_s": 0.1, "items": items},
    }


def test_phases_take_the_slowest_rank_and_add_up_to_the_wall():
    ranks = [
        rank_phases(_timing(0, SPAWN + 2.0, 5.0, 25.0, 26.0, 400)),
        rank_phases(_timing(1, SPAWN + 2.5, 5.5, 24.0, 24.5, 380)),
    ]
    assert ranks[1]["first_request_unix"] == SPAWN + 8.0  # entry + event
    got = run_phases(ranks, SPAWN, SPAWN + 28.0)
    assert got == {
        "wall_s": 28.0,
        "first_request_s": 8.0,  # rank 1 is the later one to start scoring
        "scoring_s": 19.0,  # to rank 0's last answer (27.0 after spawn)
        "after_scoring_s": 1.0,
    }
    assert got["first_request_s"] + got["scoring_s"] + got["after_scoring_s"] == got["wall_s"]
    # a run whose ranks never reached a request: the wall only
    assert run_phases([], SPAWN, SPAWN + 3.0)["scoring_s"] is None
    bare = rank_phases({"entry_unix": SPAWN, "events": {}})
    assert run_phases([bare], SPAWN, SPAWN + 3.0)["first_request_s"] is None


def _runs() -> list[dict]:
    def run(gpus, shots, limit, wall, first, scoring, acc=0.25):
        row = dict(gpus=gpus, tp=1, dp=gpus, task="hellaswag_local", num_fewshot=shots)
        row.update(limit=limit, wall_s=wall, first_request_s=first, scoring_s=scoring)
        row.update(after_scoring_s=wall - first - scoring, acc=acc, preset="7B", hf_wall_s=None)
        return summary_record(row)

    return [
        run(1, 10, 2000, 60.0, 10.0, 45.0),
        run(2, 10, 2000, 35.0, 11.0, 23.0),  # 0.58x, fixed 12 vs 15: both targets met
        run(1, 0, None, 66.0, 9.0, 40.0),
        run(2, 0, None, 50.0, 14.0, 20.0),  # 0.76x, fixed 30 vs 26: both missed
    ]


def test_ratios_judge_the_issues_targets():
    rows = ratio_rows(_runs())
    assert [(r["num_fewshot"], round(r["wall_ratio"], 3), r["wall_ok"]) for r in rows] == [
        (10, 0.583, True),
        (0, 0.758, False),
    ]
    assert [(r["fixed_one_s"], r["fixed_dp_s"], r["fixed_ok"]) for r in rows] == [
        (15.0, 12.0, True),
        (26.0, 30.0, False),
    ]


def test_outputs_follow_the_schema_exactly(tmp_path):
    ranks = {
        "hellaswag_local_10shot_2000_2gpu": {
            "spawn_unix": SPAWN,
            "ranks": [rank_phases(_timing(r, SPAWN + 2.0, 9.0, 33.0, 34.0, 4000)) for r in (0, 1)],
        }
    }
    summary = {"device_name": "NVIDIA H100 80GB HBM3", "gpus_available": 2, "runs": _runs()}
    summary["ranks"] = rank_rows(ranks)
    suite = [
        {"model": "nakta", "mode": "one_call", "tasks": ["a", "b"], "limit": 100,
         "wall_s": 40.0, "acc": {"a": 0.3, "b": 0.1}, "error": None},
        {"model": "nakta", "mode": "one_by_one", "tasks": ["a", "b"], "limit": 100,
         "wall_s": 61.0, "acc": {"a": 0.3}, "error": "suite_b: exit code 1"},
    ]  # fmt: skip
    files = write_outputs(summary, tmp_path, ranks, suite)
    assert [f.name for f in files] == [
        "lm_eval_dp_summary.json",
        "lm_eval_dp_summary.md",
        "lm_eval_dp_ranks.json",
        "lm_eval_dp_summary.png",
    ]
    got = json.loads(files[0].read_text())
    assert set(got) == {"device_name", "gpus_available", "runs", "ranks"}
    assert all(list(r) == list(RUN_KEYS) for r in got["runs"]) and got["runs"] == summary["runs"]
    assert files[3].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = files[1].read_text()
    assert (
        "| 7B | hellaswag_local | 10 | 2000 | 2 | 1 | 2 | 35.0 | 11.0 | 23.0 | 1.0 | 0.2500 | - | - |"
        in text
    )
    assert "| 0.58 (yes) | <= 0.6 |" in text and "| 0.76 (NO) | <= 0.7 |" in text
    assert "| hellaswag_local_10shot_2000_2gpu | - | - | 1 | 6.0 | 11.0 | 35.0 | 36.0 |" in text
    assert "FAILED: suite_b: exit code 1" in text
    assert json.loads(files[2].read_text())["suite"][0]["wall_s"] == 40.0
    assert text == markdown(summary, ranks, suite)
    bad = {**summary, "runs": [{**summary["runs"][0], "extra": 1}]}
    with pytest.raises(ValueError, match="schema"):
        write_outputs(bad, tmp_path)


def test_driver_command_line():
    assert lm_eval_dp.parse_runs("10:2000,0:all") == [(10, 2000), (0, None)]
    for bad in ("x:1", "10:0", "-1:5", "10:many"):
        with pytest.raises(UsageError, match="--runs"):
            lm_eval_dp.parse_runs(bad)
    a = lm_eval_dp.parse_args(["--checkpoint", "c", "--data", "d", "--suite", ""])
    assert a.run_list == [(10, 2000), (0, None)] and a.suite_tasks == [] and a.gpus == 2
    a = lm_eval_dp.parse_args(["--preset", "7B", "--data", "d"])
    assert a.suite_tasks == lm_eval_dp.SUITE.split(",")
    cmd = lm_eval_dp._command(
        a, "checkpoint=c,dp=2", "nakta", "hellaswag_local", 10, 2000, 2, tmp := "out"
    )
    assert cmd[1:7] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
    ]
    assert cmd[7] == "accuracy_test.lm_eval_cli" and cmd[-4:] == [
        "--num_fewshot",
        "10",
        "--limit",
        "2000",
    ]
    assert tmp in cmd
    one = lm_eval_dp._command(a, "checkpoint=c", "nakta", "t", None, None, 1, "o")
    assert one[1:3] == ["-m", "accuracy_test.lm_eval_cli"] and "--limit" not in one


def test_suite_runs_hf_at_its_batch_size_and_nakta_at_its_default(tmp_path):
    """lm-eval runs hf at 1 row per forward without ``--batch_size``: the suite passes
    ``--hf-batch-size`` (default auto) to hf's runs only, and the table shows it."""
    seen: list[list] = []

    class FakeRunner:
        work = tmp_path

        def run(self, name, cmd):
            seen.append(cmd)
            return {"name": name, "error": None, "wall_s": 1.0}

    argv = ["--checkpoint", "c", "--data", "d", "--suite", "a,b", "--suite-hf"]
    a = lm_eval_dp.parse_args(argv)
    a.device, a.dtype = "cpu", "fp32"
    assert a.hf_batch_size == "auto"
    suite = lm_eval_dp.measure_suite(a, FakeRunner(), tmp_path / "ckpt", tmp_path / "hf")
    hf_cmds = [c for c in seen if c[c.index("--model") + 1] == "hf"]
    nakta_cmds = [c for c in seen if c[c.index("--model") + 1] == "nakta"]
    assert len(hf_cmds) == len(nakta_cmds) == 3  # one call + one per task
    assert all(c[c.index("--batch_size") + 1] == "auto" for c in hf_cmds)
    assert not any("--batch_size" in c for c in nakta_cmds)
    assert [s["batch_size"] for s in suite] == ["default", "default", "auto", "auto"]
    text = markdown({"device_name": "cpu", "gpus_available": 0, "runs": []}, {}, suite)
    assert "| hf | auto | one_call | 2 |" in text and "| nakta | default | one_by_one | 2 |" in text
    seen.clear()
    a = lm_eval_dp.parse_args(argv + ["--hf-batch-size", "32"])
    a.device, a.dtype = "cpu", "fp32"
    lm_eval_dp.measure_suite(a, FakeRunner(), tmp_path / "ckpt", tmp_path / "hf")
    assert {c[c.index("--batch_size") + 1] for c in seen if "--batch_size" in c} == {"32"}
    for bad in ("0", "big", "auto:x"):
        with pytest.raises(SystemExit):
            lm_eval_dp.parse_args(argv + ["--hf-batch-size", bad])


# ------------------------------------------------------------------------------------------------
# Where a rank's fixed time goes (issue 43): the entry's timing events between the command and the
# first request / after the last answer, the per-rank breakdown the data-parallel report prints
# from them, the driver's tp x dp grids with hf beside one of them, and the environment report
# collected only in the process that writes the results.
# ------------------------------------------------------------------------------------------------


pytest.importorskip("lm_eval")


TASKS = REPO / "accuracy_test" / "tasks"

# the entry's events in the order a nakta run passes them (seconds after the entry's import)
ORDER = (
    "lm_eval_imported",
    "args_parsed",
    "task_index_start",
    "task_index_end",
    "get_model_start",
    "get_model_end",
    "model_start",
    "model_end",
    "tasks_load_start",
    "tasks_load_end",
    "evaluate_start",
    "first_request",
    "last_request_end",
    "evaluate_end",
    "exit",
)


def test_breakdown_spans_between_the_events():
    events = {name: float(i) for i, name in enumerate(ORDER, start=1)}
    events["process_start"] = -0.25
    events["load_warm_up_start"], events["load_warm_up_end"] = 11.5, 12.5
    timing = {
        "events": events,
        "nakta_load": {"init_parallel_s": 0.5, "read_s": 0.75, "warm_up_wait_s": 0.25},
        "loglikelihood": {"tokenize_s": 0.1, "score_s": 9.0, "gather_s": 0.2},
    }
    got = rank_breakdown(timing)
    assert list(got) == list(BREAKDOWN_KEYS)
    assert got["python_s"] == 0.25 and got["lm_eval_import_s"] == 2.0  # entry -> args parsed
    assert got["config_s"] == 1.0 and got["task_index_s"] == 1.0
    assert got["lm_eval_setup_s"] == 1.0  # index end -> the model's module
    assert got["model_import_s"] == got["model_build_s"] == got["tasks_load_s"] == 1.0
    assert got["requests_build_s"] == 1.0 and got["warm_up_s"] == 1.0
    assert got["after_last_answer_s"] == 2.0  # last answer -> evaluate end -> exit
    assert (got["init_parallel_s"], got["read_s"]) == (0.5, 0.75)
    assert got["warm_up_wait_s"] == 0.25
    assert (got["tokenize_s"], got["score_s"], got["gather_s"]) == (0.1, 9.0, 0.2)
    # an older entry's file (no new events): those spans are None, the rest still there
    old = rank_breakdown({"events": {"model_start": 1.0, "model_end": 3.5}})
    assert old["model_build_s"] == 2.5 and old["config_s"] is None and old["read_s"] is None


def test_summary_rank_rows_carry_the_runs_identity():
    timing = {"rank": 1, "entry_unix": 100.0, "events": {"model_start": 1.0, "model_end": 2.0}}
    ranks = {
        "run_a": {"preset": "7B", "tp": 1, "dp": 4, "num_fewshot": 0, "limit": None,
                  "launcher": "nakta", "ranks": [rank_phases(timing)]},
        "hf_run": {"preset": "7B", "tp": 4, "dp": 1, "ranks": []},
    }  # fmt: skip
    rows = rank_rows(ranks)
    assert len(rows) == 1
    row = rows[0]
    assert (row["run"], row["preset"], row["tp"], row["dp"], row["rank"]) == (
        "run_a",
        "7B",
        1,
        4,
        1,
    )
    assert row["model_build_s"] == 1.0 and set(BREAKDOWN_KEYS) <= set(row)
    text = markdown({"device_name": "x", "gpus_available": 4, "runs": [], "ranks": rows})
    assert "Where each rank's time goes" in text and "| run_a | 1 |" in text


def test_four_gpu_targets():
    def run(dp, shots, wall, scoring):
        row = dict(preset="7B", gpus=dp, tp=1, dp=dp, task="hellaswag_local", num_fewshot=shots)
        row.update(limit=None, wall_s=wall, first_request_s=1.0, scoring_s=scoring, acc=0.25)
        return summary_record(row)

    rows = ratio_rows([run(1, 0, 54.0, 44.0), run(4, 0, 18.0, 11.0), run(4, 10, 30.0, 20.0)])
    assert [(r["dp"], r["target"], r["wall_ok"]) for r in rows] == [(4, 0.35, True)]
    assert set(summary_record({})) == set(RUN_KEYS) and {"preset", "hf_wall_s"} <= set(RUN_KEYS)


def test_grids_on_the_command_line():
    assert lm_eval_dp.parse_grids("1x1, 2x2,4x1") == [(1, 1), (2, 2), (4, 1)]
    assert lm_eval_dp.parse_grids("") == []
    for bad in ("2", "2x", "ax2", "0x4"):
        with pytest.raises(UsageError, match="--grids"):
            lm_eval_dp.parse_grids(bad)
    a = lm_eval_dp.parse_args(["--checkpoint", "c", "--data", "d", "--gpus", "4"])
    assert a.grid_list == [(1, 1), (1, 4)] and a.hf_grid_list == []
    a = lm_eval_dp.parse_args(["--checkpoint", "c", "--data", "d", "--grids", "1x1"])
    assert a.grid_list == [(1, 1)]  # one GPU alone: allowed when the grids are given
    with pytest.raises(SystemExit):
        lm_eval_dp.parse_args(["--checkpoint", "c", "--data", "d", "--gpus", "1"])
    with pytest.raises(SystemExit):  # hf beside a grid that is not run
        lm_eval_dp.parse_args(["--checkpoint", "c", "--data", "d", "--hf-grids", "4x1"])


def test_grids_run_their_checkpoints_and_hf_beside_one(tmp_path):
    """Each grid's nakta run takes the checkpoint converted for its tp, with tp / dp in its
    model args; the hf run beside 4x1 splits over 4 GPUs (parallelize, CUDA_VISIBLE_DEVICES)
    and its wall is that row's hf_wall_s."""
    ckpt = tmp_path / "nakta"
    (tmp_path / "nakta_tp4").mkdir(parents=True)
    seen: list[tuple[str, list, dict | None, float | None]] = []

    class FakeRunner:
        work = tmp_path

        def run(self, name, cmd, extra_env=None, timeout_s=None):
            seen.append((name, cmd, extra_env, timeout_s))
            if cmd[cmd.index("--model") + 1] == "hf":  # hf ends well, without a results file
                out = str(tmp_path / "none")
                return {"name": name, "error": None, "wall_s": 100.0, "lm_eval_out": out}
            return {"name": name, "error": "exit code 1", "wall_s": 30.0, "ranks": []}

    argv = ["--preset", "30B", "--data", "d", "--runs", "0:2000", "--grids", "1x1,4x1,2x2"]
    a = lm_eval_dp.parse_args(argv + ["--hf-grids", "4x1", "--launchers", "nakta"])
    a.device, a.dtype = "cuda", "bf16"
    runs, ranks = lm_eval_dp.measure_dp(a, FakeRunner(), ckpt, tmp_path / "hf")
    margs = {name: cmd[cmd.index("--model_args") + 1] for name, cmd, _, _ in seen}
    names = list(margs)
    assert names == [
        "hellaswag_local_0shot_2000_1gpu",
        "hellaswag_local_0shot_2000_4gpu_tp4",
        "hf_0shot_2000_tp4",
        "hellaswag_local_0shot_2000_4gpu_tp2",
    ]
    assert margs[names[0]] == f"checkpoint={ckpt},dtype=bf16"
    assert margs[names[1]] == f"checkpoint={tmp_path / 'nakta_tp4'},dtype=bf16,tp=4"
    assert margs[names[3]] == f"checkpoint={ckpt},dtype=bf16,tp=2,dp=2"  # no tp2 copy here
    assert (
        "parallelize=True" in margs[names[2]] and f"pretrained={tmp_path / 'hf'}" in margs[names[2]]
    )
    assert seen[2][2] == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"} and seen[2][3] == a.hf_timeout_s
    assert seen[2][1][seen[2][1].index("--batch_size") + 1] == "auto"
    assert [(r["tp"], r["dp"], r["gpus"], r["preset"]) for r in runs] == [
        (1, 1, 1, "30B"),
        (4, 1, 4, "30B"),
        (2, 2, 4, "30B"),
    ]
    assert [r["hf_wall_s"] for r in runs] == [None, 100.0, None]  # beside 4x1 only
    assert ranks["hf_0shot_2000_tp4"]["model"] == "hf"
    assert all(list(r) == list(RUN_KEYS) for r in runs)


# ------------------------------------------------------------------ real runs of the entry
@pytest.fixture
def local_run(monkeypatch, shared_data):
    import lm_eval.tasks

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lm_eval.tasks.TaskManager)  # restored
    monkeypatch.setenv(lm_eval_cli.LOCAL_TASKS_ENV, "1")
    monkeypatch.setattr("sys.argv", ["nakta-lm-eval"])
    monkeypatch.setenv("NAKTA_HELLASWAG_JSONL", str(shared_data / "hellaswag_val_full.jsonl"))
    monkeypatch.setattr(lm_eval_cli, "EARLY_EVENTS", {})


def _argv(shared_data: Path, out: Path) -> list[str]:
    ckpt = shared_data / "stories260K"
    return [
        "--model", "nakta", "--model_args", f"checkpoint={ckpt},dtype=fp32",
        "--include_path", str(TASKS), "--tasks", "hellaswag_local", "--limit", "4",
        "--device", "cpu", "--output_path", str(out),
    ]  # fmt: skip


def test_a_run_records_every_phase_in_order(local_run, shared_data, tmp_path, monkeypatch):
    timing = tmp_path / "t.json"
    monkeypatch.setenv(lm_eval_cli.TIMING_ENV, str(timing))
    lm_eval_cli.main(_argv(shared_data, tmp_path / "out"))
    t = json.loads(timing.read_text())
    ev = t["events"]
    assert [ev[name] for name in ORDER] == sorted(ev[name] for name in ORDER), ev
    assert ev["process_start"] < 0
    # the scorer warms up on a thread from the model's construction (the index says the task
    # scores), before lm-eval loads the docs, done before the last answer
    assert ev["model_end"] <= ev["load_warm_up_start"] <= ev["tasks_load_start"]
    assert ev["load_warm_up_start"] <= ev["load_warm_up_end"]
    assert ev["load_warm_up_end"] <= ev["last_request_end"]
    b = rank_breakdown(t)
    assert all(b[k] is not None and b[k] >= 0 for k in BREAKDOWN_KEYS if k not in (
        "init_parallel_s", "gather_s")), b  # fmt: skip
    assert b["init_parallel_s"] is None  # one process: no process group


def test_env_report_only_where_results_are_written(local_run, shared_data, tmp_path, monkeypatch):
    """The entry starts collecting lm-eval's environment report only in the process that writes
    the results (LOCAL_RANK 0); on another rank lm-eval never asks for it."""
    entered: list[str] = []
    real = lm_eval_cli.env_report_prefetched

    def recording():
        entered.append(lm_eval_cli.os.environ.get("LOCAL_RANK", "-"))
        return real()

    monkeypatch.setattr(lm_eval_cli, "env_report_prefetched", recording)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert not lm_eval_cli.writes_results()
    lm_eval_cli.main(_argv(shared_data, tmp_path / "rank1"))
    assert entered == [] and not list((tmp_path / "rank1").rglob("results_*.json"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert lm_eval_cli.writes_results()
    lm_eval_cli.main(_argv(shared_data, tmp_path / "rank0"))
    assert entered == ["0"] and list((tmp_path / "rank0").rglob("results_*.json"))
    monkeypatch.delenv("LOCAL_RANK")
    assert lm_eval_cli.writes_results()


def test_nakta_reads_hf_skips_the_converted_copies(tmp_path, monkeypatch):
    """``--nakta-reads-hf``: the random HF folder is the nakta runs' checkpoint at every tp,
    and convert never runs (a 30B's copies cost minutes each)."""
    from speed_bench import lm_eval_weights

    made: list[str] = []
    monkeypatch.setattr(lm_eval_weights, "make_random_hf", lambda out, *a: made.append("hf"))
    monkeypatch.setattr(lm_eval_weights, "write_hf_tokenizer", lambda *a: None)
    monkeypatch.setattr(
        lm_eval_weights, "preset_args", lambda *a: type("A", (), {"max_seq_len": 2048})
    )
    monkeypatch.setattr(lm_eval_weights, "convert", lambda *a: made.append("convert") or 1.0)
    monkeypatch.setattr(
        "nakta_model.tokenizer.load_tokenizer", lambda p: type("T", (), {"n_words": 32000})
    )
    argv = ["--preset", "30B", "--data", "d", "--grids", "4x1,2x2", "--tokenizer", "t"]
    ckpt, hf, info = lm_eval_dp._weights(
        lm_eval_dp.parse_args(argv + ["--nakta-reads-hf"]), tmp_path, tmp_path
    )
    assert ckpt == hf == tmp_path / "hf" and made == ["hf"] and "weights" in info
    assert lm_eval_dp.checkpoint_for(ckpt, 4) == ckpt  # no hf_tp4 beside it: the folder itself
    made.clear()
    lm_eval_dp._weights(lm_eval_dp.parse_args(argv), tmp_path, tmp_path)
    assert made == ["hf", "convert", "convert"]  # without it: one copy per tp (2 and 4)
