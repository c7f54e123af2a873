"""quant="fp8" under tensor parallelism: each rank's shard quantized with its own channels'
scales (an FP8 checkpoint converted for tp=2), the forward's all-reduces in the model's dtype;
two gloo ranks agree with one process up to the per-rank scales of the row-split matrices."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_factory import TINY_PARAMS, write_meta_checkpoint

import convert
from nakta_model.loading import load

REPO = Path(__file__).resolve().parents[1]
WORKER = """
import sys, torch
from nakta_model.loading import load
from nakta_model.parallel import init_parallel
ckpt, tokens_file, out = sys.argv[1:4]
ctx = init_parallel(2, 1, checkpoint=ckpt, device="cpu")
model = load(ckpt, "cpu", torch.float32, ctx, kernels="reference", quant="fp8")
assert model.quant == "fp8" and model.layers[0].attention.wo.weight.dtype == torch.float8_e4m3fn
logits = model(torch.load(tokens_file))
if ctx.tp_rank == 0:
    torch.save(logits, out)
torch.distributed.barrier()
torch.distributed.destroy_process_group()  # gloo's threads must not meet the interpreter's exit
"""


@pytest.mark.slow
def test_fp8_tp2_with_two_gloo_ranks_is_close_to_one_process(tmp_path):
    meta = write_meta_checkpoint(tmp_path / "meta", TINY_PARAMS, seed=6)
    one = convert.convert(meta, tmp_path / "tp1", tp=1, quiet=True, quant="fp8")
    two = convert.convert(meta, tmp_path / "tp2", tp=2, quiet=True, quant="fp8")
    tokens = torch.randint(
        0, TINY_PARAMS["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1)
    )
    torch.save(tokens, tmp_path / "tokens.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "nakta_model.spawn", "--nproc", "2", "-c", WORKER, str(two),
         str(tmp_path / "tokens.pt"), str(tmp_path / "tp2.pt")],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    got = torch.load(tmp_path / "tp2.pt")
    want = load(one, "cpu", torch.float32, kernels="reference", quant="fp8")(tokens)
    exact = load(meta, "cpu", torch.float32, kernels="reference")(tokens)  # no quantization
    assert torch.isfinite(got).all() and got.shape == want.shape

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    # wo / w2 are split over K (and their inputs quantized per rank), so each rank's scales are
    # its slice's: tp=2 carries FP8 noise of the same size as one process, not the same noise
    assert 0 < rel(got, want) < 0.1
    assert rel(got, exact) < 1.5 * rel(want, exact) + 0.01
