"""speed_bench.decode_ab_report: A/B stage folders merged per call and setting, without a GPU."""

from __future__ import annotations

import pytest

from speed_bench.decode_ab_report import main, read_stage


def _stage(tmp_path, name, rows):
    d = tmp_path / name
    d.mkdir()
    lines = ["run,engine,tok_s,pct_of_floor,floor_tok_s"]
    lines += [f"{r},{e},{t},{t / 4.4},440" for r, e, t in rows]
    (d / "runs.csv").write_text("\n".join(lines) + "\n")
    return d


def test_calls_and_settings_are_summarized_in_order(tmp_path):
    a = _stage(tmp_path, "a", [("r1_base", "nakta_fp8", 350), ("r2_x", "nakta_fp8", 340),
                               ("r3_x", "nakta_fp8", 344), ("r4_base", "nakta_fp8", 352)])  # fmt: skip
    b = _stage(tmp_path, "b", [("r1_1_residual-4", "nakta_fp8", 330), ("r2_1", "nakta", 198)])
    out = tmp_path / "out"
    table = main(["--stage", f"one={a}", "--stage", f"two={b}", "--out", str(out)])
    assert table[["call", "setting"]].values.tolist() == [
        ["one", "base"],
        ["one", "x"],
        ["two", "1_residual-4"],
        ["two", "1"],
    ]
    row = table.iloc[0]
    assert row["runs"] == 2 and row["median_tok_s"] == 351 and row["min_tok_s"] == 350
    for f in ("decode_b1_ab.csv", "decode_b1_ab.md", "decode_b1_ab.png", "decode_b1_ab_runs.csv"):
        assert (out / f).exists()


def test_bad_stages_are_named(tmp_path):
    bad = _stage(tmp_path, "bad", [("base", "nakta_fp8", 350)])
    with pytest.raises(ValueError, match="r<N>_<setting>"):
        read_stage("x", bad)
    with pytest.raises(ValueError, match="cannot read"):
        read_stage("x", tmp_path / "nowhere")
    with pytest.raises(SystemExit):
        main(["--stage", "nolabel", "--out", str(tmp_path / "o")])
