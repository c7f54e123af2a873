"""The lm-eval entry point (``accuracy_test.lm_eval_cli``): lm-eval's models plus ours, the task
data checked before the model loads, the timing hook; ``lm_eval_check``'s own command line.

Here too: lm-eval's built-in task index from its on-disk cache (accuracy_test/lm_eval_task_index.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.tasks._index import TaskIndex  # noqa: E402

from accuracy_test import lm_eval_check, lm_eval_cli  # noqa: E402
from accuracy_test.lm_eval_task_index import (  # noqa: E402
    builtin_index_cached,
    builtin_tasks_dir,
    cache_file,
    cached_index,
    folder_signature,
    merged_build,
)

pytest.importorskip("lm_eval")


REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "accuracy_test" / "tasks"


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )


def test_entry_keeps_lm_eval_builtins_and_imports_ours_lazily():
    """Registering ours first used to hide every built-in ("Supported model names: nakta, ...")."""
    out = _python(
        "import sys\n"
        "from accuracy_test import lm_eval_cli\n"
        "lm_eval_cli.register_models()\n"
        "lm_eval_cli.register_models()  # idempotent\n"
        "assert 'accuracy_test.lm_eval_adapter' not in sys.modules\n"
        "from lm_eval.api.registry import get_model\n"
        "print(get_model('dummy').__name__, get_model('hf').__name__, get_model('nakta').__name__)\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["DummyLM", "HFLM", "NaktaLM"]


def test_the_adapter_imports_no_heavy_optional_library():
    """Importing the adapter (lm-eval does it when ``nakta`` is asked for) costs ~1 s, ~0.7 s of
    it torch, which the model needs at once; libraries only other paths use stay out (torch's
    compiler too: 0.8 s here, seconds on the H200 host, for the compile mode of decoding)."""
    out = _python(
        "import sys\n"
        "import accuracy_test.lm_eval_adapter\n"
        "heavy = ('transformers', 'scipy', 'matplotlib', 'pandas', 'datasets', 'llama_org',\n"
        "         'torch._dynamo')\n"
        "print(' '.join(m for m in heavy if m in sys.modules) or 'none')\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["none"]


def test_importing_the_adapter_first_keeps_the_builtins():
    out = _python(
        "import accuracy_test.lm_eval_adapter\n"
        "from accuracy_test import lm_eval_cli\n"
        "lm_eval_cli.register_models()\n"
        "from lm_eval.api.registry import get_model\n"
        "print(get_model('dummy').__name__, get_model('llama_org').__name__)\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["DummyLM", "LlamaOrgLM"]


def test_missing_task_data_is_one_error_before_the_model_loads(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "argv", ["nakta-lm-eval"])
    monkeypatch.setenv("NAKTA_HELLASWAG_JSONL", "/nope.jsonl")
    argv = ["--model", "nakta", "--model_args", f"checkpoint={tmp_path},tokenizer=/none"]
    argv += ["--include_path", str(TASKS), "--tasks", "hellaswag_local", "--device", "cpu"]
    with pytest.raises(SystemExit) as e:
        lm_eval_cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "error: hellaswag_local: /nope.jsonl (from NAKTA_HELLASWAG_JSONL / metadata) not found"
    )
    # --metadata names the file too (and wins over the environment)
    with pytest.raises(SystemExit):
        lm_eval_cli.main([*argv, "--metadata", "hellaswag_jsonl=/other.jsonl"])
    assert "error: hellaswag_local: /other.jsonl" in capsys.readouterr().err


def test_timing_env_writes_load_and_scoring_seconds(monkeypatch, tmp_path, shared_data):
    import lm_eval.tasks

    # lm-eval indexes its ~10k built-in task files first (16 s here): only ours for the test
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lm_eval.tasks.TaskManager)  # restored
    monkeypatch.setenv(lm_eval_cli.LOCAL_TASKS_ENV, "1")
    monkeypatch.setattr(sys, "argv", ["nakta-lm-eval"])
    monkeypatch.setenv("NAKTA_HELLASWAG_JSONL", str(shared_data / "hellaswag_val_full.jsonl"))
    timing = tmp_path / "t" / "timing.json"
    monkeypatch.setenv(lm_eval_cli.TIMING_ENV, str(timing))
    stories = shared_data / "stories260K"
    model_args = f"checkpoint={stories},tokenizer={stories / 'tokenizer.model'}"
    lm_eval_cli.main(
        ["--model", "nakta", "--model_args", model_args, "--include_path", str(TASKS)]
        + ["--tasks", "hellaswag_local", "--limit", "2", "--device", "cpu"]
    )
    got = json.loads(timing.read_text())
    assert got["model_class"] == "accuracy_test.lm_eval_adapter.NaktaLM"
    assert 0 <= got["load_s"] < got["total_s"] and 0 < got["scoring_s"] < got["total_s"]
    assert got["argv"][-4:] == ["--limit", "2", "--device", "cpu"]
    import lm_eval.api.registry
    import lm_eval.evaluator
    from lm_eval.config.evaluate_config import EvaluatorConfig

    assert lm_eval.api.registry.get_model.__module__ == "lm_eval.api.registry"  # restored
    assert lm_eval.evaluator.evaluate.__module__ == "lm_eval.evaluator"
    assert EvaluatorConfig.from_cli.__module__ == "lm_eval.config.evaluate_config"
    assert lm_eval.tasks.TaskManager.__name__ == "LocalTaskManager"
    local = lm_eval.tasks.TaskManager(include_path=str(TASKS)).all_tasks
    assert "hellaswag_local" in local and "mmlu_shaped_local" in local  # the local ones only
    assert "hellaswag" not in local and "mmlu" not in local
    assert got["tokens"]["request_tokens"] > 0  # nakta reports what it computed
    ev = got["events"]  # the run's phases, in order, all inside the entry's lifetime
    order = ["model_start", "model_end", "evaluate_start", "first_request", "evaluate_end", "exit"]
    assert [ev[k] for k in order] == sorted(ev[k] for k in order) and ev["model_start"] > 0
    assert "preload_start" not in ev  # no GPU here: no early read
    assert 0 < got["requests_s"] < got["scoring_s"]  # the model's share of evaluate()
    ll = got["loglikelihood"]  # of which: lm-eval's strings -> tokens, tokens -> results
    assert ll.keys() == {"tokenize_s", "score_s", "items"} and min(ll.values()) > 0
    assert ll["items"] == 2 * 4  # 2 tasks' requests, all on the one replica
    assert ll["tokenize_s"] + ll["score_s"] <= got["requests_s"]
    assert got["nakta_load"].keys() == {"read_s", "warm_up_s", "warm_up_wait_s", "prefetched"}
    assert got["nakta_load"]["prefetched"] is False  # (no GPU here: nothing was prefetched)
    load = [ev[k] for k in ("model_start", "load_build_start", "load_read_end", "load_ready")]
    assert load == sorted(load) and ev["load_ready"] <= ev["model_end"]  # loaded when built
    # Python started before this entry was imported; how long before depends on what ran first
    # (a whole pytest session here), so check it names this process's start, not a wall bound
    assert ev["process_start"] < 0
    assert abs(got["entry_unix"] + ev["process_start"] - lm_eval_cli.process_start_unix()) < 1.0


def test_lm_eval_check_help_describes_its_own_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        lm_eval_check.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "Does lm-eval, through the ``nakta`` / ``llama_org`` adapters" in out
    assert "exit code 0 when every number matches" in out
    assert "--random" not in out and "--preset" not in out and "HellaSwag parity" not in out


def test_lm_eval_check_runs_parity_without_a_truth_pass():
    a = lm_eval_check.parse_args(
        ["--checkpoint", "C", "--tokenizer", "T", "--data", "D", "--dtype", "bf16"]
        + ["--limit", "3", "--no-progress"]
    )
    p = lm_eval_check.parity_args(a)
    assert (p.checkpoint, p.tokenizer, p.data, p.dtype, p.limit) == ("C", "T", "D", "bf16", 3)
    assert p.truth == "none" and p.no_progress and not p.random


def test_bad_model_args_are_one_error_line(monkeypatch, capsys, shared_data):
    monkeypatch.setattr(sys, "argv", ["nakta-lm-eval"])
    monkeypatch.setenv(lm_eval_cli.LOCAL_TASKS_ENV, "1")
    monkeypatch.setenv("NAKTA_HELLASWAG_JSONL", str(shared_data / "hellaswag_val_full.jsonl"))
    stories = shared_data / "stories260K"
    model_args = f"checkpoint={stories},tokenizer={stories / 'tokenizer.model'},dtyp=bf16"
    with pytest.raises(SystemExit) as e:
        lm_eval_cli.main(
            ["--model", "nakta", "--model_args", model_args, "--include_path", str(TASKS)]
            + ["--tasks", "hellaswag_local", "--limit", "2", "--device", "cpu"]
        )
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(
        "error: nakta: unknown model_args dtyp (did you mean dtype?); known: checkpoint"
    )
    # no traceback through the adapter (lm-eval's log handler may hold an earlier test's
    # closed stderr and print "--- Logging error ---" here: a test artifact, so not "Traceback")
    assert not any("lm_eval_adapter.py" in line for line in err), err


def test_local_tasks_are_found_and_decide_the_index(tmp_path, monkeypatch):
    """Every requested task under --include_path: lm-eval's built-in index is skipped."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "t.yaml").write_text("# c\ntask: my_task\ndataset_path: json\n")
    (tmp_path / "b.yaml").write_text("task: 'other'\n")
    (tmp_path / "c.yaml").write_text("group: g\n")
    assert lm_eval_cli.local_task_names(str(tmp_path)) == {"my_task", "other", "g"}  # groups too
    monkeypatch.delenv(lm_eval_cli.LOCAL_TASKS_ENV, raising=False)
    args = argparse.Namespace(tasks=["my_task", "other"], include_path=str(tmp_path))
    assert lm_eval_cli._only_local_tasks(args)
    args.tasks = ["my_task", "hellaswag"]  # a built-in task: the full index is needed
    assert not lm_eval_cli._only_local_tasks(args)
    monkeypatch.setenv(lm_eval_cli.LOCAL_TASKS_ENV, "0")
    assert not lm_eval_cli._only_local_tasks(
        argparse.Namespace(tasks=["my_task"], include_path=str(tmp_path))
    )


