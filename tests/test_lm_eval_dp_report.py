"""The lm-eval data-parallel measurement's report (``speed_bench/lm_eval_dp_report.py``) on
fabricated rank timing files, and the driver's command line (``speed_bench/lm_eval_dp.py``)."""

from __future__ import annotations

import json

import pytest

from speed_bench import lm_eval_dp
from speed_bench.lm_eval_dp_report import (
    RUN_KEYS,
    markdown,
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
