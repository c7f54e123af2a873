"""ModelArgs: Meta's FFN rule, LLaMA-1 presets, HF configs, and clear errors on bad shapes."""

from __future__ import annotations

import json

import pytest

from nakta_model.config import (
    META_LLAMA3_SCALING,
    PRESETS,
    ModelArgs,
    RopeScaling,
    meta_hidden_dim,
    preset,
)


@pytest.mark.parametrize(
    "name, hidden, n_params_b",
    [("7B", 11008, 6.738), ("13B", 13824, 13.016), ("30B", 17920, 32.529), ("65B", 22016, 65.286)],
)
def test_llama1_presets_have_meta_hidden_dims_and_param_counts(name, hidden, n_params_b):
    args = preset(name)
    assert args.hidden_dim == hidden
    assert args.head_dim == 128
    assert args.n_kv_heads == args.n_heads and args.vocab_size == 32000
    assert args.n_params() / 1e9 == pytest.approx(n_params_b, rel=1e-3)


def test_ffn_rule_with_multiplier_matches_llama2_70b():
    # Llama-2 70B: dim 8192, ffn_dim_multiplier 1.3, multiple_of 4096 -> 28672.
    assert meta_hidden_dim(8192, 4096, 1.3) == 28672
    args = ModelArgs(dim=8192, n_layers=1, n_heads=64, n_kv_heads=8, vocab_size=32000,
                     multiple_of=4096, ffn_dim_multiplier=1.3)  # fmt: skip
    assert args.hidden_dim == 28672 and args.n_rep == 8
    assert args.qkv_dim == (64 + 16) * 128


def test_stories260k_params_json(shared_data):
    params = json.loads((shared_data / "stories260K" / "params.json").read_text())
    args = ModelArgs.from_meta_params(params)
    assert args.hidden_dim == 172  # llama2.c header
    assert (args.head_dim, args.n_rep, args.norm_eps, args.rope_interleaved) == (8, 2, 1e-5, True)
    assert args == PRESETS["stories260K"]


def test_meta_vocab_placeholder_needs_the_tokenizer():
    params = {"dim": 64, "n_layers": 1, "n_heads": 4, "vocab_size": -1, "multiple_of": 16}
    with pytest.raises(ValueError, match="vocab_size in params.json is -1"):
        ModelArgs.from_meta_params(params)
    assert ModelArgs.from_meta_params(params, vocab_size=300).vocab_size == 300
    with pytest.raises(ValueError, match="disagrees"):
        ModelArgs.from_meta_params({**params, "vocab_size": 200}, vocab_size=300)
    with pytest.raises(ValueError, match="vocab_size must be > 0"):
        ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=-1)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(dim=65, n_heads=4), r"dim \(65\) must be divisible by n_heads \(4\)"),
        (dict(n_heads=4, n_kv_heads=3), r"n_heads \(4\) must be divisible by n_kv_heads \(3\)"),
        (dict(dim=12, n_heads=4), "head_dim = dim / n_heads = 3 must be even"),
        (dict(n_layers=0), "n_layers must be a positive int"),
        (dict(norm_eps=0.0), "norm_eps must be a positive"),
        (dict(rope_theta=-1.0), "rope_theta must be a positive"),
        (dict(hidden_dim=0), "hidden_dim must be a positive int"),
        (dict(multiple_of=0), "multiple_of must be a positive int"),
    ],
)
def test_inconsistent_configs_raise_naming_the_field(kw, match):
    base = dict(dim=64, n_layers=2, n_heads=4, vocab_size=100, multiple_of=16)
    with pytest.raises(ValueError, match=match):
        ModelArgs(**{**base, **kw})


