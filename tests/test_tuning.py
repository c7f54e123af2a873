"""The FP8 tuners' sweep driver and result writer (kernel_benchmark/tune_fp8_decode.py): the
points timed in order until the deadline, each point's best printed, every timing and the best
per point written, and only the kept winners handed to the kernel's table."""

from __future__ import annotations

import json
import time

import pandas as pd
import pytest

from kernel_benchmark import tune_fp8_decode as tuning


def _best(df: pd.DataFrame) -> list[dict]:
    return [{"point": int(p), "us": float(g["us"].min()), "default_us": float(g["us"].max())}
            for p, g in df.groupby("point", sort=False)]  # fmt: skip


def _time_point(point: tuple) -> list[dict]:
    return [{"point": point[0], "us": float(point[0] + us)} for us in (1, 3)]


def test_time_points_in_order_with_their_best_until_the_deadline(capsys):
    t0 = time.perf_counter()
    rows = tuning.time_points([(1,), (2,)], _time_point, _best,
                              lambda pt, b: f"p{pt[0]} {b['us']:.0f} us", t0, t0 + 60)  # fmt: skip
    assert [r["point"] for r in rows] == [1, 1, 2, 2]
    out = capsys.readouterr().out
    assert "[1/2 " in out and "p1 2 us" in out and "[2/2 " in out and "p2 3 us" in out
    rows = tuning.time_points([(1,), (2,)], _time_point, _best, lambda pt, b: "", t0, t0 - 1)
    assert rows == [] and "budget spent: 2 points not tuned" in capsys.readouterr().out


def test_write_results_writes_every_timing_and_hands_on_the_kept_winners(tmp_path, capsys):
    rows = _time_point((1,)) + _time_point((2,))
    handed = []

    def update(path, family, name, chosen):
        handed.append((path, family, chosen))

    kw = dict(out=tmp_path, stem="toy_tune", title="toy", notes="n", summary={"device": "d"},
              device_name="GPU", configs=tmp_path / "t.json", update=update, t0=time.perf_counter())  # fmt: skip
    best = tuning.write_results(rows, _best, family="h100", write_configs=True,
                                keep=lambda b: b["point"] == 2, **kw)  # fmt: skip
    assert [b["point"] for b in best] == [1, 2]
    doc = json.loads((tmp_path / "toy_tune.json").read_text())
    assert doc["device"] == "d" and doc["family"] == "h100" and doc["best"] == best
    assert len(pd.read_csv(tmp_path / "toy_tune.csv")) == 4
    assert handed == [(tmp_path / "t.json", "h100", [best[1]])]
    assert "tuned configs (1 points, family h100)" in capsys.readouterr().out
    tuning.write_results(rows, _best, family="", write_configs=True, **kw)
    assert len(handed) == 1 and "no device family" in capsys.readouterr().out
    tuning.write_results(rows, _best, family="h100", write_configs=False, **kw)
    assert len(handed) == 1
    tuning.write_results([], _best, family="h100", write_configs=True, **kw)
    assert json.loads((tmp_path / "toy_tune.json").read_text())["best"] == []
    assert len(handed) == 1


def test_a_failing_pool_leaves_compiling_to_the_timing_loop(monkeypatch, capsys):
    def broken(*args):
        raise OSError("no processes here")

    monkeypatch.setattr(tuning, "_compile_in_workers", broken)
    tuning.compile_in_workers(lambda: 0, [()], 2, time.perf_counter() + 1)
    assert "precompile failed (OSError: no processes here)" in capsys.readouterr().out


def test_config_key_and_label_read_the_tuners_knobs():
    cfg = {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4, "extra": 1}
    assert tuning.config_key(cfg, ("BLOCK_N", "num_warps")) == (8, 4)
    assert tuning.config_label(cfg, ("BLOCK_K", "BLOCK_N")) == "BLOCK_K=512 BLOCK_N=8"
    with pytest.raises(KeyError):
        tuning.config_key(cfg, ("SPLIT_K",))
