"""speed_bench.fp8_report: the FP8 summary from run_all / decode_speed / parity outputs."""

from __future__ import annotations

import json

import pytest

from speed_bench import fp8_report


def _runs(engine: str, tok: dict[int, float], floor: float) -> list[dict]:
    runs = [
        {"batch": b, "engine": engine, "prompt": 64, "shared_prefix": 0, "tok_s": t,
         "floor_tok_s": floor * b}
        for b, t in tok.items()
    ]  # fmt: skip
    runs.append({"batch": 1, "engine": engine, "prompt": 512, "tok_s": 1.0, "floor_tok_s": 2})
    return runs


def _parity(model: str, flips_bf: int, flips_f8: int) -> dict:
    def cmp(flips, dll):
        return {"n_flips": {"acc": flips, "acc_norm": 1}, "ll_abs_diff": {"mean": dll, "max": 1},
                "acc": 0.3, "acc_norm": 0.31}  # fmt: skip

    return {
        "config": {"model": model, "dtype": "bf16", "n_tasks": 100},
        "truth": {"nakta": cmp(flips_bf, 0.01), "nakta_fp8": cmp(flips_f8, 0.05)},
    }


def test_summary_schema_and_files(tmp_path):
    files = {
        "scoring": {"device": "nvidia-h100", "model": "random-7B",
                    "engines": {"nakta_cache": {"tasks_per_s": 100.0},
                                "nakta_cache_fp8": {"tasks_per_s": 150.0}}},
        "decode": {"device": "nvidia-h100",
                   "runs": _runs("nakta", {1: 200.0, 32: 3000.0}, 250.0)
                   + _runs("nakta_fp8", {1: 350.0, 32: 4500.0}, 420.0)},
        "p1": _parity("stories260K", 10, 14),
        "p2": _parity("aidreams260K", 3, 5),
    }  # fmt: skip
    paths = {}
    for k, v in files.items():
        paths[k] = tmp_path / f"{k}.json"
        paths[k].write_text(json.dumps(v))
    out = tmp_path / "fp8"
    rc = fp8_report.main(
        ["--scoring", str(paths["scoring"]), "--decode", str(paths["decode"]),
         "--parity", str(paths["p1"]), str(paths["p2"]), "--out", str(out)]
    )  # fmt: skip
    assert rc == 0
    s = json.loads((out / "fp8_summary.json").read_text())
    assert s["device_name"] == "nvidia-h100"
    assert s["scoring"]["bf16_tasks_per_s"] == 100.0 and s["scoring"]["fp8_tasks_per_s"] == 150.0
    assert [d["batch"] for d in s["decode"]] == [1, 32]
    assert s["decode"][0]["fp8_floor_tok_s"] == 420.0 and s["decode"][1]["fp8_tok_s"] == 4500.0
    acc = {(a["model"], a["quant"]): a for a in s["accuracy"]}
    assert acc[("stories260K", "fp8")]["flips_vs_truth"] == 15
    assert acc[("aidreams260K", "bf16")]["mean_abs_dll_vs_truth"] == 0.01
    for name in ("fp8.md", "fp8.csv", "fp8.png"):
        assert (out / name).stat().st_size > 0
    assert "1.5" in (out / "fp8.md").read_text()


def test_missing_engine_or_fp8_column_is_an_error():
    with pytest.raises(ValueError, match="nakta_cache_fp8"):
        fp8_report.scoring_rates({"engines": {"nakta_cache": {"tasks_per_s": 1}}})
    with pytest.raises(ValueError, match="parity --quant fp8"):
        fp8_report.accuracy_rows({"truth": {"nakta": {}}})
    with pytest.raises(ValueError, match="no batch size"):
        fp8_report.decode_rows({"runs": []})


def test_plot_shows_the_full_precision_flips_whatever_the_dtype(tmp_path, monkeypatch):
    """A parity run in fp16 (quant "fp16" beside "fp8") still gets its bar: the table pairs
    the non-fp8 row with fp8, and so must the plot (it drew 0 flips for it)."""
    p = _parity("stories260K", 10, 14)
    p["config"]["dtype"] = "fp16"
    summary = {
        "device_name": "d",
        "scoring": {"fp8_vs_bf16": 1.5},
        "decode": [{"batch": 1, "fp8_vs_bf16": 1.7}],
        "accuracy": fp8_report.accuracy_rows(p),
    }
    figs = []
    monkeypatch.setattr(fp8_report, "save_figure", lambda fig, path: figs.append(fig))
    fp8_report._plot(summary, tmp_path / "x.png")
    heights = [bar.get_height() for bar in figs[0].axes[1].patches]
    assert heights == [11, 15]


def test_an_input_of_another_shape_is_one_error_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"engines": {"nakta_cache": {}, "nakta_cache_fp8": {}}}))
    rc = fp8_report.main(["--scoring", str(bad), "--decode", str(bad), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("fp8_report: error:") and err.count("\n") == 1
