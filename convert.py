"""Convert a Meta or HF LLaMA checkpoint into a Nakta checkpoint at any tensor-parallel size.

    python convert.py IN OUT [--tp N] [--dtype bf16|fp16|fp32] [--force]

IN is either a Meta checkpoint directory (``consolidated.NN.pth`` shards, any count, and
``params.json``) or a HF LLaMA directory (``config.json`` and ``*.safetensors`` or
``pytorch_model*.bin``, with or without an index json; tied embeddings are fine). OUT gets fused
``wqkv`` / ``w13`` weights split for ``--tp`` ranks, a ``params.json`` and a ``manifest.json``
(see ``nakta_model/checkpoint.py``). Sources are memory-mapped and every output tensor is
written as soon as it is built, so even 65B converts without holding the model in memory.

Everything is checked before a byte is written: shard set, tensor names, shapes against the
params, tp divisibility. OUT is written to a temporary directory and renamed at the end.

OUT must not be IN, contain IN, or lie inside IN, and is never a symlink or a file. ``--force``
replaces an existing OUT only when it is a Nakta checkpoint holding nothing but its own files
(its ``manifest.json`` lists them), and only if it is still that same directory when the new
one is complete; a directory that appears at OUT during the conversion is left alone (exit 2).
SIGINT/SIGTERM remove the partial output (exit status 130/143); temporary directories left by
a conversion that was killed outright are removed by the next conversion into the same parent.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from nakta_model.checkpoint import (
    CheckpointError,
    check_meta_names,
    check_replaceable,
    hf_tensor_to_meta,
    hf_to_meta_name,
    merge_meta_tensor,
    meta_shapes,
    meta_split_dim,
    write_checkpoint,
)
from nakta_model.config import ModelArgs

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_SHARD_RE = re.compile(r"consolidated\.(\d+)\.pth")


class Source:
    """Unsplit Meta-named tensors of a checkpoint, fetched one at a time."""

    args: ModelArgs
    get: Callable[[str], torch.Tensor]
    dtype: torch.dtype
    tokenizer: Path | None
    description: str


# ------------------------------------------------------------------------------------ helpers


def _progress(items, desc: str, quiet: bool):
    if quiet:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="file")


def _find_tokenizer(in_dir: Path, vocab_size: int | None) -> Path | None:
    """``IN/tokenizer.model``, else Meta's layout ``IN/../tokenizer.model`` if it fits.

    A broken ``IN/tokenizer.model`` is an error; a broken or mismatched one in the parent
    (shared by several model folders, maybe not ours) is passed over.
    """
    for candidate, strict in (
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
        if vocab_size is None or n_words == vocab_size:
            return candidate
        if strict:
            raise CheckpointError(
                f"{candidate} has {n_words} pieces but the checkpoint's vocab_size is {vocab_size}"
            )
    return None


def _read_json_object(path: Path) -> dict:
    """A JSON object from ``path``; a :class:`CheckpointError` naming the file otherwise."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read it as JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _check_shapes(
    shapes: dict[str, tuple[int, ...]], args: ModelArgs, what: str, hint: str = ""
) -> None:
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
    params = _read_json_object(in_dir / "params.json")
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
        d = meta_split_dim(name)
        piece_shapes = {tuple(t.shape) for t in pieces}
        if len(piece_shapes) != 1:
            raise CheckpointError(f"{name}: shards disagree on shape {sorted(piece_shapes)}")
        s = list(pieces[0].shape)
        if d is not None and len(s) > d:
            s[d] *= len(pieces)
        merged_shapes[name] = tuple(s)
    _check_shapes(
        merged_shapes,
        args,
        f"{in_dir}, merged from {len(paths)} shard(s)",
        " (a shard missing or extra, or params.json not for these weights?)",
    )

    src = Source()
    src.args = args
    src.get = lambda name: merge_meta_tensor(name, [sd[name] for sd in shards], expected[name])
    src.dtype = shards[0]["tok_embeddings.weight"].dtype
    src.tokenizer = _find_tokenizer(in_dir, args.vocab_size)
    src.description = f"Meta checkpoint, {len(paths)} shard(s)"
    return src


def _tokenizer_words(path: Path) -> int:
    from nakta_model.tokenizer import Tokenizer

    try:
        return Tokenizer(path).n_words
    except (OSError, RuntimeError, ValueError) as e:  # sentencepiece: RuntimeError on garbage
        raise CheckpointError(f"{path}: not a sentencepiece model ({e})") from e


# ----------------------------------------------------------------------------------- HF source

_HF_SHARD_RE = re.compile(r".*-(\d+)-of-(\d+)\.(safetensors|bin)")


