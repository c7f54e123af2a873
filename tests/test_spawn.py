"""nakta_model.spawn: torchrun's standalone launch without torch in the launcher, and the lm-eval
entry that starts its own dp ranks with it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from accuracy_test.lm_eval_cli import requested_world
from nakta_model import spawn

REPO = Path(__file__).resolve().parents[1]


def _run(args: list[str], timeout: float = 60.0, env: dict | None = None):
    return subprocess.run(
        [sys.executable, "-m", "nakta_model.spawn", *args], capture_output=True, text=True,
        timeout=timeout, cwd=REPO, env=env,
    )  # fmt: skip


def test_parse():
    assert spawn.parse(["--nproc", "2", "-m", "x", "--a", "b"]) == (2, ["-m", "x", "--a", "b"])
    assert spawn.parse(["--nproc_per_node=3", "s.py"]) == (3, ["s.py"])
    for bad, msg in ((["-m", "x"], "first argument"), (["--nproc", "0", "x"], ">= 1"),
                     (["--nproc", "two", "x"], "int"), (["--nproc", "2"], "give what to run")):  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            spawn.parse(bad)


def test_every_rank_gets_its_environment_and_no_torch_is_imported():
    # One os.write a rank: three ranks share the pipe, and print() under PYTHONUNBUFFERED=1
    # writes each argument by itself, so lines could interleave mid-line.
    code = (
        "import os, sys; e = os.environ; os.write(1, (' '.join([e['RANK'], e['LOCAL_RANK'], "
        "e['WORLD_SIZE'], e['LOCAL_WORLD_SIZE'], e['MASTER_ADDR'], e['MASTER_PORT'], "
        "str('torch' in sys.modules)]) + '\\n').encode())"
    )
    out = _run(["--nproc", "3", "-c", code])
    assert out.returncode == 0, out.stderr
    lines = sorted(out.stdout.split("\n")[:-1])
    assert [ln.split()[:4] for ln in lines] == [[str(r), str(r), "3", "3"] for r in range(3)]
    assert len({ln.split()[5] for ln in lines}) == 1  # one port for all
    assert all(ln.split()[6] == "False" for ln in lines)
    check = "import nakta_model.spawn, sys; print('torch' in sys.modules)"
    assert subprocess.check_output([sys.executable, "-c", check], cwd=REPO, text=True) == "False\n"


def test_first_failure_ends_the_others_with_its_status():
    code = (
        "import os, sys, time; r = int(os.environ['RANK']); time.sleep(0.2);"
        " sys.exit(3) if r == 1 else time.sleep(60)"
    )
    t0 = time.monotonic()
    out = _run(["--nproc", "2", "-c", code])
    assert out.returncode == 3 and time.monotonic() - t0 < 20


def test_bad_usage_is_one_line_and_status_2():
    out = _run(["--nproc", "x", "-c", "pass"])
    assert out.returncode == 2 and out.stderr.startswith("spawn: error: --nproc must be an int")


@pytest.mark.parametrize(
    "argv, world",
    [
        (["--model", "nakta", "--model_args", "checkpoint=c,dp=2"], 2),
        (["--model=nakta", "--model_args=checkpoint=c,tp=2,dp=2"], 4),
        (["--model", "nakta", "--model_args", "checkpoint=c"], 1),
        (["--model", "hf", "--model_args", "pretrained=p,dp=2"], 1),
        (["--model", "nakta", "--model_args", "checkpoint=c,dp=x"], 1),
        # lm-eval 0.4.13's forms: words up to the next option, repeats merged, -M/-a, JSON
        (["--model", "nakta", "--model_args", "checkpoint=c", "dp=2", "--tasks", "t"], 2),
        (["--model", "nakta", "--model_args", "dp=2", "--model_args", "checkpoint=c"], 2),
        (["--model", "nakta", "-a", "tp=2", "-a", "dp=3,tp=1"], 3),
        (["-M", "nakta", "-a", "checkpoint=c,tp=2"], 2),
        (["--model", "nakta", "--model_args", '{"checkpoint": "c", "dp": 2}'], 2),
    ],
)
def test_lm_eval_entry_reads_the_world_it_must_start(argv, world):
    assert requested_world(argv) == world


@pytest.mark.slow
def test_lm_eval_entry_starts_its_dp_ranks_itself(tmp_path, shared_data):
    """``--model_args ...,dp=2`` without torchrun: two ranks, one results table, status 0."""
    import convert

    ckpt = convert.convert(shared_data / "stories260K", tmp_path / "ck", quiet=True)
    env = {**os.environ, "NAKTA_HELLASWAG_JSONL": str(shared_data / "hellaswag_val_full.jsonl"),
           "NAKTA_LM_EVAL_LOCAL_TASKS": "1", "NAKTA_LM_EVAL_TIMING": str(tmp_path / "t.json")}  # fmt: skip
    env.pop("WORLD_SIZE", None)
    out = subprocess.run(
        [sys.executable, "-m", "accuracy_test.lm_eval_cli", "--model", "nakta", "--model_args",
         f"checkpoint={ckpt},dp=2", "--device", "cpu", "--include_path", "accuracy_test/tasks",
         "--tasks", "hellaswag_local", "--limit", "6"],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("|hellaswag_local|") == 1  # rank 0 alone prints lm-eval's table
    assert (tmp_path / "t.json").is_file() and (tmp_path / "t.rank1.json").is_file()
