"""``kernel_benchmark/sass_loop_counts.py``: the batch-1 FP8 GEMV's K loop read from sm_90 SASS
and TTGIR compiled on the CPU.

The parsers on small hand-written texts, then the tool for ``wo`` in a fresh process, as a
user runs it, checking what docs/experiments.md reads from it: ``PREFETCH=1`` keeps the
conversion at one FFMA, half an ``F2FP`` (e4m3 pair -> f16x2) and one ``HADD2.F32`` (f16 ->
f32) a code, moves only x between layouts (as ``PREFETCH=0`` does) and sums the K lanes in
``PREFETCH=0``'s layout (the same order, so the same bits).
"""

from __future__ import annotations

import collections

import pytest
from test_sass_fingerprint import needs_nvidia_tools

from kernel_benchmark.sass_loop_counts import (
    group,
    loop_conversions,
    programs_per_sm,
    reduce_layout,
    twins_differ,
    weight_loads,
    weight_loop,
)

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/               @P0 LDG.E.EF.128 R40, desc[UR6][R34.64] ;
        /*0018*/                   LDG.E.EF R44, desc[UR6][R36.64] ;
        /*0020*/                   F2FP.F16.E4M3.UNPACK_B R2, R40 ;
        /*0030*/                   HADD2.F32 R3, -RZ, R2.H0_H0 ;
        /*0040*/                   FFMA R5, R3, R4, R5 ;
        /*0050*/              @!P0 BRA `(.L_x_1) ;
.L_x_2:
        /*0060*/                   BRA `(.L_x_2);
"""

TTGIR = """#blocked = #ttg.blocked<{sizePerThread = [1, 16], threadsPerWarp = [1, 32], warpsPerCTA = [2, 2], order = [1, 0]}>
#blocked1 = #ttg.blocked<{sizePerThread = [1, 8], threadsPerWarp = [1, 32], warpsPerCTA = [1, 4], order = [1, 0]}>
module {
    %r = scf.for %k = %c0 to %K step %c1 iter_args(%a = %z) -> (tensor<8x32xf32, #blocked>) : i32 {
      %n = tt.load %p : tensor<1x32x!tt.ptr<bf16>, #blocked1>
      %c = ttg.convert_layout %s : tensor<1x32xf32, #blocked1> -> tensor<1x32xf32, #blocked>
      %w = tt.load %q, %m {cachePolicy = #tt.cache_policy<eviction_policy = evict_first>} : tensor<8x32x!tt.ptr<i32>, #blocked>
      scf.yield %a : tensor<8x32xf32, #blocked>
    }
    %s = "tt.reduce"(%r) <{axis = 1 : i32}> ({
    }) : (tensor<8x32xf32, #blocked>) -> tensor<8xf32, #ttg.slice<{dim = 1, parent = #blocked}>>
}
"""


def test_sass_parsers():
    counts = weight_loop(SASS)
    assert counts == collections.Counter(
        {"LDG.E.EF.128": 1, "LDG.E.EF": 1, "F2FP.F16.E4M3.UNPACK_B": 1, "HADD2.F32": 1,
         "FFMA": 1, "BRA": 1}
    )  # fmt: skip
    g = group(counts)
    assert (g["F2FP"], g["HADD2.F32"], g["FFMA"], g["other"], g["all"]) == (1, 1, 1, 3, 6)
    assert weight_loads(counts) == (2, 16 + 4)
    with pytest.raises(ValueError, match="evict_first"):
        weight_loop(SASS.replace(".EF", ""))


def test_ttgir_parsers():
    assert loop_conversions(TTGIR) == 32
    assert reduce_layout(TTGIR) == "1,16/1,32/2,2/1,0"
    moved_w = TTGIR.replace("tensor<1x32xf32, #blocked1> ->", "tensor<8x32xf32, #blocked1> ->")
    assert loop_conversions(moved_w) == 256
    with pytest.raises(ValueError, match="evict_first"):
        loop_conversions(TTGIR.replace("evict_first", "evict_last"))


def test_programs_per_sm_and_twins():
    assert programs_per_sm(121, 128, 4096) == 4  # 128 registers a thread: 65536 / (128 * 128)
    assert programs_per_sm(71, 64, 2048) == 14  # 72 a thread, two warps
    assert programs_per_sm(32, 1024, 200 * 1024) == 1  # shared memory bound
    row = dict(kind="wo", key=(("BLOCK_K", 512),), moved=512, reduce="a")
    rows = [{**row, "tune": {"PREFETCH": 0}}, {**row, "tune": {"PREFETCH": 1}}]
    assert twins_differ(rows) == []
    rows[1] = {**rows[1], "reduce": "b"}
    assert len(twins_differ(rows)) == 1


@needs_nvidia_tools
def test_prefetch_keeps_the_conversion_and_the_reduction():
    from cli_helpers import REPO, run_script

    tool = ["-m", "kernel_benchmark.sass_loop_counts", "--kinds", "wo", "--tune",
            "PREFETCH=0;PREFETCH=1"]  # fmt: skip
    proc = run_script(tool, REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [line.split(" | ") for line in proc.stdout.splitlines() if " | " in line]
    head, rows = lines[0], {r[1]: dict(zip(lines[0], r)) for r in lines[1:]}
    assert head[:2] == ["kind", "knobs"] and set(rows) == {"PREFETCH=0", "PREFETCH=1"}
    off, on = rows["PREFETCH=0"], rows["PREFETCH=1"]
    for row in (off, on):
        assert (row["FFMA"], row["F2FP"], row["HADD2.F32"]) == ("1.00", "0.50", "1.00")
    assert on["reduce layout"] == off["reduce layout"] and on["moved/iter"] == off["moved/iter"]
    assert on["LDG/iter"] == off["LDG/iter"] and int(on["regs"]) > int(off["regs"])
    assert "the same reduce layout and moved elements in every one" in proc.stdout
