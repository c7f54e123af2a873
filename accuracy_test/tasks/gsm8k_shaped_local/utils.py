"""Data of ``gsm8k_shaped_local``: 8 synthetic shots (train) and the test problems."""

from __future__ import annotations


def load(n_test: int = 250, **_: object):
    import datasets

    from nakta_model.tasks.shaped import gsm8k_docs

    return datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(gsm8k_docs("train")),
            "test": datasets.Dataset.from_list(gsm8k_docs("test", int(n_test))),
        }
    )
