"""model_profile.compile_profile and scripts/compile_log: what a first run compiles, named.

The GPU run itself needs CUDA; here: the argument checks, how a compile is named, and that a
process started with scripts/compile_log on its path and NAKTA_COMPILE_LOG set writes one row
per Triton compile (compiled for sm_90 with Triton's bundled ptxas, no GPU needed)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton
from triton.compiler import ASTSource

from model_profile.compile_profile import parse_args, specialization
from nakta_model.kernels.packed_attention import _packed_attention_kernel

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@pytest.mark.parametrize(
    ("argv", "match"),
    [(["--phases", "score,train"], "--phases takes"), (["--prompts", "0"], "--prompts must be")]
    + [(["--shared-prefix", "925"], "--shared-prefix must be in")],
)
def test_bad_arguments_are_refused(argv, match, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert match in capsys.readouterr().err


def test_a_compile_is_named_by_its_constexprs_and_specialised_arguments():
    names = list(_packed_attention_kernel.arg_names)
    src = ASTSource(
        _packed_attention_kernel, {n: "i32" for n in names}, constexprs={"TREE": True, "N_Q": 32},
        attrs={(names.index("stride_qt"),): [["tt.divisibility", 16]]},
    )  # fmt: skip
    assert specialization(src) == "TREE=True N_Q=32 stride_qt:16"


_COMPILE_ONE = r"""
import triton
import triton.compiler as tc
import triton.language as tl
from triton.backends.compiler import GPUTarget

@triton.jit
def _add_one(X, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(X + i, tl.load(X + i, mask=i < n) + 1, mask=i < n)

src = tc.ASTSource(_add_one, {"X": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                   constexprs={"BLOCK": 64})
tc.compile(src, target=GPUTarget("cuda", 90, 32))
"""


@pytest.mark.skipif(not (BIN / "ptxas").exists(), reason="Triton's bundled ptxas is missing")
def test_the_sitecustomize_logs_every_compile_of_a_process(tmp_path):
    log = tmp_path / "compiles.csv"
    env = {
        **os.environ, "TRITON_INTERPRET": "0", "NAKTA_COMPILE_LOG": str(log),
        "TRITON_CACHE_DIR": str(tmp_path / "cache"),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "scripts" / "compile_log"), str(ROOT)]),
    }  # fmt: skip
    script = tmp_path / "compile_one.py"  # a file: triton.jit reads the kernel's source
    script.write_text(_COMPILE_ONE)
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(log.open()))
    assert [r["kernel"] for r in rows] == ["_add_one"]
    assert rows[0]["phase"] == "run" and float(rows[0]["seconds"]) > 0
    assert rows[0]["specialization"] == "BLOCK=64"
    assert int(rows[0]["pid"]) > 0
