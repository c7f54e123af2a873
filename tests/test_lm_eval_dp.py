"""lm-eval through ``accuracy_test.lm_eval_cli`` as a user runs it: the tokenizer a converted
checkpoint holds is the default, a checkpoint that cannot be loaded is one ``error:`` line (one
process and under torchrun), and ``dp=2`` under torchrun gives one process's answers with each
replica given only its documents' requests by lm-eval (its timing file says how many it took)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from cli_helpers import REPO, error_lines, torchrun  # noqa: E402

from accuracy_test import lm_eval_cli  # noqa: E402
from nakta_model.parallel import ParallelContext  # noqa: E402

TASKS = REPO / "accuracy_test" / "tasks"


@pytest.fixture(scope="module")
def stories_nakta(tmp_path_factory) -> Path:
    """The real tiny checkpoint converted to Nakta's format (tokenizer.model beside it)."""
    from conftest import SHARED_DATA

    from convert import convert

    src = SHARED_DATA / "stories260K"
    if not src.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return convert(src, tmp_path_factory.mktemp("lm_eval_dp") / "nakta", quiet=True)


def _argv(model_args: str, limit: int = 6) -> list[str]:
    return [
        "--model", "nakta", "--model_args", model_args, "--include_path", str(TASKS),
        "--tasks", "hellaswag_local", "--limit", str(limit), "--device", "cpu",
    ]  # fmt: skip


@pytest.fixture
def local_run(monkeypatch, shared_data):
    import lm_eval.tasks

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lm_eval.tasks.TaskManager)  # restored
    monkeypatch.setenv(lm_eval_cli.LOCAL_TASKS_ENV, "1")
    monkeypatch.setattr("sys.argv", ["nakta-lm-eval"])
    monkeypatch.setenv("NAKTA_HELLASWAG_JSONL", str(shared_data / "hellaswag_val_full.jsonl"))


def test_without_tokenizer_the_checkpoints_own_is_used(stories_nakta, local_run, tmp_path, capsys):
    out = tmp_path / "res"
    lm_eval_cli.main([*_argv(f"checkpoint={stories_nakta}"), "--output_path", str(out)])
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    assert 0 <= results["results"]["hellaswag_local"]["acc,none"] <= 1


