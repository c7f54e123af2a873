"""The ``kv_cache`` precision option (``Precision.kv_cache``): parsed once where the command
reads its arguments, carried by the model (``Transformer.kv_cache``), set by ``Generator``,
independent of ``quant``; bad values are one clear error naming the argument."""

from __future__ import annotations

import pytest
import torch

from nakta_model.config import ModelArgs
from nakta_model.fp8 import Precision, check_fp8_device, check_kv_cache
from nakta_model.loading import random_model

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=16)


def test_parse_kv_cache_values():
    assert Precision.parse().kv_cache == "bf16"
    for default in (None, "", " BF16 ", "fp16", "fp32", "model"):
        assert check_kv_cache(default) == "bf16"
    assert Precision.parse(None, " FP8 ") == Precision(None, "fp8")
    assert Precision.parse("fp8", "fp8") == Precision("fp8", "fp8")
    assert Precision.parse("fp8").kv_cache == "bf16"  # independent of the weights' precision


@pytest.mark.parametrize(
    "value,exc,msg",
    [
        ("int8", ValueError, "kv_cache must be 'bf16' or 'fp8', got 'int8'"),
        (8, TypeError, "kv_cache must be 'bf16' or 'fp8', got int"),
    ],
)
def test_parse_rejects_bad_kv_cache(value, exc, msg):
    with pytest.raises(exc, match=msg):
        Precision.parse(None, value)


def test_unparsed_kv_cache_is_refused():
    with pytest.raises(
        ValueError, match="kv_cache must be 'bf16' or 'fp8', got 'FP8' \\(use parse"
    ):
        Precision(None, "FP8")


def test_device_check_names_kv_cache(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="kv_cache='fp8' needs a CUDA GPU"):
        Precision.parse(None, "fp8").check_device("cpu")
    with pytest.raises(ValueError, match="quant='fp8' needs a CUDA GPU"):
        check_fp8_device("cpu")
    Precision.parse().check_device("cpu")  # the default needs nothing


def test_model_carries_kv_cache_and_generator_sets_it():
    from nakta_model.generation.engine import Generator

    m = random_model(ARGS, "cpu", torch.float32, seed=1, kernels="reference")
    assert m.kv_cache == "bf16" and m.quant is None
    m2 = random_model(
        ARGS, "cpu", torch.float32, seed=1, kernels="reference", quant=Precision.parse(None, "fp8")
    )
    assert m2.kv_cache == "fp8" and m2.quant is None
    with pytest.raises(ValueError, match="kv_cache must be 'bf16' or 'fp8', got 'e5m2'"):
        Generator(m, max_batch=1, max_seq_len=16, kv_cache="e5m2")
    assert m.kv_cache == "bf16"
    Generator(m, max_batch=1, max_seq_len=16, graphs=False, kv_cache=Precision())
    assert m.kv_cache == "bf16" and m.layers[0].attention.k_cache is not None
    # until the attention kernels read e4m3 pages, an fp8 cache is refused, never misread
    with pytest.raises(ValueError, match="kv_cache='fp8' is not supported"):
        Generator(m, max_batch=1, max_seq_len=16, graphs=False, kv_cache="fp8")
    assert m.kv_cache == "fp8" and m.layers[0].attention.k_cache is None  # old cache freed


def test_generate_cli_parses_kv_cache_once(capsys):
    import importlib

    generate_cli = importlib.import_module("nakta_model.generate")

    base = ["--checkpoint", "x", "--prompt", "hi"]
    assert generate_cli.parse_args(base).precision == Precision()
    a = generate_cli.parse_args([*base, "--kv-cache", "fp8", "--quant", "fp8"])
    assert a.precision == Precision("fp8", "fp8")
    with pytest.raises(SystemExit) as e:
        generate_cli.parse_args([*base, "--kv-cache", "int8"])
    assert e.value.code == 2 and "--kv-cache: invalid choice: 'int8'" in capsys.readouterr().err
