"""speed_bench's commands as written: by script path (from the repo root and from inside
speed_bench/), with ``python -m``, and under ``torchrun`` (tp = world size by default; llama_org
as Meta's model parallel over the whole world); bad paths are one line and exit status 2.

Every run is a subprocess on the tiny preset with a few embedded tasks (see cli_helpers for why
``python -S``). The torchrun runs are marked slow (~15 s each on 2 CPU cores).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from cli_helpers import REPO, error_lines, run_script, torchrun

from nakta_model.parallel import ParallelConfigError, ParallelContext, validate_grid
from speed_bench import run_all
from speed_bench.engines import skip_reason
from speed_bench.run_all import EngineSet, resolve_grid

TINY = ["--preset", "tiny", "--warmup", "0", "--no-progress", "--device", "cpu"]
FEW = [*TINY, "--limit", "4"]


def _summary(out: Path) -> dict:
    for f in ("summary.json", "speed.csv", "speed.md", "speed.png"):
        assert (out / f).stat().st_size > 0, f
    return json.loads((out / "summary.json").read_text())


# ----------------------------------------------------------------------------- one process
@pytest.mark.parametrize(
    "argv,cwd",
    [
        (["speed_bench/nakta_speed.py"], REPO),
        (["nakta_speed.py"], REPO / "speed_bench"),
        (["-m", "speed_bench.nakta_speed"], REPO),
    ],
    ids=["path-from-root", "path-inside-speed_bench", "module"],
)
def test_nakta_speed_runs_in_every_form(argv, cwd, tmp_path):
    proc = run_script([*argv, *FEW, "--out", str(tmp_path)], cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tasks_per_s" in proc.stdout and f"results -> {tmp_path}" in proc.stdout
    summary = _summary(tmp_path)
    assert set(summary["engines"]) == {"nakta", "nakta_cache"}
    assert (summary["tp"], summary["dp"], summary["workload"]["tasks"]) == (1, 1, 4)
    assert summary["engines"]["nakta_cache"]["pred_agree_vs_ref"] == 1.0


def test_engine_scripts_by_path_are_run_all_with_their_engines():
    """llama_speed / hf_speed: run_all's parser (same options), their own engines only (the
    runs themselves are run_all's, tested above and under torchrun below)."""
    for script, engines in (("llama_speed.py", "llama_org"), ("hf_speed.py", "hf")):
        proc = run_script([script, "--help"], REPO / "speed_bench")
        assert proc.returncode == 0, proc.stderr[-3000:]
        text = " ".join(proc.stdout.split())
        assert f"usage: {script}" in text and "--token-budget" in text and "--dp" in text
        assert f"comma-separated, from {engines} (default: {engines})" in text


def _names(argv, engine_set=run_all.RUN_ALL) -> tuple[str, ...]:
    return tuple(spec.name for spec in run_all.parse_args(argv, engine_set).engines)


def test_engine_scripts_take_only_their_engines(capsys):
    nakta = EngineSet(("nakta", "nakta_cache"), "nakta", "Nakta")
    assert _names(["--engines", "nakta_cache"], nakta) == ("nakta_cache",)
    assert _names([], nakta) == ("nakta", "nakta_cache")
    with pytest.raises(SystemExit) as exc:
        run_all.parse_args(["--engines", "nakta,hf"], nakta)
    assert exc.value.code == 2
    assert "--engines: choose from nakta,nakta_cache, got ['hf']" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --quant fp8 would time nakta_cache_fp8: not this set's
        run_all.parse_args(["--engines", "nakta_cache", "--quant", "fp8"], nakta)
    assert "got ['nakta_cache_fp8']" in capsys.readouterr().err


def test_engines_and_quant_are_read_once_into_specs():
    """``--engines`` names and ``--quant`` become EngineSpecs (kind + Precision) at the entry;
    the name is only what tables show, never parsed again below."""
    from nakta_model.fp8 import Precision
    from speed_bench.engines import EngineSpec, engine_spec

    args = run_all.parse_args(["--engines", "nakta,nakta_cache_fp8,hf", "--quant", "fp8"])
    fp8 = Precision("fp8")
    assert args.engines == (
        EngineSpec("nakta", fp8), EngineSpec("nakta_cache", fp8), EngineSpec("hf"),
    )  # fmt: skip
    assert [s.name for s in args.engines] == ["nakta_fp8", "nakta_cache_fp8", "hf"]
    assert args.precision == fp8
    both = run_all.parse_args(["--engines", "nakta_cache,nakta_cache_fp8"]).engines
    assert [(s.kind, s.precision.quant) for s in both] == [
        ("nakta_cache", None), ("nakta_cache", "fp8"),
    ]  # fmt: skip
    assert engine_spec("nakta_ctx_fp8") == EngineSpec("nakta_ctx", fp8)
    assert engine_spec(both[0]) is both[0]
    with pytest.raises(ValueError, match="unknown engine 'hf_fp8'"):
        engine_spec("hf_fp8")
    with pytest.raises(ValueError, match="has no quant"):
        EngineSpec("llama_org", fp8)