def test_check_tp_names_what_does_not_divide():
    args = preset("tiny")  # 4 heads, 2 KV heads, hidden 176, vocab 256
    args.check_tp(2)
    args.check_tp(4)  # 2 KV heads over 4 ranks: each replicated on 2 (vLLM's rule)
    assert [args.kv_head_start(r, 4) for r in range(4)] == [0, 0, 1, 1]
    assert args.local_kv_heads(4) == 1 and args.local_kv_heads(2) == 1
    six = ModelArgs(dim=96, n_layers=1, n_heads=12, n_kv_heads=4, vocab_size=24, hidden_dim=60)
    with pytest.raises(ValueError, match="neither divides n_kv_heads = 4"):
        six.check_tp(6)
    with pytest.raises(ValueError, match="does not divide n_heads = 4"):
        args.check_tp(3)
    with pytest.raises(ValueError, match="tp_size must be a positive int"):
        args.check_tp(0)


def test_hf_config_reads_and_refuses_what_it_cannot_run(tmp_path):
    cfg = {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
        "intermediate_size": 176, "rms_norm_eps": 1e-5, "max_position_embeddings": 256,
    }  # fmt: skip
    args = ModelArgs.from_hf_config(cfg)
    assert (args.dim, args.n_kv_heads, args.hidden_dim, args.max_seq_len) == (64, 2, 176, 256)
    assert args.rope_interleaved  # HF q/k are un-permuted on conversion
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert ModelArgs.from_json(tmp_path / "config.json") == args
    with pytest.raises(ValueError, match="rope_scaling rope type 'linear' is not supported"):
        ModelArgs.from_hf_config({**cfg, "rope_scaling": {"type": "linear", "factor": 2.0}})
    with pytest.raises(ValueError, match=r"'qwen2' is not supported; supported: \['llama'"):
        ModelArgs.from_hf_config({**cfg, "model_type": "qwen2"})
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelArgs.from_hf_config({k: v for k, v in cfg.items() if k != "intermediate_size"})
    with pytest.raises(ValueError, match="head_dim"):
        ModelArgs.from_hf_config({**cfg, "head_dim": 32})


def test_params_round_trip_through_json(tmp_path):
    args = preset("tiny")
    (tmp_path / "params.json").write_text(json.dumps({**args.to_params(), "tp_size": 2}))
    assert ModelArgs.from_json(tmp_path / "params.json") == args
    with pytest.raises(ValueError, match="unknown preset"):
        preset("7b-chat")


def test_unknown_params_keys_are_refused_listing_the_known_ones():
    params = {"dim": 64, "n_layers": 1, "n_heads": 4, "vocab_size": 300, "multiple_of": 16}
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['lora_args'\]; known keys: "):
        ModelArgs.from_meta_params({**params, "lora_args": {"rank": 8}})
    with pytest.raises(ValueError, match=r"'rope_theta'"):  # the known keys are listed
        ModelArgs.from_meta_params({**params, "n_head": 4})
    # llama_org's full key set (Meta's LLaMA-1/2 params.json) reads
    full = {**params, "n_kv_heads": 2, "ffn_dim_multiplier": 1.3, "norm_eps": 1e-5,
            "rope_theta": 5e5, "max_seq_len": 256, "max_batch_size": 8}  # fmt: skip
    assert ModelArgs.from_meta_params(full).max_seq_len == 256


def test_nakta_checkpoint_params_read_back(tmp_path):
    """Every key write_checkpoint puts in params.json is known (hidden_dim, tp_size, ...)."""
    import torch
    from checkpoint_factory import TINY_PARAMS, meta_state_dict

    from nakta_model import checkpoint as ck

    args = ModelArgs.from_meta_params(TINY_PARAMS)
    out = ck.save_checkpoint(tmp_path / "ck", meta_state_dict(TINY_PARAMS), args, 2, torch.bfloat16)
    params = json.loads((out / "params.json").read_text())
    assert {"hidden_dim", "rope_interleaved", "tp_size", "format_version", "dtype"} <= set(params)
    assert ModelArgs.from_meta_params(params) == args


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("norm_eps", "1e-5", "norm_eps must be a positive finite number, got '1e-5'"),
        ("rope_theta", True, "rope_theta must be a positive finite number"),
        ("ffn_dim_multiplier", "1.3", "ffn_dim_multiplier must be a positive finite number"),
        ("vocab_size", "300", "vocab_size must be an int, got '300'"),
        ("rope_interleaved", "yes", "rope_interleaved must be true or false"),
    ],
)
def test_wrongly_typed_params_name_the_field(key, value, match):
    params = {"dim": 64, "n_layers": 1, "n_heads": 4, "vocab_size": 300, "multiple_of": 16}
    with pytest.raises(ValueError, match=match):
        ModelArgs.from_meta_params({**params, key: value})