def _requests(task_names: list[str], metadata: dict) -> list[tuple]:
    """Every request lm-eval builds for the tasks (3 docs each), as plain tuples."""
    import lm_eval.tasks

    manager = lm_eval.tasks.TaskManager(
        include_path=str(TASKS), include_defaults=False, metadata=metadata
    )
    out = []
    for name, task in sorted(manager.load(task_names)["tasks"].items()):
        task.build_all_requests(limit=3)
        out += [(name, i.doc_id, i.idx, i.arguments) for i in task.instances]
    return out


def test_prompt_templates_compile_once_and_render_the_same_requests(monkeypatch, shared_data):
    """lm-eval compiles a template per rendered document (#1286); cached, the requests of
    every local task (0-shot, few-shot, generation) are the same, and a template string is
    compiled once however many documents and shots render it."""
    import lm_eval.utils

    meta = {"hellaswag_jsonl": str(shared_data / "hellaswag_val_subset1000.jsonl")}
    names = ["hellaswag_local", "mmlu_shaped_local", "gsm8k_shaped_local", "bbh_shaped_local"]
    fresh = _requests(names, meta)
    compiles: list[str] = []
    from_string = lm_eval.utils.env.from_string

    def counting(source, *a, **kw):
        compiles.append(source)
        return from_string(source, *a, **kw)

    monkeypatch.setattr(lm_eval.utils.env, "from_string", counting)
    original = lm_eval.utils.apply_template
    with lm_eval_cli.cached_prompt_templates():
        cached = _requests(names, meta)
        assert cached == fresh and len(fresh) > 12
        assert compiles and len(compiles) == len(set(compiles))  # each template once
        again = _requests(names, meta)
        assert again == fresh and len(compiles) == len(set(compiles))
    assert lm_eval.utils.apply_template is original  # put back after the block
    _requests(names[:1], meta)
    assert len(compiles) > len(set(compiles))  # lm-eval's own: a compile per document


