"""Data loader of the offline ``hellaswag_local`` task (lm-eval ``custom_dataset``).

Reads a local HellaSwag jsonl (original rowanz schema, processed exactly as lm-eval's
``hellaswag`` task does, or the preprocessed ``ctx/endings/label`` schema used as is) through
``nakta_model.tasks.hellaswag``, so lm-eval runs need no network and see the same docs as
``accuracy_test/parity.py``.
"""

from __future__ import annotations

from pathlib import Path

ENV = "NAKTA_HELLASWAG_JSONL"
_REPO = Path(__file__).resolve().parents[3]
_DEFAULTS = (
    _REPO.parent / "shared" / "data" / "hellaswag_val_subset1000.jsonl",
    _REPO / ".data" / "hellaswag_val_subset1000.jsonl",
)


def data_path(hellaswag_jsonl: str | None = None) -> Path:
    """The jsonl to read: argument (``--metadata``), then ``$NAKTA_HELLASWAG_JSONL``, then defaults."""
    from nakta_model import knobs

    chosen = hellaswag_jsonl or knobs.get_path(ENV)
    if chosen:
        path = Path(chosen)
        if not path.is_file():
            raise FileNotFoundError(f"hellaswag_local: {path} (from {ENV} / metadata) not found")
        return path
    for path in _DEFAULTS:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"hellaswag_local: no data file; set {ENV}=PATH.jsonl (defaults tried: "
        + ", ".join(str(p) for p in _DEFAULTS)
        + ")"
    )


def load_local(hellaswag_jsonl: str | None = None, limit: int | None = None, **_: object):
    """A ``DatasetDict`` with a ``validation`` split of processed docs (query, choices, label)."""
    import datasets

    from nakta_model.tasks.hellaswag import load

    docs = load(data_path(hellaswag_jsonl), limit=limit)
    rows = [
        {
            "query": d.query,
            "choices": list(d.choices),
            "label": d.label,
            "ind": -1 if d.ind is None else d.ind,
        }
        for d in docs
    ]
    return datasets.DatasetDict({"validation": datasets.Dataset.from_list(rows)})
