"""``kernel_benchmark/sass_loop_counts.py``: instructions per weight element of the batch-1 FP8
GEMV's K loop, from sm_90 SASS compiled on the CPU.

Runs the tool for ``wo`` in a fresh process, as a user would, and checks what
docs/experiments.md reads from it: CVT=0 spends one FFMA, half an ``F2FP`` (e4m3 pair -> f16x2)
and one ``HADD2.F32`` (f16 -> f32) per code; CVT=1 no conversion instruction, one LOP3 mask.
"""

from __future__ import annotations

import collections

import pytest
from test_sass_fingerprint import needs_nvidia_tools

from kernel_benchmark.sass_loop_counts import group, weight_loop

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/               @P0 LDG.E.EF.128 R40, desc[UR6][R34.64] ;
        /*0020*/                   F2FP.F16.E4M3.UNPACK_B R2, R40 ;
        /*0030*/                   HADD2.F32 R3, -RZ, R2.H0_H0 ;
        /*0040*/                   FFMA R5, R3, R4, R5 ;
        /*0050*/              @!P0 BRA `(.L_x_1) ;
.L_x_2:
        /*0060*/                   BRA `(.L_x_2);
"""


def test_weight_loop_and_groups():
    counts = weight_loop(SASS)
    assert counts == collections.Counter(
        {"LDG.E.EF.128": 1, "F2FP.F16.E4M3.UNPACK_B": 1, "HADD2.F32": 1, "FFMA": 1, "BRA": 1}
    )
    g = group(counts)
    assert (g["F2FP"], g["HADD2.F32"], g["FFMA"], g["other"], g["all"]) == (1, 1, 1, 2, 5)
    with pytest.raises(ValueError, match="evict_first"):
        weight_loop(SASS.replace(".EF", ""))


@needs_nvidia_tools
def test_counts_of_both_conversions():
    from cli_helpers import REPO, run_script

    tool = ["-m", "kernel_benchmark.sass_loop_counts", "--kinds", "wo", "--tune", "CVT=0;CVT=1"]
    proc = run_script(tool, REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split(" | ") for line in proc.stdout.splitlines() if " | " in line]
    head, rows = lines[0], {r[1]: dict(zip(lines[0], r)) for r in lines[1:]}
    assert head[:2] == ["kind", "CVT"] and set(rows) == {"0", "1"}
    cvt0, cvt1 = rows["0"], rows["1"]
    assert (cvt0["FFMA"], cvt0["F2FP"], cvt0["HADD2.F32"]) == ("1.00", "0.50", "1.00")
    assert (cvt1["FFMA"], cvt1["F2FP"], cvt1["HADD2.F32"], cvt1["LOP3"]) == (
        "1.00", "0.00", "0.00", "1.00",
    )  # fmt: skip
    assert float(cvt1["all"]) > float(cvt0["all"])
