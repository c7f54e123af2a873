"""CPU smoke runs of the kernel benchmarks (interpreter, tiny shapes): every path runs, the
result files are written, and the head-to-head timer measures every path in each mode.

Here too: bench_decode and bench_decode_gemm end to end, and the shared timing helpers.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from bench_common.timing import eager_ms, graph_ms, input_sets, interleaved_ms, rotated_ms
from kernel_benchmark import bench_decode as bd
from kernel_benchmark import bench_decode_gemm as bg
from kernel_benchmark import bench_rmsnorm, bench_rope, bench_swiglu
from kernel_benchmark.common import head_to_head_rows, tuned, write_head_to_head
from kernel_benchmark.decode_shapes import MODELS, linear_shapes
from nakta_model.generation import step_gemm as sg
from nakta_model.kernels import decode_linear as dl

# On a GPU the benchmarks run their full sweeps (minutes each): scripts/reproduce_kernels.sh runs them.
cpu_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU smoke run; on a GPU the benchmark is the full sweep"
)


@cpu_only
@pytest.mark.parametrize(
    "bench,stem", [(bench_rmsnorm, "rmsnorm"), (bench_swiglu, "swiglu"), (bench_rope, "rope")]
)
def test_bench_smoke_writes_results(bench, stem, tmp_path):
    bench.main(["--out", str(tmp_path)])
    for ext in ("csv", "md", "png"):
        assert (tmp_path / f"{stem}.{ext}").stat().st_size > 0
    df = pd.read_csv(tmp_path / f"{stem}.csv")
    assert len(df) and "nakta" in set(df["path"])
    if stem == "rope" and bench_rope._te() is None:  # a missing peer is said, not dropped
        assert "TransformerEngine is not importable here" in (tmp_path / "rope.md").read_text()


@cpu_only
def test_head_to_head_covers_every_mode_and_path(tmp_path, monkeypatch):
    from kernel_benchmark import common

    # 3 alternating rounds, not 15: every interpreted call is slow, and the test reads the rows'
    # shape (every mode, path and block), not the medians' precision
    timer = common.interleaved_ms
    monkeypatch.setattr(common, "interleaved_ms", lambda calls, device: timer(calls, device, 3))
    cpu = torch.device("cpu")
    rms = bench_rmsnorm.head_to_head(torch.float32, cpu, float("nan"), m=2, n=128)
    assert set(rms["mode"]) == set(bench_rmsnorm.MODES) and set(rms["path"]) == {"nakta"}
    sw = bench_swiglu.head_to_head(torch.float32, cpu, float("nan"), m=2, f=128)
    assert set(sw["mode"]) == set(bench_swiglu.MODES)
    assert {"nakta", "nakta_fast", "nakta_silu_mul"} <= set(sw["path"])
    assert (sw["us"] > 0).all() and (rms["us"] > 0).all()
    write_head_to_head(sw, tmp_path, "swiglu", "SwiGLU", "cpu", "float32", float("nan"))
    written = pd.read_csv(tmp_path / "swiglu_head_to_head.csv")
    cols = ["tokens", "ffn", "mode", "path", "us", "pct_copy_bw", "spread", "us_blocks"]
    assert list(written.columns) == cols
    n_paths = written["path"].nunique()
    assert (written["us_blocks"].str.count("/") == 2 * n_paths - 1).all()  # 2P blocks
    assert "alternating rounds" in (tmp_path / "swiglu_head_to_head.md").read_text()


@cpu_only
def test_head_to_head_rows_rotates_allocations_and_orders():
    """2P blocks: each path runs on every path's inputs (refilled in place per block, so the
    same tensors), first in the given order, then reversed."""
    runs = []  # (block, path, id of the tensor it read, its first value)
    made = []

    def make_sets(seed):
        made.append(seed)
        return [{"x": torch.full((4,), float(seed))}]

    def make_calls(path, sets):
        t = sets[0]["x"]
        return [lambda: runs.append((len(made), path, id(t), float(t[0])))]

    rows = head_to_head_rows(["a", "b"], make_sets, make_calls, torch.device("cpu"), 1, 1.0, m=1)
    assert [r["path"] for r in rows] == ["a", "b"] and all(r["us"] > 0 for r in rows)
    assert all(r["us_blocks"].count("/") == 3 for r in rows)  # 2P = 4 blocks
    assert made == [0, 1, 2, 3, 4, 5, 6, 7]  # two groups, then refills per block
    blocks = sorted({b for b, _, _, _ in runs})
    first = [next(p for b, p, _, _ in runs if b == blk) for blk in blocks]
    assert first == ["a", "a", "b", "b"]
    tensors = {p: {i for _, q, i, _ in runs if q == p} for p in ("a", "b")}
    assert tensors["a"] == tensors["b"] and len(tensors["a"]) == 2
    values = [v for b, p, _, v in runs if b == blocks[1] and p == "a"]
    assert values[0] == 3.0  # block 1, group 1 refilled from seed 1 + 2 * 1


# ------------------------------------------------------------------ the scripts as a user runs them
@cpu_only
@pytest.mark.parametrize(
    "argv,where,runs",
    [
        (["bench_rope.py"], "kernel_benchmark", True),  # crashed on a CPU before
        (["kernel_benchmark/bench_attention.py"], ".", True),
        (["kernel_benchmark/bench_rmsnorm.py", "--help"], ".", False),
        (["bench_swiglu.py", "--help"], "kernel_benchmark", False),
    ],
    ids=["rope", "attention", "rmsnorm-help", "swiglu-help"],
)
def test_bench_scripts_by_path_say_what_runs_on_a_cpu(argv, where, runs, tmp_path):
    """No TRITON_INTERPRET (as a user's CPU run): the PyTorch paths are timed, Nakta's Triton
    paths are listed as skipped with why, exit status 0; --help says what runs on a CPU."""
    from cli_helpers import REPO, run_script

    proc = run_script([*argv, *(["--out", str(tmp_path)] if runs else [])], REPO / where)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = " ".join(proc.stdout.split())  # --help wraps lines
    assert "On a CPU" in text and "Exit status 1 when no path was measured" in text
    if runs and "rope" in argv[0]:
        assert "default fwd nakta: skipped: Triton kernels need a GPU" in proc.stdout
        df = pd.read_csv(tmp_path / "rope.csv")
        assert set(df[df["status"] == "ok"]["path"]) == {"torch"}
        assert (tmp_path / "rope.png").stat().st_size > 0


def _failing(*args, **kwargs):
    raise RuntimeError("this path does not run here")


@cpu_only
@pytest.mark.parametrize("stem", ["rmsnorm", "swiglu", "rope"])
def test_bench_exits_1_when_nothing_was_measured(stem, monkeypatch, tmp_path, capsys):
    from kernel_benchmark.common import exit_status

    bench = {"rmsnorm": bench_rmsnorm, "swiglu": bench_swiglu, "rope": bench_rope}[stem]
    if stem == "rmsnorm":
        monkeypatch.setattr(bench, "paths", lambda device: ({"p": _failing}, {"p": _failing}))
    elif stem == "swiglu":
        monkeypatch.setattr(bench, "paths", lambda device: {"p": ("fused", _failing)})
    else:  # every TE-API path goes through apply_rotary_pos_emb
        monkeypatch.setattr(bench, "apply_rotary_pos_emb", _failing)
    result = bench.main(["--out", str(tmp_path)])
    frames = result if isinstance(result, tuple) else (result,)
    assert exit_status(*frames) == 1
    captured = capsys.readouterr()
    assert "failed: this path does not run here" in captured.out
    assert "error: nothing was measured" in captured.err
    assert (tmp_path / f"{stem}.csv").stat().st_size > 0  # the failures are on record


def test_rope_tune_picks_the_best_worst_case_over_shapes():
    """``--tune``'s summary: per kernel the configuration whose worst shape is best, counting
    only configurations measured at every shape (a failed one has NaN)."""
    from kernel_benchmark.bench_rope import best_configs

    nan = float("nan")
    rows = [  # config -> (% at shape a, % at shape b)
        ("heuristic", 90.0, 80.0),
        ("{'TARGET': 2048}", 85.0, 84.0),  # lower best case, higher worst case: wins
        ("{'num_warps': 8}", 99.0, nan),  # failed at b
    ]
    tdf = pd.DataFrame(
        [
            {"kernel": "te", "shape": shape, "config": cfg, "pct_copy_bw": pct}
            for cfg, a, b in rows
            for shape, pct in (("a", a), ("b", b))
        ]
    )
    best = best_configs(tdf)["te"]
    assert best["config"] == {"TARGET": 2048} and best["min_pct"] == 84.0
    assert best["per_shape"] == {"a": 85.0, "b": 84.0}


def test_attention_scoring_layouts_are_the_scorers_own_batches(capsys):
    """--tune-scoring times the packed kernel on the engine's first full batch of 0- and
    few-shot tasks: valid packed layouts (contiguous trees, spans inside their rows), padded to
    the scorer's multiple, every real token seeing at least itself; a CPU run is refused."""
    from kernel_benchmark.bench_attention import main, scoring_layouts
    from nakta_model.kernels.packed_attention import _check_layout
    from nakta_model.score_batches import PAD_MULTIPLE

    layouts = scoring_layouts((0, 3), 2048)
    assert [label.split()[0] for label, *_ in layouts] == ["0-shot", "3-shot"]
    for _, start, span, pairs in layouts:
        _check_layout(start, span)
        assert start.shape[0] % PAD_MULTIPLE == 0 and pairs >= start.shape[0]
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            main(["--tune-scoring", "--device", "cpu"])
        assert "needs a GPU" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# ``kernel_benchmark/bench_decode.py`` end to end on the CPU (interpreter, toy shapes): every path
# runs and agrees with the reference, the tables and plot are written, ``--tune`` writes a config
# JSON that ``--shapes-config`` (and ``decode_linear._config``) take back; plus the byte counts
# and the tuning helpers on their own.
# ------------------------------------------------------------------------------------------------


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
def test_attention_reads_an_e4m3_cache_beside_bf16(tmp_path):
    """``--kv-cache fp8``: ``nakta_kv8`` on the same keys and values as e4m3 codes with
    per-position scales, within the codes' rounding of the reference on those codes, its bytes
    counted as codes + scales (0.53x the fp32 cache's 4 bytes per element at head_dim 16)."""
    _, attn = bd.main(["--quick", "--attention-only", "--kv-cache", "fp8", "--out", str(tmp_path)])
    kv8 = attn[attn["path"] == "nakta_kv8"]
    assert set(kv8["heads"]) == {"mha", "gqa2"} and (kv8["status"] == "ok").all()
    assert (kv8["mismatch"] < 0.5).all() and (kv8["n_splits"] >= 1).all()
    case = bd.AttnCase(2, 4, 2, 16, 40)
    t = bd.make_attn_set(case, torch.float32, torch.device("cpu"), seed=0, kv8=True)
    t["lens"].fill_(33)
    bd.attn_calls(case, t, 33, torch.device("cpu"))["nakta_kv8"]()
    want = bd.decode_attention_reference(t["q"], t["k8"], t["v8"], t["lens"], k_scale=t["ks"],
                                         v_scale=t["vs"])  # fmt: skip
    torch.testing.assert_close(t["out8"], want, rtol=1e-4, atol=1e-5)
    exact = bd.decode_attention_reference(t["q"], t["k"], t["v"], t["lens"])
    assert 0 < (t["out8"] - exact).abs().max() < 0.1  # e4m3 rounding, not a wrong read
    rows = bd.bench_attention_case(case, [33], torch.float32, torch.device("cpu"), 1.0, kv8=True)
    by_path = {r["path"]: r for r in rows}
    moved = {p: r["us"] * r["GB/s"] for p, r in by_path.items()}  # bytes / 1e3
    assert moved["nakta"] / moved["nakta_kv8"] == pytest.approx(
        4 * 16 / (16 + 4)
    )  # bytes: fp32 cache / (codes + scales)


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


@pytest.mark.parametrize("bad", ["32", "32:0", "32:5", "a:8", "32:8,"])
def test_attn_heads_must_be_q_kv_pairs(bad, capsys):
    with pytest.raises(SystemExit):
        bd.main(["--attention-only", "--attn-heads", bad])
    assert "--attn-heads: expected Q:KV pairs" in capsys.readouterr().err
    assert bd._head_pairs("32:32,32:8") == ((32, 32), (32, 8))


def test_family_shapes_come_from_their_presets():
    """``--models llama3-8B,llama3.2-1B``: the GQA ``wqkv``, the FFN width, the 128,256-row head
    and the head size as the presets state them (the keys ``decode_linear._config`` looks up)."""
    shapes = {s.kind: s for s in bd.linear_shapes("llama3-8B", bd.MODELS["llama3-8B"])}
    assert (shapes["wqkv"].n, shapes["wqkv"].k, shapes["wqkv"].heads) == (6144, 4096, (32, 8, 128))
    assert (shapes["w13"].n_cols, shapes["w2"].k, shapes["head"].n) == (14336, 14336, 128256)
    small = {s.kind: s for s in bd.linear_shapes("llama3.2-1B", bd.MODELS["llama3.2-1B"])}
    assert small["wqkv"].heads == (32, 8, 64) and small["w13"].n_cols == 8192
    assert (small["head"].n, small["head"].k) == (128256, 2048)


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


# ------------------------------------------------------------------------------------------------
# ``kernel_benchmark/bench_decode_gemm.py`` on the CPU (interpreter, toy shapes): both paths run
# and the GEMM path agrees with its reference, the tables, plot and crossover JSON are written;
# the crossover rule and the byte counts on their own.
# ------------------------------------------------------------------------------------------------


@cpu_only
def test_smoke_blocks_both_quants_and_rows_above_64(tmp_path):
    res = bg.main(["--rows", "2,65", "--quants", "fp8", "--sections", "blocks",
                   "--out", str(tmp_path)])  # fmt: skip
    blocks = pd.read_csv(tmp_path / "decode_gemm_blocks.csv")
    assert (blocks["status"] == "ok").all() and (blocks["us"] > 0).all()
    assert set(blocks[blocks["rows"] == 65]["path"]) == {"gemm"}  # no GEMVs past 64
    assert set(blocks[blocks["rows"] == 2]["path"]) == {"decode_linear", "gemm", "triton_fp8"}
    gemm = blocks[blocks["path"].isin(bg.GEMM_PATHS)]
    assert (gemm["rel_err"] < 2e-2).all()  # FP8 SwiGLU codes compared dequantized
    cross = json.loads((tmp_path / "decode_gemm_crossover.json").read_text())
    assert set(cross["crossovers"]) == {"tiny/fp8"} == set(res["crossovers"])
    for name in ("decode_gemm_blocks_layer.md", "decode_gemm.png"):
        assert (tmp_path / name).stat().st_size > 0


@cpu_only
@pytest.mark.slow  # the step section runs in the default tier through the bf16 smoke below
def test_smoke_step_fp8_three_paths(tmp_path):
    """FP8 at 8 rows: the GEMVs, cuBLASLt's path and the fp8_decode_gemm path each decode."""
    bg.main(["--rows", "8", "--quants", "fp8", "--sections", "step", "--context", "4",
             "--out", str(tmp_path)])  # fmt: skip
    step = pd.read_csv(tmp_path / "decode_gemm_step.csv")
    assert set(step["path"]) == {"decode_linear", "gemm", "triton_fp8"}
    assert (step["tok_s"] > 0).all()


def test_paths_turn_the_fp8_kernel_off_and_on():
    assert bg.paths_at(8, "fp8") == ("decode_linear", "gemm", "triton_fp8")
    assert bg.paths_at(8) == ("decode_linear", "gemm") and bg.paths_at(65, "fp8")[0] == "gemm"
    with tuned(sg, **bg.PATH_TUNE["gemm"]):
        lo, hi = sg.fp8_kernel_rows()
        assert lo > hi
    with tuned(sg, **bg.PATH_TUNE["triton_fp8"]):
        assert sg.fp8_kernel_rows() == (1, 64)
    assert bg.paths_at(64) == ("decode_linear", "gemm")
    assert bg.paths_at(128) == ("gemm",) == bg.paths_at(128, "fp8")
    assert bg.paths_at(64, "fp8") == ("decode_linear", "gemm", "triton_fp8")


@cpu_only
def test_smoke_step_both_paths(tmp_path):
    bg.main(["--rows", "2", "--quants", "bf16", "--sections", "step", "--context", "4",
             "--out", str(tmp_path)])  # fmt: skip
    step = pd.read_csv(tmp_path / "decode_gemm_step.csv")
    assert set(step["path"]) == {"decode_linear", "gemm"} and (step["tok_s"] > 0).all()


def test_crossover_is_the_first_rows_from_which_gemm_always_wins():
    rows = []
    for r, dl_us, gemm_us in [(8, 1.0, 2.0), (16, 1.0, 0.9), (32, 1.0, 1.1), (64, 2.0, 1.0)]:
        rows += [{"model": "7B", "quant": "bf16", "rows": r, "path": "decode_linear",
                  "linears_us": dl_us},
                 {"model": "7B", "quant": "bf16", "rows": r, "path": "gemm",
                  "linears_us": gemm_us}]  # fmt: skip
    rows.append({"model": "7B", "quant": "bf16", "rows": 128, "path": "gemm", "linears_us": 2.0})
    cross = bg.crossovers(pd.DataFrame(rows))["7B/bf16"]
    assert cross["crossover_rows"] == 64  # 16 wins but 32 does not: from 64 on
    assert cross["gemm_speedup_by_rows"][64] == 2.0
    never = pd.DataFrame(rows[:2])
    assert bg.crossovers(never)["7B/bf16"]["crossover_rows"] == 65


def test_block_bytes_count_fp8_weights_once_and_their_scales():
    wqkv, wo, w13, w2, head = linear_shapes("7B", MODELS["7B"])
    assert bg.weight_bytes(w13, "bf16") == 2 * 22016 * 4096
    assert bg.weight_bytes(w13, "fp8") == 22016 * 4096 + 4 * 22016
    assert bg.weight_bytes(head, "fp8") == bg.weight_bytes(head, "bf16")  # the head stays bf16
    extra = bg.block_bytes(wqkv, 8, "bf16") - bg.weight_bytes(wqkv, "bf16")
    # x, norm weight, rotated Q out, K/V cache writes
    assert extra == 2 * (8 * 4096 + 4096 + 8 * 4096 + 2 * 8 * 32 * 128)


def test_bad_arguments_exit():
    for argv in (["--rows", "0"], ["--rows", "1025"], ["--quants", "int4"], ["--models", "2B"]):
        with pytest.raises(SystemExit):
            bg.parse_args(argv)


# ------------------------------------------------------------------------------------------------
# test_bench_timing
# ------------------------------------------------------------------------------------------------


def test_eager_ms_times_a_call_on_the_cpu():
    calls = []
    ms = eager_ms(lambda: calls.append(torch.ones(64).sum()), torch.device("cpu"))
    assert ms >= 0.0 and len(calls) == 4  # one warm-up, then the median of three


def test_input_sets_is_one_on_the_cpu():
    assert input_sets(torch.device("cpu"), 1 << 20) == 1


def test_interleaved_ms_alternates_paths_on_the_cpu():
    order = []
    calls = {
        "a": [lambda: order.append("a"), lambda: order.append("a")],
        "b": [lambda: order.append("b")],
    }
    res = interleaved_ms(calls, torch.device("cpu"), rounds=3)
    assert set(res) == {"a", "b"}
    assert all(ms >= 0.0 and spread >= 0.0 for ms, spread in res.values())
    assert order == ["a", "a", "b"] * 3  # every round runs each path once, in turn


@pytest.mark.gpu
def test_rotated_ms_times_each_path_and_reports_what_cannot_be_captured():
    """Twice the bytes take longer; a call that syncs with the host (not capturable) is
    reported with its reason and the other paths are still timed."""
    small = torch.empty(1 << 24, device="cuda")
    big = torch.empty(1 << 25, device="cuda")
    calls = {
        "small": [lambda: small.mul_(1.0)],
        "host_sync": [lambda: small.sum().item()],
        "big": [lambda: big.mul_(1.0)],
    }
    with torch.cuda.stream(torch.cuda.Stream()):
        times, errors = rotated_ms(calls, rounds=3)
    assert set(times) == {"small", "big"} and set(errors) == {"host_sync"}
    assert errors["host_sync"]
    assert times["big"] > 1.5 * times["small"] > 0.0


@pytest.mark.gpu
def test_graph_ms_takes_one_call_or_several_on_the_current_stream():
    """The one graph timer: a single callable or a list, captured on the current stream."""
    small = torch.empty(1 << 24, device="cuda")
    big = torch.empty(1 << 25, device="cuda")
    with torch.cuda.stream(torch.cuda.Stream()):
        one = graph_ms(lambda: small.mul_(1.0))
        several = graph_ms([lambda: big.mul_(1.0), lambda: big.mul_(1.0)], budget_ms=5.0)
    assert several > 1.5 * one > 0.0
