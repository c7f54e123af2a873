"""The weight read started from the raw command line, before lm-eval is imported
(``accuracy_test.lm_eval_preload.start_early``): which command lines start it, and that the
configuration-time start then leaves it alone."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

import nakta_model.prefetch  # noqa: E402
from accuracy_test import lm_eval_preload  # noqa: E402
from accuracy_test.lm_eval_preload import (  # noqa: E402
    command_line_model,
    model_preloaded,
    start_early,
)

SHARD = "model.tp00-of-01.safetensors"


def _nakta_dir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "params.json").write_text(json.dumps({"dim": 8, "tp_size": 1}))
    (root / "manifest.json").write_text("{}")
    (root / SHARD).write_bytes(b"")
    return root


@pytest.fixture
def started(monkeypatch):
    """Prefetches started (path, device), on a machine that looks like it has a GPU."""
    calls: list = []
    monkeypatch.setattr(nakta_model.prefetch, "prefetch", lambda p, d: calls.append((p, d)))
    monkeypatch.setattr(lm_eval_preload, "_cuda_plausible", lambda: True)
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    return calls


def test_command_line_model_reads_as_lm_eval_does():
    argv = ["run", "--model", "nakta", "--model_args", "checkpoint=A,dtype=bf16", "dp=2"]
    argv += ["--device=cuda:1", "--tasks", "t", "-a", "dtype=fp16"]
    assert command_line_model(argv) == (
        "nakta",
        {"checkpoint": "A", "dtype": "fp16", "dp": "2"},  # a later key wins
        "cuda:1",
    )
    assert command_line_model(["-M", "hf", "-a", '{"pretrained": "x", "n": 2}']) == (
        "hf",
        {"pretrained": "x", "n": 2},
        None,
    )
    assert command_line_model([]) == (None, {}, None)


def test_the_read_starts_from_the_command_line(tmp_path, started):
    ckpt = _nakta_dir(tmp_path / "ckpt")
    base = ["--model", "nakta", "--model_args", f"checkpoint={ckpt},dtype=bf16", "--tasks", "t"]
    state = start_early(base)
    assert started == [(ckpt / SHARD, "cuda")] and state == {"checkpoint": ckpt}  # cuda:0
    started.clear()
    assert start_early(["run", *base, "--device", "cuda:1"]) == {"checkpoint": ckpt}
    assert started == [(ckpt / SHARD, "cuda:1")]
    started.clear()
    for argv in (
        ["ls", "tasks"],  # no model is built
        [*base, "--config", "c.yaml"],  # the file may change the model or its args
        [*base, "-h"],
        [*base, "--device", "cpu"],
        ["--model", "hf", "--model_args", f"pretrained={ckpt}"],
        ["--model", "nakta", "--model_args", f"checkpoint={ckpt},tp=2"],  # not this world
    ):
        assert start_early(argv) == {}, argv
    assert started == []


def test_no_gpu_driver_no_early_read(tmp_path, started, monkeypatch):
    ckpt = _nakta_dir(tmp_path / "ckpt")
    monkeypatch.setattr(lm_eval_preload, "_cuda_plausible", lambda: False)
    assert start_early(["--model", "nakta", "--model_args", f"checkpoint={ckpt}"]) == {}
    assert started == []
    monkeypatch.undo()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not lm_eval_preload._cuda_plausible()


def test_an_early_read_is_not_started_again_and_dropped_at_exit(tmp_path, started, monkeypatch):
    from lm_eval.config.evaluate_config import EvaluatorConfig

    ckpt = _nakta_dir(tmp_path / "ckpt")
    dropped: list = []
    monkeypatch.setattr(nakta_model.prefetch, "discard", lambda: dropped.append(1))
    early = start_early(["--model", "nakta", "--model_args", f"checkpoint={ckpt}"])
    seen: list = []
    with model_preloaded(on_start=lambda: seen.append(1), state=early) as state:
        cli = argparse.Namespace(
            model="nakta", model_args=f"checkpoint={ckpt}", tasks="x", batch_size=1,
            device="cuda:0", command="run",
        )  # fmt: skip
        EvaluatorConfig.from_cli(cli)
        assert state is early and len(started) == 1 and seen == []
    assert dropped == [1]


def test_the_early_start_imports_neither_lm_eval_nor_torch(tmp_path):
    """What makes it early: registering the read needs only the standard library and Nakta's
    torch-free modules (torch is imported on the prefetch's own thread)."""
    ckpt = _nakta_dir(tmp_path / "ckpt")
    code = (
        "import sys\n"
        "import nakta_model.prefetch as p\n"
        "from accuracy_test import lm_eval_preload as lp\n"
        "calls = []\n"
        "p.prefetch = lambda f, d: calls.append((str(f), d))\n"
        "lp._cuda_plausible = lambda: True\n"
        f"state = lp.start_early(['--model', 'nakta', '--model_args', 'checkpoint={ckpt}'])\n"
        "print(len(calls), 'checkpoint' in state, 'torch' in sys.modules, "
        "any(m == 'lm_eval' or m.startswith('lm_eval.') for m in sys.modules))\n"
    )
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["1", "True", "False", "False"]
