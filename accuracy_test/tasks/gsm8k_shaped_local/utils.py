"""Data of ``gsm8k_shaped_local`` (250 test problems: quick, the suite's) and
``gsm8k_shaped_full_local`` (all 1,319, GSM8K's test-split size; the first 250 are the same):
8 synthetic shots (train) and the test problems."""

from __future__ import annotations

from nakta_model.tasks.shaped import GSM8K_TEST_SIZE


def load(n_test: int = 250, **_: object):
    import datasets

    from nakta_model.tasks.shaped import gsm8k_docs

    return datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(gsm8k_docs("train")),
            "test": datasets.Dataset.from_list(gsm8k_docs("test", int(n_test))),
        }
    )


def load_full(**kw: object):
    """Every problem of a GSM8K-sized test split (``gsm8k_shaped_full_local``)."""
    kw.pop("n_test", None)
    return load(n_test=GSM8K_TEST_SIZE, **kw)
