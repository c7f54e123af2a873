"""speed_bench.fp8_report: the FP8 summary from run_all / decode_speed / parity outputs, and its
``kv`` mode (issue 42's summary from the throughput / decode / KV-accuracy outputs)."""

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


# ---------------------------------------------------------------- the kv mode (issue 42)
SCHEMA = {
    "device_name": str,
    "throughput": [{"weights": str, "kv": str, "max_batch": int, "output_tok_s": float}],
    "long_context": {"bf16_kv_tok_s": float, "fp8_kv_tok_s": float},
    "step_floor_pct": [{"batch": int, "weights": str, "pct": float}],
    "b1_outside": {"bf16_tok_s": float, "fp8_tok_s": float},
    "accuracy": [{"model": str, "kv": str, "top1_agree_vs_fp32": float, "mean_kl_vs_fp32": float}],
}


def _conforms(value, schema) -> bool:
    """Exactly the issue's keys, with its types (lists: every element)."""
    if isinstance(schema, dict):
        return (
            isinstance(value, dict)
            and set(value) == set(schema)
            and all(_conforms(value[k], s) for k, s in schema.items())
        )
    if isinstance(schema, list):
        return isinstance(value, list) and all(_conforms(v, schema[0]) for v in value)
    return isinstance(value, schema) and not isinstance(value, bool)


def _tp(engine, tok, max_batch=384, ilen=128, olen=128):
    return {"engine": engine, "input_len": ilen, "output_len": olen, "max_batch": max_batch,
            "output_tok_s": tok, "prompts": 1000}  # fmt: skip


def _dec(engine, batch, prompt, tok, pct):
    return {"engine": engine, "batch": batch, "prompt": prompt, "shared_prefix": 0,
            "tok_s": tok, "pct_of_floor": pct, "floor_tok_s": 100 * tok / pct}  # fmt: skip


FILES = {
    "throughput": {"device_name": "NVIDIA H100 80GB HBM3", "runs": [
        _tp("nakta", 12000.0), _tp("nakta_kv8", 14500.0), _tp("nakta_fp8", 15000.0),
        _tp("nakta_fp8_kv8", 19000.0), _tp("hf", 7000.0, 128),
        _tp("nakta", 9000.0, 384, 64, 64),  # another workload: left out
    ]},
    "long": {"device": "nvidia-h100-80gb-hbm3", "runs": [
        _dec("nakta", 32, 3968, 900.0, 80.0), _dec("nakta_kv8", 32, 3968, 1500.0, 70.0)]},
    "decode": {"device": "nvidia-h100-80gb-hbm3", "runs": [
        _dec("nakta", 8, 64, 1400.0, 78.0), _dec("nakta_fp8", 8, 64, 2300.0, 76.0),
        _dec("nakta", 32, 64, 4900.0, 78.3), _dec("nakta_fp8", 32, 64, 7400.0, 68.0),
        _dec("nakta_fp8", 32, 512, 7000.0, 60.0)]},
    "b1": {"device_name": "NVIDIA H100 80GB HBM3", "runs": [
        _tp("nakta", 195.0, 1, 64, 128), _tp("nakta_fp8", 340.0, 1, 64, 128)]},
    "accuracy": {"model": "stories260K", "accuracy": [
        {"model": "stories260K", "dtype": "bfloat16", "kv": "bf16", "top1_agree_vs_fp32": 0.98,
         "mean_kl_vs_fp32": 0.001, "max_kl_vs_fp32": 0.04, "positions": 3200},
        {"model": "stories260K", "dtype": "float32", "kv": "fp8", "top1_agree_vs_fp32": 0.92,
         "mean_kl_vs_fp32": 0.025, "max_kl_vs_fp32": 2.1, "positions": 3200}]},
}  # fmt: skip


@pytest.fixture
def kv_paths(tmp_path):
    out = {}
    for k, v in FILES.items():
        out[k] = tmp_path / f"{k}.json"
        out[k].write_text(json.dumps(v))
    return out


def _args(kv_paths, out, skip=()):
    argv = []
    for k in ("throughput", "long", "decode", "b1", "accuracy"):
        if k not in skip:
            argv += [f"--{k}", str(kv_paths[k])]
    return argv + ["--out", str(out)]


