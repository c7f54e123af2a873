"""One pass for settings: a command opens a checkpoint and reads its settings once
(``loading.CheckpointDir``), and parses its precision options once into one object
(``fp8.Precision``) that ``load`` and the model take as it is.

Tiny checkpoints from ``checkpoint_factory``: a Meta folder and its Nakta conversion.

Here too: the ``kv_cache`` precision option (``Precision.kv_cache``), parsed once where the
command reads its arguments and carried by the model.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from checkpoint_factory import TINY_PARAMS, train_tiny_tokenizer, write_meta_checkpoint

from nakta_model import checkpoint as checkpoint_mod
from nakta_model import fp8, loading, sources
from nakta_model.config import ModelArgs
from nakta_model.fp8 import Precision, check_fp8_device, check_kv_cache
from nakta_model.generation.engine import Generator
from nakta_model.generation.requests import GenerationRequest
from nakta_model.kernels.fp8_quant import FP8_DTYPE
from nakta_model.kv_pages import PAGE_SIZE, kv_pool, page_bytes
from nakta_model.loading import CheckpointDir, load, random_model


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from convert import convert

    root = tmp_path_factory.mktemp("settings_once")
    meta = write_meta_checkpoint(root / "meta", {**TINY_PARAMS, "max_seq_len": 64}, seed=2)
    train_tiny_tokenizer(meta)
    return {"meta": meta, "nakta": convert(meta, root / "nakta", quiet=True)}


@pytest.fixture
def reads(monkeypatch):
    """How often a checkpoint's settings are read: a Nakta params.json (``read_args``, where
    ``loading`` and ``checkpoint`` both call it) and a Meta / HF folder opened (``open_source``)."""
    counts = {"read_args": 0, "open_source": 0}

    def counted(module, name):
        original = getattr(module, name)

        def wrapper(*a, **kw):
            counts[name] += 1
            return original(*a, **kw)

        monkeypatch.setattr(module, name, wrapper)

    counted(loading, "read_args")
    counted(checkpoint_mod, "read_args")
    counted(loading, "open_source")
    return counts


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("fmt", ["nakta", "meta"])
def test_an_opened_checkpoint_loads_the_same_model_reading_its_settings_once(fmt, ckpts, reads):
    want = load(ckpts[fmt], "cpu", torch.float32)
    before = dict(reads)
    opened = CheckpointDir.open(ckpts[fmt])
    assert opened.format == fmt and opened.args == want.args and str(opened) == str(ckpts[fmt])
    got = load(opened, "cpu", torch.float32)
    assert sum(reads.values()) - sum(before.values()) == 1  # the open; the load reads weights
    assert got.args == want.args
    for (name, a), (_, b) in zip(got.state_dict().items(), want.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.usefixtures("one_torch_thread")
def test_a_grid_check_of_an_opened_nakta_checkpoint_uses_its_settings(ckpts, reads):
    """Sharded for another tp: the same ParallelConfigError as from the path, no new read."""
    from nakta_model.parallel import ParallelConfigError, ParallelContext

    opened = CheckpointDir.open(ckpts["nakta"])
    n = reads["read_args"]
    grid = ParallelContext(tp_rank=0, tp_size=2)
    with pytest.raises(ParallelConfigError, match=r"sharded for tp=1, but this run has --tp 2"):
        loading._check_grid(opened, grid)
    assert reads["read_args"] == n


@pytest.mark.usefixtures("one_torch_thread")
def test_the_lm_eval_adapter_reads_settings_once_and_parses_quant_once(ckpts, reads, monkeypatch):
    pytest.importorskip("lm_eval")
    from accuracy_test.lm_eval_adapter import NaktaLM

    parsed = []
    check_quant = fp8.check_quant
    monkeypatch.setattr(fp8, "check_quant", lambda q: parsed.append(q) or check_quant(q))
    for fmt, key in (("nakta", "read_args"), ("meta", "open_source")):
        before = dict(reads)
        lm = NaktaLM(checkpoint=str(ckpts[fmt]), device="cpu", quant="none")
        assert lm.model.args.vocab_size == TINY_PARAMS["vocab_size"]
        assert {k: reads[k] - before[k] for k in reads} == {
            "read_args": int(key == "read_args"),
            "open_source": int(key == "open_source"),
        }
    assert parsed == ["none", "none"]  # once per adapter, at its entry; not in load or the model
    assert lm.precision == Precision(None) and lm.model.quant is None


@pytest.mark.usefixtures("one_torch_thread")
def test_generate_reads_settings_once(ckpts, reads, capsys):
    generate_cli = importlib.import_module("nakta_model.generate")
    out = generate_cli.main(
        ["--checkpoint", str(ckpts["nakta"]), "--prompt", "the cat", "--max-new-tokens", "2"]
        + ["--temperature", "0", "--device", "cpu"]
    )
    assert len(out[0]["tokens"]) == 2
    assert reads["read_args"] == 1


@pytest.mark.usefixtures("one_torch_thread")
def test_precision_is_parsed_once_and_passed_as_is():
    p = Precision.parse(" FP8 ")
    assert p == Precision("fp8") and Precision.of(p) is p and Precision.of("fp8") == p
    for off in (None, "", "none", "bf16", "fp16", "fp32"):
        assert Precision.parse(off) == Precision() and Precision.of(off).quant is None
    with pytest.raises(ValueError, match="quant must be None or 'fp8', got 'int4'"):
        Precision.parse("int4")
    with pytest.raises(TypeError, match="quant must be None or 'fp8'"):
        Precision.parse(8)
    with pytest.raises(ValueError, match="use parse"):
        Precision("FP8")  # only parse() normalizes
    Precision().check_device("cpu")  # nothing to check without FP8
    with pytest.raises(ValueError, match="compute capability"):
        Precision("fp8").check_device("meta")


@pytest.mark.usefixtures("one_torch_thread")
def test_sources_open_checkpoint_format_matches_the_opened_dir(ckpts):
    for fmt, path in ckpts.items():
        assert sources.checkpoint_format(path) == CheckpointDir.open(path).format == fmt


@pytest.mark.usefixtures("one_torch_thread")
def test_the_walk_of_checkpoint_from_the_lm_eval_adapter_passes_at_most_six_files(ckpts):
    """Every function of the repo that receives the checkpoint path, from the adapter's
    constructor to the loaded model: the files they live in (a structure check, as the import
    graph's: the path must not wander through the house)."""
    pytest.importorskip("lm_eval")
    import os
    import sys
    from pathlib import Path

    from accuracy_test.lm_eval_adapter import NaktaLM

    repo = str(Path(__file__).resolve().parents[1])
    path = str(ckpts["nakta"])
    files: list[str] = []

    def profile(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(repo):
            return
        if any(isinstance(v, (str, Path)) and str(v) == path for v in frame.f_locals.values()):
            files.append(os.path.relpath(frame.f_code.co_filename, repo))

    sys.setprofile(profile)
    try:
        lm = NaktaLM(checkpoint=path, device="cpu")
    finally:
        sys.setprofile(None)
    assert lm.model.args.vocab_size == TINY_PARAMS["vocab_size"]
    walked = list(dict.fromkeys(files))
    assert walked[0] == os.path.join("accuracy_test", "lm_eval_adapter.py")
    assert len(walked) <= 6, walked


# ------------------------------------------------------------------------------------------------
# The ``kv_cache`` precision option (``Precision.kv_cache``): parsed once where the command reads
# its arguments, carried by the model (``Transformer.kv_cache``), set by ``Generator``,
# independent of ``quant``; bad values are one clear error naming the argument. The engine with an
# fp8 cache: e4m3 pages with scales, ~2x the positions per byte, tokens close to the model-dtype
# cache, every page back after a run.
# ------------------------------------------------------------------------------------------------


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
