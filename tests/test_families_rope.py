"""Llama-3.1 RoPE scaling in the cos/sin tables, against Meta's and transformers' own code.

``kernels/rope.rope_frequencies`` is checked against llama_models' ``apply_scaling`` (Meta's
reference) and transformers' ``_compute_llama3_parameters``; the tables the model builds grow
with the positions a run reaches, not with the config's context.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from nakta_model.config import META_LLAMA3_SCALING, PRESETS, ModelArgs, RopeScaling
from nakta_model.kernels.rope import build_rope_cache, rope_frequencies


def _hf_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(
        hidden_size=head_dim * 2, num_attention_heads=2, max_position_embeddings=1 << 17,
        rope_parameters={"rope_type": "llama3", "rope_theta": theta, "factor": scaling.factor,
                         "low_freq_factor": scaling.low_freq_factor,
                         "high_freq_factor": scaling.high_freq_factor,
                         "original_max_position_embeddings":
                             scaling.original_max_position_embeddings},
    )  # fmt: skip
    return ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")[0].double()


@pytest.mark.parametrize("head_dim", [64, 128, 6])
@pytest.mark.parametrize("theta", [5e5, 1e4])
def test_scaled_frequencies_equal_meta_and_transformers(head_dim, theta):
    pytest.importorskip("fairscale")
    from llama_models.llama3.model import apply_scaling

    inv = rope_frequencies(head_dim, theta, META_LLAMA3_SCALING)
    plain = rope_frequencies(head_dim, theta)
    base32 = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    meta = apply_scaling(base32).double()  # Meta's constants: factor 8, low 1, high 4, 8192
    torch.testing.assert_close(inv, meta, rtol=1e-6, atol=0)
    torch.testing.assert_close(inv, _hf_inv_freq(head_dim, theta, META_LLAMA3_SCALING),
                               rtol=1e-6, atol=0)  # fmt: skip
    # the three bands are all exercised at head_dim 128, theta 5e5: kept, divided, blended
    wavelen = 2 * math.pi / plain
    if head_dim == 128 and theta == 5e5:
        assert (wavelen < 2048).any() and (wavelen > 8192).any()
        assert ((wavelen > 2048) & (wavelen < 8192)).any()
    torch.testing.assert_close(inv[wavelen < 2048], plain[wavelen < 2048], rtol=0, atol=0)
    torch.testing.assert_close(inv[wavelen > 8192], plain[wavelen > 8192] / 8, rtol=1e-15, atol=0)


def test_llama32_factor_and_tiny_original_context_match_transformers():
    scaling = RopeScaling(32.0, 1.0, 4.0, 16)  # a tiny original context: every band at hd 16
    inv = rope_frequencies(16, 5e5, scaling)
    torch.testing.assert_close(inv, _hf_inv_freq(16, 5e5, scaling), rtol=1e-6, atol=0)
    assert not torch.equal(inv, rope_frequencies(16, 5e5))


def test_rope_cache_uses_the_scaled_frequencies():
    cos, sin = build_rope_cache(300, 16, 5e5, scaling=RopeScaling(8.0, 1.0, 4.0, 16))
    inv = rope_frequencies(16, 5e5, RopeScaling(8.0, 1.0, 4.0, 16))
    ang = torch.arange(300, dtype=torch.float64)[:, None] * inv[None, :]
    torch.testing.assert_close(cos, torch.cos(ang).float(), rtol=0, atol=1e-7)
    torch.testing.assert_close(sin, torch.sin(ang).float(), rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="rotary_dim must be a positive even int"):
        rope_frequencies(7, 1e4)
    with pytest.raises(ValueError, match="high_freq_factor > low_freq_factor"):
        bad = SimpleNamespace(
            factor=8.0,
            low_freq_factor=4.0,
            high_freq_factor=1.0,
            original_max_position_embeddings=16,
        )  # what RopeScaling itself refuses: the kernel-side function checks it too
        rope_frequencies(8, 1e4, bad)


def test_model_rope_tables_grow_on_demand_with_the_configs_scaling():
    """A 128K-context config allocates what a run reaches (power-of-two growth), never
    max_seq_len rows up front; the tables carry the config's theta and scaling."""
    from nakta_model.model import Transformer

    args = PRESETS["tiny"].replace(max_seq_len=131072, rope_theta=5e5,
                                   rope_scaling=RopeScaling(32.0, 1.0, 4.0, 16))  # fmt: skip
    with torch.device("meta"):
        model = Transformer(args, kernels="reference")
    model.output.weight = torch.nn.Parameter(torch.zeros(args.vocab_size, args.dim))
    cos, sin = model._rope_tables(10)
    assert cos.shape == (256, args.head_dim // 2)  # 256-row floor, not 2 x 131072
    ref_cos, _ = build_rope_cache(256, args.head_dim, 5e5, scaling=args.rope_scaling)
    assert torch.equal(cos, ref_cos)
    assert model._rope_tables(200)[0] is cos  # no rebuild while it is long enough
    assert model._rope_tables(1000)[0].shape[0] == 1024
    assert model._rope_tables(5)[0].shape[0] == 1024  # never shrinks


def test_te_rotary_embedding_takes_the_scaling():
    from nakta_model.kernels.rope_te import RotaryPositionEmbedding

    scaling = RopeScaling(8.0, 1.0, 4.0, 16)
    emb = RotaryPositionEmbedding(16, rotary_base=5e5, device="cpu", rope_scaling=scaling)
    freqs = emb(40)[:, 0, 0, :8].double()
    want = torch.arange(40, dtype=torch.float64)[:, None] * rope_frequencies(16, 5e5, scaling)
    torch.testing.assert_close(freqs, want, rtol=1e-6, atol=1e-5)
    plain = RotaryPositionEmbedding(16, rotary_base=5e5, device="cpu")
    assert not torch.allclose(plain(40), emb(40))


def test_args_from_every_format_build_the_same_tables():
    """A Llama-3.1 folder saved by transformers 5 (rope_parameters) and by 4 (rope_theta +
    rope_scaling) give one ModelArgs, hence one table (the silent-default bug of issue 40)."""
    base = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "vocab_size": 10, "intermediate_size": 32}  # fmt: skip
    sc = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
    a = ModelArgs.from_hf_config({**base, "rope_parameters": {**sc, "rope_theta": 5e5}})
    b = ModelArgs.from_hf_config({**base, "rope_theta": 5e5, "rope_scaling": sc})
    ta = build_rope_cache(64, a.head_dim, a.rope_theta, scaling=a.rope_scaling)
    tb = build_rope_cache(64, b.head_dim, b.rope_theta, scaling=b.rope_scaling)
    assert torch.equal(ta[0], tb[0]) and a == b
    plain = build_rope_cache(64, a.head_dim, 1e4)
    assert not torch.allclose(ta[0], plain[0])
