"""``kernel_benchmark/tune_fp8_decode.py`` off the GPU: its grid is made of configs
``decode_linear`` accepts (and runs, in the interpreter, at a small shape), its results pick
the fastest per point, and the JSON it writes is the one ``decode_linear.py`` loads."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from test_decode_linear import assert_matches_reference, run_both
from test_decode_linear_fp8 import fp8_case

from kernel_benchmark import tune_fp8_decode as tf
from nakta_model.kernels import decode_linear as cfgs
from nakta_model.kernels import decode_linear as dl
from nakta_model.kernels.fp8_quant import FP8_DTYPE

SHAPES = {s.kind: s for s in tf._shapes(list(tf.KINDS))}


@pytest.mark.parametrize("kind", tf.KINDS)
@pytest.mark.parametrize("batch", tf.BATCHES)
def test_grid_configs_resolve_unchanged(kind, batch, monkeypatch):
    """Every candidate passes the launch checks and resolves to itself (no knob clipped or
    dropped, DOT_F16 kept where asked), so the timing measures what the JSON will say."""
    shape = SHAPES[kind]
    cands = tf.candidates(shape.variant, batch)
    assert len(cands) >= 8 and len({tf.config_key(c, tf.KNOBS) for c in cands}) == len(cands)
    for cand in cands:
        monkeypatch.setattr(dl, "_TUNE", cand)
        got = dl._config(torch.bfloat16, batch, shape.n_cols, shape.k, shape.variant,
                         torch.device("cpu"), FP8_DTYPE)  # fmt: skip
        assert {k: got[k] for k in tf.KNOBS} == cand


@pytest.mark.parametrize("batch", [1, 16])
def test_grid_configs_run_correctly(batch, device, monkeypatch):
    """A sample of the grid (first, middle, last, a DOT_F16 one, a PREFETCH one) runs and
    matches the reference at a small K (the interpreter clips BLOCK_K to K)."""
    cands = tf.candidates("residual", batch)
    f16 = [c for c in cands if c["DOT_F16"]]
    prefetch = [c for c in cands if c["PREFETCH"]]
    assert bool(prefetch) == (batch == 1)  # the batch-1 CUDA-core loop only
    for cand in [cands[0], cands[len(cands) // 2], cands[-1], *f16[:1], *prefetch[:1]]:
        monkeypatch.setattr(dl, "_TUNE", cand)
        x, wq, kw, ref_kw, _ = fp8_case("residual", 3 if batch > 1 else 1, torch.bfloat16,
                                        device, k=96)  # fmt: skip
        got, ref = run_both(x, wq, kw, ref_kw)
        assert_matches_reference(got, ref, torch.bfloat16)


def _rows(kind="wo", batch=32):
    shape = SHAPES[kind]
    base = dict(kind=kind, variant=shape.variant, N=shape.n, K=shape.k, batch=batch)
    fast = tf.candidates(shape.variant, batch)[1]
    return pd.DataFrame(
        [
            {**base, "path": "bf16", **{k: -1 for k in tf.KNOBS}, "us": 20.0,
             "pct_copy_bw": 80.0, "status": "ok"},
            {**base, "path": "default", **tf.candidates(shape.variant, batch)[0], "us": 30.0,
             "pct_copy_bw": 30.0, "status": "ok"},
            {**base, "path": "candidate", **fast, "us": 12.0, "pct_copy_bw": 75.0,
             "status": "ok"},
            {**base, "path": "candidate", **tf.candidates(shape.variant, batch)[2],
             "us": float("nan"), "pct_copy_bw": float("nan"), "status": "failed: x"},
        ]
    ), fast  # fmt: skip


def test_best_per_point_picks_the_fastest_fp8_config():
    df, fast = _rows()
    (best,) = tf.best_per_point(df)
    assert best["config"] == fast and best["speedup_vs_bf16"] == pytest.approx(20 / 12)
    assert best["default_speedup_vs_bf16"] == pytest.approx(20 / 30)


def test_written_configs_load_and_apply(tmp_path, monkeypatch):
    """update_configs writes rows that load_fp8_tuned reads back under the family, keyed as
    _config looks them up (swiglu by its output columns), keeping other families' rows."""
    path = tmp_path / "tuned.json"
    df, fast = _rows("wo", 32)
    tf.update_configs(path, "h200", "NVIDIA H200", tf.best_per_point(df))
    df13, fast13 = _rows("w13", 8)
    doc = tf.update_configs(path, "h100", "NVIDIA H100 80GB HBM3", tf.best_per_point(df13))
    assert set(doc["devices"]) == {"h100", "h200"}
    tables = cfgs.load_fp8_tuned(path)
    assert tables["h200"] == {("float8_e4m3fn", 32, "residual", 4096, 4096): fast}
    assert tables["h100"] == {("float8_e4m3fn", 8, "swiglu", 11008, 4096): fast13}
    monkeypatch.setitem(dl._DEVICE_CONFIGS, "h100", tables["h100"])
    monkeypatch.setattr(dl, "device_family", lambda device: "h100")
    got = dl._config(torch.bfloat16, 7, 11008, 4096, "swiglu", torch.device("cpu"), FP8_DTYPE)
    assert {k: got[k] for k in tf.KNOBS} == fast13
    assert json.loads(path.read_text())["devices"]["h100"]["measured"]


def test_a_malformed_configs_file_is_not_overwritten(tmp_path):
    path = tmp_path / "tuned.json"
    path.write_text('{"devices": {"h100": {"entries": {"bad": {}}}}}')
    df, _ = _rows()
    with pytest.raises(ValueError, match="tuned.json"):
        tf.update_configs(path, "h100", "H100", tf.best_per_point(df))
    assert "bad" in path.read_text()


def test_cli_checks_and_cpu_exit(capsys):
    with pytest.raises(SystemExit):
        tf.parse_args(["--batches", "0"])
    with pytest.raises(SystemExit):
        tf.parse_args(["--kinds", "head"])
    args = tf.parse_args(["--batches", "32,1", "--kinds", "w2"])
    assert args.batches == [1, 32] and args.kinds == ["w2"]
    if not torch.cuda.is_available():
        assert tf.main(["--no-write-configs"]) == 1
        assert "compute capability" in capsys.readouterr().err
