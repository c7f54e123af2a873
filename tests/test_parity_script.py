"""accuracy_test/parity.py: nakta vs llama_org on the same weights, small --limit runs on CPU.

Here too: its fp32 truth column (both half-precision models against llama_org in fp32).
"""

from __future__ import annotations

import json

import pytest
from checkpoint_factory import TINY_PARAMS, train_tiny_tokenizer, write_meta_checkpoint

from accuracy_test import models, parity
from nakta_model.tasks import hellaswag


@pytest.fixture(autouse=True, scope="module")
def _llama_org_teardown():
    yield
    models.shutdown_llama_org()


def _check_result(out, n_tasks: int) -> dict:
    result = json.loads(out.read_text())
    md = out.with_suffix(".md").read_text()
    assert result["config"]["n_tasks"] == n_tasks
    assert result["config"]["n_requests"] == 4 * n_tasks
    assert result["flips"] == [] and result["identical_predictions"] is True
    assert result["n_flips"] == {"acc": 0, "acc_norm": 0}
    assert result["nakta"]["acc"] == result["llama_org"]["acc"]
    assert result["nakta"]["acc_norm"] == result["llama_org"]["acc_norm"]
    assert result["ll_abs_diff"]["max"] < 1e-3  # fp32, same weights
    assert result["greedy_flag_mismatches"] == 0
    assert "| nakta |" in md and "| llama_org |" in md
    return result


