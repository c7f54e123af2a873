"""The ``kv_cache`` precision option (``Precision.kv_cache``): parsed once where the command
reads its arguments, carried by the model (``Transformer.kv_cache``), set by ``Generator``,
independent of ``quant``; bad values are one clear error naming the argument. The engine with
an fp8 cache: e4m3 pages with scales, ~2x the positions per byte, tokens close to the
model-dtype cache, every page back after a run."""

from __future__ import annotations

import pytest
import torch

from nakta_model.config import ModelArgs
from nakta_model.fp8 import Precision, check_fp8_device, check_kv_cache
from nakta_model.generation.engine import Generator
from nakta_model.generation.requests import GenerationRequest
from nakta_model.kernels.fp8_quant import FP8_DTYPE
from nakta_model.kv_pages import PAGE_SIZE, kv_pool, page_bytes
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
    with pytest.raises(ValueError, match="quant='fp8' needs a CUDA GPU"):
        Precision.parse("fp8", "fp8").check_device("cpu")
    with pytest.raises(ValueError, match="kv_cache='fp8' needs a CUDA GPU"):
        check_fp8_device("cpu", what="kv_cache='fp8'")
    # the CPU's reference paths dequantize in PyTorch: an fp8 cache runs there
    Precision.parse(None, "fp8").check_device("cpu")
    Precision.parse().check_device("cpu")


def test_model_carries_kv_cache_and_generator_sets_it():
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
    assert m.kv_cache == "bf16" and m.layers[0].attention.k_cache.dtype == torch.float32
    assert m.layers[0].attention.k_scale is None
    Generator(m, max_batch=1, max_seq_len=16, graphs=False, kv_cache="fp8")
    a = m.layers[0].attention
    assert m.kv_cache == "fp8" and a.k_cache.dtype == FP8_DTYPE and a.v_cache.dtype == FP8_DTYPE
    assert a.k_scale.shape == a.k_cache.shape[:2] and a.v_scale.dtype == torch.float32


@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp8_pages_hold_about_twice_the_positions(head_dim):
    """A page's bytes count the e4m3 codes and the fp32 scales: a bf16 model's pool holds
    1.88x (head_dim 64) / 1.94x (128) the positions in the same memory."""
    args = ModelArgs(dim=4 * head_dim, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32)
    m = random_model(args, "cpu", torch.bfloat16, seed=0, kernels="reference")
    bf16 = page_bytes(m)
    assert bf16 == 2 * 2 * 2 * head_dim * 2 * PAGE_SIZE  # layers x K,V x heads x hd x bytes
    m.set_kv_cache("fp8")
    fp8 = page_bytes(m)
    assert fp8 == 2 * 2 * 2 * (head_dim + 4) * PAGE_SIZE
    assert bf16 / fp8 == pytest.approx(2 * head_dim / (head_dim + 4))


def _engine_tokens(model, kv_cache):
    reqs = [GenerationRequest(prompt=list(range(1, 1 + n)), max_new_tokens=10) for n in (5, 67, 30)]
    gen = Generator(model, max_batch=4, max_seq_len=160, graphs=False, kv_cache=kv_cache)
    out = [r.tokens for r in gen.generate(reqs)]
    assert kv_pool(model).used_pages == 0  # every row's pages back
    return out


def test_engine_with_fp8_kv_cache_is_close_to_bf16():
    """Greedy tokens of a tiny random model: the fp8 cache agrees with the model-dtype cache on
    most tokens (a random model's logits have near-ties; 26 of 30 here), exactly on the first
    tokens of every row (they read the prompt's keys, quantized once)."""
    m = random_model(ARGS, "cpu", torch.float32, seed=1, kernels="reference")
    full = _engine_tokens(m, "bf16")
    fp8 = _engine_tokens(m, "fp8")
    assert m.layers[0].attention.k_cache.dtype == FP8_DTYPE
    same = sum(a == b for x, y in zip(full, fp8) for a, b in zip(x, y))
    assert same >= 24, (full, fp8)
    assert all(x[:3] == y[:3] for x, y in zip(full, fp8))


@pytest.mark.slow
def test_engine_fp8_kernels_match_the_reference_path():
    """The Triton path (RoPE's quantizing write, paged decode attention, packed prefill) gives
    the reference path's greedy tokens with an fp8 cache."""
    ref = random_model(ARGS, "cpu", torch.float32, seed=1, kernels="reference")
    tri = random_model(ARGS, "cpu", torch.float32, seed=1, kernels="triton")
    assert _engine_tokens(tri, "fp8") == _engine_tokens(ref, "fp8")


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
