"""tune_splitk_gemm's CPU parts: the candidate grid, the best per point, the tuned JSON the
kernel loads (and the kernel's use of its family's row); the sweep itself needs a GPU."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from kernel_benchmark import tune_splitk_gemm as ts
from kernel_benchmark import tuning
from nakta_model.kernels import splitk_gemm as skg


def test_candidates_cover_the_sms_without_empty_splits():
    for kind, (n, k) in ts.SHAPES.items():
        for rows in (128, 256, 384, 512):
            for fp8 in (False, True):
                cands = ts.candidates(n, k, rows, fp8)
                assert len(cands) >= 10, (kind, rows)
                assert len({tuning.config_key(c, ts.KNOBS) for c in cands}) == len(cands)
                for c in cands:
                    tiles = -(-rows // c["BLOCK_M"]) * -(-n // c["BLOCK_N"])
                    assert tiles * c["SPLIT_K"] <= 4 * ts.SMS or c["SPLIT_K"] == 1
                    assert k // c["BLOCK_K"] // c["SPLIT_K"] >= 4
                    assert c["BLOCK_K"] in ((128, 256) if fp8 else (64, 128))


def _rows(kind="wo", rows=256):
    n, k = ts.SHAPES[kind]
    base = dict(kind=kind, N=n, K=k, rows=rows, quant="bf16")
    c0, c1 = ts.candidates(n, k, rows, False)[:2]
    return pd.DataFrame([
        {**base, "path": "cublas", **{key: -1 for key in ts.KNOBS}, "us": 20.0,
         "TFLOP_s": 400.0, "pct_matmul": 50.0, "status": "ok"},
        {**base, "path": "default", **c0, "us": 40.0, "TFLOP_s": 200.0, "pct_matmul": 25.0,
         "status": "ok"},
        {**base, "path": "candidate", **c1, "us": 25.0, "TFLOP_s": 320.0, "pct_matmul": 40.0,
         "status": "ok"},
        {**base, "path": "candidate", **c1, "us": 1.0, "TFLOP_s": 1e4, "pct_matmul": 999.0,
         "status": "out of resources"},
    ])  # fmt: skip


def test_best_per_point_skips_failures_and_reports_cublas():
    (best,) = ts.best_per_point(_rows())
    assert best["us"] == 25.0 and best["speedup_vs_cublas"] == pytest.approx(0.8)
    assert best["default_us"] == 40.0 and set(best["config"]) == set(ts.KNOBS)


def test_update_configs_writes_what_the_kernel_loads_and_uses(tmp_path, monkeypatch):
    path = tmp_path / "tuned.json"
    best = ts.best_per_point(pd.concat([_rows("wo", 256), _rows("w2", 384)]))
    ts.update_configs(path, "h100", "NVIDIA H100", best)
    tables = skg.load_tuned(path)
    assert tables["h100"]["4096/4096/256/float"] == best[0]["config"]
    assert tables["h100"]["4096/11008/384/float"] == best[1]["config"]
    ts.update_configs(path, "h200", "NVIDIA H200", best[:1])  # another family kept beside it
    assert set(json.loads(path.read_text())["devices"]) == {"h100", "h200"}
    # the kernel takes its family's row (rows 200 -> bucket 256), not another family's
    monkeypatch.setattr(skg, "_DEVICE_CONFIGS", tables)
    got = skg._config(200, 4096, 4096, 132, False, "h100")
    assert {k: got[k] for k in ts.KNOBS} == best[0]["config"]
    assert skg._config(200, 4096, 4096, 132, False, "a100")["BLOCK_K"] == 64  # the default
    assert skg.rows_bucket(200) == 256 and skg.rows_bucket(300) == 384
    assert skg.rows_bucket(600) == 1024
    path.write_text('{"devices": {"h100": {"entries": {"1/2/3/int8": {}}}}}')
    with pytest.raises(ValueError, match="not a tuned splitk_gemm"):
        ts.update_configs(path, "h100", "x", best)  # a malformed file is not overwritten
    assert skg.load_tuned(tmp_path / "absent.json") == {}


def test_the_committed_table_loads():
    for table in skg.load_tuned(skg.TUNED_JSON).values():
        for cfg in table.values():
            assert set(cfg) == set(skg.KNOBS)


def test_bad_arguments_exit():
    for argv in (["--rows", "32"], ["--rows", "600"], ["--kinds", "wqkv"], ["--budget", "0"],
                 ["--quants", "int8"]):  # fmt: skip
        with pytest.raises(SystemExit):
            ts.parse_args(argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal only")
def test_main_needs_a_gpu(capsys):
    assert ts.main(["--rows", "256"]) == 1
    assert "needs a GPU" in capsys.readouterr().err