def hf_weight_files(in_dir: Path) -> list[Path]:
    """The weight files of a HF directory (from the index json when present)."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = in_dir / index_name
        if index.is_file():
            weight_map = _read_json_object(index).get("weight_map")
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
    config = _read_json_object(in_dir / "config.json")
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
    tied = config.get("tie_word_embeddings", False)
    if tied and "output.weight" not in readers and "tok_embeddings.weight" in readers:
        readers["output.weight"] = readers["tok_embeddings.weight"]
        shapes["output.weight"] = shapes["tok_embeddings.weight"]
    check_meta_names(readers.keys(), args, what=f"HF checkpoint {in_dir}")
    _check_shapes(shapes, args, f"HF checkpoint {in_dir}")

    src = Source()
    src.args = args
    src.get = lambda name: hf_tensor_to_meta(name, readers[name](), args)
    src.dtype = dtype
    src.tokenizer = _find_tokenizer(in_dir, args.vocab_size)
    src.description = f"HF checkpoint, {len(files)} file(s)"
    return src


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
                dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}.get(
                    sl.get_dtype()
                )
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


# ------------------------------------------------------------------------------------- driver


def open_source(in_dir: Path, quiet: bool = False) -> Source:
    """Detect the format of ``in_dir`` and open it (checks names and shapes)."""
    if not in_dir.is_dir():
        raise CheckpointError(f"input {in_dir} is not a directory")
    if (in_dir / "params.json").is_file() and any(in_dir.glob("consolidated.*.pth")):
        return open_meta(in_dir, quiet)
    if (in_dir / "config.json").is_file():
        return open_hf(in_dir, quiet)
    if (in_dir / "params.json").is_file():
        raise CheckpointError(f"{in_dir}: params.json but no consolidated.NN.pth shards")
    raise CheckpointError(
        f"{in_dir} is neither a Meta checkpoint (params.json + consolidated.NN.pth) "
        "nor a HF LLaMA directory (config.json + weights)"
    )


def _within(inner: Path, outer: Path) -> bool:
    """``inner`` is ``outer`` or lies under it, through symlinks and bind mounts alike."""
    try:
        outer_st = os.stat(outer)
    except OSError:
        return False
    real = inner.resolve()
    for p in (real, *real.parents):
        try:
            st = os.stat(p)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (outer_st.st_dev, outer_st.st_ino):
            return True
    return False


def _check_creatable(out_dir: Path) -> None:
    """The nearest existing ancestor of OUT is a directory we may write into."""
    parent = out_dir.absolute().parent
    existing = next(p for p in (parent, *parent.parents) if os.path.lexists(p))
    if not existing.is_dir():
        raise ValueError(f"cannot create output {out_dir}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"cannot create output {out_dir}: no write permission in {existing}")


def check_output(in_dir: Path, out_dir: Path, force: bool) -> None:
    """Refuse, before any work, an OUT that convert must not create or replace.

    Never the source (IN itself, a directory holding IN, a directory inside IN), never a
    symlink or a file; an existing OUT only with ``force`` and only a Nakta checkpoint holding
    nothing else (:func:`check_replaceable`).
    """
    if not in_dir.is_dir():
        raise CheckpointError(f"input {in_dir} is not a directory")
    if _within(in_dir, out_dir):
        what = (
            "is the input directory" if _within(out_dir, in_dir) else f"contains the input {in_dir}"
        )
        raise ValueError(f"output {out_dir} {what}: refusing (it would destroy the source)")
    if _within(out_dir, in_dir):
        raise ValueError(
            f"output {out_dir} is inside the input directory {in_dir}: write the checkpoint "
            "elsewhere"
        )
    _check_creatable(out_dir)
    if out_dir.is_symlink():
        raise ValueError(
            f"output {out_dir} is a symbolic link (to {os.readlink(out_dir)}); refusing to "
            "replace it: give the real directory"
        )
    if not os.path.lexists(out_dir):
        return
    if not out_dir.is_dir():
        raise ValueError(f"output {out_dir} exists and is not a directory; refusing to replace it")
    if not force:
        raise FileExistsError(f"output {out_dir} already exists (pass --force to replace it)")
    check_replaceable(out_dir)


def convert(
    in_dir: str | Path,
    out_dir: str | Path,
    tp: int = 1,
    dtype: torch.dtype | None = None,
    force: bool = False,
    quiet: bool = False,
) -> Path:
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive int, got {tp!r}")
    check_output(in_dir, out_dir, force)
    src = open_source(in_dir, quiet)
    src.args.check_tp(tp)
    dtype = dtype or src.dtype
    if dtype not in DTYPES.values():
        raise CheckpointError(f"source dtype {dtype} is not bf16/fp16/fp32; pass --dtype")
    return write_checkpoint(
        out_dir,
        src.args,
        src.get,
        tp,
        dtype,
        force=force,
        tokenizer=src.tokenizer,
        progress=not quiet,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="convert.py", description=__doc__.split("\n\n")[0].strip()
    )
    parser.add_argument("input", type=Path, help="Meta checkpoint dir or HF LLaMA dir")
    parser.add_argument("output", type=Path, help="Nakta checkpoint dir to create")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="output dtype (default: source)")
    parser.add_argument(
        "--force", action="store_true", help="replace an existing OUT that is a Nakta checkpoint"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    ns = parser.parse_args(argv)
    if ns.tp < 1:
        parser.error(f"--tp must be >= 1, got {ns.tp}")
    try:
        out = convert(
            ns.input,
            ns.output,
            tp=ns.tp,
            dtype=DTYPES[ns.dtype] if ns.dtype else None,
            force=ns.force,
            quiet=ns.quiet,
        )
    except (CheckpointError, ValueError, TypeError, OSError) as e:
        print(f"convert.py: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # SIGTERM's default action ends the process after the cleanup
        print("convert.py: interrupted; no partial output left behind", file=sys.stderr)
        return 130
    if not ns.quiet:
        print(f"wrote {out} (tp={ns.tp})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
