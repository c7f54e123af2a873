"""The batch-1 decode chain's dependent launches, compiled for sm_90 without a GPU.

Programmatic dependent launch never runs on the CPU (not in the interpreter, not off Hopper),
so what the GPU would run is checked in its PTX: a GEMV with ``EARLY_W`` issues its first
weight loads before ``griddepcontrol.wait`` (and none without it); decode attention at batch 1
lets the next kernel launch at once (and never waits itself).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
needs_ptxas = pytest.mark.skipif(
    not (BIN / "ptxas").exists(), reason="Triton's bundled ptxas is not installed"
)

# compiled in a fresh process: the test session runs Triton's interpreter (TRITON_INTERPRET=1),
# under which kernels are not compiled at all
_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

what, params = json.loads(sys.argv[1])
if what == "linear":
    from nakta_model.kernels.decode_linear import _decode_linear_kernel as kernel
    w_type, pdl, early, block_n, num_warps = params
    pointers = {
        "X": "*bf16", "W": w_type, "WS": "*fp32", "NW": "*bf16", "R": "*bf16", "OUT": "*bf16",
        "POS": "*i32", "COS": "*fp32", "SIN": "*fp32", "KC": "*bf16", "VC": "*bf16",
        "SLOT": "*i64",
    }
    const = dict(
        HEAD_DIM=2, NORM=False, RESIDUAL=True, SWIGLU=False, ROPE=False,
        W_FP8=w_type == "*fp8e4nv", USE_DOT=False, BLOCK_M=1, BLOCK_N=block_n, TILE_N=block_n,
        BLOCK_K=512, EVEN_K=True, PREC=None, UPCAST=False, FAST_SILU=False, ACCURATE=True,
        EMULATE_RNE=False, PDL=pdl, DOT_F16=False, PREFETCH=0, NORM_BLOCK=0, EARLY_W=early,
    )
    floats = ("eps", "inv_k")
else:
    from nakta_model.kernels.decode_attention import _attn_split_kernel as kernel
    (pdl,) = params
    num_warps = 4
    pointers = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "LENS": "*i32", "TABLE": "*i32",
                "PRE_ROWS": "*i32", "PRE_LENS": "*i32", "OUT": "*bf16", "WS": "*fp32"}
    const = dict(GROUP=1, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_S=64, USE_DOT=True,
                 SINGLE=True, PREC=None, UPCAST=False, EMULATE_RNE=False, HAS_TABLE=True,
                 HAS_PREFIX=False, CASCADE=False, LAUNCH_DEPENDENTS=pdl, WINDOW=0,
                 KV_FP8=False, KS=None, VS=None)
    floats = ("qk_scale",)
names = list(kernel.arg_names)
sig = {
    n: "constexpr" if n in const else pointers.get(n, "fp32" if n in floats else "i32")
    for n in names
}
src = ASTSource(kernel, sig, constexprs={(names.index(n),): v for n, v in const.items()})
opts = {"num_warps": num_warps, "num_stages": 3}
sys.stdout.write(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"])
"""


def _ptx(what: str, *params) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE, json.dumps([what, list(params)])], env=env, cwd=root,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    body = proc.stdout
    return body[body.index(".entry") :]


def _first(body: str, *needles: str) -> int:
    return min(body.index(n) for n in needles if n in body)


@needs_ptxas
@pytest.mark.parametrize(("w_type", "block_n"), [("*fp8e4nv", 8), ("*bf16", 16)])
def test_first_weight_tile_is_asked_for_before_the_wait(w_type, block_n):
    body = _ptx("linear", w_type, True, 1, block_n, 4)
    assert body.index("griddepcontrol.launch_dependents") < body.index("griddepcontrol.wait")
    assert _first(body, "ld.global") < body.index("griddepcontrol.wait")
    late = _ptx("linear", w_type, True, 0, block_n, 4)  # without EARLY_W every load waits
    assert late.index("griddepcontrol.wait") < _first(late, "ld.global")


@needs_ptxas
def test_no_dependent_prologue_without_pdl():
    body = _ptx("linear", "*fp8e4nv", False, 1, 8, 4)
    assert "griddepcontrol" not in body


@needs_ptxas
@pytest.mark.parametrize("trigger", [True, False])
def test_attention_lets_the_next_kernel_launch_only_when_asked(trigger):
    body = _ptx("attention", trigger)
    assert ("griddepcontrol.launch_dependents" in body) == trigger
    assert "griddepcontrol.wait" not in body  # an ordinary launch itself
