"""Reading today's families' checkpoint layouts: Meta's Llama-3 split (embedding by vocabulary
rows), more Meta shards than KV heads (one head a shard, repeated), tied heads, and a converted
checkpoint that keeps every setting of its source."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoint_factory import meta_state_dict, write_meta_checkpoint
from hf_factory import write_hf_checkpoint

import convert
import nakta_model
from nakta_model.checkpoint import read_args
from nakta_model.layout import CheckpointError
from nakta_model.sources import open_meta, open_source

pytestmark = pytest.mark.usefixtures("one_torch_thread")

L3 = {"dim": 64, "n_layers": 2, "n_heads": 8, "n_kv_heads": 2, "vocab_size": 512,
      "multiple_of": 32, "ffn_dim_multiplier": 1.3, "norm_eps": 1e-5, "rope_theta": 5e5,
      "use_scaled_rope": True}  # fmt: skip


@pytest.mark.parametrize("n_shards", [2, 4])
def test_meta_llama3_split_merges_to_the_unsplit_weights(tmp_path, n_shards):
    """2 shards: the embedding split by vocabulary rows; 4 shards over 2 KV heads: each shard
    holds one KV head, repeated on 2 shards (llama_models' reshard_mp)."""
    sd = meta_state_dict(L3, seed=5)
    folder = write_meta_checkpoint(tmp_path / "m", L3, n_shards, state=sd, llama3=True)
    shard = torch.load(folder / "consolidated.00.pth", weights_only=True)
    assert shard["tok_embeddings.weight"].shape == (512 // n_shards, 64)
    src = open_meta(folder, quiet=True)
    assert src.args.rope_scaling is not None
    for name, t in sd.items():
        assert torch.equal(src.get(name), t), name


def test_replicated_kv_heads_that_differ_are_refused(tmp_path):
    folder = write_meta_checkpoint(tmp_path / "m", L3, 4, seed=1, llama3=True)
    path = folder / "consolidated.01.pth"
    shard = torch.load(path, weights_only=True)
    shard["layers.0.attention.wk.weight"] += 1.0  # shard 1 no longer a copy of shard 0
    torch.save(shard, path)
    src = open_meta(folder, quiet=True)
    with pytest.raises(CheckpointError, match="shards 0 and 1 should hold the same replicated"):
        src.get("layers.0.attention.wk.weight")


def test_tied_hf_folder_uses_the_embedding_even_with_a_stored_head(tmp_path):
    """transformers ties lm_head to the embedding when tie_word_embeddings is set, whatever
    lm_head.weight holds: Nakta reads the same head, and holds it once."""
    params = {k: v for k, v in L3.items() if k != "use_scaled_rope"}
    folder, sd = write_hf_checkpoint(tmp_path / "hf", params, seed=2, tie=True)
    model = nakta_model.load(folder, "cpu", torch.float32)
    assert model.args.tie_word_embeddings
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    assert torch.equal(model.output.weight, sd["tok_embeddings.weight"])
    # a stored lm_head that differs: transformers ignores it, so does Nakta
    from safetensors.torch import load_file, save_file

    st = load_file(folder / "model.safetensors")
    st["lm_head.weight"] = torch.zeros_like(st["model.embed_tokens.weight"])
    save_file(st, str(folder / "model.safetensors"))
    assert torch.equal(open_source(folder, quiet=True).get("output.weight"),
                       sd["tok_embeddings.weight"])  # fmt: skip


def test_a_tied_nakta_checkpoint_with_a_different_head_is_refused(tmp_path):
    params = {k: v for k, v in L3.items() if k != "use_scaled_rope"}
    folder, _ = write_hf_checkpoint(tmp_path / "hf", params, seed=2, tie=True)
    assert convert.main([str(folder), str(tmp_path / "n"), "--quiet"]) == 0
    assert read_args(tmp_path / "n")[0].tie_word_embeddings
    nakta_model.load(tmp_path / "n", "cpu")  # fine as converted
    sd = meta_state_dict(params, seed=3)  # untied weights under a tied params.json
    from nakta_model.checkpoint import save_checkpoint
    from nakta_model.config import ModelArgs

    args = ModelArgs.from_meta_params(params).replace(tie_word_embeddings=True)
    save_checkpoint(tmp_path / "bad", sd, args)
    with pytest.raises(CheckpointError, match="output.weight differs from tok_embeddings"):
        nakta_model.load(tmp_path / "bad", "cpu")


def test_converted_checkpoint_keeps_scaling_window_and_tie(tmp_path):
    params = {k: v for k, v in L3.items() if k != "use_scaled_rope"}
    sc = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}  # fmt: skip
    folder, _ = write_hf_checkpoint(
        tmp_path / "hf", params, seed=4, n_files=2, tie=True, rope_scaling=sc, rope_style="v5"
    )
    assert convert.main([str(folder), str(tmp_path / "n"), "--tp", "4", "--quiet"]) == 0
    args = read_args(tmp_path / "n")[0]
    assert args.rope_scaling.factor == 32.0 and args.tie_word_embeddings
    assert args == open_source(folder, quiet=True).args
    mistral, _ = write_hf_checkpoint(
        tmp_path / "mi", params, seed=4, model_type="mistral", sliding_window=24
    )
    assert convert.main([str(mistral), str(tmp_path / "mn"), "--quiet"]) == 0
    assert json.loads((tmp_path / "mn" / "params.json").read_text())["sliding_window"] == 24
    qwen, _ = write_hf_checkpoint(tmp_path / "q", params, seed=4)
    cfg = json.loads((qwen / "config.json").read_text())
    (qwen / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen2"}))
    with pytest.raises(CheckpointError, match="'qwen2' is not supported; supported"):
        open_source(qwen, quiet=True)