def test_meta_params_are_what_llama_org_builds_from():
    """params.json as Meta writes it: no n_kv_heads without GQA, no None fields; a width
    Meta's FFN rule cannot give is refused (llama_org could not build it)."""
    assert PRESETS["7B"].to_meta_params() == {
        "dim": 4096,
        "n_layers": 32,
        "n_heads": 32,
        "vocab_size": 32000,
        "multiple_of": 256,
        "norm_eps": 1e-6,
        "rope_theta": 10000.0,
    }
    tiny = PRESETS["tiny"]  # GQA, non-default eps; Meta's params.json has no max_seq_len
    assert ModelArgs.from_meta_params(tiny.to_meta_params(), max_seq_len=128) == tiny
    hf_width = PRESETS["tiny"].replace(hidden_dim=100)
    with pytest.raises(ValueError, match="llama_org cannot build this shape"):
        hf_width.to_meta_params()
    # an HF config's intermediate_size with the default multiple_of (256): the multiple_of
    # that gives it is written, and Meta's params build the very same shape
    hf = ModelArgs.from_meta_params({**tiny.to_meta_params(), "multiple_of": 4}, max_seq_len=128)
    hf = hf.replace(multiple_of=256)
    params = hf.to_meta_params()
    assert params["multiple_of"] != 256
    back = ModelArgs.from_meta_params(params, max_seq_len=128)
    assert back.hidden_dim == hf.hidden_dim


# ------------------------------------------------------------------ Llama-3.x / Mistral configs

_HF = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
    "intermediate_size": 176, "rms_norm_eps": 1e-5, "max_position_embeddings": 256,
}  # fmt: skip
_L31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}  # fmt: skip


def test_every_rope_spelling_reads_the_same_args():
    """transformers 4 (rope_theta + rope_scaling with type / rope_type) and transformers 5
    (rope_parameters) say the same thing: the same ModelArgs, never a silent default."""
    old = {**_HF, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **_L31}}
    older = {**_HF, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **_L31}}
    new = {**_HF, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **_L31}}
    args = ModelArgs.from_hf_config(old)
    assert args == ModelArgs.from_hf_config(older) == ModelArgs.from_hf_config(new)
    assert args.rope_theta == 5e5
    assert args.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 16)
    plain5 = {**_HF, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert ModelArgs.from_hf_config(plain5).rope_theta == 5e5
    assert ModelArgs.from_hf_config(plain5).rope_scaling is None
    # no original context stated: transformers falls back to max_position_embeddings
    no_orig = {k: v for k, v in _L31.items() if k != "original_max_position_embeddings"}
    cfg = {**_HF, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **no_orig}}
    assert ModelArgs.from_hf_config(cfg).rope_scaling.original_max_position_embeddings == 256


