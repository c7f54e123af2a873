"""The lm-eval entry's early weight read (``accuracy_test.lm_eval_preload``): which runs
prefetch, what starts when lm-eval's configuration is built, what is dropped at exit."""

from __future__ import annotations

import argparse
import json

import pytest

pytest.importorskip("lm_eval")

from lm_eval.config.evaluate_config import EvaluatorConfig  # noqa: E402

import nakta_model.prefetch  # noqa: E402
from accuracy_test import lm_eval_preload  # noqa: E402
from accuracy_test.lm_eval_preload import (  # noqa: E402
    constructor_kwargs,
    model_preloaded,
    prefetch_plan,
    prefetchable_checkpoint,
)


def _nakta_dir(root, tp_size: int = 1, manifest: bool = True):
    root.mkdir(parents=True, exist_ok=True)
    (root / "params.json").write_text(json.dumps({"dim": 8, "tp_size": tp_size}))
    if manifest:
        (root / "manifest.json").write_text("{}")
    (root / "model.tp00-of-01.safetensors").write_bytes(b"")
    return root


def _cli(model: str, model_args: str, device: str = "cuda:0") -> argparse.Namespace:
    """What lm-eval's parser gives ``run`` (the fields the configuration reads)."""
    return argparse.Namespace(
        model=model, model_args=model_args, tasks="x", batch_size=1, device=device, command="run"
    )


def test_constructor_kwargs_are_what_lm_eval_passes():
    assert constructor_kwargs("a=1,b=x", {"batch_size": 4, "device": None}) == {
        "a": 1,
        "b": "x",
        "batch_size": 4,
    }
    assert constructor_kwargs({"a": 1}, None) == {"a": 1}
    # a key in both: model_args' value wins, as the model class merges them
    assert constructor_kwargs({"device": "cpu"}, {"device": "cuda"}) == {"device": "cpu"}
    assert constructor_kwargs(42, {}) is None


def test_only_a_single_gpu_nakta_checkpoint_is_prefetchable(tmp_path):
    one = str(_nakta_dir(tmp_path / "one"))
    assert prefetchable_checkpoint({"checkpoint": one}) == tmp_path / "one"  # cuda by default
    assert prefetchable_checkpoint({"checkpoint": one, "device": "cuda:1"}) is not None
    assert prefetchable_checkpoint({"checkpoint": one, "device": "cpu"}) is None
    assert prefetchable_checkpoint({"checkpoint": one, "tp": "2"}) is None
    assert prefetchable_checkpoint({"checkpoint": one, "dp": 2}) is None
    two = str(_nakta_dir(tmp_path / "two", tp_size=2))
    assert prefetchable_checkpoint({"checkpoint": two}) is None
    meta = str(_nakta_dir(tmp_path / "meta", manifest=False))  # Meta / HF: no manifest
    assert prefetchable_checkpoint({"checkpoint": meta}) is None
    assert prefetchable_checkpoint({"checkpoint": str(tmp_path / "none")}) is None
    assert prefetchable_checkpoint({}) is None


@pytest.fixture
def started(monkeypatch):
    """Prefetches started (path, device)."""
    calls: list = []
    monkeypatch.setattr(nakta_model.prefetch, "prefetch", lambda p, d: calls.append((p, d)))
    return calls


def test_the_read_starts_when_lm_eval_builds_its_configuration(tmp_path, started, monkeypatch):
    """Registered on lm-eval's main thread without importing torch (checked in a subprocess by
    ``test_registering_a_prefetch_imports_no_torch``)."""
    ckpt = _nakta_dir(tmp_path / "ckpt")
    dropped = []
    monkeypatch.setattr(nakta_model.prefetch, "discard", lambda: dropped.append(1))
    seen = []
    with model_preloaded(on_start=lambda: seen.append(1)) as state:
        assert started == []
        EvaluatorConfig.from_cli(_cli("nakta", f"checkpoint={ckpt},tokenizer=t"))
        assert started == [(ckpt / "model.tp00-of-01.safetensors", "cuda:0")]
        assert state["checkpoint"] == ckpt and seen == [1]
        EvaluatorConfig.from_cli(_cli("nakta", f"checkpoint={ckpt}"))  # once per run
        assert len(started) == 1
    assert dropped == [1]  # whatever nobody took is dropped at exit
    assert EvaluatorConfig.from_cli.__func__.__module__ == "lm_eval.config.evaluate_config"


