"""GPU, real shapes, random weights: Nakta's Llama-3 against transformers' LlamaForCausalLM
(eager attention) on the same weights, a few layers deep (memory and time), in bf16, both
judged against transformers in fp32 (the truth). Run on the GPU machine:

    pytest -q -m gpu tests/test_families_gpu.py
"""

from __future__ import annotations

import pytest
import torch

import nakta_model
from nakta_model.config import preset
from nakta_model.layout import meta_to_hf_name, permute_for_hf, to_meta_state_dict

pytestmark = pytest.mark.gpu


def _hf_model(args, meta_sd, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    sc = args.rope_scaling
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if sc is not None:
        rope = {"rope_type": "llama3", "rope_theta": args.rope_theta, "factor": sc.factor,
                "low_freq_factor": sc.low_freq_factor, "high_freq_factor": sc.high_freq_factor,
                "original_max_position_embeddings": sc.original_max_position_embeddings}  # fmt: skip
    cfg = LlamaConfig(
        hidden_size=args.dim, intermediate_size=args.hidden_dim, num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
        vocab_size=args.vocab_size, rms_norm_eps=args.norm_eps, rope_parameters=rope,
        max_position_embeddings=args.max_seq_len, tie_word_embeddings=args.tie_word_embeddings,
        attn_implementation="eager",
    )  # fmt: skip
    hf = {}
    for name, t in meta_sd.items():
        if name.endswith("attention.wq.weight"):
            t = permute_for_hf(t, args.n_heads)
        elif name.endswith("attention.wk.weight"):
            t = permute_for_hf(t, args.n_kv_heads)
        hf[meta_to_hf_name(name)] = t.to(dtype)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(dtype)
    model.load_state_dict(hf, strict=not args.tie_word_embeddings)
    return model.eval()


def _compare(args, seq_len: int, batch: int):
    model = nakta_model.random_model(args, "cuda", torch.bfloat16, seed=1)
    return _compare_loaded(model, args, seq_len, batch)


def test_llama3_8b_shape_bf16_no_further_from_the_truth_than_transformers():
    args = preset("llama3-8B").replace(n_layers=4)
    ours_err, ref_err, agree, ref_agree = _compare(args, seq_len=512, batch=2)
    assert ours_err <= 1.25 * ref_err
    assert agree >= ref_agree - 0.01


def test_llama31_8b_shape_scaled_rope_past_the_original_context():
    """Positions up to 8,448 pass Llama-3.1's original 8,192: the scaled tables matter there."""
    args = preset("llama3.1-8B").replace(n_layers=2)
    ours_err, ref_err, agree, ref_agree = _compare(args, seq_len=8448, batch=1)
    assert ours_err <= 1.25 * ref_err
    assert agree >= ref_agree - 0.01


def test_llama32_1b_shape_tied_head():
    args = preset("llama3.2-1B").replace(n_layers=4)
    model = nakta_model.random_model(args, "cuda", torch.bfloat16, seed=2)
    # a tied model's head is its embedding: build one from the random draw
    state = dict(model.state_dict())
    state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state)
    ours_err, ref_err, agree, ref_agree = _compare_loaded(model, args)
    assert ours_err <= 1.25 * ref_err
    assert agree >= ref_agree - 0.01


def _compare_loaded(model, args, seq_len: int = 512, batch: int = 2):
    """(Nakta's bf16 max |dlogit| from the fp32 truth, transformers' bf16 one, and how often
    each one's argmax is the truth's), one transformers model in memory at a time."""
    meta_sd = to_meta_state_dict([model.state_dict()], args)
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len), device="cuda")
    out = {}
    for name, dtype in (("truth", torch.float32), ("ref", torch.bfloat16)):
        with torch.no_grad():
            hf = _hf_model(args, meta_sd, dtype)
            out[name] = hf(tokens).logits.float()
        del hf
        torch.cuda.empty_cache()
    truth, ref = out["truth"], out["ref"]
    ours = model(tokens)
    res = (
        (ours - truth).abs().max().item(),
        (ref - truth).abs().max().item(),
        (ours.argmax(-1) == truth.argmax(-1)).float().mean().item(),
        (ref.argmax(-1) == truth.argmax(-1)).float().mean().item(),
    )
    print(f"{args.n_layers} layers, {seq_len} tokens: nakta bf16 max|dlogit| {res[0]:.4g} "
          f"(argmax agree {res[2]:.4f}), transformers bf16 {res[1]:.4g} ({res[3]:.4f})")  # fmt: skip
    return res