def _damaged(src: Path, root: Path) -> dict[str, tuple[Path, str]]:
    """name -> (checkpoint dir, the error line expected), one per way a load fails."""
    shard = "model.tp00-of-01.safetensors"
    cases = {}
    for name in ("truncated", "corrupted", "shard-missing", "params-garbage"):
        shutil.copytree(src, root / name)
    f = root / "truncated" / shard
    os.truncate(f, f.stat().st_size // 2)
    cases["truncated"] = (root / "truncated", r"cannot load it: .*truncated")
    data = bytearray((root / "corrupted" / shard).read_bytes())
    data[-8:] = bytes(8)  # same size, other bytes: the manifest's sampled hash differs
    (root / "corrupted" / shard).write_bytes(bytes(data))
    cases["corrupted"] = (root / "corrupted", r"cannot load it: .*")
    (root / "shard-missing" / shard).unlink()
    cases["shard-missing"] = (root / "shard-missing", r"cannot load it: .*")
    (root / "params-garbage" / "params.json").write_text("{not json")
    cases["params-garbage"] = (root / "params-garbage", r"cannot load it: .*params")
    cases["missing"] = (root / "nope", r"nakta checkpoint .*nope: no such directory")
    return cases


@pytest.mark.parametrize(
    "case", ["truncated", "corrupted", "shard-missing", "params-garbage", "missing"]
)
def test_a_checkpoint_that_cannot_load_is_one_error_line(
    case, stories_nakta, local_run, tmp_path, capsys
):
    import re

    ckpt, pattern = _damaged(stories_nakta, tmp_path)[case]
    with pytest.raises(SystemExit) as exc:
        lm_eval_cli.main(_argv(f"checkpoint={ckpt}"))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1, err[-3000:]
    # no traceback of the load (in-process, lm-eval's log handler may still complain about
    # pytest's closed capture stream: that is not the user's output)
    assert "nakta_model/" not in err and "lm_eval_adapter.py" not in err, err[-3000:]
    assert re.search(pattern, lines[0]), lines[0]
    assert "\n" not in lines[0].strip()


def test_lm_eval_sees_each_replica_and_one_process_collectives_are_identities(stories_nakta):
    """lm-eval's data-parallel contract: the adapter reports its replica (``dp_rank`` of
    ``dp_size``), so lm-eval builds that replica's documents only; with one process its
    collectives hand back what they were given."""
    import torch

    from accuracy_test.lm_eval_adapter import NaktaLM

    lm = NaktaLM(checkpoint=str(stories_nakta), device="cpu")
    assert (lm.rank, lm.world_size) == (0, 1)
    t = torch.tensor(7)
    assert lm.all_gather(t) is t and lm.gather_object({"a": 1}) == [{"a": 1}]
    lm.barrier()
    lm.parallel = ParallelContext(tp_rank=1, tp_size=2, dp_rank=1, dp_size=3)
    assert (lm.rank, lm.world_size) == (1, 3)  # a replica's tp ranks report the same rank


@pytest.mark.slow
def test_dp2_under_torchrun_scores_like_one_process(stories_nakta, shared_data, tmp_path):
    """``torchrun --nproc_per_node 2 -m accuracy_test.lm_eval_cli ... dp=2``: the same accuracy
    as one process, each rank's timing file with its share (together: every request once)."""
    env = {
        "NAKTA_HELLASWAG_JSONL": str(shared_data / "hellaswag_val_full.jsonl"),
        lm_eval_cli.LOCAL_TASKS_ENV: "1",
    }
    results = {}
    for dp in (1, 2):
        timing = tmp_path / f"dp{dp}" / "timing.json"
        out = tmp_path / f"res{dp}"
        argv = [*_argv(f"checkpoint={stories_nakta},dp={dp}", limit=24), "--output_path", str(out)]
        if dp == 1:
            from cli_helpers import run_script

            proc = run_script(
                ["-m", "accuracy_test.lm_eval_cli", *argv], REPO, **env,
                NAKTA_LM_EVAL_TIMING=str(timing),
            )  # fmt: skip
            assert proc.returncode == 0, proc.stderr[-3000:]
        else:
            rc, output = torchrun(
                ["-m", "accuracy_test.lm_eval_cli", *argv], REPO,
                env={**env, "NAKTA_LM_EVAL_TIMING": str(timing)},
            )  # fmt: skip
            assert rc == 0, output[-3000:]
        results[dp] = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    assert results[1]["hellaswag_local"]["acc,none"] == results[2]["hellaswag_local"]["acc,none"]
    assert results[1] == results[2] or (
        results[1]["hellaswag_local"]["acc_norm,none"]
        == results[2]["hellaswag_local"]["acc_norm,none"]
    )
    ranks = [
        json.loads((tmp_path / "dp2" / f).read_text()) for f in ("timing.json", "timing.rank1.json")
    ]
    assert [r["rank"] for r in ranks] == [0, 1] and {r["world_size"] for r in ranks} == {2}
    shares = [r["loglikelihood"]["items"] for r in ranks]
    assert sum(shares) == 24 * 4 and min(shares) > 0  # each request scored by one replica
    for r in ranks:
        ev = r["events"]
        assert ev["first_request"] <= ev["last_request_end"] <= ev["exit"]


@pytest.mark.slow
def test_a_bad_checkpoint_under_torchrun_is_one_line_from_one_rank(
    stories_nakta, shared_data, tmp_path
):
    ckpt, _ = _damaged(stories_nakta, tmp_path)["truncated"]
    env = {
        "NAKTA_HELLASWAG_JSONL": str(shared_data / "hellaswag_val_full.jsonl"),
        lm_eval_cli.LOCAL_TASKS_ENV: "1",
    }
    rc, output = torchrun(
        ["-m", "accuracy_test.lm_eval_cli", *_argv(f"checkpoint={ckpt},dp=2")], REPO, env=env
    )
    assert rc != 0
    lines = error_lines(output)
    assert len(lines) == 1 and "cannot load it" in lines[0], output[-3000:]
    assert "exitcode  : 2" in output and "SIGABRT" not in output
    # torchrun's own launcher prints its ChildFailedError report; no frame of ours is in it
    assert "nakta_model/" not in output and "lm_eval_adapter.py" not in output


@pytest.mark.slow
def test_two_replicas_of_tp2_score_like_one_process(stories_nakta, shared_data, tmp_path):
    """``dp=2`` of ``tp=2`` (four ranks started by the entry): lm-eval gathers each tp
    position's replicas within its own dp group; the accuracy equals one process's."""
    from cli_helpers import run_script

    from convert import convert

    tp2 = convert(shared_data / "stories260K", tmp_path / "tp2", 2, quiet=True)
    env = {
        "NAKTA_HELLASWAG_JSONL": str(shared_data / "hellaswag_val_full.jsonl"),
        lm_eval_cli.LOCAL_TASKS_ENV: "1",
    }
    accs = []
    for margs in (f"checkpoint={stories_nakta}", f"checkpoint={tp2},tp=2,dp=2"):
        out = tmp_path / f"res{len(accs)}"
        argv = [*_argv(margs, limit=12), "--output_path", str(out)]
        proc = run_script(["-m", "accuracy_test.lm_eval_cli", *argv], REPO, **env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results = [json.loads(p.read_text()) for p in out.rglob("results_*.json")]
        assert len(results) == 1  # one process wrote them
        accs.append(results[0]["results"]["hellaswag_local"]["acc,none"])
    assert accs[0] == accs[1]
