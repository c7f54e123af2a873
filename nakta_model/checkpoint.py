"""Nakta checkpoints: fused weights, one safetensors file per tensor-parallel rank, a manifest.

Layout of a checkpoint directory::

    params.json                          Meta-style params + hidden_dim, tp_size, format_version
    model.tp00-of-02.safetensors         rank 0's tensors (fused wqkv / w13, local shapes)
    model.tp01-of-02.safetensors         rank 1's tensors
    tokenizer.model / tokenizer.json     (when the source had one, with its HF configs and chat
                                         template beside it)
    manifest.json                        size, sha256 and sampled sha256 of every file,
                                         shape + dtype of every tensor

An FP8 checkpoint (``quant="fp8"`` in params.json and the manifest, ``convert.py --quant fp8``)
stores each rank's ``wqkv``/``wo``/``w13``/``w2`` as e4m3 with an fp32 ``*.weight_scale`` per
output channel of that rank's shard (``nakta_model/fp8.py``), everything else in ``dtype``:
half the bytes to read. It loads only with ``quant="fp8"``.

Why fused and pre-split: loading is then a straight copy (no concat/permute on the GPU), each
rank reads only its own file, and the manifest lets a loader refuse a corrupt or mismatched
checkpoint instead of running on garbage.

Verification on load (``verify=``) costs no more than reading the weights: ``"fast"`` (the
default, also ``True``) checks sizes and a sha256 over a fixed sample of each file (its header,
then every k-th 1 MiB block and the last one, at most 64 MiB per file; see
:func:`sample_ranges`), ``"full"`` the sha256 of every byte, ``"size"`` (also ``False``) sizes
only. Sizes catch truncation; the sample catches a wrong or partly overwritten file; a bit flip
outside the sample needs ``"full"``. Manifests written before the sample existed verify sizes
only under ``"fast"``.

Tensor names and per-rank shapes: ``layout.py`` (Nakta's fused layout, and how Meta's and HF's
unsplit tensors map to it).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import struct
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch

from nakta_model.checkpoint_names import MANIFEST, PARAMS, shard_file_name
from nakta_model.config import ModelArgs
from nakta_model.fp8 import check_quant, quantizing_fetch, stored_layout
from nakta_model.io_utils import atomic_output_dir, atomic_write_text
from nakta_model.layout import (
    CheckpointError,
    check_meta_names,
    meta_shapes,
    nakta_tensor,
    short_list,
)

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "check_replaceable",
    "load_rank_state_dict",
    "read_args",
    "read_json_object",
    "read_manifest",
    "sample_ranges",
    "save_checkpoint",
    "shard_file_name",
    "verify_checkpoint",
    "write_checkpoint",
]

FORMAT_VERSION = 1
TOKENIZER = "tokenizer.model"

_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_FP8 = torch.float8_e4m3fn
_STORED_ST = {**_ST_DTYPES, _FP8: "F8_E4M3"}  # what a shard may hold (FP8 weights too)
_STORED_NAMES = {**_DTYPE_NAMES, _FP8: "float8_e4m3fn"}

# Fast verification: sha256 over the header plus every k-th block and the last one, k chosen so
# that at most SAMPLE_MAX_BLOCKS blocks (64 MiB) are read per file. 64 MiB hash in ~0.05 s, a
# fraction of reading a 13 GB shard; 1 MiB blocks keep each read sequential on disks and network
# filesystems. The parameters are stored per file, so a reader recomputes the digest exactly
# whatever these constants are later.
SAMPLE_BLOCK_BYTES = 1 << 20
SAMPLE_MAX_BLOCKS = 64
VERIFY_MODES = ("fast", "full", "size")


# --------------------------------------------------------------------------- file names


# ---------------------------------------------------------------------------------- writing


class _SafetensorsStream:
    """Writes one safetensors file tensor by tensor (header first: shapes are known up front),
    hashing as it goes, so converting a 65B model never holds more than one tensor in memory."""

    def __init__(
        self,
        path: Path,
        shapes: Mapping[str, tuple[int, ...]],
        dtypes: Mapping[str, torch.dtype],
    ):
        self.path, self.shapes, self.dtypes = path, dict(shapes), dict(dtypes)
        self.order = sorted(self.shapes)
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in self.order:
            nbytes = self.dtypes[name].itemsize * _numel(self.shapes[name])
            header[name] = {
                "dtype": _STORED_ST[self.dtypes[name]],
                "shape": list(self.shapes[name]),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.file = open(path, "wb")  # noqa: SIM115 - closed in finish()
        self.sha = hashlib.sha256()
        self.size = 0
        self._write(struct.pack("<Q", len(raw)) + raw)
        self.next = 0

    def _write(self, data: bytes | memoryview) -> None:
        self.file.write(data)
        self.sha.update(data)
        self.size += len(data)

    def add(self, name: str, t: torch.Tensor) -> None:
        if self.order[self.next] != name:
            raise RuntimeError(f"tensors must come in order: expected {self.order[self.next]}")
        if tuple(t.shape) != self.shapes[name]:
            raise CheckpointError(f"{name}: shape {tuple(t.shape)}, expected {self.shapes[name]}")
        if t.dtype == _FP8 and self.dtypes[name] != _FP8:
            raise CheckpointError(f"{name}: e4m3 tensor for a {self.dtypes[name]} slot")
        t = t.detach().to("cpu", self.dtypes[name]).contiguous()
        self._write(memoryview(t.view(torch.uint8).reshape(-1).numpy()))
        self.next += 1

    def finish(self) -> dict[str, object]:
        if self.next != len(self.order):
            raise RuntimeError(f"{self.path.name}: {len(self.order) - self.next} tensors missing")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return {"size": self.size, "sha256": self.sha.hexdigest()}

    def abort(self) -> None:
        self.file.close()


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(functools.partial(f.read, 1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def sample_plan(size: int, head_bytes: int = 0) -> dict[str, int]:
    """Sampling parameters for a file of ``size`` bytes (stored in the manifest with the digest)."""
    n_blocks = -(-size // SAMPLE_BLOCK_BYTES)
    stride = max(1, -(-n_blocks // (SAMPLE_MAX_BLOCKS - 1)))  # + the last block: <= MAX blocks
    return {"block_bytes": SAMPLE_BLOCK_BYTES, "stride_blocks": stride, "head_bytes": head_bytes}


def sample_ranges(
    size: int, block_bytes: int, stride_blocks: int, head_bytes: int
) -> list[tuple[int, int]]:
    """Byte ranges ``[start, end)`` the fast digest hashes, sorted and merged: the first
    ``head_bytes`` (a safetensors header), blocks ``0, k, 2k, ...`` and the last block."""
    n_blocks = -(-size // block_bytes)
    blocks = set(range(0, n_blocks, stride_blocks)) | ({n_blocks - 1} if n_blocks else set())
    ranges = [(0, min(head_bytes, size))] if head_bytes > 0 else []
    ranges += [(b * block_bytes, min((b + 1) * block_bytes, size)) for b in blocks]
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def _sample_sha256(path: Path, size: int, plan: Mapping[str, int]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for start, end in sample_ranges(size, **plan):
            f.seek(start)
            left = end - start
            while left:
                chunk = f.read(min(left, 1 << 24))
                if not chunk:
                    return ""  # shorter than the manifest says: the size check reports it
                h.update(chunk)
                left -= len(chunk)
    return h.hexdigest()


def _safetensors_head_bytes(path: Path) -> int:
    """Length prefix + JSON header of a safetensors file (tensor names, shapes, offsets)."""
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def _file_record(path: Path, sha256: str | None = None) -> dict[str, object]:
    """Manifest entry of a finished file: size, full sha256, the fast digest and its plan."""
    size = path.stat().st_size
    head = _safetensors_head_bytes(path) if path.suffix == ".safetensors" else 0
    plan = sample_plan(size, head)
    return {
        "size": size,
        "sha256": sha256 or _sha256_file(path),
        "sample_sha256": _sample_sha256(path, size, plan),
        "sample": plan,
    }


def write_checkpoint(
    out_dir: str | Path,
    args: ModelArgs,
    get_meta: Callable[[str], torch.Tensor],
    tp_size: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    *,
    force: bool = False,
    tokenizer: str | Path | None = None,
    progress: bool = False,
    quant: str | None = None,
) -> Path:
    """Write a Nakta checkpoint from unsplit Meta tensors fetched one at a time by ``get_meta``.

    ``quant="fp8"``: each rank's block matrices quantized on its own shard (module docstring).

    All ``tp_size`` rank files are written side by side, tensor by tensor, into a temporary
    directory that replaces ``out_dir`` only when everything (manifest included) is done.
    ``force`` replaces only a Nakta checkpoint (:func:`check_replaceable`); see
    ``io_utils.atomic_output_dir`` for what happens on signals and concurrent writers.
    """
    if dtype not in _ST_DTYPES:
        raise TypeError(f"dtype must be one of {list(_DTYPE_NAMES.values())}, got {dtype}")
    quant = check_quant(quant)
    shapes, dtypes = stored_layout(args, tp_size, dtype, quant)
    get_meta = functools.lru_cache(maxsize=4)(get_meta)  # wqkv needs wq, wk, wv for each rank
    tensor = quantizing_fetch(get_meta, tp_size, args) if quant else None
    out_dir = Path(out_dir)
    notify = _print_stderr if progress else None
    with atomic_output_dir(out_dir, force, may_replace=check_replaceable, notify=notify) as tmp:
        streams = [
            _SafetensorsStream(tmp / shard_file_name(r, tp_size), shapes, dtypes)
            for r in range(tp_size)
        ]
        try:
            names = streams[0].order
            if progress:
                from tqdm import tqdm

                names = tqdm(names, desc=f"writing {tp_size} shard(s)", unit="tensor")
            for name in names:
                for r, stream in enumerate(streams):
                    t = (
                        tensor(name, r)
                        if tensor
                        else nakta_tensor(name, get_meta, r, tp_size, args)
                    )
                    stream.add(name, t)
            written = [s.finish() for s in streams]
        except BaseException:
            for s in streams:
                s.abort()
            raise
        files: dict[str, dict[str, object]] = {}
        for r, info in enumerate(written):
            name = shard_file_name(r, tp_size)
            files[name] = {
                **_file_record(tmp / name, sha256=info["sha256"]),
                "tp_rank": r,
                "tensors": {
                    n: {"shape": list(s), "dtype": _STORED_NAMES[dtypes[n]]}
                    for n, s in shapes.items()
                },
            }
        params = {
            **args.to_params(),
            "tp_size": tp_size,
            "format_version": FORMAT_VERSION,
            "dtype": _DTYPE_NAMES[dtype],
            **({"quant": quant} if quant else {}),
        }
        atomic_write_text(tmp / PARAMS, json.dumps(params, indent=2, sort_keys=True) + "\n")
        extras = [PARAMS]
        if tokenizer is not None:  # the tokenizer file and its companions (HF configs, chat)
            from nakta_model.tokenizer import tokenizer_files

            copied = {Path(tokenizer).name: Path(tokenizer)}
            for companion in tokenizer_files(Path(tokenizer).parent):
                copied.setdefault(companion.name, companion)
            for name, path in copied.items():
                shutil.copyfile(path, tmp / name)
                extras.append(name)
        for extra in extras:
            if (tmp / extra).exists():
                files[extra] = _file_record(tmp / extra)
        manifest = {
            "format_version": FORMAT_VERSION,
            "tp_size": tp_size,
            "dtype": _DTYPE_NAMES[dtype],
            **({"quant": quant} if quant else {}),
            "files": files,
        }
        atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        _make_readable(tmp)
    return out_dir


def _print_stderr(message: str) -> None:
    print(message, file=sys.stderr)


def check_replaceable(path: str | Path) -> None:
    """Raise :class:`CheckpointError` unless ``path`` is a Nakta checkpoint directory holding
    nothing but its own files: the only kind of directory ``force`` may delete."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise CheckpointError(
            f"output {path} is not a Nakta checkpoint (no {MANIFEST}); --force replaces only a "
            "Nakta checkpoint: remove it yourself or choose another OUT"
        )
    try:
        manifest = read_manifest(path)
    except CheckpointError as e:
        raise CheckpointError(f"--force refuses to replace output {path}: {e}") from None
    extra = sorted(set(os.listdir(path)) - set(manifest["files"]) - {MANIFEST})
    if extra:
        raise CheckpointError(
            f"output {path} holds files that are not part of its Nakta checkpoint "
            f"{short_list(extra)}; --force replaces only a checkpoint directory holding nothing "
            "else: move them away or choose another OUT"
        )


