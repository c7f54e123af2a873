"""The lm-eval adapters' model args and generation settings, checked before anything loads.

Every value lm-eval hands the ``nakta`` / ``llama_org`` constructors (``--model_args``,
``--batch_size``, ``--device``, generation kwargs) is parsed here into what the engines use, or
refused with a :class:`ModelArgsError` naming the argument and what was expected
(``lm_eval_cli`` prints it as one ``error:`` line, exit status 2).

Torch-free at import (``lm_eval_preload`` merges the constructor's arguments with
:func:`merged_model_args` before torch is imported).
"""

from __future__ import annotations

import difflib
import inspect
import logging
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "GenSettings",
    "ModelArgsError",
    "default_tokenizer",
    "generation_settings",
    "merged_model_args",
]

# what lm-eval passes beside model_args (``additional_config``) when the user gave nothing:
# ``--batch_size`` defaults to 1, the rest to None (the entry unsets lm-eval's ``cuda:0``)
LM_EVAL_DEFAULTS = {"batch_size": (1, "1"), "max_batch_size": (), "device": ()}

IMPLEMENTED_GEN_KWARGS = ("until", "max_gen_toks", "temperature", "do_sample", "top_p", "top_k")
# settings the engine does not implement, accepted only at the value that changes nothing
NOOP_GEN_KWARGS = {
    "num_beams": (1,),
    "num_return_sequences": (1,),
    "repetition_penalty": (1, 1.0),
}


class ModelArgsError(ValueError):
    """model_args or generation settings that cannot work: ``lm_eval_cli`` prints one
    ``error:`` line and exits 2 instead of lm-eval's traceback."""


def _as_bool(v: object, name: str = "value") -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ModelArgsError(f"{name} must be a boolean (true/false), got {v!r}")


def _rows_cap(value: object, name: str) -> int | None:
    """One lm-eval batch-size value (int, "N", "auto", "auto:N", None) -> a rows cap or None.

    None, 1 and auto mean "no cap": lm-eval's CLI passes 1 when the user gave nothing.
    """
    if value is None:
        return None
    s = str(value).strip().lower()
    if s == "auto" or s.startswith("auto:"):
        return None
    try:
        n = int(s)
    except ValueError as e:
        raise ModelArgsError(f"{name} must be an int, 'auto' or 'auto:N', got {value!r}") from e
    if n < 1:
        raise ModelArgsError(f"{name} must be >= 1, got {n}")
    return None if n == 1 else n


def _rows(batch_size: object, max_batch_size: object = None) -> int | None:
    """Max rows per forward from ``--batch_size`` / ``--max_batch_size`` (the smaller cap)."""
    caps = [
        c
        for c in (
            _rows_cap(batch_size, "batch_size"),
            _rows_cap(max_batch_size, "max_batch_size"),
        )
        if c is not None
    ]
    return min(caps, default=None)


def _positive_int(name: str, value: object) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ModelArgsError(f"{name} must be an int, got {value!r}") from None
    if n < 1:
        raise ModelArgsError(f"{name} must be >= 1, got {n}")
    return n


def _float(name: str, value: object) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ModelArgsError(f"{name} must be a number, got {value!r}") from None


def merged_model_args(model_args: dict, additional: dict | None, warn: bool = True) -> dict:
    """The constructor's keyword arguments from ``--model_args`` and what lm-eval adds beside
    them (``--batch_size``, ``--max_batch_size``, ``--device``; None values dropped, as lm-eval
    does). A key in both: the model_args value wins (it names this model's own setting), with
    one warning line when the other was given on lm-eval's command line and differs."""
    merged = dict(model_args)
    for key, value in (additional or {}).items():
        if value is None:
            continue
        if key not in merged:
            merged[key] = value
            continue
        given = value not in LM_EVAL_DEFAULTS.get(key, ())
        if warn and given and str(value) != str(merged[key]) and os.environ.get("RANK", "0") == "0":
            logging.getLogger(__name__).warning(  # once under torchrun: rank 0
                "warning: model_args %s=%s is used; lm-eval's --%s %s is ignored",
                key, merged[key], key, value,
            )  # fmt: skip
    return merged


def _refuse_unknown_args(model: str, cls: type, extra: dict) -> None:
    """A typo (``dtyp=bf16``) must not run silently with the defaults: the unknown keys named,
    the nearest known one suggested, every known one listed."""
    if not extra:
        return
    known = [
        n
        for n, p in inspect.signature(cls.__init__).parameters.items()
        if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]
    near = {
        k: close[0]
        for k in sorted(extra)
        if (close := difflib.get_close_matches(k, known, n=1, cutoff=0.7))
    }
    hint = ""
    if len(extra) == 1 and near:
        hint = f" (did you mean {next(iter(near.values()))}?)"
    elif near:
        hint = f" (did you mean {', '.join(f'{v} for {k}' for k, v in near.items())}?)"
    raise ModelArgsError(
        f"{model}: unknown model_args {', '.join(sorted(extra))}{hint}; known: {', '.join(known)}"
    )


