"""``gsm8k_shaped_full_local``: GSM8K's test-split size (1,319 problems) of the GSM8K-shaped
task, deterministic, its first 250 problems and every prompt the 250-doc task's own."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

TASKS = Path(__file__).resolve().parents[1] / "accuracy_test" / "tasks"


def _tasks():
    import lm_eval.tasks

    manager = lm_eval.tasks.TaskManager(include_path=str(TASKS), include_defaults=False)
    return manager.load(["gsm8k_shaped_full_local", "gsm8k_shaped_local"])["tasks"]


def test_full_task_has_gsm8ks_size_and_the_small_tasks_docs_first():
    from nakta_model.tasks.shaped import GSM8K_TEST_SIZE, gsm8k_docs

    tasks = _tasks()
    full, small = tasks["gsm8k_shaped_full_local"], tasks["gsm8k_shaped_local"]
    full_docs, small_docs = list(full.test_docs()), list(small.test_docs())
    assert GSM8K_TEST_SIZE == 1319
    assert len(full_docs) == 1319 and len(small_docs) == 250
    assert full_docs[:250] == small_docs
    assert len({d["question"] for d in full_docs}) > 1300  # not one problem repeated
    assert (
        full_docs
        == gsm8k_docs("test", 1319)
        == list(_tasks()["gsm8k_shaped_full_local"].test_docs())
    )
    assert list(full.fewshot_docs()) == list(small.fewshot_docs()) == gsm8k_docs("train")
    for key in ("generation_kwargs", "num_fewshot", "doc_to_text", "fewshot_delimiter"):
        assert getattr(full.config, key) == getattr(small.config, key), key
    assert full.config.generation_kwargs["max_gen_toks"] == 256
    assert "Question:" in full.config.generation_kwargs["until"]


def test_full_task_builds_the_same_8_shot_requests():
    tasks = _tasks()
    got = {}
    for name in ("gsm8k_shaped_full_local", "gsm8k_shaped_local"):
        task = tasks[name]
        task.build_all_requests(limit=3)
        got[name] = [(i.doc_id, i.arguments) for i in task.instances]
    assert (
        got["gsm8k_shaped_full_local"] == got["gsm8k_shaped_local"]
        and len(got["gsm8k_shaped_local"]) == 3
    )
    context = got["gsm8k_shaped_local"][0][1][0]
    assert context.count("Question:") == 9 and context.endswith("Answer:")  # 8 shots + the problem