def test_tiny_meta_checkpoint(tmp_path, shared_data):
    ckpt = write_meta_checkpoint(tmp_path / "meta", {**TINY_PARAMS, "max_seq_len": 256}, seed=1)
    tok = train_tiny_tokenizer(tmp_path / "tok")
    out = tmp_path / "res" / "tiny.json"
    rc = parity.main(
        [
            "--checkpoint",
            str(ckpt),
            "--tokenizer",
            str(tok),
            "--data",
            str(shared_data / "hellaswag_val_subset1000.jsonl"),
            "--limit",
            "5",
            "--device",
            "cpu",
            "--batch-size",
            "3",
            "--token-budget",
            "600",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    result = _check_result(out, 5)
    assert result["config"]["max_length"] == 256 and result["config"]["dtype"] == "fp32"


def test_random_preset_gives_both_models_the_same_weights(tmp_path, shared_data):
    out = tmp_path / "rand.json"
    parity.main(
        [
            "--preset",
            "stories260K",
            "--random",
            "--tokenizer",
            str(shared_data / "stories260K" / "tokenizer.model"),
            "--data",
            str(shared_data / "hellaswag_val_full.jsonl"),
            "--limit",
            "3",
            "--device",
            "cpu",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    result = _check_result(out, 3)
    assert result["config"]["model"] == "stories260K-random-seed0"


def test_compare_reports_flips_with_margins():
    docs = [
        hellaswag.Doc("q", ("aa", "bbbb"), 0, ind=7),
        hellaswag.Doc("q", ("aa", "bbbb"), 1, ind=8),
    ]
    nakta = [-2.0, -2.1, -1.0, -5.0]
    org = [-2.05, -2.0, -1.0, -5.0]  # task 0: raw argmax 1 vs nakta 0
    r = parity.compare(docs, nakta, org)
    assert r["n_flips"] == {"acc": 1, "acc_norm": 0}
    (f,) = r["flips"]
    assert (f["task"], f["ind"], f["metric"], f["nakta"], f["llama_org"]) == (0, 7, "acc", 0, 1)
    assert f["margin"] == pytest.approx(0.05) and f["nakta_margin"] == pytest.approx(0.1)
    assert f["max_ll_diff"] == pytest.approx(0.1)
    assert r["acc_diff_pt"] == pytest.approx(50.0)
    assert r["identical_predictions"] is False
    assert "| 0 | 7 | acc |" in parity.markdown(
        {
            **r,
            "config": dict.fromkeys(
                [
                    "model",
                    "dtype",
                    "device",
                    "n_tasks",
                    "data",
                    "n_requests",
                    "max_length",
                    "token_budget",
                    "batch_size",
                    "torch",
                    "device_name",
                ],
                "x",
            ),
            "nakta": {**r["nakta"], "seconds": 1.0},
            "llama_org": {**r["llama_org"], "seconds": 1.0},
        }
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--tokenizer", "t", "--data", "d"],  # neither checkpoint nor random
        ["--tokenizer", "t", "--data", "d", "--random"],  # random without preset
        ["--tokenizer", "t", "--data", "d", "--checkpoint", "c", "--limit", "0"],
    ],
)
def test_bad_arguments(argv):
    with pytest.raises(SystemExit):
        parity.parse_args(argv)


def _bad_paths(tmp_path, data) -> dict[str, tuple[list[str], str]]:
    """argv -> the start of the one error line expected, for every kind of bad path."""
    ckpt, tok = str(data / "stories260K"), str(data / "stories260K" / "tokenizer.model")
    jsonl = str(data / "hellaswag_val_subset1000.jsonl")
    (tmp_path / "empty").mkdir()
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text('{"ctx": "no endings"}\n')
    return {
        "checkpoint-missing": (
            ["--checkpoint", "/nope", "--tokenizer", tok, "--data", jsonl],
            "error: --checkpoint /nope: no such directory (expected a checkpoint folder: Nakta",
        ),
        "checkpoint-not-a-checkpoint": (
            ["--checkpoint", str(tmp_path / "empty"), "--tokenizer", tok, "--data", jsonl],
            f"error: --checkpoint {tmp_path / 'empty'}: not a checkpoint, no params.json or "
            "config.json in it",
        ),
        "tokenizer-missing": (
            ["--checkpoint", ckpt, "--tokenizer", "/nope", "--data", jsonl],
            "error: --tokenizer /nope: no such file (expected a SentencePiece tokenizer.model)",
        ),
        "tokenizer-not-a-model": (
            ["--checkpoint", ckpt, "--tokenizer", jsonl, "--data", jsonl],
            f"error: --tokenizer {jsonl}: not a SentencePiece model",
        ),
        "data-missing": (
            ["--checkpoint", ckpt, "--tokenizer", tok, "--data", "/nope"],
            "error: --data /nope: no such file (expected a HellaSwag .jsonl",
        ),
        "data-unreadable": (
            ["--checkpoint", ckpt, "--tokenizer", tok, "--data", str(garbage)],
            f"error: --data {garbage}: cannot read HellaSwag tasks from it (",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "checkpoint-missing",
        "checkpoint-not-a-checkpoint",
        "tokenizer-missing",
        "tokenizer-not-a-model",
        "data-missing",
        "data-unreadable",
    ],
)
def test_bad_paths_are_one_line_and_exit_2(case, tmp_path, shared_data, capsys):
    argv, start = _bad_paths(tmp_path, shared_data)[case]
    out = tmp_path / "res" / "r.json"
    with pytest.raises(SystemExit) as exc:
        parity.main([*argv, "--device", "cpu", "--no-progress", "--out", str(out)])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(start), lines
    assert not out.exists()


def test_runs_by_path_from_its_folder_and_refuses_a_bad_path_in_one_line(shared_data):
    from cli_helpers import REPO, run_script

    tok = str(shared_data / "stories260K" / "tokenizer.model")
    argv = ["parity.py", "--checkpoint", "/nope", "--tokenizer", tok, "--data", "/x"]
    proc = run_script(argv, REPO / "accuracy_test")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "error: --checkpoint /nope: no such directory (expected a checkpoint folder: Nakta "
        "(convert.py's params.json + manifest.json), Meta (params.json + consolidated.*.pth) or "
        "HF (config.json + weights))"
    ]


def test_quant_fp8_default_out_is_its_own_file():
    """``--quant fp8`` without ``--out`` must not overwrite the plain run's result file."""
    base = ["--checkpoint", "ck/stories260K", "--data", "d", "--dtype", "bf16"]
    plain = parity.default_out(parity.parse_args(base), "cuda")
    fp8 = parity.default_out(parity.parse_args([*base, "--quant", "fp8"]), "cuda")
    assert plain.name == "stories260K_bf16_cuda.json"
    assert fp8.name == "stories260K_bf16_fp8_cuda.json"


def test_quant_fp8_on_a_device_without_fp8_is_one_line_before_scoring(
    tmp_path, shared_data, capsys, monkeypatch
):
    """No FP8 GEMMs here (the CPU outside the interpreter): one error line and status 2 before
    either model is scored, not a traceback after both were."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    scored = []
    monkeypatch.setattr(parity, "_score_reference", lambda *a, **k: scored.append(1))
    ckpt = str(shared_data / "stories260K")
    argv = ["--checkpoint", ckpt, "--data", str(shared_data / "hellaswag_val_subset1000.jsonl"),
            "--limit", "2", "--dtype", "bf16", "--quant", "fp8", "--device", "cpu",
            "--no-progress", "--out", str(tmp_path / "r.json")]  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        parity.main(argv)
    assert exc.value.code == 2 and not scored
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --quant fp8: quant='fp8' needs"), lines


# ------------------------------------------------------------------------------------------------
# parity.py's fp32 truth column: both half-precision models against llama_org in fp32.
# ------------------------------------------------------------------------------------------------


DOCS = [
    hellaswag.Doc("q", ("aa", "bbbb"), 0, ind=7),
    hellaswag.Doc("q", ("aa", "bbbb"), 1, ind=8),
    hellaswag.Doc("q", ("aa", "bbbb"), 1, ind=9),
]
TRUTH = [-2.0, -2.05, -1.0, -5.0, -3.0, -3.5]


def test_truth_comparison_counts_flips_and_the_truths_margins():
    # task 0: raw argmax 1 instead of the truth's 0 (truth margin 0.05); task 2: per-char
    # argmax 0 (-3/2 > -6.2/4) instead of the truth's 1 (-3.5/4 = -0.875; margin 0.625)
    model = [-2.1, -2.0, -1.0, -5.0, -3.0, -6.2]
    t = parity.truth_comparison(DOCS, model, TRUTH)
    assert t["n_flips"] == {"acc": 1, "acc_norm": 1}
    assert t["flip_truth_margins"]["acc"] == [pytest.approx(0.05)]
    assert t["flip_truth_margins"]["acc_norm"] == [pytest.approx(0.625)]
    hist = t["flip_margin_histogram"]
    assert [b["count"] for b in hist["acc"]] == [0, 0, 0, 1, 0]  # 0.05 in [0.01, 0.1)
    assert [b["count"] for b in hist["acc_norm"]] == [0, 0, 0, 0, 1]
    assert (hist["acc"][0]["lo"], hist["acc"][-1]["hi"]) == (0.0, float("inf"))
    assert t["ll_abs_diff"]["max"] == pytest.approx(3.2 - 0.5)
    assert t["ll_abs_diff"]["mean"] == pytest.approx((0.1 + 0.05 + 2.7) / 6)
    assert (t["acc"], t["acc_norm"]) == (0.0, 0.0)  # labels 0, 1, 1: every pick wrong


def test_same_predictions_as_the_truth_mean_no_flips():
    t = parity.truth_comparison(DOCS, [x + 1e-3 for x in TRUTH], TRUTH)
    assert t["n_flips"] == {"acc": 0, "acc_norm": 0}
    assert sum(b["count"] for b in t["flip_margin_histogram"]["acc"]) == 0
    assert t["ll_abs_diff"]["max"] == pytest.approx(1e-3)


def _side(flips: int, mean: float) -> dict:
    return {"n_flips": {"acc": flips, "acc_norm": 0}, "ll_abs_diff": {"mean": mean}}


@pytest.mark.parametrize(
    ("nakta", "org", "no_further"),
    [
        (_side(3, 0.010), _side(4, 0.011), True),
        (_side(1, 0.010), _side(0, 0.010), True),  # one flip on a handful of tasks is noise
        (_side(100, 0.010), _side(40, 0.010), False),  # far beyond two standard deviations
        (_side(4, 0.012), _side(4, 0.010), False),  # mean |dll| 20% worse
        (_side(0, 0.0), _side(0, 0.0), True),
    ],
)
def test_verdict(nakta, org, no_further):
    assert parity.truth_verdict(nakta, org)["nakta_no_further"] is no_further


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("truth")
    ckpt = write_meta_checkpoint(root / "meta", {**TINY_PARAMS, "max_seq_len": 256}, seed=1)
    return ckpt, train_tiny_tokenizer(root / "tok")


def _run(tiny, shared_data, tmp_path, *extra: str) -> tuple[dict, str]:
    ckpt, tok = tiny
    out = tmp_path / "r.json"
    argv = ["--checkpoint", str(ckpt), "--tokenizer", str(tok), "--device", "cpu"]
    argv += ["--data", str(shared_data / "hellaswag_val_subset1000.jsonl"), "--limit", "6"]
    argv += ["--out", str(out), "--no-progress", *extra]
    assert parity.main(argv) == 0
    return json.loads(out.read_text()), out.with_suffix(".md").read_text()


def test_bf16_run_reports_both_models_against_the_fp32_truth(tiny, shared_data, tmp_path, capsys):
    result, md = _run(tiny, shared_data, tmp_path, "--dtype", "bf16")
    assert result["config"]["truth"] == "fp32"
    truth = result["truth"]
    for name in ("nakta", "llama_org"):
        t = truth[name]
        assert (t["acc"], t["acc_norm"]) == (result[name]["acc"], result[name]["acc_norm"])
        assert 0 < t["ll_abs_diff"]["mean"] <= t["ll_abs_diff"]["max"] < 1.0  # bf16 vs fp32
        assert sum(b["count"] for b in t["flip_margin_histogram"]["acc"]) == t["n_flips"]["acc"]
    assert truth["reference"]["dtype"] == "fp32" and truth["reference"]["seconds"] > 0
    assert isinstance(truth["verdict"]["nakta_no_further"], bool)
    assert "## Against the fp32 truth" in md and "| llama_org-fp32 (truth) |" in md
    assert "| nakta-bf16 |" in md and "| [0.01, 0.1) |" in md
    assert "**Verdict: nakta-bf16 is" in md and "**Verdict" in capsys.readouterr().out


def test_fp32_truth_of_the_upcast_weights_equals_an_fp32_run(tiny, shared_data, tmp_path):
    """The truth is llama_org in fp32 on the very weights the bf16 models hold."""
    import torch

    ckpt, tok = tiny
    llama = models.load_llama_org(ckpt, tok, torch.device("cpu"), torch.bfloat16, 64, 2)
    params, state = models.fp32_weights(llama)
    assert all(v.dtype == torch.float32 for v in state.values()) and "rope.freqs" not in state
    truth = models.llama_org_fp32(params, state, tok, torch.device("cpu"), 64, 2)
    x = torch.tensor([[1, 5, 9, 30]])
    want = llama.model.float()(x, 0)  # the bf16 weights, upcast in place
    assert torch.equal(truth.model(x, 0), want)


def test_truth_none_and_fp32_runs_skip_the_truth_pass(tiny, shared_data, tmp_path):
    result, md = _run(tiny, shared_data, tmp_path, "--dtype", "bf16", "--truth", "none")
    assert "truth" not in result and result["config"]["truth"] == "none"
    assert "fp32 truth" not in md
    result, _ = _run(tiny, shared_data, tmp_path)  # fp32: the run is its own truth
    assert "truth" not in result and result["config"]["truth"] == "none"