def test_no_read_for_other_models_grids_or_cpus(tmp_path, started, monkeypatch):
    ckpt = _nakta_dir(tmp_path / "ckpt")
    for cli in (
        _cli("hf", f"pretrained={ckpt}"),
        _cli("llama_org", f"checkpoint={ckpt}"),
        _cli("nakta", f"checkpoint={ckpt}", device="cpu"),
    ):
        with model_preloaded() as state:
            EvaluatorConfig.from_cli(cli)
        assert "checkpoint" not in state
    monkeypatch.setenv("WORLD_SIZE", "2")  # a world of 2 but no dp=2 / tp=2 asked for
    with model_preloaded() as state:
        EvaluatorConfig.from_cli(_cli("nakta", f"checkpoint={ckpt}"))
    assert "checkpoint" not in state and started == []


def test_every_torchrun_rank_prefetches_its_own_shard_onto_its_own_gpu(
    tmp_path, started, monkeypatch
):
    """Under torchrun each rank's read overlaps lm-eval's start-up as a lone process's does:
    dp ranks read the one shard onto their own GPU, tp ranks their own shard."""
    one = _nakta_dir(tmp_path / "one")
    two = _nakta_dir(tmp_path / "two", tp_size=2)
    env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
    shard = "model.tp00-of-01.safetensors"
    assert prefetch_plan({"checkpoint": str(one), "dp": "2"}, env) == (one / shard, "cuda:1")
    assert prefetch_plan({"checkpoint": str(two), "tp": 2}, env) == (
        two / "model.tp01-of-02.safetensors",
        "cuda:1",
    )
    assert prefetch_plan({"checkpoint": str(one), "tp": 2}, env) is None  # sharded for tp=1
    assert prefetch_plan({"checkpoint": str(one), "dp": "3"}, env) is None  # not the world
    assert prefetch_plan({"checkpoint": str(one), "dp": "x"}, env) is None
    assert prefetch_plan({"checkpoint": str(one), "dp": 2, "device": "cpu"}, env) is None
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with model_preloaded() as state:
        EvaluatorConfig.from_cli(_cli("nakta", f"checkpoint={one},dp=2"))
    assert started == [(one / shard, "cuda:1")] and state["checkpoint"] == one


def test_a_missing_shard_starts_nothing(tmp_path):
    ckpt = _nakta_dir(tmp_path / "ckpt")
    (ckpt / "model.tp00-of-01.safetensors").unlink()
    assert not lm_eval_preload._start_prefetch(ckpt / "model.tp00-of-01.safetensors", "cuda")


def test_registering_a_prefetch_imports_no_torch(tmp_path):
    """torch is imported on the prefetch's thread, not on lm-eval's main thread."""
    import subprocess
    import sys
    from pathlib import Path

    ckpt = _nakta_dir(tmp_path / "ckpt")
    code = (
        "import sys, threading\n"
        "from pathlib import Path\n"
        "from accuracy_test.lm_eval_preload import _start_prefetch\n"
        "seen = []\n"
        "real = threading.Thread.start\n"
        "def start(self):\n"
        "    seen.append('torch' in sys.modules)\n"
        "    real(self)\n"
        "threading.Thread.start = start\n"
        f"assert _start_prefetch(Path({str(ckpt)!r}) / 'model.tp00-of-01.safetensors', 'cuda:0')\n"
        "print(seen)\n"
    )
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[False]"
