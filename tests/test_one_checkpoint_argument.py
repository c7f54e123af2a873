"""One ``--checkpoint`` everywhere: the speed bench (run_all and its engine scripts through
``speed_bench/weights.py``), decode_speed, parity, the profiler and the generate CLI take a
Nakta (``convert.py``'s output), Meta or HF folder; peers that need another layout (llama_org:
Meta tensors, HF: its own) get the same weights in memory; the tokenizer defaults to the
checkpoint's own; every load failure is one ``error:`` line, exit status 2.

The issue's repro first: ``python convert.py in out`` then ``python speed_bench/run_all.py
--checkpoint out`` (it refused: "no consolidated.*.pth").
"""

from __future__ import annotations

import importlib
import json
import re

import pytest
import torch
from checkpoint_factory import TINY_PARAMS, train_tiny_tokenizer, write_meta_checkpoint
from checkpoint_formats import FORMATS, broken_nakta, in_format
from cli_helpers import REPO, run_script

from nakta_model.layout import meta_shapes

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", autouse=True)
def _shutdown_llama_org():
    yield
    from accuracy_test import models

    models.shutdown_llama_org()


def test_convert_then_run_all_on_its_output(shared_data, tmp_path):
    """The commands as a user types them, by script path, in subprocesses."""
    out = tmp_path / "out"
    conv = run_script(["convert.py", str(shared_data / "stories260K"), str(out), "--quiet"], REPO)
    assert conv.returncode == 0, conv.stderr
    run = run_script(
        ["speed_bench/run_all.py", "--checkpoint", str(out), "--device", "cpu", "--limit", "3"]
        + ["--warmup", "0", "--engines", "nakta_cache,llama_org", "--no-progress"]
        + ["--out", str(tmp_path / "res")],
        REPO,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "res" / "summary.json").read_text())
    assert summary["model"] == "out"
    row = summary["engines"]["nakta_cache"]
    assert row["pred_agree_vs_ref"] == 1.0 and row["max_abs_ll_diff_vs_ref"] < 1e-3


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_hands_the_same_meta_tensors_to_the_engines(fmt, shared_data, tmp_path):
    from speed_bench.weights import CheckpointWeights

    stories = shared_data / "stories260K"
    want = CheckpointWeights(stories).state_dict(CPU, torch.float32)
    got = CheckpointWeights(in_format(stories, fmt, tmp_path))
    assert got.tokenizer is not None and got.tokenizer.name == "tokenizer.model"
    sd = got.state_dict(CPU, torch.float32)
    assert sd.keys() == want.keys() == meta_shapes(got.args).keys()
    assert all(torch.equal(sd[k], want[k]) for k in want)


def test_sharded_checkpoints_in_every_form_give_the_same_tensors(tmp_path):
    """A 2-shard Meta folder, its tp=2 Nakta conversion and a tp=1 one: the same unsplit
    tensors (tiny random GQA weights, fp32)."""
    from convert import convert
    from speed_bench.weights import CheckpointWeights

    meta = write_meta_checkpoint(tmp_path / "meta2", TINY_PARAMS, n_shards=2, seed=5)
    want = CheckpointWeights(meta).state_dict(CPU, torch.float32)
    for tp in (1, 2):
        nakta = convert(meta, tmp_path / f"nakta-tp{tp}", tp=tp, quiet=True)
        sd = CheckpointWeights(nakta).state_dict(CPU, torch.float32)
        assert sd.keys() == want.keys()
        assert all(torch.equal(sd[k], want[k]) for k in want), tp


def test_run_all_scores_real_tasks_with_the_checkpoints_own_tokenizer(shared_data, tmp_path):
    from speed_bench.run_all import main

    nakta = in_format(shared_data / "stories260K", "nakta", tmp_path)
    summary = main(
        ["--checkpoint", str(nakta), "--data", str(shared_data / "hellaswag_val_subset1000.jsonl")]
        + ["--limit", "2", "--warmup", "0", "--device", "cpu", "--no-progress"]
        + ["--engines", "nakta_cache,llama_org,hf", "--out", str(tmp_path / "res")]
    )
    assert summary["workload"]["tasks"] == 2
    for name, row in summary["engines"].items():
        assert row["pred_agree_vs_ref"] == 1.0, name