def test_default_results_folders_do_not_overwrite_each_other(monkeypatch, tmp_path):
    monkeypatch.setattr(run_all, "results_dir", lambda _file, slug: tmp_path / slug)
    one, grid = ParallelContext(), ParallelContext(tp_rank=0, tp_size=2)
    nakta = EngineSet(("nakta",), "nakta", "")
    assert run_all.default_out(run_all.RUN_ALL, "cpu", "random-tiny", one) == tmp_path / "cpu"
    assert run_all.default_out(nakta, "cpu", "random-tiny", one) == tmp_path / "cpu" / "nakta"
    assert run_all.default_out(nakta, "cpu", "random-tiny", grid) == (
        tmp_path / "cpu" / "nakta" / "random-tiny-tp2-dp1"
    )


def test_an_earlier_run_in_a_folder_of_ones_own_is_never_replaced_silently(tmp_path):
    """A second run into a folder holding results (the git-ignored results/cpu/, any --out) is
    refused before anything is timed, unless --overwrite; a catalogue folder
    (results/<device>/ with its README.md index, and its subfolders) is replaced."""
    from nakta_model.cli import InputError

    cpu = tmp_path / "speed_bench" / "results" / "cpu"
    run_all.check_replaceable(cpu, overwrite=False)  # nothing there yet
    for out in (cpu, cpu / "nakta", tmp_path / "mine"):
        out.mkdir(parents=True, exist_ok=True)
        (out / "speed.md").write_text("an earlier run")
        with pytest.raises(InputError, match=r"earlier run's results \(speed.md, .*--overwrite"):
            run_all.check_replaceable(out, overwrite=False)
        run_all.check_replaceable(out, overwrite=True)
    (cpu / "notes.txt").write_text("not a result file")
    (tmp_path / "mine" / "speed.md").unlink()
    run_all.check_replaceable(tmp_path / "mine", overwrite=False)  # no result file left
    device = tmp_path / "speed_bench" / "results" / "nvidia-h200"
    (device / "nakta").mkdir(parents=True)
    for out in (device, device / "nakta"):
        (out / "summary.json").write_text("{}")
    (device / "README.md").write_text("# the catalogue's index")
    assert run_all.in_catalogue(device) and run_all.in_catalogue(device / "nakta")
    assert not run_all.in_catalogue(cpu) and not run_all.in_catalogue(tmp_path / "mine")
    run_all.check_replaceable(device, overwrite=False)
    run_all.check_replaceable(device / "nakta", overwrite=False)
    assert run_all.in_catalogue(REPO / "speed_bench" / "results" / "nvidia-h200")


def test_a_tiny_model_run_says_why_the_caches_are_not_faster():
    from nakta_model.config import preset

    rows = {"nakta": {"tasks_per_s": 10.0}, "nakta_cache": {"tasks_per_s": 0.9}}
    note = run_all.tiny_model_note(rows, preset("tiny"), torch.device("cpu"))
    assert note.startswith("note: nakta_cache 0.09x nakta on a tiny model (")
    assert "--checkpoint, or --preset 7B on a GPU" in note and "\n" not in note
    assert run_all.tiny_model_note(rows, preset("7B"), torch.device("cpu")) is None
    assert run_all.tiny_model_note({"nakta": rows["nakta"]}, preset("tiny"), "cpu") is None


