"""Tensor names and layouts: Meta's unsplit checkpoint, HF's LLaMA, Nakta's fused per-rank one.

No file I/O here: pure functions of names, shapes and tensors, shared by the readers of foreign
checkpoints (``sources.py``), the Nakta checkpoint format (``checkpoint.py``) and the loader
(``loading.py``).

Meta names (``layers.N.attention.wq.weight``, ...; fairscale splits ``wq/wk/wv/w1/w3/output``
by rows and ``wo/w2/tok_embeddings`` by columns across model-parallel shards) map to Nakta's
per-rank tensors (local shapes with ``hq = n_heads / tp``, ``hkv = n_kv_heads / tp``,
``f = hidden_dim / tp``, ``v = vocab_size / tp``)::

    tok_embeddings.weight               [vocab, dim]            replicated
    layers.N.attention.wqkv.weight      [(hq + 2 hkv) hd, dim]  rank's Q heads, K heads, V heads
    layers.N.attention.wo.weight        [dim, hq hd]            row-parallel
    layers.N.feed_forward.w13.weight    [2 f, dim]              rank's gate rows, then up rows
    layers.N.feed_forward.w2.weight     [dim, f]                row-parallel
    layers.N.attention_norm.weight      [dim]                   replicated
    layers.N.ffn_norm.weight            [dim]                   replicated
    norm.weight                         [dim]                   replicated
    output.weight                       [v, dim]                vocab-parallel

HF names (``model.layers.N.self_attn.q_proj.weight``, ...) map to Meta's one to one, with the
q/k rows permuted for rotate-half RoPE (:func:`unpermute_hf` undoes it).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from nakta_model.config import ModelArgs

__all__ = [
    "META_IGNORED",
    "CheckpointError",
    "check_meta_names",
    "from_hf_state_dict",
    "from_meta_state_dict",
    "hf_tensor_to_meta",
    "hf_to_meta_name",
    "merge_meta_shards",
    "merge_meta_tensor",
    "meta_shapes",
    "meta_shard_plan",
    "meta_split_dim",
    "meta_tensor",
    "meta_to_hf_name",
    "nakta_shapes",
    "nakta_tensor",
    "permute_for_hf",
    "short_list",
    "to_meta_state_dict",
    "unpermute_hf",
]

# Meta names that carry no weights (LLaMA-1 consolidated files hold the RoPE frequencies).
META_IGNORED = frozenset({"rope.freqs"})


class CheckpointError(ValueError):
    """A checkpoint (or conversion source) that is incomplete, corrupt or mismatched."""


# ----------------------------------------------------------------------------- shapes and names


def meta_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Unsplit shape of every tensor of a Meta-format checkpoint of this shape."""
    d, hd, f, v = args.dim, args.head_dim, args.hidden_dim, args.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (v, d)}
    for i in range(args.n_layers):
        p = f"layers.{i}."
        shapes[p + "attention.wq.weight"] = (args.n_heads * hd, d)
        shapes[p + "attention.wk.weight"] = (args.n_kv_heads * hd, d)
        shapes[p + "attention.wv.weight"] = (args.n_kv_heads * hd, d)
        shapes[p + "attention.wo.weight"] = (d, args.n_heads * hd)
        shapes[p + "feed_forward.w1.weight"] = (f, d)
        shapes[p + "feed_forward.w2.weight"] = (d, f)
        shapes[p + "feed_forward.w3.weight"] = (f, d)
        shapes[p + "attention_norm.weight"] = (d,)
        shapes[p + "ffn_norm.weight"] = (d,)
    shapes["norm.weight"] = (d,)
    shapes["output.weight"] = (v, d)
    return shapes


def nakta_shapes(args: ModelArgs, tp_size: int = 1) -> dict[str, tuple[int, ...]]:
    """Per-rank (local) shape of every tensor of a Nakta checkpoint sharded ``tp_size`` ways."""
    args.check_tp(tp_size)
    d, hd = args.dim, args.head_dim
    hq, hkv = args.n_heads // tp_size, args.local_kv_heads(tp_size)
    f, v = args.hidden_dim // tp_size, args.vocab_size // tp_size
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (args.vocab_size, d)}
    for i in range(args.n_layers):
        p = f"layers.{i}."
        shapes[p + "attention.wqkv.weight"] = ((hq + 2 * hkv) * hd, d)
        shapes[p + "attention.wo.weight"] = (d, hq * hd)
        shapes[p + "feed_forward.w13.weight"] = (2 * f, d)
        shapes[p + "feed_forward.w2.weight"] = (d, f)
        shapes[p + "attention_norm.weight"] = (d,)
        shapes[p + "ffn_norm.weight"] = (d,)
    shapes["norm.weight"] = (d,)
    shapes["output.weight"] = (v, d)
    return shapes


