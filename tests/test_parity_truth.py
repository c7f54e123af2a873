"""parity.py's fp32 truth column: both half-precision models against llama_org in fp32."""

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
