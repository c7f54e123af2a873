"""The GPU jobs under scripts/ run only on a lent GPU, where a syntax error or a wrong setting
costs device time: every script parses (``bash -n``), scripts/ holds the few reproduction scripts
the docs name, and the throughput job, driven with a fake ``nvidia-smi`` and ``python3``, runs
the catalogue's command for each setting and archives what it wrote (and nothing older)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((REPO / "scripts").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_gpu_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_scripts_are_the_few_reproduction_scripts_the_docs_name():
    names = {p.name for p in (REPO / "scripts").iterdir()}
    assert len(names) <= 8, sorted(names)
    assert {"gpu_env.sh", "fetch_device_wheels.sh"} <= names
    doc = (REPO / "docs" / "benchmarks-and-reproducing.md").read_text(encoding="utf-8")
    for name in names - {"gpu_env.sh"}:
        assert f"scripts/{name}" in doc, name


FAKE_PY = """#!/usr/bin/env bash
echo "$*" >> {calls}
case "$*" in
  *device_slug*) echo fake-gpu ;;
  *speed_bench.throughput*)
    out=$(echo "$*" | sed -E 's/.*--out ([^ ]+).*/\\1/')
    mkdir -p "$out" && echo "| run |" > "$out/throughput.md" ;;
esac
"""


def _run(tmp_path: Path, args: list[str], **env_extra: str):
    work = tmp_path / "repo"
    (work / "scripts").mkdir(parents=True)
    for name in ("gpu_env.sh", "reproduce_throughput.sh"):
        shutil.copy(REPO / "scripts" / name, work / "scripts" / name)
    old = work / "speed_bench" / "results" / "fake-gpu" / "speed.md"  # a committed result
    old.parent.mkdir(parents=True)
    old.write_text("| old |\n")
    bin_dir, calls, out = tmp_path / "bin", tmp_path / "calls.txt", tmp_path / "out"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\necho 'name, memory.used'\n")
    (bin_dir / "python3").write_text(FAKE_PY.format(calls=calls))
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "OUT": str(out), "PATH": f"{bin_dir}:{os.environ['PATH']}", **env_extra}
    proc = subprocess.run(
        ["bash", "scripts/reproduce_throughput.sh", *args], cwd=work, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = calls.read_text().splitlines() if calls.exists() else []
    return proc, [ln for ln in lines if "speed_bench.throughput" in ln], out


@pytest.mark.skipif(not shutil.which("tar"), reason="needs tar")
def test_throughput_job_runs_the_catalogue_command_and_archives_its_files(tmp_path):
    proc, runs, out = _run(tmp_path, [])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(runs) == 1
    assert "--preset 7B --prompts 1000 --input-len 128 --output-len 128" in runs[0]
    assert "--engines nakta,hf --max-batch 64,128,256,384 --hf-batches 128,64" in runs[0]
    assert runs[0].endswith("--out speed_bench/results/fake-gpu/throughput")
    with tarfile.open(out / "throughput.tar.gz") as t:
        assert t.getnames() == ["speed_bench/results/fake-gpu/throughput/throughput.md"]
    assert (out / "throughput_log.txt").is_file()


@pytest.mark.skipif(not shutil.which("tar"), reason="needs tar")
def test_throughput_job_fp8_switch_size_and_bad_job(tmp_path):
    proc, runs, _ = _run(tmp_path / "a", [], QUANT="fp8", SIZE="13B", HF_BATCHES="")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--preset 13B " in runs[0] and "--engines nakta,nakta_fp8 --max-batch 384 " in runs[0]
    assert runs[0].endswith("--out speed_bench/results/fake-gpu/throughput_fp8")
    proc, runs, _ = _run(tmp_path / "b", [], HF_BATCHES="")
    assert "--engines nakta --max-batch 64,128,256,384 --out" in runs[0]  # HF left out
    proc, runs, _ = _run(tmp_path / "c", ["nonsense"])
    assert proc.returncode == 2 and runs == [] and "unknown job nonsense" in proc.stdout
