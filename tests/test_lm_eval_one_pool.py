"""``speed_bench/lm_eval_one_pool.py``'s pure parts: lm-eval samples read back, the one call's
answers compared with the runs alone, metrics compared without the sample count, its command
line. (On a GPU, ``scripts/reproduce_lm_eval.sh one_pool`` runs the whole driver.)"""

from __future__ import annotations

import json

import pytest

from speed_bench import lm_eval_one_pool as op


def _samples(folder, task, docs):
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"doc_id": i, "resps": r}) for i, r in docs.items()]
    (folder / f"samples_{task}_2026-01-01T00-00-00.123456.jsonl").write_text("\n".join(lines))


def test_samples_are_read_per_task_and_compared_per_requested_task(tmp_path):
    one, alone = tmp_path / "one" / "model", tmp_path / "alone" / "model"
    ll = {0: [[[-1.0, True]], [[-2.0, False]]], 1: [[[-3.0, False]], [[-0.5, True]]]}
    _samples(one, "mmlu_shaped_anatomy", ll)
    _samples(alone, "mmlu_shaped_anatomy",
             {0: [[[-1.25, True]], [[-2.0, False]]], 1: [[[-3.0, True]], [[-0.5, True]]]})  # fmt: skip
    _samples(one, "gsm8k_shaped_local", {0: [["a b"]], 1: [["c"]]})
    _samples(alone, "gsm8k_shaped_local", {0: [["a b"]], 1: [["d"]], 2: [["e"]]})
    got, want = op.read_samples(tmp_path / "one"), op.read_samples(tmp_path / "alone")
    assert set(got) == {"mmlu_shaped_anatomy", "gsm8k_shaped_local"}
    assert got["gsm8k_shaped_local"] == {0: [["a b"]], 1: [["c"]]}
    res = op.compare(
        {"samples": got}, {"samples": want}, ["gsm8k_shaped_local", "mmlu_shaped_local"]
    )
    assert res["mmlu_shaped_local"] == {
        "docs": 2, "max_abs_dll": 0.25, "greedy_flips": 1, "answers_differ": 0
    }  # fmt: skip
    assert res["gsm8k_shaped_local"] == {
        "docs": 2, "max_abs_dll": 0.0, "greedy_flips": 0, "answers_differ": 1
    }  # fmt: skip


def test_metrics_are_compared_without_the_sample_count():
    one = {"mmlu_shaped_local": {"acc": 0.25, "n": 177}}
    assert op._values(one) == op._values({"mmlu_shaped_local": {"acc": 0.25, "n": 171}})
    assert op._values(one) != op._values({"mmlu_shaped_local": {"acc": 0.3, "n": 177}})


@pytest.mark.parametrize(
    "extra, message", [(["--tasks", ","], "--tasks"), (["--limit", "0"], "--limit")]
)
def test_bad_command_lines_are_refused(extra, message, capsys):
    base = ["--preset", "tiny", "--tokenizer", "t", "--data", "d", "--work", "w", "--out", "o"]
    with pytest.raises(SystemExit):
        op.parse_args(base + extra)
    assert message in capsys.readouterr().err
