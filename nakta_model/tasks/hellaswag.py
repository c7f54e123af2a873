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

Every row is validated while loading, before anything is scored: a bad row fails at once with a
``ValueError`` naming the file, the 1-based line and the field, instead of a ``KeyError`` or a
``ZeroDivisionError`` (an empty ending under ``acc_norm``) after an hour of scoring.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

HF_DATASET = "Rowan/hellaswag"
_BRACKETS = re.compile("\\[.*?\\]")
_DIGITS = re.compile(r"\s*[0-9]+\s*")


@dataclass(frozen=True)
class Doc:
    """One HellaSwag task as lm-eval sees it: the query, the four choices, the gold index.

    Checked on construction: ``acc_norm`` divides by each choice's length and indexes by label.
    """

    query: str
    choices: tuple[str, ...]
    label: int
    ind: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.query, str):
            raise TypeError(f"query must be a str, got {type(self.query).__name__}")
        if not isinstance(self.choices, tuple) or not self.choices:
            raise ValueError(f"choices must be a non-empty tuple, got {self.choices!r}")
        for i, c in enumerate(self.choices):
            if not isinstance(c, str) or not c:
                raise ValueError(f"choices[{i}] must be a non-empty str, got {c!r}")
        if isinstance(self.label, bool) or not isinstance(self.label, int):
            raise TypeError(f"label must be an int, got {self.label!r}")
        if not 0 <= self.label < len(self.choices):
            raise ValueError(f"label {self.label} out of range for {len(self.choices)} choices")


def preprocess(text: str) -> str:
    """lm-eval's ``preprocess``: strip, ``" [title]"`` -> ``". "``, drop ``[...]``, ``"  "`` -> ``" "``.

    The strip comes first, so an ending that starts with ``"[title] "`` keeps a leading space.
    """
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = _BRACKETS.sub("", text)
    text = text.replace("  ", " ")
    return text


def _field(row: dict, key: str, where: str) -> object:
    if key not in row:
        raise ValueError(f"{where}: missing field {key!r} (has {sorted(row)})")
    return row[key]


def _text(row: dict, key: str, where: str) -> str:
    value = _field(row, key, where)
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {key!r} must be a string, got {value!r}")
    return value


def _index(value: object, what: str, where: str) -> int:
    """An int, or a string of digits (HF's ``Rowan/hellaswag`` stores labels as ``"3"``)."""
    if isinstance(value, str) and _DIGITS.fullmatch(value):
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: {what} must be an int, got {value!r}")
    return value


def _endings(row: dict, where: str, clean: Callable[[str], str]) -> tuple[str, ...]:
    raw = _field(row, "endings", where)
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{where}: field 'endings' must be a non-empty list, got {raw!r}")
    choices = []
    for i, ending in enumerate(raw):
        if not isinstance(ending, str):
            raise ValueError(f"{where}: field 'endings'[{i}] must be a string, got {ending!r}")
        choice = clean(ending)
        if not choice:
            after = " after preprocessing" if ending else ""
            raise ValueError(f"{where}: field 'endings'[{i}] is empty{after} (was {ending!r})")
        choices.append(choice)
    return tuple(choices)


def process_doc(row: dict, where: str = "row") -> Doc:
    """One raw row (either schema, see module docstring) -> :class:`Doc`, every field checked.

    ``where`` starts each error message (the loaders pass ``"FILE line N"``).
    """
    if not isinstance(row, dict):
        raise TypeError(f"{where}: row must be a dict (JSON object), got {type(row).__name__}")
    if "ctx_a" in row:
        ctx = _text(row, "ctx_a", where) + " " + _text(row, "ctx_b", where).capitalize()
        query = preprocess(_text(row, "activity_label", where) + ": " + ctx)
        choices = _endings(row, where, preprocess)
    elif "ctx" in row:
        query, choices = _text(row, "ctx", where), _endings(row, where, lambda e: e)
    else:
        raise ValueError(f"{where}: row has neither ctx_a/ctx_b nor ctx; keys: {sorted(row)}")
    label = _index(_field(row, "label", where), "field 'label'", where)
    if not 0 <= label < len(choices):
        raise ValueError(
            f"{where}: field 'label' = {label} out of range for {len(choices)} endings"
        )
    ind = row.get("ind")
    ind = None if ind is None else _index(ind, "field 'ind'", where)
    return Doc(query=query, choices=choices, label=label, ind=ind)


