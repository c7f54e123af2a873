"""A Nakta checkpoint's file names, importable without torch (the lm-eval entry names the shard
to prefetch before torch is imported)."""

from __future__ import annotations

__all__ = ["MANIFEST", "PARAMS", "shard_file_name"]

MANIFEST = "manifest.json"
PARAMS = "params.json"


def shard_file_name(tp_rank: int, tp_size: int) -> str:
    """The safetensors file of tensor-parallel rank ``tp_rank`` of ``tp_size``."""
    return f"model.tp{tp_rank:02d}-of-{tp_size:02d}.safetensors"
