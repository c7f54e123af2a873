"""One pass for settings: a command opens a checkpoint and reads its settings once
(``loading.CheckpointDir``), and parses its precision options once into one object
(``fp8.Precision``) that ``load`` and the model take as it is.

Tiny checkpoints from ``checkpoint_factory``: a Meta folder and its Nakta conversion.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from checkpoint_factory import TINY_PARAMS, train_tiny_tokenizer, write_meta_checkpoint

from nakta_model import checkpoint as checkpoint_mod
from nakta_model import fp8, loading, sources
from nakta_model.fp8 import Precision
from nakta_model.loading import CheckpointDir, load

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from convert import convert

    root = tmp_path_factory.mktemp("settings_once")
    meta = write_meta_checkpoint(root / "meta", {**TINY_PARAMS, "max_seq_len": 64}, seed=2)
    train_tiny_tokenizer(meta)
    return {"meta": meta, "nakta": convert(meta, root / "nakta", quiet=True)}


@pytest.fixture
def reads(monkeypatch):
    """How often a checkpoint's settings are read: a Nakta params.json (``read_args``, where
    ``loading`` and ``checkpoint`` both call it) and a Meta / HF folder opened (``open_source``)."""
    counts = {"read_args": 0, "open_source": 0}

    def counted(module, name):
        original = getattr(module, name)

        def wrapper(*a, **kw):
            counts[name] += 1
            return original(*a, **kw)

        monkeypatch.setattr(module, name, wrapper)

    counted(loading, "read_args")
    counted(checkpoint_mod, "read_args")
    counted(loading, "open_source")
    return counts


@pytest.mark.parametrize("fmt", ["nakta", "meta"])
def test_an_opened_checkpoint_loads_the_same_model_reading_its_settings_once(fmt, ckpts, reads):
    want = load(ckpts[fmt], "cpu", torch.float32)
    before = dict(reads)
    opened = CheckpointDir.open(ckpts[fmt])
    assert opened.format == fmt and opened.args == want.args and str(opened) == str(ckpts[fmt])
    got = load(opened, "cpu", torch.float32)
    assert sum(reads.values()) - sum(before.values()) == 1  # the open; the load reads weights
    assert got.args == want.args
    for (name, a), (_, b) in zip(got.state_dict().items(), want.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_grid_check_of_an_opened_nakta_checkpoint_uses_its_settings(ckpts, reads):
    """Sharded for another tp: the same ParallelConfigError as from the path, no new read."""
    from nakta_model.parallel import ParallelConfigError, ParallelContext

    opened = CheckpointDir.open(ckpts["nakta"])
    n = reads["read_args"]
    grid = ParallelContext(tp_rank=0, tp_size=2)
    with pytest.raises(ParallelConfigError, match=r"sharded for tp=1, but this run has --tp 2"):
        loading._check_grid(opened, grid)
    assert reads["read_args"] == n


def test_the_lm_eval_adapter_reads_settings_once_and_parses_quant_once(ckpts, reads, monkeypatch):
    pytest.importorskip("lm_eval")
    from accuracy_test.lm_eval_adapter import NaktaLM

    parsed = []
    check_quant = fp8.check_quant
    monkeypatch.setattr(fp8, "check_quant", lambda q: parsed.append(q) or check_quant(q))
    for fmt, key in (("nakta", "read_args"), ("meta", "open_source")):
        before = dict(reads)
        lm = NaktaLM(checkpoint=str(ckpts[fmt]), device="cpu", quant="none")
        assert lm.model.args.vocab_size == TINY_PARAMS["vocab_size"]
        assert {k: reads[k] - before[k] for k in reads} == {
            "read_args": int(key == "read_args"),
            "open_source": int(key == "open_source"),
        }
    assert parsed == ["none", "none"]  # once per adapter, at its entry; not in load or the model
    assert lm.precision == Precision(None) and lm.model.quant is None


def test_generate_reads_settings_once(ckpts, reads, capsys):
    generate_cli = importlib.import_module("nakta_model.generate")
    out = generate_cli.main(
        ["--checkpoint", str(ckpts["nakta"]), "--prompt", "the cat", "--max-new-tokens", "2"]
        + ["--temperature", "0", "--device", "cpu"]
    )
    assert len(out[0]["tokens"]) == 2
    assert reads["read_args"] == 1


def test_precision_is_parsed_once_and_passed_as_is():
    p = Precision.parse(" FP8 ")
    assert p == Precision("fp8") and Precision.of(p) is p and Precision.of("fp8") == p
    for off in (None, "", "none", "bf16", "fp16", "fp32"):
        assert Precision.parse(off) == Precision() and Precision.of(off).quant is None
    with pytest.raises(ValueError, match="quant must be None or 'fp8', got 'int4'"):
        Precision.parse("int4")
    with pytest.raises(TypeError, match="quant must be None or 'fp8'"):
        Precision.parse(8)
    with pytest.raises(ValueError, match="use parse"):
        Precision("FP8")  # only parse() normalizes
    Precision().check_device("cpu")  # nothing to check without FP8
    with pytest.raises(ValueError, match="compute capability"):
        Precision("fp8").check_device("meta")


def test_sources_open_checkpoint_format_matches_the_opened_dir(ckpts):
    for fmt, path in ckpts.items():
        assert sources.checkpoint_format(path) == CheckpointDir.open(path).format == fmt


def test_the_walk_of_checkpoint_from_the_lm_eval_adapter_passes_at_most_six_files(ckpts):
    """Every function of the repo that receives the checkpoint path, from the adapter's
    constructor to the loaded model: the files they live in (a structure check, as the import
    graph's: the path must not wander through the house)."""
    pytest.importorskip("lm_eval")
    import os
    import sys
    from pathlib import Path

    from accuracy_test.lm_eval_adapter import NaktaLM

    repo = str(Path(__file__).resolve().parents[1])
    path = str(ckpts["nakta"])
    files: list[str] = []

    def profile(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(repo):
            return
        if any(isinstance(v, (str, Path)) and str(v) == path for v in frame.f_locals.values()):
            files.append(os.path.relpath(frame.f_code.co_filename, repo))

    sys.setprofile(profile)
    try:
        lm = NaktaLM(checkpoint=path, device="cpu")
    finally:
        sys.setprofile(None)
    assert lm.model.args.vocab_size == TINY_PARAMS["vocab_size"]
    walked = list(dict.fromkeys(files))
    assert walked[0] == os.path.join("accuracy_test", "lm_eval_adapter.py")
    assert len(walked) <= 6, walked