def test_env_report_is_collected_while_evaluate_runs_and_is_the_same(monkeypatch):
    """lm-eval asks for torch's environment report after the evaluation; the entry has it
    collected on a thread from evaluate's start: same text, off the critical path."""
    import threading

    import lm_eval.evaluator
    import torch.utils.collect_env as collect_env

    original_evaluate = lm_eval.evaluator.evaluate
    seen = {}

    def slow_report() -> str:
        seen["thread"] = threading.current_thread().name
        return "REPORT"

    def fake_evaluate(*a, **kw):
        seen["evaluate"] = a
        return "RESULTS"

    monkeypatch.setattr(collect_env, "get_pretty_env_info", slow_report)
    monkeypatch.setattr(lm_eval.evaluator, "evaluate", fake_evaluate)
    with lm_eval_cli.env_report_prefetched():
        assert lm_eval.evaluator.evaluate(1, 2) == "RESULTS"
        # as lm-eval's simple_evaluate does: add_env_info after evaluate has returned
        assert collect_env.get_pretty_env_info() == "REPORT"
        assert seen == {"thread": seen["thread"], "evaluate": (1, 2)}
        assert seen["thread"].startswith("nakta-env")  # collected on the prefetch thread
        assert collect_env.get_pretty_env_info is slow_report  # put back after one use
        lm_eval.evaluator.evaluate(3)  # never asked for: put back when the block ends
        assert collect_env.get_pretty_env_info is not slow_report
    assert collect_env.get_pretty_env_info is slow_report
    assert lm_eval.evaluator.evaluate is fake_evaluate
    monkeypatch.setattr(lm_eval.evaluator, "evaluate", original_evaluate)