# ------------------------------------------------------------------ Meta (unsplit) -> Nakta


def _rows(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    n = t.shape[0] // tp
    return t[rank * n : (rank + 1) * n]


def _cols(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    n = t.shape[1] // tp
    return t[:, rank * n : (rank + 1) * n]


def _kv_rows(t: torch.Tensor, args: ModelArgs | None, rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s KV heads of an unsplit ``wk``/``wv``: its share, or (``tp`` above the
    KV-head count) the one head its query heads use, replicated over ``tp / n_kv_heads`` ranks."""
    if args is None or tp <= args.n_kv_heads:
        return _rows(t, rank, tp)
    hd = args.head_dim
    start = args.kv_head_start(rank, tp) * hd
    return t[start : start + hd]


def nakta_tensor(
    name: str,
    get_meta: Callable[[str], torch.Tensor],
    tp_rank: int,
    tp_size: int,
    args: ModelArgs | None = None,
) -> torch.Tensor:
    """Rank ``tp_rank``'s Nakta tensor ``name`` built from unsplit Meta tensors ``get_meta(n)``
    (``args`` needed only when ``tp_size`` exceeds the KV heads, which are then replicated)."""
    m = re.fullmatch(r"layers\.(\d+)\.(attention|feed_forward)\.(wqkv|w13)\.weight", name)
    if m:
        p = f"layers.{m.group(1)}."
        if m.group(3) == "wqkv":
            wq, wk, wv = (get_meta(p + f"attention.{x}.weight") for x in ("wq", "wk", "wv"))
            pieces = [_rows(wq, tp_rank, tp_size)]
            pieces += [_kv_rows(w, args, tp_rank, tp_size) for w in (wk, wv)]
        else:
            parts = ["feed_forward.w1", "feed_forward.w3"]
            pieces = [_rows(get_meta(p + x + ".weight"), tp_rank, tp_size) for x in parts]
        return torch.cat(pieces, dim=0)
    if name.endswith((".wo.weight", ".w2.weight")):
        return _cols(get_meta(name), tp_rank, tp_size)
    if name == "output.weight":
        return _rows(get_meta(name), tp_rank, tp_size)
    return get_meta(name)  # embedding and norms: replicated


def from_meta_state_dict(
    meta_sd: Mapping[str, torch.Tensor], args: ModelArgs, tp_rank: int = 0, tp_size: int = 1
) -> dict[str, torch.Tensor]:
    """Unsplit Meta names -> rank ``tp_rank``'s fused Nakta tensors (contiguous copies)."""
    check_meta_names(meta_sd.keys(), args)
    shapes = nakta_shapes(args, tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
    for name, shape in meta_shapes(args).items():
        if tuple(meta_sd[name].shape) != shape:
            raise CheckpointError(
                f"{name} has shape {tuple(meta_sd[name].shape)}, params say {shape}"
            )
    return {
        name: nakta_tensor(name, meta_sd.__getitem__, tp_rank, tp_size, args).contiguous().clone()
        for name in shapes
    }


def to_meta_state_dict(
    shards: Sequence[Mapping[str, torch.Tensor]], args: ModelArgs
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`from_meta_state_dict` over all ranks: Nakta shards -> unsplit Meta."""
    return {name: meta_tensor(name, shards, args) for name in meta_shapes(args)}


def meta_tensor(
    name: str, shards: Sequence[Mapping[str, torch.Tensor]], args: ModelArgs
) -> torch.Tensor:
    """Unsplit Meta tensor ``name`` from every rank's Nakta tensors (``shards``, rank order):
    one tensor at a time, so a reader of a Nakta checkpoint hands out Meta names lazily."""
    tp = len(shards)
    hd = args.head_dim
    hq, hkv, f = args.n_heads // tp, args.local_kv_heads(tp), args.hidden_dim // tp
    m = re.fullmatch(r"layers\.(\d+)\.(attention|feed_forward)\.(\w+)\.weight", name)
    kind = m.group(3) if m else name.split(".")[0]
    p = f"layers.{m.group(1)}." if m else ""
    if kind in ("wq", "wk", "wv"):
        lo = {"wq": 0, "wk": hq * hd, "wv": (hq + hkv) * hd}[kind]
        n = (hq if kind == "wq" else hkv) * hd
        owners = shards
        if kind != "wq" and tp > args.n_kv_heads:  # replicated: the first rank of each head
            owners = shards[:: tp // args.n_kv_heads]
        return torch.cat([s[p + "attention.wqkv.weight"][lo : lo + n] for s in owners])
    if kind in ("w1", "w3"):
        lo = 0 if kind == "w1" else f
        return torch.cat([s[p + "feed_forward.w13.weight"][lo : lo + f] for s in shards])
    if kind in ("wo", "w2"):
        return torch.cat([s[name] for s in shards], dim=1)
    if kind == "output":
        return torch.cat([s[name] for s in shards], dim=0)
    return shards[0][name]


def check_meta_names(names: Iterable[str], args: ModelArgs, what: str = "state dict") -> None:
    """Raise :class:`CheckpointError` listing missing and unknown tensor names."""
    names = set(names) - META_IGNORED
    expected = set(meta_shapes(args))
    missing, unknown = sorted(expected - names), sorted(names - expected)
    if missing or unknown:
        msg = [f"{what} does not match params ({args.n_layers} layers):"]
        if missing:
            msg.append(f"missing tensors {short_list(missing)}")
        if unknown:
            msg.append(f"unknown tensor names {short_list(unknown)}")
        raise CheckpointError(" ".join(msg))


def short_list(names: list[str], n: int = 6) -> str:
    """The first ``n`` names, and how many more: error messages stay one readable line."""
    return str(names[:n]) + (f" (+{len(names) - n} more)" if len(names) > n else "")


# Meta's fairscale model-parallel split dimension (None = replicated on every shard).
def meta_split_dim(name: str) -> int | None:
    kind = name.split(".")[-2]
    if kind in ("wq", "wk", "wv", "w1", "w3", "output"):
        return 0  # ColumnParallelLinear
    if kind in ("wo", "w2", "tok_embeddings"):
        return 1  # RowParallelLinear, ParallelEmbedding (splits the embedding dim)
    return None


def merge_meta_shards(
    shards: Sequence[Mapping[str, torch.Tensor]], args: ModelArgs
) -> dict[str, torch.Tensor]:
    """Meta's model-parallel shards (``consolidated.NN.pth`` dicts) -> one unsplit state dict."""
    if not shards:
        raise CheckpointError("no shards given")
    for i, s in enumerate(shards):
        check_meta_names(s.keys(), args, what=f"shard {i}")
    shapes = meta_shapes(args)
    return {
        name: merge_meta_tensor(name, [s[name] for s in shards], shapes[name], args)
        for name in shapes
    }


def meta_shard_plan(
    name: str, piece_shape: Sequence[int], n_shards: int, args: ModelArgs
) -> tuple[int | None, int]:
    """``(split dim, stride)`` of one tensor over ``n_shards`` Meta shards: which dimension the
    pieces concatenate on (None: replicated) and which pieces to take (every ``stride``-th).

    Beyond LLaMA-1/2's fairscale split (:func:`meta_split_dim`), as Llama-3's code writes it:
    the embedding split by vocabulary rows (``VocabParallelEmbedding``) rather than by dim, read
    from the piece's shape; and ``wk``/``wv`` over more shards than KV heads, each shard holding
    one whole head replicated over ``n_shards / n_kv_heads`` shards (llama_models' ``reshard_mp``
    with ``repeat_qk_qv``): one piece of each head is taken.
    """
    kind = name.split(".")[-2]
    shape = tuple(piece_shape)
    if n_shards > 1 and kind == "tok_embeddings" and shape == (
        args.vocab_size // n_shards, args.dim
    ):  # fmt: skip
        return 0, 1
    if (
        kind in ("wk", "wv")
        and n_shards > args.n_kv_heads
        and n_shards % args.n_kv_heads == 0
        and shape == (args.head_dim, args.dim)
    ):
        return 0, n_shards // args.n_kv_heads
    return meta_split_dim(name), 1


def merge_meta_tensor(
    name: str,
    pieces: Sequence[torch.Tensor],
    expected: tuple[int, ...],
    args: ModelArgs | None = None,
) -> torch.Tensor:
    """Concatenate one tensor's shards on its split dim (:func:`meta_shard_plan` with ``args``,
    else fairscale's LLaMA-1 split); check the result's shape."""
    d, stride = meta_split_dim(name), 1
    if args is not None and pieces:
        d, stride = meta_shard_plan(name, pieces[0].shape, len(pieces), args)
    if stride > 1:
        _check_replicas(name, pieces, stride)
        pieces = list(pieces)[::stride]
    if d is None:
        for i, p in enumerate(pieces):
            if tuple(p.shape) != expected:
                raise CheckpointError(
                    f"{name} in shard {i} has shape {tuple(p.shape)}, params say {expected}"
                )
        return pieces[0]
    shapes = {tuple(p.shape) for p in pieces}
    if len(shapes) != 1:
        raise CheckpointError(f"{name}: shards disagree on shape {sorted(shapes)}")
    merged = pieces[0] if len(pieces) == 1 else torch.cat(list(pieces), dim=d)
    if tuple(merged.shape) != expected:
        raise CheckpointError(
            f"{name}: merged shape {tuple(merged.shape)} from {len(pieces)} shard(s) of "
            f"{tuple(pieces[0].shape)} disagrees with params {expected}"
        )
    return merged


def _check_replicas(name: str, pieces: Sequence[torch.Tensor], stride: int) -> None:
    """The shards that replicate one KV head must hold the same head (else the split is not
    the one :func:`meta_shard_plan` read from the shapes)."""
    for i in range(0, len(pieces), stride):
        for j in range(i + 1, i + stride):
            if not torch.equal(pieces[i], pieces[j]):
                raise CheckpointError(
                    f"{name}: shards {i} and {j} should hold the same replicated KV head "
                    f"({len(pieces)} shards, {len(pieces) // stride} KV heads) but differ"
                )


# --------------------------------------------------------------------------- HF -> Meta names

_HF_LAYER = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.down_proj": "feed_forward.w2",
    "mlp.up_proj": "feed_forward.w3",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}
_HF_TOP = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}


def hf_to_meta_name(name: str) -> str | None:
    """HF LLaMA tensor name -> Meta name; ``None`` for buffers that carry no weights
    (``rotary_emb.inv_freq``); raises :class:`CheckpointError` on an unknown name."""
    if name in _HF_TOP:
        return _HF_TOP[name]
    if name.endswith("rotary_emb.inv_freq"):
        return None
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name)
    if m and m.group(2) in _HF_LAYER:
        return f"layers.{m.group(1)}.{_HF_LAYER[m.group(2)]}.weight"
    raise CheckpointError(f"unknown tensor name {name!r} in the HF checkpoint")


def meta_to_hf_name(name: str) -> str:
    """Meta tensor name -> HF LLaMA name (the inverse of :func:`hf_to_meta_name`)."""
    for hf, meta in _HF_TOP.items():
        if meta == name:
            return hf
    m = re.fullmatch(r"layers\.(\d+)\.(.+)\.weight", name)
    for hf, meta in _HF_LAYER.items():
        if m and meta == m.group(2):
            return f"model.layers.{m.group(1)}.{hf}.weight"
    raise CheckpointError(f"unknown Meta tensor name {name!r}")


def unpermute_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo HF's q/k row permutation (rotate-half RoPE) -> Meta's adjacent-pair layout."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_for_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Meta layout -> HF's permuted q/k rows (what HF's LLaMA conversion script does)."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_tensor_to_meta(meta_name: str, w: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """Convert one HF tensor already renamed to ``meta_name`` (un-permute q and k)."""
    if meta_name.endswith("attention.wq.weight"):
        return unpermute_hf(w, args.n_heads)
    if meta_name.endswith("attention.wk.weight"):
        return unpermute_hf(w, args.n_kv_heads)
    return w


def from_hf_state_dict(
    hf_sd: Mapping[str, torch.Tensor], args: ModelArgs, tie_word_embeddings: bool = False
) -> dict[str, torch.Tensor]:
    """HF LLaMA state dict -> unsplit Meta-named state dict (q/k rows un-permuted)."""
    out: dict[str, torch.Tensor] = {}
    for name, w in hf_sd.items():
        meta = hf_to_meta_name(name)
        if meta is not None:
            out[meta] = w
    if "output.weight" not in out and tie_word_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    check_meta_names(out.keys(), args, what="HF checkpoint")
    shapes = meta_shapes(args)
    for name, t in out.items():
        if tuple(t.shape) != shapes[name]:
            raise CheckpointError(
                f"{name}: shape {tuple(t.shape)} disagrees with config {shapes[name]}"
            )
    return {name: hf_tensor_to_meta(name, t, args) for name, t in out.items()}
