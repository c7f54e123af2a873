"""HellaSwag: loading, lm-eval-identical preprocessing, request tokenization and metrics.

Why a copy of lm-eval's logic: Nakta's parity and speed runs must score exactly the requests
``lm_eval --tasks hellaswag`` scores, without lm-eval installed (the GPU machine has none).
Every rule below follows lm-eval's ``tasks/hellaswag/utils.py`` and ``HFLM._encode_pair``
(described in ``shared/data/README.md`` section 4); tests check them on real rows.

Two local file schemas are understood:

* the original rowanz jsonl (``activity_label, ctx_a, ctx_b, endings, label``), e.g.
  ``hellaswag_val_subset1000.jsonl``: processed exactly as lm-eval does;
* the preprocessed jsonl (``ctx, endings, label``), e.g. ``hellaswag_val_full.jsonl`` (all
  10,042 tasks, from llama.cpp's text file). Its ``ctx`` is already ``activity_label: ctx`` with
  the tags removed, but ``ctx_b`` is NOT capitalised as lm-eval does, and endings lost the
  leading space lm-eval keeps after ``[title]``/``[step]`` tags (134 of 4,000 endings on the
  1,000-row subset). It is used as is: same task set and labels, slightly different text, so
  absolute accuracies differ a little from lm-eval's; nakta-vs-llama_org parity is unaffected.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

HF_DATASET = "Rowan/hellaswag"
_BRACKETS = re.compile("\\[.*?\\]")


@dataclass(frozen=True)
class Doc:
    """One HellaSwag task as lm-eval sees it: the query, the four choices, the gold index."""

    query: str
    choices: tuple[str, ...]
    label: int
    ind: int | None = None


def preprocess(text: str) -> str:
    """lm-eval's ``preprocess``: strip, ``" [title]"`` -> ``". "``, drop ``[...]``, ``"  "`` -> ``" "``.

    The strip comes first, so an ending that starts with ``"[title] "`` keeps a leading space.
    """
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = _BRACKETS.sub("", text)
    text = text.replace("  ", " ")
    return text


def process_doc(row: dict) -> Doc:
    """One raw row (either schema, see module docstring) -> :class:`Doc`."""
    if not isinstance(row, dict):
        raise TypeError(f"row must be a dict, got {type(row).__name__}")
    missing = [k for k in ("endings", "label") if k not in row]
    if missing:
        raise ValueError(f"row is missing {missing}; keys: {sorted(row)}")
    if "ctx_a" in row:
        ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
        query = preprocess(row["activity_label"] + ": " + ctx)
        choices = tuple(preprocess(e) for e in row["endings"])
    elif "ctx" in row:
        query, choices = row["ctx"], tuple(row["endings"])
    else:
        raise ValueError(f"row has neither ctx_a/ctx_b nor ctx; keys: {sorted(row)}")
    label = int(row["label"])
    if not 0 <= label < len(choices):
        raise ValueError(f"row label {label} out of range for {len(choices)} endings")
    ind = row.get("ind")
    return Doc(query=query, choices=choices, label=label, ind=None if ind is None else int(ind))


def load_jsonl(path: str | Path, limit: int | None = None) -> list[Doc]:
    """Read a local HellaSwag jsonl (either schema), in file order, first ``limit`` rows."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"path {path} is not a file")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit}")
    docs: list[Doc] = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            docs.append(process_doc(json.loads(line)))
            if limit is not None and len(docs) >= limit:
                break
    return docs