def _check_source(path: Path, limit: int | None) -> None:
    if not path.is_file():
        raise ValueError(f"path {path} is not a file")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be an int >= 1 or None, got {limit!r}")


def load_jsonl(path: str | Path, limit: int | None = None) -> list[Doc]:
    """Read a local HellaSwag jsonl (either schema), in file order, first ``limit`` rows."""
    path = Path(path)
    _check_source(path, limit)
    docs: list[Doc] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path} line {lineno}"
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            docs.append(process_doc(row, where))
            if limit is not None and len(docs) >= limit:
                break
    if not docs:
        raise ValueError(f"{path}: no HellaSwag rows (empty file?)")
    return docs


def load_llamacpp_txt(path: str | Path, limit: int | None = None) -> list[Doc]:
    """llama.cpp's HellaSwag text file (``.txt`` or ``.txt.bz2``): 6 lines per task
    (``activity_label: ctx``, label, 4 endings), preprocessed like ``hellaswag_val_full.jsonl``
    (which was derived from it). 2 MB compressed instead of 8 MB of jsonl."""
    import bz2

    path = Path(path)
    _check_source(path, limit)
    opener = bz2.open if path.suffix == ".bz2" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            lines = f.read().split("\n")
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read it as UTF-8 text ({e})") from None
    if lines and lines[-1] == "":
        lines.pop()
    if not lines:
        raise ValueError(f"{path}: no HellaSwag tasks (empty file?)")
    if len(lines) % 6:
        raise ValueError(f"{path}: {len(lines)} lines, not a multiple of 6 (ctx, label, 4 endings)")
    docs = []
    for i in range(0, len(lines), 6):
        docs.append(_llamacpp_task(path, lines[i : i + 6], first_line=i + 1))
        if limit is not None and len(docs) >= limit:
            break
    return docs


def _llamacpp_task(path: Path, lines: list[str], first_line: int) -> Doc:
    """One 6-line task; errors name the line of the bad field."""
    ctx, label, *endings = lines
    for k, ending in enumerate(endings):
        if not ending:
            raise ValueError(f"{path} line {first_line + 2 + k}: ending {k} is empty")
    if not _DIGITS.fullmatch(label) or not 0 <= int(label) < len(endings):
        raise ValueError(
            f"{path} line {first_line + 1}: label must be an int in [0, {len(endings)}), "
            f"got {label!r}"
        )
    row = {"ind": (first_line - 1) // 6, "ctx": ctx, "endings": endings, "label": int(label)}
    return process_doc(row, where=f"{path} lines {first_line}-{first_line + 5}")


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
    return [process_doc(ds[i], where=f"{HF_DATASET} {split} row {i}") for i in range(n)]


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
    """An ``encode`` for :func:`build_requests` from a tokenizer file or folder (any kind
    :func:`~nakta_model.tokenizer.load_tokenizer` reads; BOS like LLaMA)."""
    from nakta_model.tokenizer import load_tokenizer

    tok = load_tokenizer(model_file)

    def encode(text: str) -> list[int]:
        return tok.encode(text, bos=bos, eos=False)

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
    if not docs:
        raise ValueError("docs is empty: no HellaSwag tasks to evaluate")
    flat = list(lls)
    need = sum(len(d.choices) for d in docs)
    if len(flat) != need:
        raise ValueError(f"lls has {len(flat)} values, docs need {need}")
    results, i = [], 0
    for doc in docs:
        k = len(doc.choices)
        results.append(score_doc(doc, flat[i : i + k]))
        i += k
    n = len(docs)
    metrics = {
        "acc": sum(r.pred == d.label for r, d in zip(results, docs)) / n,
        "acc_norm": sum(r.pred_norm == d.label for r, d in zip(results, docs)) / n,
    }
    return metrics, results
