"""The FP8 tuners' sweep driver and result writer (kernel_benchmark/tune_fp8_decode.py): the
points timed in order until the deadline, each point's best printed, every timing and the best
per point written, and only the kept winners handed to the kernel's table.

Here too: the two FP8 decode tuners off the GPU (their grids are made of configs the kernels accept).
"""

from __future__ import annotations

import json
import time

import pandas as pd
import pytest
import torch
from test_decode_linear import assert_matches_reference, run_both
from test_decode_linear_fp8 import fp8_case
from test_fp8_decode_gemm import assert_close_to, error_bound, make_inputs

from kernel_benchmark import tune_fp8_decode as tf
from kernel_benchmark import tune_fp8_decode as tg
from kernel_benchmark import tune_fp8_decode as tuning
from nakta_model.kernels import decode_linear as cfgs
from nakta_model.kernels import decode_linear as dl
from nakta_model.kernels import fp8_decode_gemm as fdg
from nakta_model.kernels.fp8_quant import FP8_DTYPE


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


# ------------------------------------------------------------------------------------------------
# ``kernel_benchmark/tune_fp8_decode.py`` off the GPU: its grid is made of configs
# ``decode_linear`` accepts (and runs, in the interpreter, at a small shape), its results pick the
# fastest per point, and the JSON it writes is the one ``decode_linear.py`` loads.
# ------------------------------------------------------------------------------------------------


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


# ------------------------------------------------------------------------------------------------
# ``kernel_benchmark/tune_fp8_decode.py --kernel gemm`` off the GPU: its grid is made of configs
# ``fp8_decode_gemm`` takes unchanged (and runs correctly, in the interpreter, at a small shape),
# its results pick the fastest per point, and the JSON it writes is the one the kernel loads.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(tg.GEMM_SHAPES))
@pytest.mark.parametrize("rows", tg.GEMM_ROWS)
def test_gemm_grid_configs_resolve_unchanged(kind, rows, monkeypatch):
    """Every candidate passes the launch checks and resolves to itself at its shape (no knob
    clipped), so the timing measures what the JSON will say; splits stay useful."""
    n, k, _ = tg.GEMM_SHAPES[kind]
    cands = tg.gemm_candidates(n, k, rows)
    assert len(cands) >= 7 and len({tg.config_key(c, tg.GEMM_KNOBS) for c in cands}) == len(cands)
    for cand in cands:
        monkeypatch.setattr(fdg, "_TUNE", cand)
        got = fdg._config(n, k, rows, torch.device("cpu"))
        assert {key: got[key] for key in tg.GEMM_KNOBS} == cand
        assert k // cand["BLOCK_K"] // cand["SPLIT_K"] >= 4
    if n == 4096:  # the narrow weights get split-K candidates
        assert max(c["SPLIT_K"] for c in cands) >= 4


def test_gemm_grid_configs_run_correctly(device, monkeypatch):
    """A sample of the grid (every tile family, split on and off) runs and matches the
    reference at a small shape (BLOCK_K clipped to K there)."""
    cands = tg.gemm_candidates(4096, 4096, 16)
    sample = {(c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["SPLIT_K"] > 1): c for c in cands}
    xq, xs, wq, ws = make_inputs(11, 150, 256, device)
    res = torch.randn(11, 150, device=device).bfloat16()
    for cand in sample.values():
        monkeypatch.setattr(fdg, "_TUNE", cand)
        got = fdg.fp8_decode_gemm(xq, xs, wq, ws, residual=res)
        want = fdg.fp8_decode_gemm_reference(xq, xs, wq, ws, residual=res)
        bound = 2 * error_bound(xq, xs, wq, ws, 256, torch.bfloat16) + 2**-8 * res.abs()
        assert_close_to(got, want, bound.double())


def test_point_calls_agree(device):
    """The timed calls of one (toy-sized) point: the kernel and cuBLASLt's path (its reference
    off the GPU) give the same product and residual add."""
    tg.GEMM_SHAPES["toy"] = (40, 64, True)
    try:
        t = tg.point_set("toy", 5, device, 0)
        got = tg.kernel_call(t, None)().clone()
        want = tg.cublaslt_call(t)()
        bound = 2 * error_bound(t["xq"], t["xs"], t["wq"], t["ws"], 64, torch.bfloat16)
        assert_close_to(got, want, bound + 2**-8 * t["res"].abs().double())
        assert tg.point_bytes("toy", 5) == 40 * 64 + 4 * 40 + 5 * 64 + 4 * 5 + 2 * 5 * 40 * 2
    finally:
        del tg.GEMM_SHAPES["toy"]


def _gemm_rows(kind="wo", rows=32):
    n, k, _ = tg.GEMM_SHAPES[kind]
    base = dict(kind=kind, N=n, K=k, rows=rows)
    c0, c1 = tg.gemm_candidates(n, k, rows)[:2]
    return pd.DataFrame([
        {**base, "path": "cublaslt", **{key: -1 for key in tg.GEMM_KNOBS}, "us": 20.0,
         "pct_copy_bw": 30.0, "status": "ok"},
        {**base, "path": "default", **c0, "us": 12.0, "pct_copy_bw": 50.0, "status": "ok"},
        {**base, "path": "candidate", **c1, "us": 8.0, "pct_copy_bw": 75.0, "status": "ok"},
        {**base, "path": "candidate", **c1, "us": 1.0, "pct_copy_bw": 99.0,
         "status": "out of resources"},
    ])  # fmt: skip


def test_best_per_point_skips_failures_and_reports_cublaslt():
    (best,) = tg.gemm_best_per_point(_gemm_rows())
    assert best["us"] == 8.0 and best["speedup_vs_cublaslt"] == 2.5
    assert best["default_speedup_vs_cublaslt"] == pytest.approx(20 / 12)
    assert set(best["config"]) == set(tg.GEMM_KNOBS)


def test_update_configs_writes_what_the_kernel_loads(tmp_path):
    path = tmp_path / "tuned.json"
    best = tg.gemm_best_per_point(pd.concat([_gemm_rows("wo", 32), _gemm_rows("w2", 8)]))
    tg.gemm_update_configs(path, "h200", "NVIDIA H200", best)
    tables = fdg.load_tuned(path)
    assert tables["h200"][(4096, 4096, 32)] == best[0]["config"]
    assert tables["h200"][(4096, 11008, 8)] == best[1]["config"]
    tg.gemm_update_configs(path, "h100", "NVIDIA H100", best[:1])  # another family kept beside it
    doc = json.loads(path.read_text())
    assert set(doc["devices"]) == {"h100", "h200"}
    path.write_text('{"devices": {"h200": {"entries": {"1/2": {}}}}}')
    with pytest.raises(ValueError, match="not a tuned"):
        tg.gemm_update_configs(path, "h200", "x", best)  # a malformed file is not overwritten


def test_bad_arguments_exit():
    for argv in (["--rows", "0"], ["--rows", "65"], ["--kinds", "head"], ["--budget", "0"]):
        with pytest.raises(SystemExit):
            tg.gemm_parse_args(argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal only")
def test_main_needs_a_gpu(capsys):
    assert tg.gemm_main(["--rows", "8"]) == 1
    assert "needs a GPU" in capsys.readouterr().err
