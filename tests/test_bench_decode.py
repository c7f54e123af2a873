"""``kernel_benchmark/bench_decode.py`` end to end on the CPU (interpreter, toy shapes): every
path runs and agrees with the reference, the tables and plot are written, ``--tune`` writes a
config JSON that ``--shapes-config`` (and ``decode_linear._config``) take back; plus the byte
counts and the tuning helpers on their own."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from kernel_benchmark import bench_decode as bd
from nakta_model.kernels import decode_linear as dl

# On a GPU the benchmark is the full sweep (minutes): the lead runs it by hand.
cpu_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU smoke run; on a GPU the benchmark is the full sweep"
)


@cpu_only
def test_smoke_run_writes_every_path(tmp_path):
    linear, attn = bd.main(["--quick", "--out", str(tmp_path)])
    for name in ("decode_quick_linear.csv", "decode_quick_linear.md", "decode_quick_attention.csv",
                 "decode_quick_attention.md", "decode_quick.png"):  # fmt: skip
        assert (tmp_path / name).stat().st_size > 0
    lin = pd.read_csv(tmp_path / "decode_quick_linear.csv")
    assert set(lin["kind"]) == set(bd.KINDS)
    assert set(lin["path"]) == {"nakta", "cublas", "unfused"}
    assert (lin["status"] == "ok").all() and (lin["us"] > 0).all()
    nakta = lin[lin["path"] == "nakta"]
    assert (nakta["mismatch"] <= 0.01).all() and nakta["config"].str.contains("BLOCK_N").all()
    att = pd.read_csv(tmp_path / "decode_quick_attention.csv")
    assert set(att["path"]) == {"nakta", "nakta_fma", "sdpa"}
    assert set(att["heads"]) == {"mha", "gqa2"}
    assert set(att[att["path"] == "nakta_fma"]["heads"]) == {"mha"}  # MHA only
    assert (att["status"] == "ok").all()
    mism = att[att["path"] == "nakta"].groupby("heads")["mismatch"].max()
    # tl.dot rounds the probabilities to the cache dtype (1-2 ulp, test_decode_attention)
    assert mism["mha"] < 0.5 and mism["gqa2"] < 0.5
    assert "CPU SMOKE RUN" in (tmp_path / "decode_quick_linear.md").read_text()


@cpu_only
def test_tune_writes_configs_the_launcher_takes_back(tmp_path, monkeypatch):
    monkeypatch.setattr(dl, "_CONFIGS", dict(dl._CONFIGS))  # the tune adds entries
    argv = ["--quick", "--tune", "--tune-budget", "1", "--batches", "2", "--out", str(tmp_path)]
    tdf, _ = bd.main(argv)
    assert len(tdf) and (tdf["status"] == "ok").any() and tdf["default"].any()
    best = json.loads((tmp_path / "decode_quick_linear_tune_best.json").read_text())
    assert best["points"] and best["shapes"]
    assert bd.load_shapes_config(str(tmp_path / "decode_quick_linear_tune_best.json")) == len(
        best["shapes"]
    )
    (key, cfg), *_ = [(k, c) for k, c in dl._CONFIGS.items() if len(k) == 5]  # per shape
    dtype_name, bucket, variant, n_cols, k = key
    got = dl._config(getattr(torch, dtype_name), bucket, n_cols, k, variant, torch.device("cpu"))
    assert all(got[name] == value for name, value in cfg.items())


def test_best_configs_picks_the_fastest_per_point():
    shape = bd.LinearShape("7B", "w13", 22016, 4096)
    row = dict(model="7B", kind="w13", N=22016, K=4096, batch=1, bucket=1, status="ok")
    knobs = dict(USE_DOT=0, BLOCK_K=512, num_warps=4, num_stages=4)
    tdf = pd.DataFrame(
        [
            {**row, **knobs, "BLOCK_N": 32, "us": 90.0, "pct_copy_bw": 80.0, "default": True},
            {**row, **knobs, "BLOCK_N": 16, "us": 80.0, "pct_copy_bw": 90.0, "default": False},
            {**row, **knobs, "BLOCK_N": 8, "us": float("nan"), "pct_copy_bw": float("nan"),
             "default": False, "status": "failed: x"},
        ]
    )  # fmt: skip
    best = bd.best_configs(tdf, [shape], torch.bfloat16)
    point = best["points"]["7B w13 22016x4096 batch 1"]
    assert point["config"]["BLOCK_N"] == 16 and point["default_pct_copy_bw"] == 80.0
    assert point["tried"] == 2
    assert best["shapes"] == {repr(("bfloat16", 1, "swiglu", 11008, 4096)): point["config"]}


def test_load_shapes_config_rejects_other_json(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"points": {}}))
    with pytest.raises(ValueError, match="expected a --tune JSON with a 'shapes' object"):
        bd.load_shapes_config(str(path))


@pytest.mark.parametrize(
    "knob, cfg, expected",
    [
        ("BLOCK_N", dict(BLOCK_N=16, USE_DOT=1), [32]),  # tl.dot keeps 16 rows
        ("BLOCK_N", dict(BLOCK_N=16, USE_DOT=0), [8, 32]),
        ("BLOCK_K", dict(BLOCK_K=16), [32]),
        ("num_stages", dict(num_stages=1), [2]),
        ("num_warps", dict(num_warps=4), [2, 8]),
        ("USE_DOT", dict(USE_DOT=0), [1]),
    ],
)
def test_tune_candidates_stay_legal(knob, cfg, expected):
    assert bd.tune_candidates(knob, cfg, bucket=1, rows_per_col=1) == expected


def test_tune_candidates_keep_batched_rows_on_tensor_cores():
    assert bd.tune_candidates("USE_DOT", dict(USE_DOT=1), bucket=8, rows_per_col=1) == []


def test_linear_bytes_count_what_a_perfect_kernel_moves():
    shapes = {s.kind: s for s in bd.linear_shapes("7B", bd.MODELS["7B"])}
    e = 2
    wo = 4096 * 4096 * e + 4096 * e + 4096 * e + 4096 * e  # weight, x, residual, out
    assert bd.linear_bytes(shapes["wo"], 1, e) == wo
    qkv = 12288 * 4096 * e + 4096 * e + 4096 * e + 4096 * e + 2 * 4096 * e  # + norm w, K/V
    assert bd.linear_bytes(shapes["wqkv"], 1, e) == qkv
    head = 32000 * 4096 * e + 2 * 4096 * e + 32000 * 4  # fp32 logits
    assert bd.linear_bytes(shapes["head"], 1, e) == head
    assert shapes["w13"].n_out == 11008 and shapes["w13"].n_cols == 11008


def test_linear_shapes_match_the_model_layout():
    shapes = {s.kind: (s.n, s.k) for s in bd.linear_shapes("13B", bd.MODELS["13B"])}
    assert shapes == {
        "wqkv": (15360, 5120),
        "wo": (5120, 5120),
        "w13": (27648, 5120),
        "w2": (5120, 13824),
        "head": (32000, 5120),
    }


def test_unknown_model_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bd.main(["--models", "7B,3B"])
    assert exit_info.value.code == 2
    assert "error: --models: unknown ['3B']" in capsys.readouterr().err
