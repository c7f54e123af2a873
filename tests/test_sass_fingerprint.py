"""``kernel_benchmark/sass_fingerprint.py``: sm_90 SASS of the kernel launches without a GPU.

Runs the logprobs part (a few seconds of ptxas) in a fresh process, as a user would, then
checks that ``--compare`` finds a run identical to itself and names a launch whose SASS differs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import triton

from kernel_benchmark.sass_fingerprint import compare

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
needs_nvidia_tools = pytest.mark.skipif(
    not (BIN / "ptxas").exists() or not (BIN / "nvdisasm").exists(),
    reason="Triton's bundled ptxas / nvdisasm are not installed",
)


@needs_nvidia_tools
def test_fingerprint_run_and_compare(tmp_path):
    from cli_helpers import REPO, run_script

    tool = ["-m", "kernel_benchmark.sass_fingerprint"]
    out = tmp_path / "fp.json"
    proc = run_script([*tool, "--out", str(out), "--parts", "logprobs", "--jobs", "1"], REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    # 3 dtypes x 4 vocab sizes, one launch each; distinct specializations compile distinct SASS
    assert len(rows) == 12 and {r["kernel"] for r in rows} == {"_lse_argmax_kernel"}
    assert all(len(r["sass"]) == 16 for r in rows) and len({r["sass"] for r in rows}) > 1

    same = run_script([*tool, "--compare", str(out), str(out)], REPO)
    assert same.returncode == 0 and "all 12 launches: identical SASS" in same.stdout
    changed = tmp_path / "changed.json"
    changed.write_text(json.dumps([{**rows[0], "sass": "0" * 16}, *rows[1:]]))
    diff = run_script([*tool, "--compare", str(out), str(changed)], REPO)
    assert diff.returncode == 1
    assert f"SASS differs: {rows[0]['label']} launch 0 (_lse_argmax_kernel)" in diff.stdout


def test_compare_names_launches_only_one_run_made():
    row = {"label": "a #1", "index": 0, "kernel": "k", "sass": "x"}
    assert compare([row], [row]) == []
    assert compare([row], []) == ["only in the first run: a #1 launch 0"]
    assert compare([], [row]) == ["only in the second run: a #1 launch 0"]
