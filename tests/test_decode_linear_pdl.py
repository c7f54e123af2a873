"""The decode GEMV's programmatic-dependent prologue, compiled for sm_90 without a GPU.

PDL never runs on the CPU (not in the interpreter, not off Hopper), so what the GPU would run
is checked in its PTX: the weight prefetch (``_prefetch_rows``) is issued before
``griddepcontrol.wait``, one ``prefetch.global.L2`` per 128-byte line of the program's weight
rows, and none at all when ``PF_LINES`` is 0 or the launch is not a dependent.
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
pytestmark = pytest.mark.skipif(
    not (BIN / "ptxas").exists(), reason="Triton's bundled ptxas is not installed"
)

# compiled in a fresh process: the test session runs Triton's interpreter (TRITON_INTERPRET=1),
# under which kernels are not compiled at all
_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nakta_model.kernels._decode_linear_kernels import _decode_linear_kernel as kernel

w_type, pdl, pf_lines, block_n, num_warps = json.loads(sys.argv[1])
pointers = {
    "X": "*bf16", "W": w_type, "WS": "*fp32", "NW": "*bf16", "R": "*bf16", "OUT": "*bf16",
    "POS": "*i32", "COS": "*fp32", "SIN": "*fp32", "KC": "*bf16", "VC": "*bf16", "SLOT": "*i64",
}
const = dict(
    HEAD_DIM=128, NORM=True, RESIDUAL=False, SWIGLU=False, ROPE=True,
    W_FP8=w_type == "*fp8e4nv", USE_DOT=False, BLOCK_M=1, BLOCK_N=block_n, TILE_N=block_n,
    BLOCK_K=256, EVEN_K=True, PREC=None, UPCAST=False, FAST_SILU=False, ACCURATE=True,
    EMULATE_RNE=False, PDL=pdl, DOT_F16=False, PF_LINES=pf_lines, PF_LINE=64,
)
names = list(kernel.arg_names)
sig = {
    n: "constexpr" if n in const else pointers.get(n, "fp32" if n in ("eps", "inv_k") else "i32")
    for n in names
}
src = ASTSource(kernel, sig, constexprs={(names.index(n),): v for n, v in const.items()})
opts = {"num_warps": num_warps, "num_stages": 3}
sys.stdout.write(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"])
"""


def _ptx(w_type: str, pdl: bool, pf_lines: int, block_n: int, num_warps: int) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    args = json.dumps([w_type, pdl, pf_lines, block_n, num_warps])
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE, args], env=env, cwd=root, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize(("w_type", "block_n", "num_warps"), [("*fp8e4nv", 8, 2), ("*bf16", 16, 4)])
def test_dependent_prefetches_its_weight_rows_before_waiting(w_type, block_n, num_warps):
    pf_lines = 64  # 4096 bf16 elements = 64 lines of 128 bytes
    ptx = _ptx(w_type, pdl=True, pf_lines=pf_lines, block_n=block_n, num_warps=num_warps)
    body = ptx[ptx.index(".entry") :]
    assert "griddepcontrol.launch_dependents" in body and "griddepcontrol.wait" in body
    prefetches = body.count("prefetch.global.L2")
    # one line per element of the [BLOCK_N, PF_LINES] pointer tile, spread over the threads
    assert prefetches == block_n * pf_lines // (32 * num_warps)
    last_prefetch = body.rindex("prefetch.global.L2")
    assert last_prefetch < body.index("griddepcontrol.wait")
    assert body.index("griddepcontrol.launch_dependents") < body.index("prefetch.global.L2")


@pytest.mark.parametrize(("pdl", "pf_lines"), [(True, 0), (False, 64)])
def test_no_prefetch_without_a_dependent_prologue(pdl, pf_lines):
    ptx = _ptx("*fp8e4nv", pdl=pdl, pf_lines=pf_lines, block_n=8, num_warps=2)
    assert "prefetch.global.L2" not in ptx
    assert ("griddepcontrol.wait" in ptx) == pdl


def test_derived_tensor_core_configs_fit_hoppers_shared_memory():
    """Every derived or tuned tensor-core config of the 7B / 13B step shapes keeps its pipelined
    tiles within ``SMEM_BUDGET`` (an H200 refused the 7B LM head's derived 4-stage 128 x 256
    tile at 2, 4 and 16 rows: 296 KB asked, 227 KiB allowed); tiles stay as derived."""
    import torch

    from nakta_model.kernels import decode_linear as dl

    shapes = [("plain", 32000, 4096), ("rope", 12288, 4096), ("swiglu", 11008, 4096),
              ("residual", 4096, 11008), ("residual", 4096, 4096), ("plain", 32000, 5120),
              ("rope", 15360, 5120), ("swiglu", 13824, 5120), ("residual", 5120, 13824)]  # fmt: skip
    lowered = 0
    for batch in (2, 4, 8, 16, 32, 64):
        for variant, n, k in shapes:
            for w_dtype in (None, torch.float8_e4m3fn):
                c = dl._config(torch.bfloat16, batch, n, k, variant, torch.device("cpu"), w_dtype)
                if not c["USE_DOT"]:
                    continue
                w_bytes = 1 if w_dtype else 2
                stage = c["BLOCK_K"] * (c["BLOCK_M"] * 2 + c["TILE_N"] * w_bytes)
                assert c["num_stages"] * stage <= dl.SMEM_BUDGET or c["num_stages"] == 2
                assert c["num_stages"] >= 2
                lowered += (c["num_stages"] + 1) * stage > dl.SMEM_BUDGET
    assert lowered  # the 7B head's derived rows are among them
    head = dl._config(torch.bfloat16, 2, 32000, 4096, "plain", torch.device("cpu"))
    assert (head["BLOCK_N"], head["BLOCK_K"], head["num_stages"]) == (128, 256, 3)