@pytest.mark.parametrize(
    "change, match",
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic' is not"),
        ({"rope_theta": 1e4, "rope_parameters": {"rope_theta": 5e5}}, "different RoPE thetas"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "missing"),
        ({"rope_parameters": {"mrope_section": [1, 2]}}, r"\['mrope_section'\]"),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial"),
        ({"rope_parameters": {"rope_type": "default", "factor": 2.0}}, "scaling key"),
        ({"attention_bias": True}, "attention_bias=True changes the model's math"),
        ({"mlp_bias": True}, "mlp_bias=True"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
        ({"sliding_window": 64}, "sliding_window=64 with model_type 'llama'"),
        ({"model_type": "gemma"}, r"supported: \['llama', 'mistral'\]"),
        ({"head_dim": 32}, "head_dim != dim / n_heads is not supported"),
    ],
)
def test_hf_keys_that_change_the_math_are_one_line_errors(change, match):
    with pytest.raises(ValueError, match=match) as info:
        ModelArgs.from_hf_config({**_HF, **change})
    assert "\n" not in str(info.value)


def test_mistral_and_tied_configs():
    mistral = {**_HF, "model_type": "mistral", "head_dim": 16, "sliding_window": 4096}
    args = ModelArgs.from_hf_config(mistral)
    assert args.sliding_window == 4096 and args.head_dim == 16
    assert ModelArgs.from_hf_config({**mistral, "sliding_window": None}).sliding_window is None
    assert ModelArgs.from_hf_config({**mistral, "head_dim": None}).head_dim == 16
    assert ModelArgs.from_hf_config({**_HF, "tie_word_embeddings": True}).tie_word_embeddings
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        ModelArgs.from_hf_config({**mistral, "sliding_window": 0})


def test_meta_llama3_params_json():
    """Meta's Llama-3.1 params.json: use_scaled_rope means Meta's constants (factor 8, low 1,
    high 4, 8192 original context: llama_models' apply_scaling); Mistral's head_dim and
    sliding_window; everything round-trips through a Nakta params.json."""
    meta = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 300,
            "multiple_of": 16, "ffn_dim_multiplier": 1.3, "norm_eps": 1e-5,
            "rope_theta": 5e5, "use_scaled_rope": True}  # fmt: skip
    args = ModelArgs.from_meta_params(meta)
    assert args.rope_scaling == META_LLAMA3_SCALING == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert ModelArgs.from_meta_params({**meta, "use_scaled_rope": False}).rope_scaling is None
    back = json.loads(json.dumps(args.to_params()))
    assert back["rope_scaling"]["rope_type"] == "llama3"
    assert ModelArgs.from_meta_params(back) == args
    with pytest.raises(ValueError, match="use_scaled_rope must be true or false"):
        ModelArgs.from_meta_params({**meta, "use_scaled_rope": "yes"})
    with pytest.raises(ValueError, match="llama_org .* cannot build this model"):
        args.to_meta_params()
    mistral = {"dim": 64, "n_layers": 2, "head_dim": 16, "hidden_dim": 176, "n_heads": 4,
               "n_kv_heads": 2, "norm_eps": 1e-5, "sliding_window": 32, "vocab_size": 300}  # fmt: skip
    m = ModelArgs.from_meta_params(mistral)
    assert (m.sliding_window, m.hidden_dim) == (32, 176)
    assert ModelArgs.from_meta_params(m.to_params()) == m
    with pytest.raises(ValueError, match="head_dim=32 differs"):
        ModelArgs.from_meta_params({**mistral, "head_dim": 32})
    with pytest.raises(ValueError, match=r"rope_scaling has unknown key\(s\) \['beta'\]"):
        ModelArgs.from_meta_params({**meta, "use_scaled_rope": False,
                                    "rope_scaling": {**_L31, "beta": 1}})  # fmt: skip