def test_grid_defaults_to_one_replica_over_the_world():
    assert resolve_grid(None, None, 1) == (1, 1)
    assert resolve_grid(None, None, 4) == (4, 1)  # the seed's torchrun --nproc_per_node 4
    assert resolve_grid(None, 2, 4) == (2, 2)  # --dp 2: tp = world / dp
    assert resolve_grid(None, 4, 4) == (1, 4)
    assert resolve_grid(2, None, 4) == (2, 2)
    assert resolve_grid(2, 1, 2) == (2, 1)  # explicit: as given
    assert resolve_grid(2, None, 1) == (2, 1)  # plain python with --tp 2: refused below
    # pairs that cannot make the world are left for validate_grid to refuse, with its message
    for tp, dp, world, match in [
        (None, 3, 4, r"world size 4 != tp 1 x dp 3"),
        (3, None, 4, r"world size 4 != tp 3 x dp 1"),
        (None, 8, 4, r"world size 4 != tp 1 x dp 8"),
        (0, None, 4, r"--tp must be a positive integer"),
        (2, None, 1, r"torchrun --nproc_per_node 2"),
    ]:
        with pytest.raises(ParallelConfigError, match=match):
            validate_grid(*resolve_grid(tp, dp, world), world)


def test_engines_that_cannot_run_on_a_grid_are_skipped_or_refused():
    tp2 = ParallelContext(tp_rank=0, tp_size=2)
    dp2 = ParallelContext(dp_rank=0, dp_size=2)
    assert skip_reason("nakta_cache", dp2) is None
    assert skip_reason("llama_org", tp2) is None  # Meta's MP over the whole world
    assert "--dp 1" in skip_reason("llama_org", dp2)
    assert "single-GPU engine" in skip_reason("hf", tp2)
    with pytest.raises(run_all.InputError, match="no requested engine can run here: hf: single"):
        run_all.plan_engines(("hf",), tp2)
    assert set(run_all.plan_engines(("nakta", "llama_org", "hf"), dp2)) == {"llama_org", "hf"}


# ----------------------------------------------------------------------------- bad input
def _bad_inputs(tmp_path: Path, data: Path) -> dict[str, tuple[list[str], str]]:
    """argv -> the one error line expected (a regex), for every kind of bad path."""
    tok = data / "llama_tokenizer.model"
    jsonl = data / "hellaswag_val_subset1000.jsonl"
    (tmp_path / "empty_dir").mkdir()
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("this is not json\n")
    fake = tmp_path / "fake_ckpt"
    fake.mkdir()
    (fake / "params.json").write_text('{"dim": 64, "n_layers": 1, "n_heads": 4}')
    (fake / "consolidated.00.pth").write_bytes(b"not a torch file")
    return {
        "checkpoint-missing": (["--checkpoint", "/nope"], r"--checkpoint /nope: no such directory"),
        "checkpoint-not-a-checkpoint": (
            ["--checkpoint", str(tmp_path / "empty_dir")],
            r"empty_dir: not a checkpoint, no params.json or config.json in it",
        ),
        "checkpoint-unloadable": (
            ["--checkpoint", str(fake)],
            r"fake_ckpt: cannot load it: CheckpointError: .*consolidated.00.pth: cannot read",
        ),
        "data-missing": (
            ["--data", "/nope", "--tokenizer", str(tok)],
            r"--data /nope: no such file \(expected a HellaSwag .jsonl file\)",
        ),
        "tokenizer-missing": (
            ["--data", str(jsonl), "--tokenizer", "/nope"],
            r"--tokenizer /nope: no such file",
        ),
        "tokenizer-not-a-model": (
            ["--data", str(jsonl), "--tokenizer", str(jsonl)],
            r"--tokenizer .*subset1000.jsonl: not a SentencePiece model",
        ),
        "data-unreadable": (
            ["--data", str(garbage), "--tokenizer", str(tok)],
            r"--data .*garbage.jsonl: cannot read HellaSwag tasks from it .*line 1: not valid JSON",
        ),
        "vocab-mismatch": (
            ["--preset", "tiny", "--data", str(jsonl), "--tokenizer", str(tok), "--limit", "2"],
            r"the workload uses token ids up to \d+ but the model's vocabulary has 256",
        ),
        "preset-unknown": (["--preset", "nope"], r"--preset nope: unknown preset 'nope'"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "checkpoint-missing",
        "checkpoint-not-a-checkpoint",
        "checkpoint-unloadable",
        "data-missing",
        "tokenizer-missing",
        "tokenizer-not-a-model",
        "data-unreadable",
        "vocab-mismatch",
        "preset-unknown",
    ],
)
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, shared_data, capsys):
    argv, pattern = _bad_inputs(tmp_path, shared_data)[case]
    with pytest.raises(SystemExit) as exc:
        run_all.main([*argv, "--device", "cpu", "--no-progress", "--out", str(tmp_path / "o")])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert re.search(pattern, lines[0]), lines[0]
    assert "device cpu" not in captured.out  # refused before anything was built or timed
    assert not (tmp_path / "o").exists()


