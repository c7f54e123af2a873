"""speed_bench.families_report: the families' rows read from the benches' own summaries."""

from __future__ import annotations

import json

import pytest

from speed_bench import families_report


def _write(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def _lm_eval_run(model, wall, acc, limit=None, n=10042):
    return {"model": model, "wall_s": wall, "acc": acc, "num_fewshot": 0, "limit": limit,
            "n": n, "error": None}  # fmt: skip


def test_collect_reads_every_measure(tmp_path):
    root = tmp_path / "families"
    _write(
        root / "llama3-8B" / "lm_eval" / "lm_eval_summary.json",
        {"device_name": "GPU X", "runs": [_lm_eval_run("nakta", 40.0, 0.25),
                                          _lm_eval_run("hf", 120.0, 0.251),
                                          _lm_eval_run("hf", 100.0, 0.251)]},
    )  # fmt: skip
    _write(
        root / "llama3-8B" / "decode" / "decode_summary.json",
        {"runs": [
            {"engine": "nakta", "batch": 1, "prompt": 512, "pct_of_floor": 80.0},
            {"engine": "nakta", "batch": 1, "prompt": 64, "pct_of_floor": 86.0},
            {"engine": "hf", "batch": 1, "prompt": 64, "pct_of_floor": 30.0},
            {"engine": "nakta", "batch": 8, "prompt": 64, "pct_of_floor": 70.0},
        ]},
    )  # fmt: skip
    _write(
        root / "llama3-8B" / "throughput" / "throughput_summary.json",
        {"device_name": "GPU X", "runs": [
            {"engine": "nakta", "max_batch": 256, "output_tok_s": 15000.0},
            {"engine": "nakta", "max_batch": 512, "output_tok_s": 17000.0},
            {"engine": "hf", "max_batch": 128, "output_tok_s": 7000.0},
        ]},
    )  # fmt: skip
    _write(
        root / "llama3-8B" / "throughput_fp8" / "throughput_summary.json",
        {"runs": [{"engine": "nakta_fp8", "max_batch": 512, "output_tok_s": 24000.0}]},
    )
    summary, missing = families_report.collect(root)
    rows = {(r["preset"], r["measure"]): r for r in summary["runs"]}
    assert summary["device_name"] == "GPU X"
    assert rows["llama3-8B", "lm_eval_hellaswag_full_0shot_s"]["nakta"] == 40.0
    assert rows["llama3-8B", "lm_eval_hellaswag_full_0shot_s"]["peer_value"] == 100.0
    assert rows["llama3-8B", "lm_eval_acc"]["peer_value"] == 0.251
    assert rows["llama3-8B", "decode_b1_pct_floor"]["nakta"] == 86.0  # the shortest prompt
    assert rows["llama3-8B", "decode_b1_pct_floor"]["peer_value"] == 30.0
    assert rows["llama3-8B", "throughput_128_128_tok_s"]["nakta"] == 17000.0
    fp8 = rows["llama3-8B", "throughput_128_128_fp8_tok_s"]
    assert (fp8["nakta"], fp8["peer_value"]) == (24000.0, 7000.0)  # HF from the bf16 run
    assert families_report.ratio(rows["llama3-8B", "throughput_128_128_tok_s"]) == 17000 / 7000
    assert missing == []
    assert families_report.ratio(rows["llama3-8B", "lm_eval_hellaswag_full_0shot_s"]) == 2.5
    families_report.write_outputs(summary, root, missing)
    written = json.loads((root / "families_summary.json").read_text())
    assert set(written) == {"device_name", "runs"}
    assert set(written["runs"][0]) == {"preset", "measure", "nakta", "peer", "peer_value"}
    assert "throughput_128_128_fp8_tok_s" in (root / "families.md").read_text()
    assert (root / "families.png").stat().st_size > 0


def test_a_limited_lm_eval_run_is_named_by_its_task_count(tmp_path):
    rows = families_report.lm_eval_rows(
        "mistral-7B",
        {"runs": [_lm_eval_run("nakta", 9.0, 0.26, 1000, 1000), _lm_eval_run("hf", 20.0, 0.26)]},
    )
    assert rows[0]["measure"] == "lm_eval_hellaswag_1000_0shot_s"


def test_errors_name_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match="no families results"):
        families_report.collect(tmp_path)
    with pytest.raises(ValueError, match="nakta and an hf"):
        families_report.lm_eval_rows("x", {"runs": [_lm_eval_run("nakta", 1.0, 0.2)]})
    assert families_report.main(["--root", str(tmp_path)]) == 2
