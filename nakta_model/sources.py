"""Readers of foreign checkpoints, shared by ``convert.py`` and ``loading.load``.

A :class:`Source` is one model's :class:`ModelArgs` and its unsplit Meta-named tensors, fetched
one at a time: a Meta checkpoint (``params.json`` + ``consolidated.NN.pth`` shards, any count;
:func:`open_meta`), a HF LLaMA directory (``config.json`` + ``*.safetensors`` or
``pytorch_model*.bin``, with or without an index json, tied embeddings allowed; :func:`open_hf`)
or an unsplit Meta state dict in memory (:func:`state_dict_source`). Files are memory-mapped and
every name and shape is checked when the source is opened, before a tensor is read: ``convert.py``
writes a Source as a Nakta checkpoint tensor by tensor, ``load`` builds one rank's model from it
with no checkpoint on disk.

:class:`MetaRankShard` is the other in-memory kind: one rank's own piece of Meta's fairscale
split (``consolidated.0R.pth`` of a checkpoint with ``tp`` shards, or llama_org's state dict at
MP = ``tp``), which ``load`` turns into that rank's Nakta tensors without the unsplit model.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from nakta_model.checkpoint import load_rank_state_dict, read_args, read_json_object
from nakta_model.checkpoint_names import MANIFEST, PARAMS
from nakta_model.config import ModelArgs
from nakta_model.layout import (
    META_IGNORED,
    CheckpointError,
    check_meta_names,
    hf_tensor_to_meta,
    hf_to_meta_name,
    merge_meta_tensor,
    meta_shapes,
    meta_shard_plan,
    meta_tensor,
)

__all__ = [
    "MetaRankShard",
    "Source",
    "checkpoint_format",
    "checkpoint_tokenizer",
    "hf_weight_files",
    "is_hf_checkpoint",
    "is_meta_checkpoint",
    "is_nakta_checkpoint",
    "meta_shard_paths",
    "open_checkpoint",
    "open_hf",
    "open_meta",
    "open_nakta",
    "open_source",
    "state_dict_source",
]

_SHARD_RE = re.compile(r"consolidated\.(\d+)\.pth")
_HF_SHARD_RE = re.compile(r".*-(\d+)-of-(\d+)\.(safetensors|bin)")
_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class Source:
    """Unsplit Meta-named tensors of one model, fetched one at a time by ``get(name)``.

    ``dtype`` is the stored one (the embedding's), ``tokenizer`` the tokenizer file found
    beside the weights (or None); ``description`` says where the tensors come from."""

    args: ModelArgs
    get: Callable[[str], torch.Tensor]
    dtype: torch.dtype
    tokenizer: Path | None = None
    description: str = "Meta-named tensors in memory"


@dataclass(frozen=True)
class MetaRankShard:
    """One rank's own piece of a Meta model-parallel checkpoint split ``tp`` ways (fairscale's
    split), for the rank ``tp_rank`` of the ``parallel`` context it is loaded with."""

    shard: Mapping[str, torch.Tensor]
    args: ModelArgs


def is_meta_checkpoint(path: str | Path) -> bool:
    """A Meta release folder: ``params.json`` + ``consolidated.NN.pth`` shards."""
    path = Path(path)
    return (path / "params.json").is_file() and any(path.glob("consolidated.*.pth"))


def is_hf_checkpoint(path: str | Path) -> bool:
    """A HF model folder: ``config.json`` (its weights are checked when it is opened)."""
    return (Path(path) / "config.json").is_file()


def is_nakta_checkpoint(path: str | Path) -> bool:
    """A Nakta checkpoint folder (``convert.py``'s output): ``params.json`` + ``manifest.json``."""
    path = Path(path)
    return (path / PARAMS).is_file() and (path / MANIFEST).is_file()


def checkpoint_format(path: str | Path) -> str | None:
    """``"meta"``, ``"hf"`` or ``"nakta"`` from the files in folder ``path`` (nothing read), or
    None when it is none of them. The order is :func:`~nakta_model.loading.load`'s."""
    if is_meta_checkpoint(path):
        return "meta"
    if is_hf_checkpoint(path):
        return "hf"
    if is_nakta_checkpoint(path):
        return "nakta"
    return None


# ------------------------------------------------------------------------------------ helpers


def _progress(items, desc: str, quiet: bool):
    if quiet:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="file")


