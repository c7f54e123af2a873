"""kernel_benchmark.bench_gemm: the block GEMM shapes it times and its command line (the
timings themselves need a GPU: they are cuBLAS rates)."""

from __future__ import annotations

import pytest
import torch

from kernel_benchmark.bench_gemm import block_gemms, main
from nakta_model.config import ModelArgs, preset


def test_block_gemms_match_the_model_weights():
    from nakta_model.model import Transformer

    args = ModelArgs(dim=64, n_layers=1, n_heads=8, n_kv_heads=2, vocab_size=32, multiple_of=16)
    block = Transformer(args).layers[0]
    modules = {"wqkv": block.attention.wqkv, "wo": block.attention.wo,
               "w13": block.feed_forward.w13, "w2": block.feed_forward.w2}  # fmt: skip
    assert block_gemms(args).keys() == modules.keys()
    for name, (k, n) in block_gemms(args).items():
        assert tuple(modules[name].weight.shape) == (n, k), name
    assert block_gemms(preset("7B")) == {
        "wqkv": (4096, 12288), "wo": (4096, 4096), "w13": (4096, 22016), "w2": (11008, 4096)
    }  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path only")
def test_cpu_run_measures_nothing_and_says_so(capsys):
    assert main([]) == 1
    assert "nothing measured" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--tokens", "x"], "--tokens must be comma-separated ints"),
        (["--tokens", "0"], "--tokens needs at least one positive int"),
        (["--seconds", "0"], "--seconds must be > 0"),
    ],
)
def test_bad_arguments_are_refused(argv, why, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert why in capsys.readouterr().err
