"""Data of the ``mmlu_shaped_local`` tasks: one subject's synthetic dev (5 shots) and test split."""

from __future__ import annotations


def load(subject: str, **_: object):
    """A ``DatasetDict`` with ``dev`` and ``test`` splits (``question``, ``choices``, ``answer``)."""
    import datasets

    from nakta_model.tasks.shaped import mmlu_docs

    return datasets.DatasetDict(
        {split: datasets.Dataset.from_list(mmlu_docs(subject, split)) for split in ("dev", "test")}
    )
