"""Tiny random checkpoints in Meta's LLaMA format and a tiny tokenizer trained at test time.

Tests must run anywhere, without real weights: this module writes ``consolidated.NN.pth`` +
``params.json`` exactly as Meta's release does (same key names, same fairscale model-parallel
split), so loaders and converters are exercised on the real layout. Weights are random but of a
sane scale (fan-in scaled matrices, norms near 1 with noise) so attention, norms and the FFN all
change the result and a wrong implementation shows up in the logits.
"""

from __future__ import annotations

import io
import json
import random
import shutil
import tempfile
from pathlib import Path

import torch

# vocab_size matches train_tiny_tokenizer's default (300 pieces).
TINY_PARAMS: dict = {
    "dim": 64,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,  # GQA: 2 query heads per KV head
    "vocab_size": 300,
    "multiple_of": 16,
    "norm_eps": 1e-5,
}
# Multi-head attention variant (LLaMA-1 style params.json: no n_kv_heads key).
TINY_PARAMS_MHA: dict = {k: v for k, v in TINY_PARAMS.items() if k != "n_kv_heads"}

# Meta's fairscale split: the dimension each weight is split on across model-parallel ranks
# (None = replicated on every rank).
#   ColumnParallelLinear (output features, dim 0): wq, wk, wv, w1, w3, output
#   RowParallelLinear (input features, dim 1): wo, w2
#   ParallelEmbedding (embedding dim, dim 1): tok_embeddings
_SPLIT_DIM = {
    "tok_embeddings": 1,
    "wq": 0,
    "wk": 0,
    "wv": 0,
    "wo": 1,
    "w1": 0,
    "w2": 1,
    "w3": 0,
    "output": 0,
    "attention_norm": None,
    "ffn_norm": None,
    "norm": None,
}


def split_dim_for_key(key: str) -> int | None:
    """Dimension along which Meta's model-parallel shards split ``key`` (None: replicated)."""
    name = key.split(".")[-2]
    if name not in _SPLIT_DIM:
        raise ValueError(f"key {key!r} is not a Meta LLaMA weight name")
    return _SPLIT_DIM[name]


def ffn_hidden_dim(params: dict) -> int:
    """Meta's FFN width rule (LLaMA-1, plus Llama-2's optional ffn_dim_multiplier); Mistral's
    params.json states ``hidden_dim`` itself."""
    if params.get("hidden_dim") is not None:
        return params["hidden_dim"]
    dim, multiple_of = params["dim"], params["multiple_of"]
    hidden = int(2 * (4 * dim) / 3)
    if params.get("ffn_dim_multiplier") is not None:
        hidden = int(params["ffn_dim_multiplier"] * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def meta_shapes(params: dict) -> dict[str, tuple[int, ...]]:
    """Unsplit shape of every tensor of a Meta checkpoint, in Meta's key order."""
    dim, n_heads = params["dim"], params["n_heads"]
    n_kv_heads = params.get("n_kv_heads") or n_heads
    head_dim = dim // n_heads
    vocab, hidden = params["vocab_size"], ffn_hidden_dim(params)
    if vocab <= 0:
        raise ValueError(f"params['vocab_size'] must be positive, got {vocab}")
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (vocab, dim)}
    for i in range(params["n_layers"]):
        p = f"layers.{i}."
        shapes[p + "attention.wq.weight"] = (n_heads * head_dim, dim)
        shapes[p + "attention.wk.weight"] = (n_kv_heads * head_dim, dim)
        shapes[p + "attention.wv.weight"] = (n_kv_heads * head_dim, dim)
        shapes[p + "attention.wo.weight"] = (dim, n_heads * head_dim)
        shapes[p + "feed_forward.w1.weight"] = (hidden, dim)
        shapes[p + "feed_forward.w2.weight"] = (dim, hidden)
        shapes[p + "feed_forward.w3.weight"] = (hidden, dim)
        shapes[p + "attention_norm.weight"] = (dim,)
        shapes[p + "ffn_norm.weight"] = (dim,)
    shapes["norm.weight"] = (dim,)
    shapes["output.weight"] = (vocab, dim)
    return shapes


def meta_state_dict(params: dict, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """The unsplit random weights of a Meta-format checkpoint (deterministic in ``seed``).

    Matrices ~ N(0, 1/fan_in) so activations keep unit scale; embeddings ~ N(0, 1);
    norm weights 1 + N(0, 0.1) so a skipped ``* weight`` is visible.
    """
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for key, shape in meta_shapes(params).items():
        if len(shape) == 1:
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif key == "tok_embeddings.weight":
            t = torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) / shape[1] ** 0.5
        out[key] = t.to(dtype)
    return out


