"""The 4-GPU catalogue: ``speed_bench.scaling_x4`` on fabricated ``run_all`` summaries and an
lm-eval data-parallel report (the issue's schema key for key, the ratios, the merge of two
device calls, refusals), and ``scripts/reproduce_scoring.sh``'s x4 jobs driven with a fake
``nvidia-smi``, ``python3`` and ``torchrun`` (the command of every step, the deadline)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from speed_bench import scaling_x4

REPO = Path(__file__).resolve().parents[1]
SLUG = "nvidia-h100-80gb-hbm3"


def _run(tmp: Path, model: str, tp: int, dp: int, dtype: str, engines: dict, preds: dict):
    """A run_all summary.json as run_all writes it (the keys scaling_x4 reads)."""
    ref = "llama_org" if "llama_org" in engines else next(iter(engines))
    summary = {
        "device": SLUG,
        "model": f"random-{model}",
        "tp": tp,
        "dp": dp,
        "gpus": tp * dp,
        "dtype": dtype,
        "workload": {"name": "hellaswag_val_full-8-spread", "tasks": 8},
        "reference_engine": ref,
        "engines": {
            name: {"tasks_per_s": tps, "pred_agree_vs_ref": agree}
            for name, (tps, agree) in engines.items()
        },
        "predictions": {name: {"acc": p, "acc_norm": p[::-1]} for name, p in preds.items()},
    }
    folder = tmp / f"{model}-{dtype}-tp{tp}-dp{dp}"
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps(summary))
    return str(folder)


def _lm_eval_report(path: Path, device: str = "NVIDIA H100 80GB HBM3") -> Path:
    runs = [
        # preset, tp, dp, shots, limit, wall, hf wall
        ("7B", 1, 1, 0, None, 60.0, None),
        ("7B", 1, 4, 0, None, 20.0, None),
        ("7B", 1, 1, 10, 2000, 57.0, None),
        ("7B", 1, 4, 10, 2000, 19.5, None),
        ("30B", 4, 1, 0, 2000, 30.0, 90.0),
    ]
    rows = [
        {
            "gpus": tp * dp,
            "task": "hellaswag_local",
            "preset": p,
            "tp": tp,
            "dp": dp,
            "num_fewshot": s,
            "limit": n,
            "wall_s": w,
            "hf_wall_s": hf,
            "acc": 0.25,
            "first_request_s": 5.0,
        }  # fmt: skip
        for p, tp, dp, s, n, w, hf in runs
    ]
    rows.append({**rows[0], "task": "suite_4", "wall_s": 99.0})  # a suite run: not a row here
    path.write_text(json.dumps({"device_name": device, "gpus_available": 4, "runs": rows}))
    return path


def _big_runs(tmp: Path) -> list[str]:
    engines = {"nakta": (80.0, 1.0), "nakta_cache": (150.0, 0.999), "llama_org": (50.0, 1.0)}
    preds = {e: "01230123" for e in engines}
    return [
        _run(tmp, "30B", 4, 1, "float16", engines, preds),
        _run(tmp, "65B", 4, 1, "bfloat16", engines, preds),
    ]


def _grid_runs(tmp: Path) -> list[str]:
    grids = [((1, 1), 100.0, "01230123"), ((2, 1), 170.0, "01230120"), ((4, 1), 300.0,
             "01230123"), ((2, 2), 330.0, "01230123"), ((1, 4), 390.0, "01230123")]  # fmt: skip
    return [
        _run(tmp, "13B", tp, dp, "bfloat16", {"nakta_cache": (tps, 1.0)}, {"nakta_cache": p})
        for (tp, dp), tps, p in grids
    ]


def test_summary_has_the_issue_schema_and_its_ratios(tmp_path):
    out = tmp_path / "dev-x4" / "scaling_x4"
    lm = _lm_eval_report(tmp_path / "lm.json")
    runs = _big_runs(tmp_path) + _grid_runs(tmp_path)
    got = scaling_x4.main(
        [
            *runs,
            "--seed-command",
            "0",
            "33.25",
            "--lm-eval",
            str(lm),
            "--out",
            str(out),
            "--device-name",
            "NVIDIA H100 80GB HBM3",
            "--index",
        ]  # fmt: skip
    )
    saved = json.loads((out / "scaling_x4_summary.json").read_text())
    assert saved == got
    assert set(saved) == {"device_name", "gpus", "seed_command", "scoring", "lm_eval"}
    assert saved["gpus"] == 4 and saved["device_name"] == "NVIDIA H100 80GB HBM3"
    assert saved["seed_command"] == {"rc": 0, "wall_s": 33.25}
    for r in saved["scoring"]:
        assert set(r) == {"preset", "dtype", "tp", "dp", "engine", "tasks_per_s",
                          "vs_llama_org", "pred_agree"}  # fmt: skip
        assert isinstance(r["tasks_per_s"], float) and isinstance(r["pred_agree"], float)
    for r in saved["lm_eval"]:
        assert set(r) == {"preset", "tp", "dp", "num_fewshot", "limit", "wall_s", "hf_wall_s"}
    by = {(r["preset"], r["dtype"], r["tp"], r["dp"], r["engine"]): r for r in saved["scoring"]}
    cache30 = by[("30B", "fp16", 4, 1, "nakta_cache")]
    assert cache30["vs_llama_org"] == pytest.approx(3.0)
    assert cache30["pred_agree"] == 0.999  # run_all's agreement with llama_org, as measured
    assert by[("65B", "bf16", 4, 1, "llama_org")]["vs_llama_org"] == 1.0
    # the grids: no llama_org, agreement with the one-GPU run's predictions task by task
    assert by[("13B", "bf16", 2, 1, "nakta_cache")]["vs_llama_org"] is None
    # one task's acc and another's acc_norm differ (acc_norm digits are the reverse)
    assert by[("13B", "bf16", 2, 1, "nakta_cache")]["pred_agree"] == 6 / 8
    assert by[("13B", "bf16", 1, 1, "nakta_cache")]["pred_agree"] == 1.0
    assert len(saved["scoring"]) == 6 + 5
    assert len(saved["lm_eval"]) == 5  # the suite run left out

    grid = scaling_x4.grid_table(saved).set_index(["tp", "dp"])
    assert grid.loc[(1, 4), "speedup_vs_1gpu"] == pytest.approx(3.9)
    assert grid.loc[(2, 2), "efficiency"] == pytest.approx(3.3 / 4)
    lm_t = scaling_x4.lm_eval_table(saved)
    dp4_0 = lm_t[(lm_t.dp == 4) & (lm_t.num_fewshot == 0)].iloc[0]
    assert dp4_0.wall_vs_1gpu == pytest.approx(1 / 3)
    assert lm_t[lm_t.preset == "30B"].iloc[0].hf_over_nakta == pytest.approx(3.0)

    md = (out / "scaling_x4_summary.md").read_text()
    assert "rc 0 in 33.2 s" in md
    assert "30B tp=4 fp16: nakta_cache 3.00x llama_org, predictions 99.9% equal" in md
    assert "NOT met" in md  # predictions not all equal
    assert "65B tp=4 bf16: nakta_cache" in md and "judged in fp16 as the seed ran" in md
    assert "0-shot limit all: 0.33x the one-GPU wall (target <= 0.35x): met" in md
    assert "10-shot limit 2000: 0.34x the one-GPU wall (target <= 0.33x): NOT met" in md
    assert "lm-eval 30B tp=4: 3.00x --model hf parallelize=True (target >= 2.5x): met" in md
    assert (out / "scaling_x4_summary.png").stat().st_size > 1000
    csv = (out / "scaling_x4_summary.csv").read_text().splitlines()
    assert len(csv) == 1 + 11 + 5 and csv[0].startswith("part,preset,dtype,tp,dp,engine")
    index = (out.parent / "README.md").read_text()
    assert "[`scaling_x4/scaling_x4_summary.md`](scaling_x4/scaling_x4_summary.md)" in index
    assert "nakta_cache vs llama_org (MP=4): 30B fp16 3.00x, 65B bf16 3.00x" in index
    assert "13B 4x1 3.00x, 13B 2x2 3.30x, 13B 1x4 3.90x" in index


def test_two_device_calls_merge_into_one_summary(tmp_path):
    out = tmp_path / "scaling_x4"
    first, second = tmp_path / "call1", tmp_path / "call2"
    first.mkdir()
    second.mkdir()
    base = ["--out", str(out), "--device-name", "NVIDIA H100 80GB HBM3"]
    scaling_x4.main([*_grid_runs(first), "--seed-command", "0", "30", *base])
    # the second call: the big runs, and the 30B fp16 run again (replaces its rows)
    runs = _big_runs(second)
    scaling_x4.main([*runs, *base])
    again = tmp_path / "again"
    again.mkdir()
    engines = {"nakta": (81.0, 1.0), "nakta_cache": (160.0, 1.0), "llama_org": (50.0, 1.0)}
    rerun = _run(again, "30B", 4, 1, "float16", engines, {e: "0" * 8 for e in engines})
    got = scaling_x4.main([rerun, "--lm-eval", str(_lm_eval_report(tmp_path / "lm.json")), *base])
    assert got["seed_command"] == {"rc": 0, "wall_s": 30.0}  # kept from the first call
    assert len(got["scoring"]) == 5 + 6  # grids + big runs, the rerun replacing its 3 rows
    cache30 = [r for r in got["scoring"] if (r["preset"], r["engine"]) == ("30B", "nakta_cache")]
    assert [r["tasks_per_s"] for r in cache30] == [160.0]
    assert len(got["lm_eval"]) == 5
    # ordered: preset, then against-llama_org rows before the grids, GPUs ascending
    assert [r["preset"] for r in got["scoring"]][:5] == ["13B"] * 5
    assert [r["tp"] * r["dp"] for r in got["scoring"][:5]] == [1, 2, 4, 4, 4]


def test_inputs_that_cannot_be_used_are_refused(tmp_path):
    out = tmp_path / "x4"
    runs = _grid_runs(tmp_path)
    with pytest.raises(ValueError, match="several devices"):
        scaling_x4.main([*runs, "--device-name", "NVIDIA H200", "--out", str(out)])
    bad = tmp_path / "bad"
    bad.mkdir()
    eight = _run(bad, "7B", 4, 2, "bfloat16", {"nakta_cache": (1.0, 1.0)}, {})
    with pytest.raises(ValueError, match="more than 4 GPUs"):
        scaling_x4.main([eight, "--device-name", "NVIDIA H100 80GB HBM3", "--out", str(out)])
    lm = tmp_path / "lm.json"
    lm.write_text(json.dumps({"device_name": "NVIDIA H100 80GB HBM3",
                              "runs": [{"task": "hellaswag", "tp": 1, "dp": 1}]}))  # fmt: skip
    with pytest.raises(ValueError, match=r"runs\[0\] has no 'preset', 'num_fewshot'"):
        scaling_x4.main(["--lm-eval", str(lm), "--out", str(out)])
    with pytest.raises(ValueError, match="keys"):
        scaling_x4.check_schema({"device_name": "x", "gpus": 4, "scoring": [], "lm_eval": []})
    row = {k: 1 for k in scaling_x4.SCORING_KEYS} | {"extra": 1}
    summary = {"device_name": "x", "gpus": 4, "seed_command": None, "scoring": [row],
               "lm_eval": []}  # fmt: skip
    with pytest.raises(ValueError, match=r"scoring\[0\]: keys"):
        scaling_x4.check_schema(summary)


def test_command_line_errors_are_one_line_and_exit_2(tmp_path, capsys):
    for argv, says in (
        ([], "give run folders"),
        (["--seed-command", "zero", "1"], "--seed-command"),
        (["--lm-eval", str(tmp_path / "none.json")], "no such file"),
        ([str(tmp_path / "nowhere")], "no run_all summary"),
    ):
        with pytest.raises(SystemExit) as e:
            scaling_x4.cli([*argv, "--out", str(tmp_path / "o")])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and says in err and "\n" not in err, err


# ----------------------------------------------------------------------------- the GPU job
FAKE_PY = """#!/usr/bin/env bash
echo "python3 $*" >> {calls}
case "$*" in
  *device_slug*) echo {slug} ;;
  *speed_bench.scaling_x4*) ;;
  *speed_bench.run_all*)
    out=$(echo "$*" | sed -E 's/.*--out ([^ ]+).*/\\1/')
    mkdir -p "$out" && echo '{{}}' > "$out/summary.json" ;;
