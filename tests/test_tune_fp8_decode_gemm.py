"""``kernel_benchmark/tune_fp8_decode.py --kernel gemm`` off the GPU: its grid is made of configs
``fp8_decode_gemm`` takes unchanged (and runs correctly, in the interpreter, at a small shape),
its results pick the fastest per point, and the JSON it writes is the one the kernel loads."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from test_fp8_decode_gemm import assert_close_to, error_bound, make_inputs

from kernel_benchmark import tune_fp8_decode as tg
from nakta_model.kernels import fp8_decode_gemm as fdg


@pytest.mark.parametrize("kind", list(tg.GEMM_SHAPES))
@pytest.mark.parametrize("rows", tg.GEMM_ROWS)
def test_grid_configs_resolve_unchanged(kind, rows, monkeypatch):
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


def test_grid_configs_run_correctly(device, monkeypatch):
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


def _rows(kind="wo", rows=32):
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
    (best,) = tg.gemm_best_per_point(_rows())
    assert best["us"] == 8.0 and best["speedup_vs_cublaslt"] == 2.5
    assert best["default_speedup_vs_cublaslt"] == pytest.approx(20 / 12)
    assert set(best["config"]) == set(tg.GEMM_KNOBS)


def test_update_configs_writes_what_the_kernel_loads(tmp_path):
    path = tmp_path / "tuned.json"
    best = tg.gemm_best_per_point(pd.concat([_rows("wo", 32), _rows("w2", 8)]))
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