def shard_state_dict(
    state: dict, n_shards: int, *, llama3: bool = False, n_kv_heads: int | None = None
) -> list[dict]:
    """Split an unsplit Meta state dict into ``n_shards`` model-parallel shards, as fairscale does.

    ``llama3``: as Meta's Llama-3 code writes them (llama_models/llama3/model.py): the embedding
    is a ``VocabParallelEmbedding`` (split by vocabulary rows, dim 0), and with more shards than
    ``n_kv_heads`` each shard's ``wk``/``wv`` is one KV head, repeated over ``n_shards /
    n_kv_heads`` shards (llama_models.checkpoint.reshard_mp's ``repeat_qk_qv``)."""
    shards: list[dict] = [{} for _ in range(n_shards)]
    for key, t in state.items():
        d = split_dim_for_key(key)
        kind = key.split(".")[-2]
        if llama3 and kind == "tok_embeddings":
            d = 0
        if llama3 and kind in ("wk", "wv") and n_kv_heads and n_shards > n_kv_heads:
            heads = t.view(n_kv_heads, -1, t.shape[1])  # [n_kv, head_dim, dim]: whole heads
            t = heads.repeat_interleave(n_shards // n_kv_heads, dim=0).flatten(0, 1)
        if d is None:
            for s in shards:
                s[key] = t.clone()
            continue
        if t.shape[d] % n_shards:
            raise ValueError(
                f"{key} has size {t.shape[d]} on dim {d}, not divisible by n_shards={n_shards}"
            )
        for s, piece in zip(shards, torch.chunk(t, n_shards, dim=d)):
            s[key] = piece.clone()  # clone: save only this piece, not the full storage
    return shards


def write_meta_checkpoint(
    out_dir,
    params: dict,
    n_shards: int = 1,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    *,
    llama3: bool = False,
    state: dict | None = None,
) -> Path:
    """Write ``consolidated.NN.pth`` (``n_shards`` of them) + ``params.json`` into ``out_dir``
    (``llama3``: Meta's Llama-3 split, see :func:`shard_state_dict`; ``state``: these unsplit
    weights instead of ``meta_state_dict(params, seed)``)."""
    if n_shards < 1:
        raise ValueError(f"n_shards must be >= 1, got {n_shards}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if state is None:
        state = meta_state_dict(params, seed=seed, dtype=dtype)
    n_kv = params.get("n_kv_heads") or params["n_heads"]
    shards = shard_state_dict(state, n_shards, llama3=llama3, n_kv_heads=n_kv)
    for rank, shard in enumerate(shards):
        torch.save(shard, out / f"consolidated.{rank:02d}.pth")
    (out / "params.json").write_text(json.dumps(params))
    return out


# ----------------------------------------------------------------------------- tokenizer

# fmt: off
_WORDS = [
    "the", "a", "little", "girl", "boy", "dog", "cat", "sun", "tree", "house", "park", "ball",
    "red", "blue", "green", "big", "small", "happy", "sad", "once", "upon", "time", "there",
    "was", "named", "Lily", "Tom", "play", "run", "jump", "see", "saw", "went", "found",
    "wanted", "loved", "said", "mom", "dad", "friend", "day", "night", "sky", "water", "fish",
    "bird", "flower", "hat", "box", "car", "toy", "cake",
]
# fmt: on
# A small alphabet (~30 characters) so that 300 pieces = 3 special + 256 bytes + characters still
# leaves room for real BPE merges.
_TOKENIZER_CACHE: dict[int, bytes] = {}


def _tiny_corpus(n_sentences: int = 3000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 12))]
        lines.append(" ".join(words) + rng.choice([".", ","]))
    return lines


def _train_tokenizer_bytes(vocab_size: int) -> bytes:
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_tiny_corpus()),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        add_dummy_prefix=True,
        split_digits=True,
        minloglevel=2,
    )
    return model.getvalue()


def train_tiny_tokenizer(out_dir, vocab_size: int = 300) -> Path:
    """A LLaMA-like sentencepiece BPE (byte fallback; unk=0, bos=1, eos=2, no pad) in ``out_dir``.

    Trained once per process and per ``vocab_size`` on generated English-like text, then copied.
    Returns the path of ``out_dir/tokenizer.model``.
    """
    if vocab_size not in _TOKENIZER_CACHE:
        _TOKENIZER_CACHE[vocab_size] = _train_tokenizer_bytes(vocab_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tokenizer.model"
    with tempfile.NamedTemporaryFile(dir=out, delete=False, suffix=".tmp") as f:
        f.write(_TOKENIZER_CACHE[vocab_size])
    shutil.move(f.name, path)
    return path
