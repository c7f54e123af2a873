"""Data of ``bbh_shaped_local``: 3 synthetic chain-of-thought shots (train) and test questions."""

from __future__ import annotations


def load(n_test: int = 250, **_: object):
    import datasets

    from nakta_model.tasks.shaped import bbh_docs

    return datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(bbh_docs("train")),
            "test": datasets.Dataset.from_list(bbh_docs("test", int(n_test))),
        }
    )
