"""``wo``'s weights asked of L2 while decode attention runs (batch 1, Hopper), compiled for
sm_90 without a GPU, and the step's choice of when to do it.

Programmatic dependent launch never runs on the CPU (not in the interpreter, not off Hopper),
so what the GPU would run is checked in its PTX: the GEMV's prefetch (``_prefetch_rows``) comes
after ``griddepcontrol.launch_dependents`` and before ``griddepcontrol.wait``, one
``prefetch.global.L2`` per 128-byte line of the program's weight rows, none without a dependent
prologue; the attention kernels signal ``launch_dependents`` only when asked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
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
    from nakta_model.kernels._decode_linear_kernels import _decode_linear_kernel as kernel
    w_type, pdl, pf_lines, block_n, num_warps = params
    pointers = {
        "X": "*bf16", "W": w_type, "WS": "*fp32", "NW": "*bf16", "R": "*bf16", "OUT": "*bf16",
        "POS": "*i32", "COS": "*fp32", "SIN": "*fp32", "KC": "*bf16", "VC": "*bf16",
        "SLOT": "*i64",
    }
    const = dict(
        HEAD_DIM=2, NORM=False, RESIDUAL=True, SWIGLU=False, ROPE=False,
        W_FP8=w_type == "*fp8e4nv", USE_DOT=False, BLOCK_M=1, BLOCK_N=block_n, TILE_N=block_n,
        BLOCK_K=512, EVEN_K=True, PREC=None, UPCAST=False, FAST_SILU=False, ACCURATE=True,
        EMULATE_RNE=False, PDL=pdl, DOT_F16=False, PREFETCH=0, PF_LINES=pf_lines,
        PF_LINE=128 // (1 if w_type == "*fp8e4nv" else 2),
    )
    floats = ("eps", "inv_k")
else:
    from nakta_model.kernels._decode_attention_kernels import _attn_split_kernel as kernel
    (launch_dependents,) = params
    num_warps = 4
    pointers = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "LENS": "*i32", "TABLE": "*i32",
                "PRE_ROWS": "*i32", "PRE_LENS": "*i32", "OUT": "*bf16", "WS": "*fp32"}
    const = dict(GROUP=1, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_S=64, USE_DOT=True,
                 SINGLE=True, PREC=None, UPCAST=False, EMULATE_RNE=False, HAS_TABLE=True,
                 HAS_PREFIX=False, CASCADE=False, LAUNCH_DEPENDENTS=launch_dependents)
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


@needs_ptxas
@pytest.mark.parametrize(
    ("w_type", "block_n", "num_warps", "pf_lines"),
    [("*fp8e4nv", 8, 4, 32), ("*bf16", 16, 4, 64)],  # K = 4096: 32 / 64 lines of 128 bytes
)
def test_wo_dependent_prefetches_its_weight_rows_before_waiting(w_type, block_n, num_warps,
                                                                pf_lines):  # fmt: skip
    body = _ptx("linear", w_type, True, pf_lines, block_n, num_warps)
    assert "griddepcontrol.launch_dependents" in body and "griddepcontrol.wait" in body
    # one line per element of the [BLOCK_N, PF_LINES] pointer tile, spread over the threads
    assert body.count("prefetch.global.L2") == block_n * pf_lines // (32 * num_warps)
    assert body.index("griddepcontrol.launch_dependents") < body.index("prefetch.global.L2")
    assert body.rindex("prefetch.global.L2") < body.index("griddepcontrol.wait")


@needs_ptxas
@pytest.mark.parametrize(("pdl", "pf_lines"), [(True, 0), (False, 32)])
def test_no_prefetch_without_a_dependent_prologue(pdl, pf_lines):
    body = _ptx("linear", "*fp8e4nv", pdl, pf_lines, 8, 4)
    assert "prefetch.global.L2" not in body
    assert ("griddepcontrol.wait" in body) == pdl


@needs_ptxas
@pytest.mark.parametrize("launch_dependents", [True, False])
def test_attention_lets_dependents_launch_only_when_asked(launch_dependents):
    body = _ptx("attention", launch_dependents)
    assert ("griddepcontrol.launch_dependents" in body) == launch_dependents
    assert "griddepcontrol.wait" not in body  # attention itself is an ordinary launch


def test_step_prefetches_only_for_one_row_on_hopper_with_the_weight_in_l2(monkeypatch):
    """The CPU never prefetches; the rule's other conditions (env, GEMM path, batch, the
    weight's share of L2) each turn it off."""
    from nakta_model.generation import step as st
    from nakta_model.kernels import decode_linear as dl

    class W:
        def __init__(self, nbytes):
            self.weight = torch.empty(nbytes, dtype=torch.uint8)

    class Layer:
        def __init__(self, nbytes):
            self.attention = type("A", (), {"wo": W(nbytes)})()

    class Model:
        def __init__(self, device, nbytes):
            self.device, self.layers = torch.device(device), [Layer(nbytes)]

    assert not st._wo_prefetch(Model("cpu", 16), 1, False, True)
    monkeypatch.setattr(dl, "dependent_launch", lambda dev: True)
    props = type("P", (), {"L2_cache_size": 1000})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: props)
    fits, too_big = Model("cuda", 750), Model("cuda", 751)
    assert st._wo_prefetch(fits, 1, False, True)
    assert not st._wo_prefetch(too_big, 1, False, True)
    assert not st._wo_prefetch(fits, 2, False, True)  # wo is no dependent above batch 1
    assert not st._wo_prefetch(fits, 1, True, True)  # the GEMM path
    assert not st._wo_prefetch(fits, 1, False, False)  # the eager reference
    monkeypatch.setattr(st, "WO_L2_PREFETCH", False)
    assert not st._wo_prefetch(fits, 1, False, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2_prefetch_is_only_a_hint(dtype):
    """Through the interpreter (no dependent launch) the hint changes nothing, bit for bit, and
    the reference takes it too."""
    from nakta_model.kernels import decode_linear as dl

    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 96, generator=g).to(dtype)
    w = torch.randn(40, 96, generator=g).to(dtype)
    r = torch.randn(1, 40, generator=g).to(dtype)
    a = dl.decode_linear(x, w, residual=r)
    b = dl.decode_linear(x, w, residual=r, l2_prefetch=True)
    assert torch.equal(a, b)
    ref = dl.decode_linear_reference(x, w, residual=r, l2_prefetch=True)
    assert torch.equal(ref, dl.decode_linear_reference(x, w, residual=r))