def _make_readable(directory: Path) -> None:
    """Temp dirs/files are created 0700/0600; a checkpoint is meant to be shared (umask applies)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for f in directory.iterdir():
        os.chmod(f, 0o666 & ~umask)


def save_checkpoint(
    out_dir: str | Path,
    meta_sd: Mapping[str, torch.Tensor],
    args: ModelArgs,
    tp_size: int = 1,
    dtype: torch.dtype | None = None,
    *,
    force: bool = False,
    tokenizer: str | Path | None = None,
) -> Path:
    """In-memory convenience: an unsplit Meta state dict -> Nakta checkpoint at ``tp_size``."""
    check_meta_names(meta_sd.keys(), args)
    shapes = meta_shapes(args)
    for name, shape in shapes.items():
        if tuple(meta_sd[name].shape) != shape:
            raise CheckpointError(
                f"{name} has shape {tuple(meta_sd[name].shape)}, params say {shape}"
            )
    if dtype is None:
        dtype = meta_sd["tok_embeddings.weight"].dtype
    return write_checkpoint(
        out_dir, args, meta_sd.__getitem__, tp_size, dtype, force=force, tokenizer=tokenizer
    )


# ---------------------------------------------------------------------------------- reading


def read_args(path: str | Path) -> tuple[ModelArgs, dict]:
    """``(ModelArgs, raw params dict)`` of a Nakta checkpoint directory."""
    path = Path(path)
    if not (path / PARAMS).is_file():
        raise CheckpointError(f"{path} is not a Nakta checkpoint: {PARAMS} not found")
    params = read_json_object(path / PARAMS)
    if params.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}/{PARAMS}: format_version {params.get('format_version')!r}, this Nakta "
            f"reads {FORMAT_VERSION} (convert Meta/HF checkpoints with convert.py)"
        )
    try:
        return ModelArgs.from_meta_params(params), params
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path / PARAMS}: {e}") from e


def read_json_object(f: Path) -> dict:
    """A JSON object from ``f``; a :class:`CheckpointError` naming the file otherwise."""
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{f}: cannot read it as JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{f}: expected a JSON object, got {type(data).__name__}")
    return data


def _check_entry_name(path: Path, fname: str) -> None:
    """A manifest entry must name a file directly inside the checkpoint directory."""
    where = f"{path / MANIFEST}: file entry {fname!r}"
    plain = (
        fname
        and ".." not in fname
        and not any(sep in fname for sep in ("/", "\\", "\0"))
        and not os.path.isabs(fname)
    )
    if not plain:
        raise CheckpointError(f"{where} is not a plain file name inside the checkpoint directory")
    target = (path / fname).resolve()
    if target.parent != path.resolve():
        raise CheckpointError(f"{where} resolves outside the checkpoint directory (to {target})")


def read_manifest(path: str | Path) -> dict:
    """The manifest of checkpoint ``path``, its structure and every file name checked."""
    path = Path(path)
    f = path / MANIFEST
    if not f.is_file():
        raise CheckpointError(f"{path}: {MANIFEST} not found (not a Nakta checkpoint?)")
    manifest = read_json_object(f)
    if not isinstance(manifest.get("format_version"), int) or not isinstance(
        manifest.get("files"), dict
    ):
        raise CheckpointError(f"{f}: not a Nakta manifest (needs format_version and files)")
    for fname, info in manifest["files"].items():
        _check_entry_name(path, fname)
        size = info.get("size") if isinstance(info, dict) else None
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise CheckpointError(f"{f}: file entry {fname!r} has no valid size")
    return manifest


def verify_mode(verify: str | bool) -> str:
    """``"fast"`` | ``"full"`` | ``"size"`` from a ``verify=`` argument.

    ``True`` is the default check (``"fast"``): ``load(path)`` and ``load(path, verify=True)``
    stay the same call, and the cost of a full sha256 is asked for by name. ``False`` still
    checks that every file exists with its recorded size (``"size"``).
    """
    if verify is True:
        return "fast"
    if verify is False:
        return "size"
    if verify not in VERIFY_MODES:
        raise ValueError(
            f"verify must be one of {list(VERIFY_MODES)}, True or False; got {verify!r}"
        )
    return verify


def _verify_file(path: Path, fname: str, info: Mapping, mode: str) -> None:
    f = path / fname
    if not f.is_file():
        raise CheckpointError(f"{path}: {fname} listed in the manifest is missing")
    size = f.stat().st_size
    if size != info["size"]:
        raise CheckpointError(f"{f}: size {size} bytes, manifest says {info['size']} (truncated?)")
    if mode == "full" and _sha256_file(f) != info.get("sha256"):
        raise CheckpointError(f"{f}: sha256 differs from the manifest (corrupt file)")
    if mode == "fast" and "sample_sha256" in info:
        digest = _sample_sha256(f, size, _sample_params(f, info))
        if digest != info["sample_sha256"]:
            raise CheckpointError(
                f"{f}: sampled sha256 differs from the manifest (corrupt or replaced file)"
            )


def _sample_params(f: Path, info: Mapping) -> dict[str, int]:
    plan = info.get("sample")
    keys = ("block_bytes", "stride_blocks", "head_bytes")
    ok = isinstance(plan, dict) and set(plan) == set(keys)
    ok = ok and all(isinstance(plan[k], int) and not isinstance(plan[k], bool) for k in keys)
    if not ok or plan["block_bytes"] < 1 or plan["stride_blocks"] < 1 or plan["head_bytes"] < 0:
        raise CheckpointError(f"{f}: the manifest's sample parameters are invalid: {plan!r}")
    return {k: plan[k] for k in keys}


def verify_checkpoint(
    path: str | Path, tp_rank: int | None = None, verify: str | bool = "fast"
) -> dict:
    """Check the manifest against the files; ``verify`` picks how (:func:`verify_mode`).

    Every file must exist with its recorded size; ``"fast"`` also checks each file's sampled
    sha256 (when the manifest has one), ``"full"`` its whole sha256. ``tp_rank`` limits the
    check to that rank's shard (plus params/tokenizer). Returns the manifest; raises
    :class:`CheckpointError` naming the file on any mismatch.
    """
    mode = verify_mode(verify)
    path = Path(path)
    manifest = read_manifest(path)
    for fname, info in manifest["files"].items():
        if tp_rank is not None and info.get("tp_rank", tp_rank) != tp_rank:
            continue
        _verify_file(path, fname, info, mode)
    return manifest


def load_rank_state_dict(
    path: str | Path,
    tp_rank: int = 0,
    tp_size: int = 1,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    verify: str | bool = "fast",
    settings: tuple[ModelArgs, dict] | None = None,
) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """Rank ``tp_rank``'s tensors, read straight onto ``device`` and checked against the manifest.
    ``settings``: :func:`read_args` of ``path`` when the caller has read them already.

    Refuses a checkpoint sharded for another tensor-parallel size, and any missing, extra or
    misshapen tensor: a model must never run on uninitialized memory. ``verify``: ``"fast"``
    (default, also ``True``), ``"full"`` or ``"size"`` (also ``False``), see
    :func:`verify_checkpoint`.
    """
    from nakta_model import prefetch
    from nakta_model.safetensors_read import read_safetensors

    path = Path(path)
    args, params = settings if settings is not None else read_args(path)
    stored_tp = params.get("tp_size")
    if stored_tp != tp_size:
        raise CheckpointError(
            f"{path} is sharded for tp_size={stored_tp}, but tp_size={tp_size} was requested; "
            f"reshard it with: python convert.py <source> <out> --tp {tp_size}"
        )
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be an int in [0, {tp_size}), got {tp_rank!r}")
    manifest = verify_checkpoint(path, tp_rank=tp_rank, verify=verify)
    fname = shard_file_name(tp_rank, tp_size)
    if fname not in manifest["files"]:
        raise CheckpointError(f"{path}: manifest has no entry for {fname}")
    listed = manifest["files"][fname].get("tensors")
    if not isinstance(listed, dict):
        raise CheckpointError(f"{path / MANIFEST}: entry {fname} has no tensor list")
    quant = _stored_quant(path, params, manifest)
    expected, _ = stored_layout(args, tp_size, torch.float32, quant)
    out: dict[str, torch.Tensor] = {}
    try:  # a prefetch of this very file (nakta_model.prefetch) already read it, or read now
        tensors = prefetch.take(path / fname, device) or read_safetensors(path / fname, device)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    names = set(tensors)
    missing, extra = sorted(set(expected) - names), sorted(names - set(expected))
    if missing or extra:
        raise CheckpointError(
            f"{path / fname}: missing tensors {short_list(missing)}, unexpected {short_list(extra)}"
        )
    for name in sorted(expected):
        t = tensors.pop(name)
        info = listed.get(name)
        if (
            not isinstance(info, dict)
            or list(t.shape) != info.get("shape")
            or _STORED_NAMES.get(t.dtype) != info.get("dtype")
        ):
            raise CheckpointError(f"{path / fname}: {name} does not match the manifest")
        if tuple(t.shape) != expected[name]:
            raise CheckpointError(
                f"{path / fname}: {name} has shape {tuple(t.shape)}, params say {expected[name]}"
            )
        keep = t.dtype == _FP8 or (quant and name.endswith("_scale"))  # FP8 data as stored
        out[name] = t if keep or dtype is None or t.dtype == dtype else t.to(dtype)
    return args, out


def _stored_quant(path: Path, params: Mapping, manifest: Mapping) -> str | None:
    """The checkpoint's ``quant`` (None or ``"fp8"``), params.json and manifest agreeing."""
    try:
        quant = check_quant(params.get("quant"))
        listed = check_quant(manifest.get("quant"))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from None
    if quant != listed:
        raise CheckpointError(
            f"{path}: {PARAMS} says quant={quant!r} but {MANIFEST} says {listed!r}"
        )
    return quant