def require_checkpoint_arg(model: str, checkpoint: object) -> str:
    """``checkpoint=`` must be given (it has no default)."""
    if checkpoint in (None, ""):
        raise ModelArgsError(
            f"{model}: model_args needs checkpoint=DIR (a Nakta, Meta or HF checkpoint folder"
            + (", Meta for llama_org" if model == "llama_org" else "")
            + ")"
        )
    return str(checkpoint)


def _max_length(requested: object, limit: int, checkpoint: object) -> int:
    """``max_length`` model arg: default ``limit``; above the checkpoint's max_seq_len refused."""
    if requested in (None, ""):
        return limit
    n = _positive_int("max_length", requested)
    if n < 2:
        raise ModelArgsError(f"max_length must be >= 2, got {n}")
    if n > limit:
        raise ModelArgsError(
            f"max_length={n} exceeds max_seq_len={limit} of checkpoint {checkpoint} "
            "(the model was not built for longer sequences)"
        )
    return n


@dataclass(frozen=True)
class GenSettings:
    """One ``generate_until`` group's settings, as the engine implements them."""

    until: tuple[str, ...]
    max_gen: int
    temperature: float
    top_p: float
    top_k: int = 0


def generation_settings(kwargs: dict, default_max_gen: int, eos_text: str) -> GenSettings:
    """lm-eval generation kwargs -> what the engine does; unimplemented settings refused."""
    kwargs = dict(kwargs)
    until = kwargs.pop("until", None) or []
    until = [until] if isinstance(until, str) else list(until)
    if eos_text and eos_text not in until:
        until.append(eos_text)
    max_gen = _positive_int("max_gen_toks", kwargs.pop("max_gen_toks", default_max_gen))
    temperature = _float("temperature", kwargs.pop("temperature", 0.0) or 0.0)
    if not _as_bool(kwargs.pop("do_sample", False), "do_sample") and temperature > 0:
        temperature = 0.0  # lm-eval: do_sample=False means greedy
    top_p = _float("top_p", kwargs.pop("top_p", 1.0))
    top_k = kwargs.pop("top_k", None) or 0
    top_k = _positive_int("top_k", top_k) if top_k else 0
    unsupported = sorted(
        k for k, v in kwargs.items() if k not in NOOP_GEN_KWARGS or v not in NOOP_GEN_KWARGS[k]
    )
    if unsupported:
        raise ModelArgsError(
            "generation settings not implemented by this engine: "
            + ", ".join(f"{k}={kwargs[k]!r}" for k in unsupported)
            + f" (implemented: {', '.join(IMPLEMENTED_GEN_KWARGS)}; accepted as no-ops: "
            + ", ".join(f"{k}={v[-1]}" for k, v in NOOP_GEN_KWARGS.items())
            + ")"
        )
    return GenSettings(tuple(until), max_gen, temperature, top_p, top_k if temperature > 0 else 0)


def _parallel_device(device: str | None) -> str | None:
    """Under torchrun every rank takes its own GPU: ``cuda:N`` (lm-eval's default ``cuda:0``)
    would put all ranks on one; ``cuda`` lets ``init_parallel`` pick ``LOCAL_RANK``'s."""
    from accuracy_test import models

    if device is None or not str(device).startswith("cuda"):
        return device
    if models.resolve_device(device, fallback=True).type != "cuda":
        return "cpu"  # no GPU here: the warning is out, the ranks share the CPU
    return "cuda"


def default_tokenizer(tokenizer: str | None, checkpoint: str, model: str) -> str:
    """``tokenizer`` when given, else the checkpoint folder's own ``tokenizer.model`` (what
    ``convert.py`` writes beside the weights, and what Meta's folders hold)."""
    if tokenizer not in (None, ""):
        return str(tokenizer)
    for name in ("tokenizer.json", "tokenizer.model"):  # HF's first, as AutoTokenizer reads it
        own = Path(checkpoint) / name
        if own.is_file():
            return str(own)
    raise ModelArgsError(
        f"{model}: no tokenizer= given and checkpoint {checkpoint} holds no tokenizer.model: "
        "pass tokenizer=PATH (the SentencePiece model the checkpoint was trained with)"
    )


def _check_vocab(tok, tokenizer: object, vocab_size: int, checkpoint: object) -> None:
    """A tokenizer of another model scores ids the checkpoint never learned (or has none of)."""
    if tok.n_words != vocab_size:
        raise ModelArgsError(
            f"tokenizer {tokenizer} has {tok.n_words} pieces but checkpoint {checkpoint} has "
            f"vocab_size {vocab_size}: use the tokenizer the checkpoint was trained with"
        )


def _meta_dir(checkpoint: str) -> Path:
    """llama_org's checkpoint: an existing Meta dir (params.json + consolidated.*.pth)."""
    from nakta_model.sources import is_meta_checkpoint

    path = Path(checkpoint)
    if not path.exists():
        raise ModelArgsError(f"llama_org checkpoint {checkpoint} does not exist")
    if not is_meta_checkpoint(path):
        raise ModelArgsError(
            f"llama_org checkpoint {checkpoint} must be a Meta dir "
            "(params.json + consolidated.*.pth), e.g. the one convert.py reads"
        )
    return path