def _find_tokenizer(in_dir: Path, vocab_size: int | None) -> Path | None:
    """``IN/tokenizer.json`` (a HF folder: what AutoTokenizer reads), else ``IN/tokenizer.model``,
    else Meta's layout ``IN/../tokenizer.model`` if it fits.

    A broken tokenizer in IN is an error; a broken or mismatched one in the parent (shared by
    several model folders, maybe not ours) is passed over. A ``tokenizer.json`` may hold fewer
    ids than the vocabulary (HF pads embeddings); a ``tokenizer.model`` must hold exactly as many.
    """
    for candidate, strict in (
        (in_dir / "tokenizer.json", True),
        (in_dir / "tokenizer.model", True),
        (in_dir.parent / "tokenizer.model", False),
    ):
        if not candidate.is_file():
            continue
        try:
            n_words = _tokenizer_words(candidate)
        except CheckpointError:
            if strict:
                raise
            continue
        if vocab_size is None or (
            n_words <= vocab_size if candidate.suffix == ".json" else n_words == vocab_size
        ):
            return candidate
        if strict:
            raise CheckpointError(
                f"{candidate} has {n_words} pieces but the checkpoint's vocab_size is {vocab_size}"
            )
    return None


def _check_shapes(
    shapes: dict[str, tuple[int, ...]], args: ModelArgs, what: str, hint: str = ""
) -> None:
    """Every unsplit shape is what the params say (names were checked before)."""
    expected = meta_shapes(args)
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise CheckpointError(
                f"{what}: {name} has shape {tuple(shapes[name])}, params say {shape}{hint}"
            )


# --------------------------------------------------------------------------------- Meta source


def meta_shard_paths(in_dir: Path) -> list[Path]:
    """``consolidated.00.pth .. NN``; refuses gaps and stray numbering."""
    found = {}
    for p in in_dir.glob("consolidated.*.pth"):
        m = _SHARD_RE.fullmatch(p.name)
        if not m:
            raise CheckpointError(f"{p.name}: not a consolidated.NN.pth shard name")
        found[int(m.group(1))] = p
    if not found:
        raise CheckpointError(f"{in_dir}: no consolidated.NN.pth shards")
    n = max(found) + 1
    missing = [f"consolidated.{i:02d}.pth" for i in range(n) if i not in found]
    if missing:
        have = ", ".join(sorted(p.name for p in found.values()))
        raise CheckpointError(f"{in_dir}: missing shard(s) {', '.join(missing)} (found {have})")
    return [found[i] for i in range(n)]


