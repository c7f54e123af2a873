"""CPU smoke runs of the kernel benchmarks (interpreter, tiny shapes): every path runs, the
result files are written, and the head-to-head timer measures every path in each mode."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from kernel_benchmark import bench_rmsnorm, bench_rope, bench_swiglu
from kernel_benchmark.common import head_to_head_rows, write_head_to_head

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