esac
"""
FAKE_TORCHRUN = """#!/usr/bin/env bash
echo "torchrun $* (in $(basename "$PWD"))" >> {calls}
mkdir -p results/{slug}/nakta/random-7B-tp4-dp1 && echo x > results/{slug}/nakta/random-7B-tp4-dp1/speed.md
"""


def _job(tmp_path: Path, jobs: list[str], gpus: int = 4, **env_extra: str):
    work = tmp_path / "repo"
    (work / "scripts").mkdir(parents=True)
    (work / "speed_bench").mkdir()
    for name in ("gpu_env.sh", "reproduce_scoring.sh"):
        shutil.copy(REPO / "scripts" / name, work / "scripts" / name)
    bin_dir, calls, out = tmp_path / "bin", tmp_path / "calls.txt", tmp_path / "out"
    bin_dir.mkdir()
    gpu_lines = "".join(f"echo 'GPU {i}: fake'\n" for i in range(gpus))
    (bin_dir / "nvidia-smi").write_text(
        f'#!/usr/bin/env bash\nif [ "$1" = -L ]; then\n{gpu_lines}else echo name; fi\n'
    )
    (bin_dir / "python3").write_text(FAKE_PY.format(calls=calls, slug=SLUG))
    (bin_dir / "torchrun").write_text(FAKE_TORCHRUN.format(calls=calls, slug=SLUG))
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "OUT": str(out), "PATH": f"{bin_dir}:{os.environ['PATH']}", **env_extra}
    proc = subprocess.run(
        ["bash", "scripts/reproduce_scoring.sh", *jobs], cwd=work, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = calls.read_text().splitlines() if calls.exists() else []
    return proc, [ln for ln in lines if "device_slug" not in ln], work


@pytest.mark.skipif(not shutil.which("timeout"), reason="needs coreutils timeout")
def test_x4_jobs_run_the_catalogue_commands(tmp_path):
    proc, calls, work = _job(tmp_path, ["x4_seed", "x4_big", "x4_scaling"], X4_DEADLINE="3000")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    x4 = f"--out speed_bench/results/{SLUG}-x4/scaling_x4 --index"
    real = "--data ../shared/data/hellaswag_val_full.jsonl --tokenizer ../shared/data/llama_tokenizer.model"
    # the seed command as a user types it, from inside speed_bench/; its results leave the tree
    assert calls[0] == "torchrun --nproc_per_node 4 nakta_speed.py (in speed_bench)"
    assert not (work / "speed_bench" / "results" / SLUG / "nakta").exists()
    assert calls[1].startswith("python3 -m speed_bench.scaling_x4 --seed-command 0 ")
    assert calls[1].endswith(x4)
    big = [c for c in calls if "nakta,nakta_cache,llama_org" in c]
    tr4 = "python3 -m torch.distributed.run --standalone --nproc_per_node 4 -m speed_bench.run_all"
    assert [c.split("--preset ")[1].split(" --limit")[0] for c in big] == [
        "30B --dtype fp16", "30B --dtype bf16", "65B --dtype fp16", "65B --dtype bf16",
    ]  # fmt: skip
    for c in big:
        assert c.startswith(tr4) and "--limit 1000" in c and real in c and "--select spread" in c
    report_big = calls[calls.index(big[-1]) + 1]
    assert report_big.startswith("python3 -m speed_bench.scaling_x4 /tmp/")
    assert report_big.count("summary.json") == 4 and report_big.endswith(x4)
    grids = [c for c in calls if "--engines nakta_cache " in c]
    got = [
        (c.split("--preset ")[1].split()[0], c.split("--limit ")[1].split()[0],
         c.split("--nproc_per_node ")[1].split()[0] if "nproc" in c else "1",
         c.split("--tp ")[1].split()[0] if "--tp" in c else "1",
         c.split("--dp ")[1].split()[0] if "--dp" in c else "1")
        for c in grids
    ]  # fmt: skip
    expect = []
    for m, n, two in (("7B", "2000", ("1", "2")), ("13B", "1000", ("2", "1")),
                      ("30B", "1000", ("2", "1"))):  # fmt: skip
        expect += [(m, n, "1", "1", "1"), (m, n, "2", *two), (m, n, "4", "4", "1"),
                   (m, n, "4", "2", "2"), (m, n, "4", "1", "4")]  # fmt: skip
    assert got == expect
    assert calls[-1].count("summary.json") == 15 and calls[-1].endswith(x4)


@pytest.mark.skipif(not shutil.which("timeout"), reason="needs coreutils timeout")
def test_x4_jobs_skip_on_a_small_host_and_stop_at_the_deadline(tmp_path):
    proc, calls, _ = _job(tmp_path, ["x4_big"], gpus=2)
    assert proc.returncode == 1 and calls == []
    assert "x4_big: SKIPPED (needs 4 GPUs, this host has 2)" in proc.stdout
    # past the call's deadline no step starts (one slow step cannot take the whole call)
    proc, calls, _ = _job(tmp_path / "b", ["x4_big"], X4_DEADLINE="10")
    assert proc.returncode == 1 and calls == []
    assert "30B_tp4_fp16: SKIPPED" in proc.stdout and "65B_tp4_bf16: SKIPPED" in proc.stdout
    assert "x4_report_big: no run finished, nothing to report" in proc.stdout


def test_a_real_run_all_summary_makes_rows(tmp_path):
    """run_all's own summary (tiny model, 4 embedded tasks, in this process): the keys
    scaling_x4 reads are the keys run_all writes."""
    pytest.importorskip("fairscale")
    from speed_bench import run_all

    out = tmp_path / "run"
    run_all.main(["--preset", "tiny", "--warmup", "0", "--no-progress", "--device", "cpu",
                  "--limit", "4", "--engines", "nakta_cache,llama_org", "--out", str(out)])  # fmt: skip
    got = scaling_x4.main([str(out), "--device-name", "cpu", "--out", str(tmp_path / "x4")])
    rows = {r["engine"]: r for r in got["scoring"]}
    assert set(rows) == {"nakta_cache", "llama_org"}
    assert rows["llama_org"]["vs_llama_org"] == 1.0
    assert rows["nakta_cache"]["dtype"] == "fp32" and rows["nakta_cache"]["preset"] == "tiny"
    assert 0.0 <= rows["nakta_cache"]["pred_agree"] <= 1.0


def test_lm_eval_reports_of_two_calls_merge_row_by_row(tmp_path):
    """--lm-eval twice: a run both reports hold takes the later one's row (its hf wall with it);
    the others stay; a later call with one report replaces only its own runs."""
    first = _lm_eval_report(tmp_path / "a.json")
    second = tmp_path / "b.json"
    report = json.loads(first.read_text())
    report["runs"] = [
        {**r, "wall_s": 19.5, "hf_wall_s": 80.1} for r in report["runs"] if r["preset"] == "30B"
    ] + [{**report["runs"][4], "tp": 2, "dp": 2, "wall_s": 22.2, "hf_wall_s": None}]
    second.write_text(json.dumps(report))
    base = ["--out", str(tmp_path / "s"), "--device-name", "NVIDIA H100 80GB HBM3"]
    got = scaling_x4.main(["--lm-eval", str(first), "--lm-eval", str(second), *base])
    rows = {(r["preset"], r["tp"], r["dp"], r["num_fewshot"]): r for r in got["lm_eval"]}
    assert len(got["lm_eval"]) == 6
    assert (rows["30B", 4, 1, 0]["wall_s"], rows["30B", 4, 1, 0]["hf_wall_s"]) == (19.5, 80.1)
    assert rows["30B", 2, 2, 0]["wall_s"] == 22.2 and rows["7B", 1, 4, 0]["wall_s"] == 20.0
    again = scaling_x4.main(["--lm-eval", str(second), *base])  # the old 7B rows are kept
    assert len(again["lm_eval"]) == 6 and again["lm_eval"] == got["lm_eval"]