def open_meta(in_dir: Path, quiet: bool = False) -> Source:
    """A Meta checkpoint: its shards memory-mapped, merged one tensor at a time on ``get``.
    ``vocab_size: -1`` in ``params.json`` is read from the tokenizer beside it, else from the
    embedding's shape."""
    params = read_json_object(in_dir / "params.json")
    paths = meta_shard_paths(in_dir)
    shards = []
    for p in _progress(paths, f"reading {len(paths)} Meta shard(s)", quiet):
        try:
            sd = torch.load(p, map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file is reported the same way
            raise CheckpointError(f"{p}: cannot read ({type(e).__name__}: {e})") from e
        if not isinstance(sd, dict):
            raise CheckpointError(f"{p}: expected a state dict, got {type(sd).__name__}")
        shards.append(sd)

    vocab = params.get("vocab_size", -1)
    if vocab in (None, -1):
        emb = shards[0].get("tok_embeddings.weight")
        if emb is None:
            raise CheckpointError(f"{paths[0]}: missing tensors ['tok_embeddings.weight']")
        tok = _find_tokenizer(in_dir, None)
        vocab = _tokenizer_words(tok) if tok is not None else emb.shape[0]
    try:
        args = ModelArgs.from_meta_params({**params, "vocab_size": vocab})
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{in_dir / 'params.json'}: {e}") from e
    for p, sd in zip(paths, shards):
        check_meta_names(sd.keys(), args, what=p.name)

    expected = meta_shapes(args)
    merged_shapes = {}
    for name in expected:
        pieces = [sd[name] for sd in shards]
        piece_shapes = {tuple(t.shape) for t in pieces}
        if len(piece_shapes) != 1:
            raise CheckpointError(f"{name}: shards disagree on shape {sorted(piece_shapes)}")
        d, stride = meta_shard_plan(name, pieces[0].shape, len(pieces), args)
        s = list(pieces[0].shape)
        if d is not None and len(s) > d:
            s[d] *= len(pieces) // stride
        merged_shapes[name] = tuple(s)
    _check_shapes(
        merged_shapes,
        args,
        f"{in_dir}, merged from {len(paths)} shard(s)",
        " (a shard missing or extra, or params.json not for these weights?)",
    )

    return Source(
        args=args,
        get=lambda name: merge_meta_tensor(name, [sd[name] for sd in shards], expected[name], args),
        dtype=shards[0]["tok_embeddings.weight"].dtype,
        tokenizer=_find_tokenizer(in_dir, args.vocab_size),
        description=f"Meta checkpoint, {len(paths)} shard(s)",
    )


def _tokenizer_words(path: Path) -> int:
    from nakta_model.tokenizer import TokenizerError, load_tokenizer

    try:
        return load_tokenizer(path).n_words
    except TokenizerError as e:
        raise CheckpointError(f"{path}: {e.reason}") from e


# ----------------------------------------------------------------------------------- HF source


def hf_weight_files(in_dir: Path) -> list[Path]:
    """The weight files of a HF directory (from the index json when present)."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = in_dir / index_name
        if index.is_file():
            weight_map = read_json_object(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index}: no weight_map")
            files = sorted({in_dir / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{index} lists missing weight file(s) {missing}")
            return files
    files = sorted(in_dir.glob("*.safetensors")) or sorted(in_dir.glob("pytorch_model*.bin"))
    if not files:
        raise CheckpointError(f"{in_dir}: no *.safetensors or pytorch_model*.bin weight files")
    totals = set()
    seen = set()
    for f in files:
        m = _HF_SHARD_RE.fullmatch(f.name)
        if m:
            seen.add(int(m.group(1)))
            totals.add(int(m.group(2)))
    if len(totals) > 1:
        raise CheckpointError(f"{in_dir}: weight files from different shard sets {sorted(totals)}")
    if totals:
        n = totals.pop()
        missing = sorted(set(range(1, n + 1)) - seen)
        if missing:
            raise CheckpointError(f"{in_dir}: missing weight shard(s) {missing} of {n}")
    return files


def open_hf(in_dir: Path, quiet: bool = False) -> Source:
    """A HF ``llama`` / ``mistral`` directory: tensors renamed to Meta's names, q/k rows
    un-permuted on ``get`` (Meta's adjacent-pair RoPE layout, what every Nakta checkpoint
    stores); with ``tie_word_embeddings`` the head is the embedding."""
    config = read_json_object(in_dir / "config.json")
    try:
        args = ModelArgs.from_hf_config(config)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{in_dir / 'config.json'}: {e}") from e
    files = hf_weight_files(in_dir)
    readers: dict[str, Callable[[], torch.Tensor]] = {}  # Meta name -> loader
    shapes: dict[str, tuple[int, ...]] = {}
    dtype = None
    for f in _progress(files, f"reading {len(files)} HF file(s)", quiet):
        tensors = _open_hf_file(f)
        for hf_name, (shape, tdtype, load) in tensors.items():
            meta = hf_to_meta_name(hf_name)
            if meta is None:
                continue
            if meta in readers:
                raise CheckpointError(f"{hf_name} appears in more than one weight file")
            readers[meta], shapes[meta] = load, shape
            if meta == "tok_embeddings.weight":
                dtype = tdtype
    if args.tie_word_embeddings and "tok_embeddings.weight" in readers:
        # transformers ties the head to the embedding whether or not lm_head.weight is stored
        readers["output.weight"] = readers["tok_embeddings.weight"]
        shapes["output.weight"] = shapes["tok_embeddings.weight"]
    check_meta_names(readers.keys(), args, what=f"HF checkpoint {in_dir}")
    _check_shapes(shapes, args, f"HF checkpoint {in_dir}")

    return Source(
        args=args,
        get=lambda name: hf_tensor_to_meta(name, readers[name](), args),
        dtype=dtype,
        tokenizer=_find_tokenizer(in_dir, args.vocab_size),
        description=f"HF checkpoint, {len(files)} file(s)",
    )


def _open_hf_file(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype, Callable]]:
    """name -> (shape, dtype, loader) without reading the data yet."""
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            handle = safe_open(str(path), framework="pt")
            out = {}
            names = handle.keys()
            for k in names:
                sl = handle.get_slice(k)
                dtype = _ST_DTYPES.get(sl.get_dtype())
                if dtype is None:
                    raise CheckpointError(f"{path}: {k} has unsupported dtype {sl.get_dtype()}")
                out[k] = (tuple(sl.get_shape()), dtype, lambda k=k: handle.get_tensor(k))
            return out
        sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path}: cannot read ({type(e).__name__}: {e})") from e
    return {k: (tuple(t.shape), t.dtype, lambda t=t: t) for k, t in sd.items()}


# ---------------------------------------------------------------------------------- any source


def open_source(in_dir: str | Path, quiet: bool = False) -> Source:
    """Detect the format of ``in_dir`` and open it (checks names and shapes)."""
    in_dir = Path(in_dir)
    if not in_dir.is_dir():
        raise CheckpointError(f"input {in_dir} is not a directory")
    if is_meta_checkpoint(in_dir):
        return open_meta(in_dir, quiet)
    if is_hf_checkpoint(in_dir):
        return open_hf(in_dir, quiet)
    if (in_dir / "params.json").is_file():
        raise CheckpointError(f"{in_dir}: params.json but no consolidated.NN.pth shards")
    raise CheckpointError(
        f"{in_dir} is neither a Meta checkpoint (params.json + consolidated.NN.pth) "
        "nor a HF LLaMA directory (config.json + weights)"
    )


def open_nakta(in_dir: str | Path, verify: str | bool = "fast") -> Source:
    """A Nakta checkpoint as unsplit Meta-named tensors: every rank's shard read on the CPU and
    checked against the manifest (``verify`` as :func:`~nakta_model.loading.load`), each Meta
    tensor cut back out of the fused ones on ``get`` (for peers that need Meta's or HF's names:
    llama_org, HF transformers, the speed bench's weight layer)."""
    in_dir = Path(in_dir)
    args, params = read_args(in_dir)
    tp = params.get("tp_size")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise CheckpointError(f"{in_dir / PARAMS}: tp_size must be an int >= 1, got {tp!r}")
    shards = [load_rank_state_dict(in_dir, r, tp, "cpu", None, verify)[1] for r in range(tp)]
    dtype = shards[0]["tok_embeddings.weight"].dtype
    fp8 = any(t.dtype == torch.float8_e4m3fn for s in shards for t in s.values())  # as stored
    if fp8:  # the peers get what the e4m3 codes stand for, in the checkpoint's dtype
        shards = [_dequantized(s, dtype) for s in shards]
    from nakta_model.tokenizer import find_tokenizer

    return Source(
        args=args,
        get=lambda name: meta_tensor(name, shards, args),
        dtype=dtype,
        tokenizer=find_tokenizer(in_dir),
        description=f"Nakta checkpoint, tp={tp}" + (", FP8 dequantized" if fp8 else ""),
    )


def _dequantized(shard: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One rank's FP8 tensors as ``dtype`` weights (codes x per-channel scales), scales dropped."""
    out = {}
    for name, t in shard.items():
        if name.endswith("_scale"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            t = (t.float() * shard[name + "_scale"][:, None]).to(dtype)
        out[name] = t
    return out


def open_checkpoint(in_dir: str | Path, verify: str | bool = "fast", quiet: bool = True) -> Source:
    """Any checkpoint folder :func:`~nakta_model.loading.load` reads (Nakta, Meta or HF) as one
    :class:`Source` of unsplit Meta-named tensors: the same weights for every peer."""
    in_dir = Path(in_dir)
    if in_dir.is_dir() and checkpoint_format(in_dir) == "nakta":
        return open_nakta(in_dir, verify)
    if in_dir.is_dir() and checkpoint_format(in_dir) is None and (in_dir / PARAMS).is_file():
        raise CheckpointError(
            f"{in_dir}: params.json but neither consolidated.NN.pth shards (Meta) nor "
            f"{MANIFEST} (Nakta)"
        )
    return open_source(in_dir, quiet)


def checkpoint_tokenizer(in_dir: str | Path, vocab_size: int | None = None) -> Path | None:
    """The sentencepiece model that belongs to checkpoint folder ``in_dir``: its own
    ``tokenizer.model``, else (Meta's release layout) the parent's when its size fits
    ``vocab_size``; None when there is none. A broken own one is a :class:`CheckpointError`."""
    return _find_tokenizer(Path(in_dir), vocab_size)


def state_dict_source(meta_sd: Mapping[str, torch.Tensor], args: ModelArgs) -> Source:
    """An unsplit Meta-named state dict in memory (llama_org's, a test's), checked like a file:
    every name present, no unknown one, every shape what ``args`` says."""
    check_meta_names(meta_sd.keys(), args)
    shapes = {n: tuple(t.shape) for n, t in meta_sd.items() if n not in META_IGNORED}
    _check_shapes(shapes, args, "state dict")
    return Source(args=args, get=meta_sd.__getitem__, dtype=meta_sd["tok_embeddings.weight"].dtype)
