"""Every ``NAKTA_*`` environment variable Nakta reads, declared once: name, type, default and one
line on what it does. Code reads them only through the getters here (a test greps the tree for
any other read), and docs/knobs.md lists the same names.

Values are read at each call, not cached at import: a test or a benchmark that sets one in its
own process sees it on the next read. The table lives here, beside the getters, so that adding a
knob means adding one line, and a typo in a name fails loudly (``KeyError``) instead of reading
an unset variable forever.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KNOBS", "Knob", "get_bool", "get_int", "get_path", "get_str", "raw"]


@dataclass(frozen=True)
class Knob:
    """One environment variable: its ``name``, the ``kind`` its value parses to (``bool``,
    ``int``, ``str`` or ``Path``), its ``default`` when unset or empty, and one line of ``doc``."""

    name: str
    kind: type
    default: object
    doc: str


KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob("NAKTA_KERNELS", str, "auto",
             "kernel dispatch when a model is built without kernels=: auto (Triton on CUDA, "
             "PyTorch elsewhere), triton or reference"),
        Knob("NAKTA_DEBUG", bool, False,
             "run the host checks that need a device sync (index ranges) on CUDA too"),
        Knob("NAKTA_DECODE_ATTENTION_TUNE", str, "",
             "decode attention launch values over the table, KEY=INT pairs "
             "(e.g. MIN_SPLIT_KEYS=64,BLOCK_S=32), for benchmarks in a fresh process"),
        Knob("NAKTA_PREFILL_BURST", int, 8,
             "prefill forwards the generator may run back to back before the running rows' "
             "next decode chunk (Generator(prefill_burst=) when not given)"),
        Knob("NAKTA_SHARED_DATA", Path, None,
             "the folder of real test assets (tokenizer, stories260K, HellaSwag); "
             "default ../shared/data beside the checkout"),
        Knob("NAKTA_HELLASWAG_JSONL", Path, None,
             "the HellaSwag jsonl the hellaswag_local lm-eval task reads when --metadata "
             "names none"),
        Knob("NAKTA_LM_EVAL_TIMING", Path, None,
             "nakta-lm-eval writes its phase timings (JSON) there; rank N > 0 writes "
             "PATH.rankN.json"),
        Knob("NAKTA_LM_EVAL_LOCAL_TASKS", bool, None,
             "1: nakta-lm-eval indexes only --include_path tasks, 0: lm-eval's whole index as "
             "lm-eval builds it; unset: only local when every requested task is, else the "
             "built-in index from the on-disk cache"),
        Knob("NAKTA_LM_EVAL_TEMPLATE_CACHE", bool, True,
             "nakta-lm-eval compiles each prompt template once (0: lm-eval's own per-document "
             "compile)"),
        Knob("NAKTA_LM_EVAL_ENV_PREFETCH", bool, True,
             "nakta-lm-eval gathers lm-eval's environment report in a thread during the run"),
        Knob("NAKTA_LM_EVAL_FAST_EXIT", bool, True,
             "nakta-lm-eval exits without Python's teardown once results are written"),
        Knob("NAKTA_LM_EVAL_PRELOAD", bool, True,
             "nakta-lm-eval starts reading the checkpoint while lm-eval builds its tasks, and "
             "warming the scorer up while it builds the requests"),
    )
}  # fmt: skip


def raw(name: str) -> str | None:
    """The variable's text as set (``None`` when unset); ``name`` must be declared."""
    if name not in KNOBS:
        raise KeyError(f"{name} is not a declared knob (nakta_model/knobs.py)")
    return os.environ.get(name)


def _text(name: str, kind: type) -> str | None:
    knob = KNOBS.get(name)
    if knob is None:
        raise KeyError(f"{name} is not a declared knob (nakta_model/knobs.py)")
    if knob.kind is not kind:
        raise TypeError(f"{name} is a {knob.kind.__name__} knob, not a {kind.__name__}")
    value = os.environ.get(name)
    return None if value is None or value.strip() == "" else value.strip()


def get_bool(name: str) -> bool | None:
    """``0`` is False, any other set value True; unset or empty: the default (``None`` for a
    knob whose unset state means "decide from the request")."""
    text = _text(name, bool)
    return KNOBS[name].default if text is None else text != "0"  # type: ignore[return-value]


def get_int(name: str) -> int:
    """The value as an int; a value that is not one raises ValueError naming the variable."""
    text = _text(name, int)
    if text is None:
        return KNOBS[name].default  # type: ignore[return-value]
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {text!r}") from None


def get_str(name: str) -> str:
    """The value as set (stripped), or the default."""
    text = _text(name, str)
    return KNOBS[name].default if text is None else text  # type: ignore[return-value]


def get_path(name: str) -> Path | None:
    """The value as a path (``~`` expanded), or the default."""
    text = _text(name, Path)
    return KNOBS[name].default if text is None else Path(text).expanduser()  # type: ignore[return-value]
