"""The GPU jobs under scripts/ run only on a lent GPU, where a syntax error or a wrong setting
costs device time: every script parses (``bash -n``), and the throughput A/B job, driven with a
fake ``nvidia-smi`` and ``python3`` that record what they are asked, runs each named setting
with its environment, picks the big rows from the GPU's memory, keeps to its deadline and
names what it skips."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((REPO / "scripts").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_gpu_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _fake_tools(bin_dir: Path, calls: Path, mib: int) -> None:
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/usr/bin/env bash\necho {mib}\n")
    py = bin_dir / "python3"
    py.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "overlap=$NAKTA_PREFILL_OVERLAP defer=$NAKTA_DEFER_RESIDUAL '
        f'splitk=$NAKTA_SPLITK_GEMM burst=$NAKTA_PREFILL_BURST pipe=$NAKTA_DECODE_PIPELINE $*" >> {calls}\n'
    )
    for f in (smi, py):
        f.chmod(0o755)


def _run_ab(tmp_path: Path, mib: int, args: list[str], deadline: int | None = None):
    work = tmp_path / "repo"  # a copy without .whl/: no wheel install
    (work / "scripts").mkdir(parents=True)
    for name in ("gpu_env.sh", "gpu_throughput_ab.sh"):
        shutil.copy(REPO / "scripts" / name, work / "scripts" / name)
    calls, out = tmp_path / "calls.txt", tmp_path / "out"
    out.mkdir()
    _fake_tools(tmp_path / "bin", calls, mib)
    env = {**os.environ, "OUT": str(out), "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    if deadline is not None:
        env["DEADLINE"] = str(deadline)
    proc = subprocess.run(
        ["bash", "scripts/gpu_throughput_ab.sh", *args], cwd=work, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = calls.read_text().splitlines() if calls.exists() else []
    return proc, [ln for ln in lines if "speed_bench.throughput " in ln + " "], out


@pytest.mark.skipif(not shutil.which("tar"), reason="needs tar")
def test_throughput_ab_runs_each_setting_with_its_environment(tmp_path):
    proc, runs, out = _run_ab(tmp_path, 81559, [])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / "throughput_ab.tar.gz").is_file()
    want = [  # the default list, most wanted first; "big" is 384 rows on an 80 GB GPU
        (0, "384"), (1, "384"), (0, "384"), (1, "384"), (0, "256"), (1, "256"),
    ]  # fmt: skip
    assert len(runs) == len(want)
    for line, (pipe, rows) in zip(runs, want):
        assert line.startswith(f"overlap=off defer=1 splitk=0 burst=8 pipe={pipe} ")
        assert f"--engines nakta --max-batch {rows} " in line


def test_throughput_ab_named_runs_big_rows_deadline_and_bad_names(tmp_path):
    proc, runs, _ = _run_ab(tmp_path / "a", 143771, ["big_fp8splitk", "256_fp8", "256_sep_2",
                                                     "256_first", "big_equal", "big_nopipe",
                                                     "big_pipe"])  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "splitk=1 " in runs[0] and "--engines nakta_fp8 --max-batch 512 " in runs[0]
    assert "splitk=0 " in runs[1] and "--engines nakta_fp8 --max-batch 256 " in runs[1]
    assert runs[2].startswith("overlap=off defer=0 splitk=0 burst=1 ")
    assert runs[3].startswith("overlap=decode_first defer=1 ")
    assert runs[4].startswith("overlap=equal ") and "--max-batch 512 " in runs[4]
    assert " burst=8 pipe=0 " in runs[5] and " burst=8 pipe=1 " in runs[6]
    proc, runs, _ = _run_ab(tmp_path / "b", 81559, ["256_off", "256_equal"], deadline=-1)
    assert runs == [] and "=== 256_off: skipped at" in proc.stdout
    assert "=== 256_equal: skipped at" in proc.stdout and "gemm_blocks" not in proc.stdout
    proc, runs, _ = _run_ab(tmp_path / "c", 81559, ["256_bogus"])
    assert proc.returncode == 1 and "unknown setting in run 256_bogus" in proc.stdout