@pytest.mark.parametrize("fmt", ["nakta", "hf"])
def test_parity_on_a_converted_or_hf_folder_gives_llama_org_the_same_weights(
    fmt, shared_data, tmp_path
):
    from accuracy_test import parity

    ckpt = in_format(shared_data / "stories260K", fmt, tmp_path)
    out = tmp_path / "res" / "p.json"
    rc = parity.main(
        ["--checkpoint", str(ckpt), "--data", str(shared_data / "hellaswag_val_subset1000.jsonl")]
        + ["--limit", "3", "--device", "cpu", "--no-progress", "--out", str(out)]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["identical_predictions"] is True and result["ll_abs_diff"]["max"] < 1e-3
    assert result["config"]["tokenizer"] == "tokenizer.model"  # the checkpoint's own


def test_profile_takes_a_checkpoint(shared_data, tmp_path):
    profile = importlib.import_module("model_profile.profile")
    nakta = in_format(shared_data / "stories260K", "nakta", tmp_path)
    summary = profile.main(
        ["--checkpoint", str(nakta), "--tasks", "2", "--engines", "nakta_cache"]
        + ["--device", "cpu", "--out", str(tmp_path / "prof")]
    )
    assert "nakta_cache" in json.dumps(summary)


# ------------------------------------------------------------------------ load failures
def _commands(data, out):
    """command -> (main, the arguments it needs beside --checkpoint; results under ``out``)."""
    from accuracy_test import parity
    from speed_bench import decode_speed, nakta_speed, run_all

    jsonl = str(data / "hellaswag_val_subset1000.jsonl")
    tok = str(data / "stories260K" / "tokenizer.model")
    return {
        "run_all": (run_all.main, ["--device", "cpu", "--no-progress", "--out", out]),
        "nakta_speed": (nakta_speed.main, ["--device", "cpu", "--no-progress", "--out", out]),
        "decode_speed": (decode_speed.main, ["--device", "cpu", "--out", out]),
        "parity": (
            parity.main,
            ["--data", jsonl, "--tokenizer", tok, "--device", "cpu", "--out", f"{out}/p.json"],
        ),
        "profile": (
            importlib.import_module("model_profile.profile").main,
            ["--device", "cpu", "--out", out],
        ),
        "generate": (
            importlib.import_module("nakta_model.generate").main,
            ["--prompt", "x", "--device", "cpu"],
        ),
    }


def _broken(kind: str, data, tmp_path):
    """A checkpoint folder that fails to load in one way, and the error line's pattern."""
    if kind == "missing":
        return tmp_path / "nope", r"no such directory"
    if kind in ("truncated", "corrupted"):
        nakta = in_format(data / "stories260K", "nakta", tmp_path)
        why = r"truncated\?" if kind == "truncated" else r"sampled sha256 differs"
        return broken_nakta(nakta, kind, tmp_path), rf"cannot load it: CheckpointError: .*{why}"
    if kind == "wrong-format":
        d = tmp_path / "params-only"
        d.mkdir()
        (d / "params.json").write_text(json.dumps(TINY_PARAMS))
        return d, r"not a checkpoint, params.json without consolidated.\*.pth or manifest.json"
    if kind == "hf-without-weights":
        d = tmp_path / "hf-empty"
        d.mkdir()
        (d / "config.json").write_text("{}")
        return d, r"cannot load it: CheckpointError: .*config.json"
    raise ValueError(kind)


KINDS = ["missing", "truncated", "corrupted", "wrong-format", "hf-without-weights"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "command", ["run_all", "nakta_speed", "decode_speed", "parity", "profile", "generate"]
)
def test_every_load_failure_is_one_error_line(command, kind, shared_data, tmp_path, capsys):
    main, extra = _commands(shared_data, str(tmp_path / "o"))[command]
    ckpt, pattern = _broken(kind, shared_data, tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["--checkpoint", str(ckpt), *extra])
    assert exc.value.code == 2
    assert not (tmp_path / "o").exists()  # refused before anything was written
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if not line.startswith("loading ")]
    assert len(lines) == 1 and lines[0].startswith(f"error: --checkpoint {ckpt}"), err
    assert re.search(pattern, lines[0]), lines[0]


def test_the_tokenizer_defaults_to_the_checkpoints_own(tmp_path):
    """A folder with no tokenizer.model: commands that need one say so in one line."""
    from nakta_model.cli import InputError, checkpoint_tokenizer_path

    meta = write_meta_checkpoint(tmp_path / "meta", TINY_PARAMS)
    with pytest.raises(InputError, match="holds no tokenizer.model: pass --tokenizer"):
        checkpoint_tokenizer_path(meta, None)
    tok = train_tiny_tokenizer(meta)
    assert checkpoint_tokenizer_path(meta, None) == tok
    with pytest.raises(InputError, match="--tokenizer is needed"):
        checkpoint_tokenizer_path(None, None)
