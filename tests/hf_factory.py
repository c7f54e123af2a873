"""Tiny HF-format LLaMA directories, written the way HF's LLaMA conversion script writes them.

HF key names, a ``config.json`` and -- the part a converter gets wrong -- the q/k row
permutation HF applies so its rotate-half RoPE matches Meta's adjacent-pair RoPE. The
permutation is written out here independently of ``nakta_model.checkpoint`` (the code under test).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from checkpoint_factory import ffn_hidden_dim, meta_state_dict

_LAYER_NAMES = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def hf_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF's ``permute`` from convert_llama_weights_to_hf.py (Meta pairs -> rotate-half halves)."""
    dim1, dim2 = w.shape
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def hf_config(
    params: dict,
    tie: bool = False,
    *,
    model_type: str = "llama",
    rope_scaling: dict | None = None,
    rope_style: str = "v4",
    sliding_window: int | None = None,
) -> dict:
    """A ``config.json`` for ``params``. ``rope_scaling``: HF's llama3 dict (``factor``,
    ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``);
    ``rope_style`` ``"v4"`` writes ``rope_theta`` + ``rope_scaling`` (transformers 4),
    ``"v5"`` one ``rope_parameters`` dict (what transformers 5 saves)."""
    n_heads = params["n_heads"]
    theta = params.get("rope_theta", 10000.0)
    cfg = {
        "architectures": ["MistralForCausalLM" if model_type == "mistral" else "LlamaForCausalLM"],
        "model_type": model_type,
        "hidden_size": params["dim"],
        "intermediate_size": ffn_hidden_dim(params),
        "num_hidden_layers": params["n_layers"],
        "num_attention_heads": n_heads,
        "num_key_value_heads": params.get("n_kv_heads") or n_heads,
        "head_dim": params["dim"] // n_heads,
        "vocab_size": params["vocab_size"],
        "rms_norm_eps": params["norm_eps"],
        "max_position_embeddings": params.get("max_seq_len", 2048),
        "tie_word_embeddings": tie,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if rope_style == "v5":
        kind = {"rope_type": "llama3", **rope_scaling} if rope_scaling else {"rope_type": "default"}
        cfg["rope_parameters"] = {**kind, "rope_theta": theta}
    elif rope_style == "v4":
        cfg["rope_theta"] = theta
        if rope_scaling:
            cfg["rope_scaling"] = {"rope_type": "llama3", **rope_scaling}
    else:
        raise ValueError(f"rope_style must be 'v4' or 'v5', got {rope_style!r}")
    if model_type == "mistral":
        cfg["sliding_window"] = sliding_window
    return cfg


def hf_state_dict(meta_sd: dict, params: dict, tie: bool = False) -> dict:
    """Meta-named unsplit weights -> HF names with q/k permuted (``lm_head`` dropped if tied)."""
    n_heads = params["n_heads"]
    n_kv = params.get("n_kv_heads") or n_heads
    out = {}
    for key, t in meta_sd.items():
        if key == "tok_embeddings.weight":
            out["model.embed_tokens.weight"] = t
        elif key == "norm.weight":
            out["model.norm.weight"] = t
        elif key == "output.weight":
            if not tie:
                out["lm_head.weight"] = t
        else:
            _, i, rest = key.split(".", 2)
            module = rest.rsplit(".", 1)[0]
            if module == "attention.wq":
                t = hf_permute(t, n_heads)
            elif module == "attention.wk":
                t = hf_permute(t, n_kv)
            out[f"model.layers.{i}.{_LAYER_NAMES[module]}.weight"] = t
    return {k: v.contiguous() for k, v in out.items()}


def write_hf_checkpoint(
    out_dir,
    params: dict,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    *,
    n_files: int = 1,
    fmt: str = "safetensors",
    tie: bool = False,
    index: bool = True,
    state: dict | None = None,
    **config: object,
) -> tuple[Path, dict]:
    """Write a HF LLaMA / Mistral directory; returns ``(dir, meta_sd)`` with the Meta-named
    source weights (with ``tie`` the LM head equals the embedding, as the tied HF model
    computes); ``state``: these weights instead of random ones; ``config``: :func:`hf_config`'s
    keywords (model_type, rope_scaling, rope_style, sliding_window)."""
    meta_sd = dict(state) if state is not None else meta_state_dict(params, seed=seed, dtype=dtype)
    if tie:
        meta_sd["output.weight"] = meta_sd["tok_embeddings.weight"].clone()
    sd = hf_state_dict(meta_sd, params, tie=tie)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(params, tie=tie, **config)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    names = list(sd)
    chunks = [names[i::n_files] for i in range(n_files)]
    ext = "safetensors" if fmt == "safetensors" else "bin"
    stem = "model" if fmt == "safetensors" else "pytorch_model"
    weight_map = {}
    for i, chunk in enumerate(chunks):
        fname = f"{stem}.{ext}" if n_files == 1 else f"{stem}-{i + 1:05d}-of-{n_files:05d}.{ext}"
        part = {k: sd[k] for k in chunk}
        if fmt == "safetensors":
            from safetensors.torch import save_file

            save_file(part, str(out / fname), metadata={"format": "pt"})
        else:
            torch.save(part, out / fname)
        weight_map.update({k: fname for k in chunk})
    if index and n_files > 1:
        index_name = f"{stem}.{ext}.index.json"
        (out / index_name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out, meta_sd