def test_kv_summary_in_the_issue_schema_with_table_and_plot(kv_paths, tmp_path):
    out = tmp_path / "fp8_kv"
    assert fp8_report.main(["kv", *_args(kv_paths, out)]) == 0
    s = json.loads((out / "fp8_kv_summary.json").read_text())
    assert _conforms(s, SCHEMA)
    assert s["device_name"] == "NVIDIA H100 80GB HBM3"
    tp = {(t["weights"], t["kv"]): t["output_tok_s"] for t in s["throughput"]}
    assert tp == {("bf16", "bf16"): 12000.0, ("bf16", "fp8"): 14500.0,
                  ("fp8", "bf16"): 15000.0, ("fp8", "fp8"): 19000.0}  # fmt: skip
    assert s["long_context"] == {"bf16_kv_tok_s": 900.0, "fp8_kv_tok_s": 1500.0}
    assert s["step_floor_pct"] == [
        {"batch": 8, "weights": "bf16", "pct": 78.0}, {"batch": 8, "weights": "fp8", "pct": 76.0},
        {"batch": 32, "weights": "bf16", "pct": 78.3}, {"batch": 32, "weights": "fp8", "pct": 68.0},
    ]  # fmt: skip
    assert s["b1_outside"] == {"bf16_tok_s": 195.0, "fp8_tok_s": 340.0}
    assert [(a["model"], a["kv"]) for a in s["accuracy"]] == [
        ("stories260K/bf16", "bf16"), ("stories260K/fp32", "fp8")]  # fmt: skip
    md = (out / "fp8_kv.md").read_text()
    # targets: 19,000 < 20,000; 14,500 >= 14,000; 1.67x >= 1.6x; 76% met, 68% not; 1.74x met
    assert ">= 20,000: not met" in md and ">= 14,000: met" in md
    assert ">= 1.6x: met" in md and ">= 1.7x: met" in md
    assert md.count(">= 75%: met") == 1 and md.count(">= 75%: not met") == 1
    assert (out / "fp8_kv.csv").exists() and (out / "fp8_kv.png").stat().st_size > 0


def test_kv_source_not_given_is_null_not_made_up(kv_paths, tmp_path):
    out = tmp_path / "partial"
    assert fp8_report.main(["kv", *_args(kv_paths, out, skip=("b1", "long", "accuracy"))]) == 0
    s = json.loads((out / "fp8_kv_summary.json").read_text())
    assert s["b1_outside"] is None and s["long_context"] is None and s["accuracy"] == []
    assert len(s["throughput"]) == 4 and len(s["step_floor_pct"]) == 4
    assert (out / "fp8_kv.md").read_text().count("not measured") == 3
    # the step panel with no decode source (its log axis has no points)
    out2 = tmp_path / "no_decode"
    assert fp8_report.main(["kv", *_args(kv_paths, out2, skip=("b1", "decode"))]) == 0
    assert json.loads((out2 / "fp8_kv_summary.json").read_text())["step_floor_pct"] == []
    assert (out2 / "fp8_kv.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("key", "bad", "says"),
    [
        ("b1", {"runs": [_tp("nakta", 195.0, 1)]}, "lacks max_batch 1 run(s) of ['nakta_fp8']"),
        ("long", {"runs": [_dec("nakta", 32, 3968, 900.0, 80.0)]}, "expected one (batch, prompt)"),
        ("decode", {"runs": []}, "no nakta / nakta_fp8 run at prompt 64"),
        ("throughput", {"device_name": "x"}, "no 'runs' list"),
        ("accuracy", {"accuracy": []}, "no 'accuracy' rows"),
    ],
)
def test_kv_bad_inputs_are_one_error_line(kv_paths, tmp_path, capsys, key, bad, says):
    kv_paths[key].write_text(json.dumps(bad))
    assert fp8_report.main(["kv", *_args(kv_paths, tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fp8_report kv: error:") and says in err and "\n" not in err
    assert not (tmp_path / "o" / "fp8_kv_summary.json").exists()


def test_kv_unreadable_file_and_bad_workload(kv_paths, tmp_path, capsys):
    kv_paths["decode"].write_text("{not json")
    assert fp8_report.main(["kv", *_args(kv_paths, tmp_path / "o")]) == 2
    assert "cannot read" in capsys.readouterr().err
    kv_paths["decode"].write_text(json.dumps(FILES["decode"]))
    assert fp8_report.main(["kv", *_args(kv_paths, tmp_path / "o"), "--workload", "128x128"]) == 2
    assert "--workload must be INPUT/OUTPUT" in capsys.readouterr().err
