"""One set of weights in each of the three checkpoint formats every command takes, and broken
copies of a Nakta checkpoint: the "one checkpoint argument" tests share them.

``in_format(meta_dir, fmt, tmp)``: the Meta folder itself, its ``convert.py`` output (Nakta) or
a HF LLaMA folder of the same weights (q/k rows permuted as HF's conversion does), each with
the Meta folder's ``tokenizer.model`` beside the weights when it has one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from hf_factory import hf_config, hf_state_dict

FORMATS = ("meta", "nakta", "hf")


def in_format(meta_dir: Path, fmt: str, tmp: Path) -> Path:
    if fmt == "meta":
        return meta_dir
    out = tmp / f"{meta_dir.name}-{fmt}"
    if out.exists():
        return out
    if fmt == "nakta":
        from convert import convert

        return convert(meta_dir, out, quiet=True)
    if fmt != "hf":
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    from safetensors.torch import save_file

    from nakta_model.layout import merge_meta_shards
    from nakta_model.loading import checkpoint_args

    params = json.loads((meta_dir / "params.json").read_text())
    args = checkpoint_args(meta_dir)
    params["vocab_size"] = args.vocab_size
    shards = [
        torch.load(p, map_location="cpu", weights_only=True)
        for p in sorted(meta_dir.glob("consolidated.*.pth"))
    ]
    meta_sd = merge_meta_shards(shards, args)
    out.mkdir(parents=True)
    save_file(hf_state_dict(meta_sd, params), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(hf_config(params)))
    if (meta_dir / "tokenizer.model").is_file():
        shutil.copy(meta_dir / "tokenizer.model", out / "tokenizer.model")
    return out


def broken_nakta(nakta_dir: Path, how: str, tmp: Path) -> Path:
    """A copy of a Nakta checkpoint whose shard is ``truncated`` (half its bytes) or
    ``corrupted`` (its first tensor bytes overwritten: the manifest's sampled sha256 differs)."""
    out = tmp / f"{nakta_dir.name}-{how}"
    shutil.copytree(nakta_dir, out)
    (shard,) = out.glob("*.safetensors")
    data = bytearray(shard.read_bytes())
    if how == "truncated":
        shard.write_bytes(data[: len(data) // 2])
    elif how == "corrupted":
        head = 8 + int.from_bytes(data[:8], "little")
        data[head : head + 64] = bytes(64)
        shard.write_bytes(bytes(data))
    else:
        raise ValueError(f"how must be 'truncated' or 'corrupted', got {how!r}")
    return out