# Published config.json values of each family (meta-llama/*, mistralai/Mistral-7B-v0.1,
# TinyLlama/TinyLlama-1.1B-intermediate..., as of their releases).
_PUBLISHED = {
    "llama2-7B": (4096, 32, 32, 32, 11008, 32000, 1e4, 4096, None, False, None),
    "llama2-70B": (8192, 80, 64, 8, 28672, 32000, 1e4, 4096, None, False, None),
    "llama3-8B": (4096, 32, 32, 8, 14336, 128256, 5e5, 8192, None, False, None),
    "llama3-70B": (8192, 80, 64, 8, 28672, 128256, 5e5, 8192, None, False, None),
    "llama3.1-8B": (4096, 32, 32, 8, 14336, 128256, 5e5, 131072, 8.0, False, None),
    "llama3.2-1B": (2048, 16, 32, 8, 8192, 128256, 5e5, 131072, 32.0, True, None),
    "llama3.2-3B": (3072, 28, 24, 8, 8192, 128256, 5e5, 131072, 32.0, True, None),
    "mistral-7B": (4096, 32, 32, 8, 14336, 32000, 1e4, 32768, None, False, 4096),
    "tinyllama-1.1B": (2048, 22, 32, 4, 5632, 32000, 1e4, 2048, None, False, None),
}


@pytest.mark.parametrize("name", sorted(_PUBLISHED))
def test_family_presets_match_their_published_configs(name):
    dim, layers, heads, kv, inter, vocab, theta, ctx, factor, tie, window = _PUBLISHED[name]
    a = preset(name)
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.hidden_dim) == (
        dim, layers, heads, kv, inter
    )  # fmt: skip
    assert (a.vocab_size, a.rope_theta, a.max_seq_len) == (vocab, theta, ctx)
    assert (a.rope_scaling.factor if a.rope_scaling else None) == factor
    assert (a.tie_word_embeddings, a.sliding_window, a.norm_eps) == (tie, window, 1e-5)
    a.check_tp(8)  # splits over one 8-GPU node (TinyLlama's 4 KV heads replicated)


@pytest.mark.parametrize("style", ["v4", "v5"])
@pytest.mark.parametrize("name", sorted(_PUBLISHED))
def test_to_hf_config_reads_back_and_transformers_reads_the_same_model(name, style):
    """``to_hf_config`` (the speed benches' HF peer, the families' parity folders) is read back
    by ``from_hf_config`` to the same args, and transformers' own config class reads the same
    shape, RoPE and window from it (the test factory's configs are spelled independently)."""
    transformers = pytest.importorskip("transformers")
    a = preset(name).replace(rope_interleaved=False)  # HF folders: rotate-half halves
    cfg = a.to_hf_config(style)
    assert ModelArgs.from_hf_config(cfg, rope_interleaved=False) == a
    assert json.loads(json.dumps(cfg)) == cfg  # a config.json as written
    hf = transformers.AutoConfig.for_model(**cfg)
    assert type(hf).__name__ == ("MistralConfig" if a.sliding_window else "LlamaConfig")
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads) == (
        a.dim, a.n_layers, a.n_heads
    )  # fmt: skip
    assert (hf.num_key_value_heads, hf.intermediate_size, hf.vocab_size) == (
        a.n_kv_heads, a.hidden_dim, a.vocab_size
    )  # fmt: skip
    assert getattr(hf, "sliding_window", None) == a.sliding_window
    assert hf.tie_word_embeddings == a.tie_word_embeddings
    rope = getattr(hf, "rope_parameters", None) or {
        "rope_theta": hf.rope_theta,
        **(getattr(hf, "rope_scaling", None) or {}),
    }  # transformers 5 normalises either spelling into rope_parameters
    assert rope["rope_theta"] == a.rope_theta
    assert rope.get("factor") == (a.rope_scaling.factor if a.rope_scaling else None)


def test_to_hf_config_refuses_what_transformers_would_misread():
    a = preset("mistral-7B")
    with pytest.raises(ValueError, match="model_type 'mistral' states it"):
        a.to_hf_config(model_type="llama")
    with pytest.raises(ValueError, match="model_type must be one of"):
        a.to_hf_config(model_type="qwen2")
    with pytest.raises(ValueError, match="rope_style must be 'v4' or 'v5'"):
        a.to_hf_config("v6")
    unwindowed = a.replace(sliding_window=None).to_hf_config(model_type="mistral")
    assert unwindowed["model_type"] == "mistral" and unwindowed["sliding_window"] is None
