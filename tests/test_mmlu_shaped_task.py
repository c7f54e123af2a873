"""The ``mmlu_shaped_local`` group, one yaml with its 57 subjects inline, builds the very
requests the 57 per-subject yaml files (one shared template) built before: same prompts,
shots, choices and order. lm-eval 0.4.13 names an inline subtask ``<group>::<task>``, so the
subject names are compared with that prefix taken off."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

TASKS = Path(__file__).resolve().parents[1] / "accuracy_test" / "tasks"

# sha256 of [(task, doc_id, idx, arguments)] for the first test question of every subject,
# computed from the 57 per-subject files (git: accuracy_test/tasks/mmlu_shaped_local/ before
# the inline group) with lm-eval 0.4.13.
OLD_REQUESTS_SHA256 = "d535f218a37b6889652fa3bf10de7c4d58bfa1a97e3f834c59616a942eb633cb"


def _group():
    import lm_eval.tasks

    manager = lm_eval.tasks.TaskManager(include_path=str(TASKS), include_defaults=False)
    return manager, manager.load(["mmlu_shaped_local"])


def test_the_group_holds_57_subjects_with_the_old_names_aliases_and_prompts():
    manager, loaded = _group()
    assert "mmlu_shaped_local" in manager.all_groups
    tasks = loaded["tasks"]
    assert len(tasks) == 57
    subjects = [name.removeprefix("mmlu_shaped_local::mmlu_shaped_") for name in tasks]
    assert subjects[0] == "abstract_algebra" and subjects[-1] == "world_religions"
    for subject, task in zip(subjects, tasks.values(), strict=True):
        c = task.config
        assert c.task_alias == subject and c.dataset_kwargs == {"subject": subject}
        about = subject.replace("_", " ")
        assert c.description == (
            f"The following are multiple choice questions (with answers) about {about}.\n\n"
        )
        assert (c.num_fewshot, c.fewshot_split, c.test_split) == (5, "dev", "test")
        assert [m["metric"] for m in c.metric_list] == ["acc"]
        assert c.metadata["version"] == 1.0
    group = loaded["groups"]["mmlu_shaped_local"]
    agg = group.aggregate_metric_list
    assert [(a.metric, a.weight_by_size) for a in agg] == [("acc", True)]
    assert float(group.version) == 1.0


def test_the_requests_are_those_of_the_old_per_subject_files():
    _, loaded = _group()
    out = []
    for name, task in loaded["tasks"].items():
        task.build_all_requests(limit=1)
        old_name = name.removeprefix("mmlu_shaped_local::")
        out += [(old_name, i.doc_id, i.idx, list(i.arguments)) for i in task.instances]
    assert len(out) == 57 * 4  # one question, four choices, per subject
    assert hashlib.sha256(json.dumps(out).encode()).hexdigest() == OLD_REQUESTS_SHA256
