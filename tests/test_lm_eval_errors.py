"""Every bad ``--model_args`` key or value, and every unreadable checkpoint part, through
``nakta-lm-eval --model nakta`` / ``--model llama_org`` is one ``error:`` line and exit status 2
(under ``dp=2``: printed once, by rank 0); lm-eval's own ``batch_size`` / ``device`` beside the
same keys in ``--model_args`` are passed once (model_args wins), and a run given no device
says nothing about ``cuda:0``.

Tiny checkpoints from ``checkpoint_factory``: a Meta folder (its own ``tokenizer.model``) and
its Nakta conversion, damaged one part at a time.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from checkpoint_factory import TINY_PARAMS, train_tiny_tokenizer, write_meta_checkpoint  # noqa: E402
from cli_helpers import REPO, error_lines, run_script  # noqa: E402

from accuracy_test import lm_eval_cli, models  # noqa: E402
from accuracy_test.lm_eval_adapter import LlamaOrgLM, NaktaLM  # noqa: E402

TASKS = REPO / "accuracy_test" / "tasks"
SHARD = "model.tp00-of-01.safetensors"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """``meta``: a tiny Meta folder with its tokenizer; ``nakta``: the same converted."""
    from convert import convert

    root = tmp_path_factory.mktemp("lm_eval_errors")
    meta = write_meta_checkpoint(root / "meta", {**TINY_PARAMS, "max_seq_len": 128}, seed=1)
    train_tiny_tokenizer(meta)
    return {"meta": meta, "nakta": convert(meta, root / "nakta", quiet=True)}


@pytest.fixture(autouse=True, scope="module")
def _llama_org_teardown():
    yield
    models.shutdown_llama_org()


def _damage(src: Path, dst: Path, part: str) -> Path:
    """A copy of ``src`` with one part unreadable."""
    shutil.copytree(src, dst)
    if part == "tokenizer":
        (dst / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    elif part == "params":
        (dst / "params.json").write_text("{not json")
    elif part == "consolidated":
        (dst / "consolidated.00.pth").unlink()
    elif part == "truncated-pth":
        f = dst / "consolidated.00.pth"
        os.truncate(f, f.stat().st_size // 2)
    elif part == "truncated-safetensors":
        f = dst / SHARD
        os.truncate(f, f.stat().st_size // 2)
    else:
        raise ValueError(part)
    return dst


def _argv(model: str, model_args: str) -> list[str]:
    return [
        "--model", model, "--model_args", model_args, "--include_path", str(TASKS),
        "--tasks", "hellaswag_local", "--limit", "2", "--device", "cpu",
    ]  # fmt: skip


@pytest.fixture
def cli_env(monkeypatch, shared_data):
    import lm_eval.tasks

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lm_eval.tasks.TaskManager)  # restored
    monkeypatch.setenv(lm_eval_cli.LOCAL_TASKS_ENV, "1")
    monkeypatch.setattr(sys, "argv", ["nakta-lm-eval"])
    monkeypatch.setenv("NAKTA_HELLASWAG_JSONL", str(shared_data / "hellaswag_val_full.jsonl"))


def _one_error_line(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        lm_eval_cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1, err[-3000:]
    assert "lm_eval_adapter.py" not in err and "nakta_model/" not in err, err[-3000:]
    return lines[0]


# (model, checkpoint kind, damaged part or None, model_args suffix, expected error pattern)
CASES = [
    ("nakta", "nakta", None, ",chekpoint=X", r"unknown model_args chekpoint \(did you mean"),
    ("nakta", None, None, "", r"model_args needs checkpoint=DIR"),
    ("nakta", "missing", None, "", r"nakta checkpoint .*nope: no such directory"),
    ("nakta", "nakta", "tokenizer", "", r"tokenizer .*tokenizer.model: cannot read it"),
    ("nakta", "nakta", "params", "", r"cannot load it: .*params.json: cannot read it as JSON"),
    ("nakta", "nakta", "truncated-safetensors", "", r"cannot load it: .*truncated"),
    ("nakta", "meta", "tokenizer", "", r"tokenizer .*: cannot read it"),
    ("nakta", "meta", "params", "", r"cannot load it: .*params.json"),
    ("nakta", "meta", "consolidated", "", r"not a checkpoint, params.json without consolidated"),
    ("nakta", "meta", "truncated-pth", "", r"cannot load it: .*consolidated.00.pth"),
    ("nakta", "nakta", None, ",kernels=fast", r"kernels must be one of"),
    ("nakta", "nakta", None, ",quant=int4", r"quant must be None or 'fp8'"),
    ("nakta", "nakta", None, ",device=gpu", r"device 'gpu': expected cpu, cuda or cuda:N"),
    ("llama_org", "meta", None, ",chekpoint=X", r"llama_org: unknown model_args chekpoint"),
    ("llama_org", None, None, "", r"llama_org: model_args needs checkpoint=DIR"),
    ("llama_org", "missing", None, "", r"llama_org checkpoint .*nope does not exist"),
    ("llama_org", "meta", "tokenizer", "", r"tokenizer .*: cannot read it"),
    ("llama_org", "meta", "params", "", r"llama_org checkpoint .*: cannot load it: .*JSON"),
    ("llama_org", "meta", "consolidated", "", r"must be a Meta dir"),
    ("llama_org", "meta", "truncated-pth", "", r"llama_org checkpoint .*: cannot load it"),
]


@pytest.mark.parametrize(
    ("model", "kind", "part", "extra", "pattern"),
    CASES,
    ids=[f"{m}-{k}-{p}{e.split('=')[0]}" for m, k, p, e, _ in CASES],
)
def test_bad_model_args_and_unreadable_parts_are_one_error_line(
    model, kind, part, extra, pattern, ckpts, cli_env, tmp_path, capsys
):
    if kind is None:
        model_args = extra.lstrip(",") or "tokenizer=x"
    else:
        path = tmp_path / "nope" if kind == "missing" else ckpts[kind]
        if part is not None:
            path = _damage(ckpts[kind], tmp_path / part, part)
        model_args = f"checkpoint={path}{extra}"
        if extra.startswith(",chekpoint"):  # the misspelled key alone
            model_args = f"chekpoint={path}"
    line = _one_error_line(_argv(model, model_args), capsys)
    assert re.search(pattern, line), line


@pytest.mark.parametrize("cls", [NaktaLM, LlamaOrgLM])
def test_lm_evals_own_batch_size_and_device_beside_model_args_are_passed_once(cls, ckpts, caplog):
    """lm-eval passes ``batch_size`` / ``device`` beside model_args (its CLI: batch size 1 when
    not given): the model_args value wins, a given and differing one is a warning line."""
    ckpt = ckpts["meta" if cls is LlamaOrgLM else "nakta"]
    lm = cls.create_from_arg_string(
        f"checkpoint={ckpt},batch_size=4,device=cpu", {"batch_size": 1, "device": None}
    )
    assert lm.rows == 4 and lm.device.type == "cpu"
    assert "ignored" not in caplog.text
    with caplog.at_level(logging.WARNING):
        lm = cls.create_from_arg_obj(
            {"checkpoint": str(ckpt), "batch_size": "4"}, {"batch_size": 8, "device": "cpu"}
        )
    assert lm.rows == 4
    assert "model_args batch_size=4 is used; lm-eval's --batch_size 8 is ignored" in caplog.text


def test_a_run_given_no_device_does_not_warn_about_cuda0(ckpts, cli_env, caplog, capsys):
    """No ``--device``: the model gets None (CUDA when present, else the CPU), not lm-eval's
    ``cuda:0`` default and a warning that it is missing."""
    argv = [a for a in _argv("nakta", f"checkpoint={ckpts['nakta']}") if a not in ("--device",)]
    argv.remove("cpu")
    seen: dict = {}
    original = NaktaLM.__init__

    def spy(self, *a, **kw):
        seen.update(kw)
        original(self, *a, **kw)

    NaktaLM.__init__ = spy
    try:
        with caplog.at_level(logging.WARNING):
            lm_eval_cli.main(argv)
    finally:
        NaktaLM.__init__ = original
    assert "device" not in seen
    assert "requested but" not in caplog.text + capsys.readouterr().err


def test_model_args_errors_before_the_group_is_up_print_from_rank_0_only(monkeypatch, capsys):
    """Under a launch of several ranks with no process group yet, rank 0 prints the line and
    the others exit 2 quietly (after a moment: rank 0's status is the one the launcher reports)."""
    from nakta_model import cli

    slept = []
    monkeypatch.setattr(cli.time, "sleep", slept.append)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, printed in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exc:
            cli.exit_with_error("bad\nthing")
        assert exc.value.code == 2
        assert error_lines(capsys.readouterr().err) == (["error: bad thing"] if printed else [])
    assert slept == [cli.QUIET_RANK_DELAY_S]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["misspelled", "tokenizer"])
def test_under_dp2_the_error_is_printed_once(case, ckpts, shared_data, tmp_path):
    """``dp=2`` through the entry's own launcher: a key refused before the ranks' group is up,
    and a tokenizer that fails after it: one ``error:`` line, exit status 2."""
    if case == "misspelled":
        model_args = f"chekpoint={ckpts['nakta']},dp=2"
    else:
        model_args = f"checkpoint={_damage(ckpts['nakta'], tmp_path / 'tok', 'tokenizer')},dp=2"
    argv = [a for a in _argv("nakta", model_args) if a not in ("--device", "cpu")]
    proc = run_script(
        ["-m", "accuracy_test.lm_eval_cli", *argv], REPO, timeout=180,
        NAKTA_HELLASWAG_JSONL=str(shared_data / "hellaswag_val_full.jsonl"),
        **{lm_eval_cli.LOCAL_TASKS_ENV: "1"},
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    lines = error_lines(output)
    assert len(lines) == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