def test_bad_path_by_script_path_prints_no_traceback():
    proc = run_script(["speed_bench/run_all.py", "--checkpoint", "/nope"], REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --checkpoint /nope: no such directory (expected a checkpoint folder: Nakta "
        "(convert.py's params.json + manifest.json), Meta (params.json + consolidated.*.pth) or "
        "HF (config.json + weights))"
    ]


# ----------------------------------------------------------------------------- torchrun
@pytest.mark.slow
def test_nakta_speed_under_torchrun_splits_over_the_world(tmp_path):
    """The seed's ``cd speed_bench && torchrun --nproc_per_node N nakta_speed.py``: tp = N."""
    rc, output = torchrun(["nakta_speed.py", *FEW, "--out", str(tmp_path)], REPO / "speed_bench")
    assert rc == 0, output[-3000:]
    summary = _summary(tmp_path)
    assert (summary["gpus"], summary["tp"], summary["dp"]) == (2, 2, 1)
    assert set(summary["engines"]) == {"nakta", "nakta_cache"}
    assert output.count("results -> ") == 1  # rank 0 alone prints and writes


@pytest.mark.slow
def test_llama_speed_under_torchrun_is_meta_model_parallel(tmp_path):
    """``torchrun --nproc_per_node 2 speed_bench/llama_speed.py``: fairscale MP = 2, each rank
    its shard of the same seeded weights, so the predictions are one process's."""
    from nakta_model.tasks.hellaswag import evaluate
    from speed_bench.engines import EngineConfig, make_engine
    from speed_bench.weights import weight_source
    from speed_bench.workload import synthetic_workload

    argv = [*TINY, "--limit", "8", "--out", str(tmp_path)]
    rc, output = torchrun(["speed_bench/llama_speed.py", *argv], REPO)
    assert rc == 0, output[-3000:]
    summary = _summary(tmp_path)
    assert (summary["tp"], summary["dp"], list(summary["engines"])) == (2, 1, ["llama_org"])
    assert "initializing model parallel with size 2" in output

    weights = weight_source("tiny", None, seed=0)
    workload = synthetic_workload(8, weights.args.vocab_size, 0, weights.args.max_seq_len)
    cfg = EngineConfig(
        torch.device("cpu"), torch.float32, 2048, weights.args.max_seq_len, progress=False
    )
    engine = make_engine("nakta_cache", weights, cfg, {})
    lls = [ll for ll, _ in engine.score(workload.requests)]
    _, docs = evaluate(workload.docs, lls)
    assert summary["predictions"]["llama_org"] == {
        "acc": "".join(str(d.pred) for d in docs),
        "acc_norm": "".join(str(d.pred_norm) for d in docs),
    }


BAD_PATH_RUNS = 5  # the abort it guards against came about one exit in two


@pytest.mark.slow
def test_bad_path_under_torchrun_is_one_line_from_one_rank(tmp_path):
    """Clean on every run: run_all checks fairscale while the gloo group is up, and fairscale's
    import pins the group (``group=dist.group.WORLD`` default arguments), so a normal
    interpreter exit aborted at random (``terminate called without an active exception``)."""
    for run in range(BAD_PATH_RUNS):
        rc, output = torchrun(
            ["speed_bench/run_all.py", "--data", "/nope", "--tokenizer", "/x"], REPO
        )
        where = f"run {run + 1}/{BAD_PATH_RUNS}:\n{output[-3000:]}"
        assert rc != 0, where
        assert error_lines(output) == [
            "error: --data /nope: no such file (expected a HellaSwag .jsonl file)"
        ], where
        assert "exitcode  : 2" in output, where  # rank 0 exits by itself (status 2), not killed
        assert "SIGABRT" not in output and "terminate called" not in output, where
        assert 'run_all.py", line' not in output, where  # no traceback of ours


def test_default_preset_splits_over_the_seed_grid():
    """Without --preset a CPU run picks a tiny model whose KV heads split over tp, so the
    seed's `torchrun --nproc_per_node 4 nakta_speed.py` runs as written (tiny has 2 KV heads)."""
    from nakta_model.config import preset
    from speed_bench.run_all import _default_preset

    cpu = torch.device("cpu")
    assert _default_preset(cpu) == _default_preset(cpu, 2) == "tiny"
    four = _default_preset(cpu, 4)
    assert four == "tiny-mha" and preset(four).n_kv_heads % 4 == 0