# "0" (Python's own teardown) is slow-tier only: the same cli() run, results, table, thread and
# atexit are checked in the default tier by "1", which takes the harder early exit
@pytest.mark.parametrize("fast", ["1", pytest.param("0", marks=pytest.mark.slow)])
def test_the_command_exits_fast_after_writing_everything(tmp_path, shared_data, fast):
    """``cli()`` (the console script and ``python -m``) ends the process without Python's
    teardown, but only after the results file is written, the table printed, a still-running
    non-daemon thread finished and the ``atexit`` handlers ran; exit code 0 either way."""
    stories = shared_data / "stories260K"
    argv = ["--model", "nakta", "--include_path", str(TASKS), "--tasks", "hellaswag_local"]
    argv += ["--model_args", f"checkpoint={stories},tokenizer={stories / 'tokenizer.model'}"]
    argv += ["--limit", "2", "--device", "cpu", "--output_path", str(tmp_path / "res")]
    code = (
        "import atexit, sys, threading, time\n"
        "from pathlib import Path\n"
        f"out = Path({str(tmp_path)!r})\n"
        "atexit.register(lambda: (out / 'atexit').write_text('ran'))\n"
        "def late(): time.sleep(1.0); (out / 'thread').write_text('done')\n"
        "from accuracy_test import lm_eval_cli\n"
        "real_main = lm_eval_cli.main\n"
        "def main():\n"
        "    real_main()\n"
        "    threading.Thread(target=late).start()  # still running when main returns\n"
        "lm_eval_cli.main = main\n"
        f"sys.argv = ['nakta-lm-eval', *{argv!r}]\n"
        "lm_eval_cli.cli()\n"
        "print('not reached with a fast exit')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), lm_eval_cli.FAST_EXIT_ENV: fast}
    env[lm_eval_cli.LOCAL_TASKS_ENV] = "1"
    env["NAKTA_HELLASWAG_JSONL"] = str(shared_data / "hellaswag_val_full.jsonl")
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "hellaswag_local" in run.stdout and "acc_norm" in run.stdout  # the table, flushed
    assert list((tmp_path / "res").rglob("results_*.json"))  # lm-eval's results file
    assert (tmp_path / "thread").read_text() == "done"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert ("not reached with a fast exit" in run.stdout) == (fast == "0")


def test_timing_hook_times_generate_until_and_counts_its_answer_tokens():
    """``methods`` splits ``requests_s`` by method; ``generate_until``'s answers are counted in
    the model's own tokens (no BOS), with nakta's engine counters when the model has them."""

    class FakeLM:
        generation_stats = {"generated_tokens": 9, "decode_steps": 4}

        def generate_until(self, requests, disable_tqdm=False):
            time.sleep(0.01)
            return [r.upper() for r in requests]

        def loglikelihood(self, requests, disable_tqdm=False):
            return [(0.0, True)] * len(requests)

        def tok_encode(self, text, add_special_tokens=None):
            assert add_special_tokens is False
            return text.split()

    lm = FakeLM()
    timings = {"requests_s": 0.0, "events": {}}
    lm_eval_cli._time_requests(lm, timings)
    assert lm.generate_until(["a b c", ""]) == ["A B C", ""]
    assert lm.generate_until(["d e"]) == ["D E"]
    lm.loglikelihood(["x"])
    methods = timings["methods"]
    assert methods.keys() == {"generate_until", "loglikelihood"}
    assert methods["generate_until"] >= 0.02
    assert abs(sum(methods.values()) - timings["requests_s"]) < 1e-9
    got = lm_eval_cli._generated(lm, timings["_answers"])
    assert got == {
        "answers": 3,
        "answer_tokens": 5,
        "engine": {"generated_tokens": 9, "decode_steps": 4},
    }
    no_tokenizer = lm_eval_cli._generated(object(), ["x"])
    assert (
        no_tokenizer["answer_tokens"] is None
        and "AttributeError" in no_tokenizer["answer_tokens_error"]
    )


def test_cuda_peaks_fold_into_the_run_and_the_method(monkeypatch):
    """The timing hook's ``cuda_memory``: each window's peaks (reset after reading) add up to
    the run's maximum and the method's; nothing when CUDA is not in use."""

    class FakeCuda:
        def __init__(self):
            self.peaks, self.resets = [(5, 8), (9, 12), (3, 4)], 0

        def is_available(self):
            return True

        def is_initialized(self):
            return True

        def max_memory_allocated(self):
            return self.peaks[self.resets][0]

        def max_memory_reserved(self):
            return self.peaks[self.resets][1]

        def memory_allocated(self):
            return 7

        def reset_peak_memory_stats(self):
            self.resets += 1

    cuda = FakeCuda()
    monkeypatch.setitem(sys.modules, "torch", argparse.Namespace(cuda=cuda))
    timings: dict = {}
    lm_eval_cli._note_cuda_peaks(timings, reset=True)  # before the method: load's peak
    lm_eval_cli._note_cuda_peaks(timings, "generate_until", reset=True)
    lm_eval_cli._note_cuda_peaks(timings)  # at exit
    assert cuda.resets == 2
    assert timings["cuda_memory"] == {
        "max_allocated": 9,
        "max_reserved": 12,
        "methods": {
            "generate_until": {"max_allocated": 9, "max_reserved": 12, "allocated_after": 7}
        },
    }
    cuda.is_initialized = lambda: False
    other: dict = {}
    lm_eval_cli._note_cuda_peaks(other, "loglikelihood")
    assert other == {}


# ------------------------------------------------------------------------------------------------
# lm-eval's built-in task index read from the on-disk cache (accuracy_test/lm_eval_task_index):
# the same entries, configs, tags and warnings as lm-eval's own build, rebuilt when a file
# changes, and the entry choosing local / cached / lm-eval's own index per run.
# ------------------------------------------------------------------------------------------------


pytest.importorskip("lm_eval")


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


def test_our_tasks_load_the_same_configs(tmp_path, shared_data, monkeypatch):
    monkeypatch.setenv("NAKTA_HELLASWAG_JSONL", str(shared_data / "hellaswag_val_subset1000.jsonl"))
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


@pytest.fixture
def index_log(caplog):
    """caplog on lm-eval's index logger itself: an lm-eval run earlier in the process (its
    ``setup_logging``) may have stopped ``lm_eval`` records from reaching the root logger."""
    log = logging.getLogger("lm_eval.tasks._index")
    log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="lm_eval.tasks._index"):
            yield caplog
    finally:
        log.removeHandler(caplog.handler)


def test_build_warnings_are_logged_again_from_the_cache(tmp_path, index_log):
    root, cache = tmp_path / "tasks", tmp_path / "cache"
    _write(root, "a.yaml", "task: same\ndataset_path: json\n")
    _write(root, "b.yaml", "task: same\ndataset_path: csv\n")
    caplog = index_log
    built = cached_index(root, BUILD, cache)
    logged = [r.getMessage() for r in caplog.records]
    caplog.clear()
    again = cached_index(root, BUILD, cache)
    replayed = [r.getMessage() for r in caplog.records]
    assert again == built and built["same"].cfg["dataset_path"] == "json"  # the first wins
    assert logged and replayed == logged and "Duplicate task name 'same'" in logged[0]


def test_include_path_overrides_the_builtins_as_lm_eval_merges(tmp_path, index_log):
    builtin, mine, cache = tmp_path / "builtin", tmp_path / "mine", tmp_path / "cache"
    _write(builtin, "x.yaml", "task: x\ndataset_path: json\n")
    _write(builtin, "y.yaml", "task: y\ndataset_path: json\n")
    _write(mine, "x.yaml", "task: x\ndataset_path: csv\n")
    caplog = index_log
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
