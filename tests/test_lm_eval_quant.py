"""speed_bench.lm_eval_quant: the bf16-vs-FP8 lm-eval comparison's arguments, ratio and table."""

from __future__ import annotations

import pytest

from speed_bench import lm_eval_quant as lq


def _row(quant, wall, error=None):
    return {"quant": quant, "repeat": 0, "task": "hellaswag_local", "num_fewshot": 0,
            "limit": None, "error": error, "wall_s": wall, "first_request_s": 5.0,
            "scoring_s": wall - 6.0, "after_scoring_s": 1.0, "acc": 0.25, "acc_norm": 0.26}  # fmt: skip


def test_ratio_and_markdown():
    rows = [_row("bf16", 60.0), _row("fp8", 50.0), _row("fp8", 40.0), _row("bf16", 1.0, "x")]
    r = lq._ratio(rows)
    assert r["median_wall_s"] == {"bf16": 60.0, "fp8": 45.0}
    assert r["bf16_over_fp8_wall"] == pytest.approx(60 / 45)
    md = lq.markdown({"checkpoint": "ck", "runs": rows, **r})
    assert "| fp8 | 0 | all | 50.00 |" in md and "1.333x" in md


def test_model_args_and_bad_arguments(tmp_path):
    assert lq.model_args(tmp_path, "fp8").endswith(",dtype=bf16,quant=fp8")
    assert "quant" not in lq.model_args(tmp_path, "bf16")
    with pytest.raises(SystemExit):
        lq.parse_args(["--checkpoint", "x", "--data", "y", "--out", "z", "--repeats", "0"])


def test_a_failed_write_keeps_the_previous_summary(tmp_path, monkeypatch):
    """The summary files are replaced atomically: a write that fails half-way (disk full)
    leaves the previous run's file whole, never a truncated one."""
    from pathlib import Path

    class SkippingRunner:
        def __init__(self, *a):
            pass

        def run(self, name, cmd):
            return {"name": name, "error": "skipped: not enough time left before --deadline-s"}

    monkeypatch.setattr(lq, "Runner", SkippingRunner)
    out = tmp_path / "out"
    out.mkdir()
    (out / "lm_eval_fp8.json").write_text('{"previous": true}\n')

    def half_then_fail(self, data, *a, **k):
        with open(self, "w") as f:
            f.write(data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_fail)
    monkeypatch.setattr("os.fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "full")))
    argv = ["--checkpoint", str(tmp_path), "--data", "d", "--out", str(out), "--warmup-limit", "0"]
    with pytest.raises(OSError):
        lq.main(argv)
    assert (out / "lm_eval_fp8.json").read_text() == '{"previous": true}\n'
