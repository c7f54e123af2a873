"""speed_bench.fp8_kv_report: issue 42's summary from the benches' outputs (fixtures, no GPU)."""

from __future__ import annotations

import json

import pytest

from speed_bench import fp8_kv_report

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
def paths(tmp_path):
    out = {}
    for k, v in FILES.items():
        out[k] = tmp_path / f"{k}.json"
        out[k].write_text(json.dumps(v))
    return out


def _args(paths, out, skip=()):
    argv = []
    for k in ("throughput", "long", "decode", "b1", "accuracy"):
        if k not in skip:
            argv += [f"--{k}", str(paths[k])]
    return argv + ["--out", str(out)]


def test_summary_in_the_issue_schema_with_table_and_plot(paths, tmp_path):
    out = tmp_path / "fp8_kv"
    assert fp8_kv_report.main(_args(paths, out)) == 0
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


def test_a_source_not_given_is_null_not_made_up(paths, tmp_path):
    out = tmp_path / "partial"
    assert fp8_kv_report.main(_args(paths, out, skip=("b1", "long", "accuracy"))) == 0
    s = json.loads((out / "fp8_kv_summary.json").read_text())
    assert s["b1_outside"] is None and s["long_context"] is None and s["accuracy"] == []
    assert len(s["throughput"]) == 4 and len(s["step_floor_pct"]) == 4
    assert (out / "fp8_kv.md").read_text().count("not measured") == 3


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
def test_bad_inputs_are_one_error_line(paths, tmp_path, capsys, key, bad, says):
    paths[key].write_text(json.dumps(bad))
    assert fp8_kv_report.main(_args(paths, tmp_path / "o")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fp8_kv_report: error:") and says in err and "\n" not in err
    assert not (tmp_path / "o" / "fp8_kv_summary.json").exists()


def test_unreadable_file_and_bad_workload(paths, tmp_path, capsys):
    paths["decode"].write_text("{not json")
    assert fp8_kv_report.main(_args(paths, tmp_path / "o")) == 2
    assert "cannot read" in capsys.readouterr().err
    paths["decode"].write_text(json.dumps(FILES["decode"]))
    assert fp8_kv_report.main(_args(paths, tmp_path / "o") + ["--workload", "128x128"]) == 2
    assert "--workload must be INPUT/OUTPUT" in capsys.readouterr().err