def load_llamacpp_txt(path: str | Path, limit: int | None = None) -> list[Doc]:
    """llama.cpp's HellaSwag text file (``.txt`` or ``.txt.bz2``): 6 lines per task
    (``activity_label: ctx``, label, 4 endings), preprocessed like ``hellaswag_val_full.jsonl``
    (which was derived from it). 2 MB compressed instead of 8 MB of jsonl."""
    import bz2

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"path {path} is not a file")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit}")
    opener = bz2.open if path.suffix == ".bz2" else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) % 6:
        raise ValueError(f"{path}: {len(lines)} lines, not a multiple of 6 (ctx, label, 4 endings)")
    docs = []
    for i in range(0, len(lines), 6):
        ctx, label, *endings = lines[i : i + 6]
        docs.append(process_doc({"ind": i // 6, "ctx": ctx, "endings": endings, "label": label}))
        if limit is not None and len(docs) >= limit:
            break
    return docs


def load(path: str | Path, limit: int | None = None) -> list[Doc]:
    """Any local HellaSwag file: jsonl (either schema) or llama.cpp text (``.txt[.bz2]``)."""
    name = Path(path).name
    if name.endswith((".txt", ".txt.bz2")):
        return load_llamacpp_txt(path, limit)
    return load_jsonl(path, limit)


def load_hf(split: str = "validation", limit: int | None = None) -> list[Doc]:
    """``Rowan/hellaswag`` through ``datasets`` (needs the network or a warm HF cache)."""
    try:
        import datasets
    except ImportError as e:  # optional dependency
        raise RuntimeError("load_hf needs the `datasets` package (pip install datasets)") from e
    ds = datasets.load_dataset(HF_DATASET, split=split)
    n = len(ds) if limit is None else min(limit, len(ds))
    return [process_doc(ds[i]) for i in range(n)]


def encode_pair(
    encode: Callable[[str], list[int]], context: str, continuation: str
) -> tuple[list[int], list[int]]:
    """lm-eval's ``HFLM._encode_pair``: trailing context whitespace moves to the continuation;
    the continuation tokens are ``encode(context + continuation)[len(encode(context)):]``.

    ``encode`` must add whatever the model expects at the start (BOS for LLaMA).
    """
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = encode(context + continuation)
    ctx = encode(context)
    return ctx, whole[len(ctx) :]


def doc_requests(doc: Doc) -> list[tuple[str, str]]:
    """The (context, continuation) strings lm-eval scores for one doc (0-shot, delimiter ``" "``)."""
    return [(doc.query, " " + c) for c in doc.choices]


def build_requests(
    docs: Sequence[Doc], encode: Callable[[str], list[int]]
) -> list[tuple[list[int], list[int]]]:
    """Token requests for all docs, ``len(doc.choices)`` consecutive ones per doc."""
    out = []
    for doc in docs:
        for context, continuation in doc_requests(doc):
            out.append(encode_pair(encode, context, continuation))
    return out


def sentencepiece_encoder(model_file: str | Path, bos: bool = True) -> Callable[[str], list[int]]:
    """An ``encode`` for :func:`build_requests` from a sentencepiece model (BOS like LLaMA)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    bos_id = sp.bos_id()

    def encode(text: str) -> list[int]:
        ids = sp.encode(text)
        return [bos_id, *ids] if bos else ids

    return encode


@dataclass(frozen=True)
class DocResult:
    """Per-task outcome: predictions under both metrics and the summed log-likelihoods."""

    pred: int
    pred_norm: int
    lls: tuple[float, ...]


def _argmax(values: Sequence[float]) -> int:
    # numpy.argmax semantics (first maximum wins), as lm-eval uses.
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def score_doc(doc: Doc, lls: Sequence[float]) -> DocResult:
    """lm-eval multiple_choice metrics for one doc: ``acc`` on raw sums, ``acc_norm`` on
    ``ll / len(choice)`` with len in characters of the preprocessed choice (no delimiter)."""
    if len(lls) != len(doc.choices):
        raise ValueError(f"lls has {len(lls)} values, doc has {len(doc.choices)} choices")
    lls = tuple(float(x) for x in lls)
    normed = [ll / len(c) for ll, c in zip(lls, doc.choices)]
    return DocResult(pred=_argmax(lls), pred_norm=_argmax(normed), lls=lls)


def evaluate(docs: Sequence[Doc], lls: Iterable[float]) -> tuple[dict[str, float], list[DocResult]]:
    """Flat log-likelihoods (as :func:`build_requests` ordered them) -> metrics and per-doc results."""
    flat = list(lls)
    need = sum(len(d.choices) for d in docs)
    if len(flat) != need:
        raise ValueError(f"lls has {len(flat)} values, docs need {need}")
    results, i = [], 0
    for doc in docs:
        k = len(doc.choices)
        results.append(score_doc(doc, flat[i : i + k]))
        i += k
    n = max(len(docs), 1)
    metrics = {
        "acc": sum(r.pred == d.label for r, d in zip(results, docs)) / n,
        "acc_norm": sum(r.pred_norm == d.label for r, d in zip(results, docs)) / n,
    }
    return metrics, results
