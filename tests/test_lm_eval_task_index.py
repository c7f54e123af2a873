"""lm-eval's built-in task index read from the on-disk cache (accuracy_test/lm_eval_task_index):
the same entries, configs, tags and warnings as lm-eval's own build, rebuilt when a file
changes, and the entry choosing local / cached / lm-eval's own index per run."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.tasks._index import TaskIndex  # noqa: E402

from accuracy_test import lm_eval_cli  # noqa: E402
from accuracy_test.lm_eval_task_index import (  # noqa: E402
    builtin_index_cached,
    builtin_tasks_dir,
    cache_file,
    cached_index,
    folder_signature,
    merged_build,
)

REPO = Path(__file__).resolve().parents[1]
OUR_TASKS = REPO / "accuracy_test" / "tasks"
# a real lm-eval folder with groups, tags and includes of a non-yaml template (62 yamls)
MMLU = builtin_tasks_dir() / "mmlu" / "default"
BUILD = TaskIndex.__dict__["build"].__func__


def _manager(*paths: Path) -> TaskManager:
    return TaskManager(include_defaults=False, include_path=[str(p) for p in paths])


def test_cached_index_equals_lm_evals_build_and_is_read_back(tmp_path):
    ref = _manager(MMLU, OUR_TASKS)
    for _ in range(2):  # the first run builds and writes the file, the second reads it
        with builtin_index_cached(directory=tmp_path, builtin=MMLU):
            got = _manager(MMLU, OUR_TASKS)
        assert list(got.task_index) == list(ref.task_index)  # same order
        assert got.task_index == ref.task_index  # name, kind, path, parsed config, tags
        assert (got.all_tasks, got.all_groups, got.all_tags, got.all_subtasks) == (
            ref.all_tasks, ref.all_groups, ref.all_tags, ref.all_subtasks
        )  # fmt: skip
        assert cache_file(MMLU, tmp_path).is_file()
    # a name only lm-eval's folder has still resolves, next to ours
    names = ["mmlu_abstract_algebra", "hellaswag_local"]
    assert sorted(got.match_tasks(names)) == sorted(names)
    assert got.task_index["mmlu_abstract_algebra"].cfg["dataset_name"] == "abstract_algebra"


def test_the_cache_is_read_without_building(tmp_path):
    calls: list[list[Path]] = []

    def counting_build(paths, **kw):
        calls.append(list(paths))
        return BUILD(paths, **kw)

    first = cached_index(MMLU, counting_build, tmp_path)
    second = cached_index(MMLU, counting_build, tmp_path)
    assert calls == [[MMLU]] and second == first and second is not first


def test_our_tasks_load_the_same_configs(tmp_path):
    ref = _manager(MMLU, OUR_TASKS).load(["hellaswag_local"])["tasks"]["hellaswag_local"]
    with builtin_index_cached(directory=tmp_path, builtin=MMLU):
        _manager(MMLU, OUR_TASKS)  # writes the cache
        got = _manager(MMLU, OUR_TASKS).load(["hellaswag_local"])["tasks"]["hellaswag_local"]
    assert got.config.to_dict() == ref.config.to_dict()
    assert got.OUTPUT_TYPE == ref.OUTPUT_TYPE == "multiple_choice"
    docs = list(got.validation_docs())
    assert docs == list(ref.validation_docs()) and len(docs) > 0


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_changed_file_rebuilds_the_index(tmp_path):
    root, cache = tmp_path / "tasks", tmp_path / "cache"
    _write(root, "_template_yaml", "dataset_path: json\noutput_type: multiple_choice\n")
    leaf = _write(root, "sub/a.yaml", "include: ../_template_yaml\ntask: a\ntag: t1\n")
    first = cached_index(root, BUILD, cache)
    assert first == BUILD([root]) and first["t1"].tags == {"a"}
    sig = folder_signature(root)
    leaf.write_text("include: ../_template_yaml\ntask: a\ntag: t2\n")
    assert folder_signature(root) != sig
    second = cached_index(root, BUILD, cache)
    assert second == BUILD([root]) and "t2" in second and "t1" not in second
    # an included template changed (not a .yaml file: still in the signature)
    template = root / "_template_yaml"
    template.write_text("dataset_path: csv\noutput_type: multiple_choice\n")
    os.utime(template, ns=(1, 1))
    assert cached_index(root, BUILD, cache)["a"].cfg["dataset_path"] == "csv"


def test_build_warnings_are_logged_again_from_the_cache(tmp_path, caplog):
    root, cache = tmp_path / "tasks", tmp_path / "cache"
    _write(root, "a.yaml", "task: same\ndataset_path: json\n")
    _write(root, "b.yaml", "task: same\ndataset_path: csv\n")
    with caplog.at_level(logging.WARNING, logger="lm_eval.tasks._index"):
        built = cached_index(root, BUILD, cache)
        logged = [r.getMessage() for r in caplog.records]
        caplog.clear()
        again = cached_index(root, BUILD, cache)
        replayed = [r.getMessage() for r in caplog.records]
    assert again == built and built["same"].cfg["dataset_path"] == "json"  # the first wins
    assert logged and replayed == logged and "Duplicate task name 'same'" in logged[0]


def test_include_path_overrides_the_builtins_as_lm_eval_merges(tmp_path, caplog):
    builtin, mine, cache = tmp_path / "builtin", tmp_path / "mine", tmp_path / "cache"
    _write(builtin, "x.yaml", "task: x\ndataset_path: json\n")
    _write(builtin, "y.yaml", "task: y\ndataset_path: json\n")
    _write(mine, "x.yaml", "task: x\ndataset_path: csv\n")
    with caplog.at_level(logging.WARNING, logger="lm_eval.tasks._index"):
        ref = BUILD([builtin, mine])
        ref_log = [r.getMessage() for r in caplog.records]
        caplog.clear()
        got = merged_build(BUILD, [builtin, mine], builtin, cache)
        got_log = [r.getMessage() for r in caplog.records]
    assert list(got) == list(ref) and got == ref and got["x"].cfg["dataset_path"] == "csv"
    assert got_log == ref_log and "overrides existing task" in got_log[0]


def test_an_unwritable_cache_still_gives_the_index(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert cached_index(MMLU, BUILD, blocker / "cache") == BUILD([MMLU])


def test_a_corrupt_cache_file_is_rebuilt(tmp_path):
    path = cache_file(MMLU, tmp_path)
    path.write_bytes(b"\x00garbage")
    assert cached_index(MMLU, BUILD, tmp_path) == BUILD([MMLU])
    assert path.stat().st_size > 1000  # written again


def test_the_entry_chooses_the_index(tmp_path, monkeypatch):
    monkeypatch.delenv(lm_eval_cli.LOCAL_TASKS_ENV, raising=False)
    ours = argparse.Namespace(tasks=["hellaswag_local"], include_path=str(OUR_TASKS))
    theirs = argparse.Namespace(tasks=["hellaswag_local", "hellaswag"], include_path=str(OUR_TASKS))
    assert lm_eval_cli._index_choice(ours) == "local"
    assert lm_eval_cli._index_choice(theirs) == "cached"  # an lm-eval-only task: all of it
    monkeypatch.setenv(lm_eval_cli.LOCAL_TASKS_ENV, "0")  # lm-eval's own build
    assert lm_eval_cli._index_choice(ours) == lm_eval_cli._index_choice(theirs) == "lm_eval"
    monkeypatch.setenv(lm_eval_cli.LOCAL_TASKS_ENV, "1")
    assert lm_eval_cli._index_choice(theirs) == "local"


@pytest.mark.slow
def test_the_whole_builtin_index_from_the_cache(tmp_path):
    """lm-eval's ~14k built-in yamls (11-16 s a build on a slow CPU): cached == built."""
    ref = TaskManager(include_path=str(OUR_TASKS))
    with builtin_index_cached(directory=tmp_path):
        TaskManager(include_path=str(OUR_TASKS))
        got = TaskManager(include_path=str(OUR_TASKS))
    assert list(got.task_index) == list(ref.task_index) and got.task_index == ref.task_index
    assert "hellaswag" in got.all_tasks and got.match_tasks(["hellaswag"]) == ["hellaswag"]
