"""Nakta: a fast, honest LLaMA for scoring benchmarks and generation.

``import nakta_model`` stays light: the model, checkpoint and generation code (and the Triton
kernels they pull in) are imported on first use of the names below.
"""

from __future__ import annotations

import importlib

__all__ = [
    "ModelArgs",
    "ParallelContext",
    "Tokenizer",
    "Transformer",
    "generate",
    "load",
    "random_model",
]

_LAZY = {
    "ModelArgs": "nakta_model.config",
    "ParallelContext": "nakta_model.parallel",
    "Tokenizer": "nakta_model.tokenizer",
    "Transformer": "nakta_model.model",
    "load": "nakta_model.loading",
    "random_model": "nakta_model.loading",
    "generate": "nakta_model.generation",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nakta_model' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
