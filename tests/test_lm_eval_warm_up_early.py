"""The scorer's warm-up started as soon as lm-eval has constructed the model, when lm-eval's task
index already says a requested task scores (``lm_eval_cli.scorer_warmed_from_construction``):
the output types read from the index (groups and tags expanded), nothing started for
generation-only or undecidable task lists, and a CPU run through the entry whose warm-up starts
before lm-eval loads the documents, with the same results as lm-eval's own order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from lm_eval.tasks import TaskManager  # noqa: E402

from accuracy_test import lm_eval_cli  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
OUR_TASKS = REPO / "accuracy_test" / "tasks"
DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    extra = tmp_path_factory.mktemp("extra_tasks")
    (extra / "g.yaml").write_text("group: mixed\ntask:\n  - hellaswag_local\n  - gen_only\n")
    (extra / "gen.yaml").write_text("task: gen_only\noutput_type: generate_until\ntag: gens\n")
    (extra / "bare.yaml").write_text("task: no_type\ndataset_path: json\n")
    return TaskManager(include_defaults=False, include_path=[str(OUR_TASKS), str(extra)])


def test_output_types_come_from_the_index(manager):
    types = lm_eval_cli.requested_output_types
    assert types(manager, ["hellaswag_local"]) == {"multiple_choice"}
    assert types(manager, ["gsm8k_shaped_local"]) == {"generate_until"}
    assert types(manager, ["mixed"]) == {"multiple_choice", "generate_until"}  # a group
    assert types(manager, ["gens"]) == {"generate_until"}  # a tag
    # what the index cannot tell: left to evaluate's start
    assert types(manager, ["no_type"]) is None  # lm-eval's default output type
    assert types(manager, [{"task": "inline"}]) is None
    assert types(manager, ["hellaswag_local", "not_a_task"]) is None
    assert types(manager, []) is None and types(object(), ["hellaswag_local"]) is None


def test_the_factory_starts_the_warm_up_after_construction(monkeypatch, manager):
    import lm_eval.api.registry as registry
    from lm_eval.config.evaluate_config import EvaluatorConfig

    calls: list[str] = []

    class Model:
        @classmethod
        def create_from_arg_string(cls, *a, **kw):
            calls.append("built")
            return cls()

        def start_warm_up(self):
            calls.append("warm")

    class Plain:  # no start_warm_up (hf): built as always
        @classmethod
        def create_from_arg_obj(cls, *a, **kw):
            return cls()

    models = {"m": Model, "p": Plain}

    def get_model(name):
        return models[name]

    monkeypatch.setattr(registry, "get_model", get_model)
    monkeypatch.setattr(EvaluatorConfig, "process_tasks", lambda self, md=None: manager)
    with lm_eval_cli.scorer_warmed_from_construction():
        cfg = EvaluatorConfig.__new__(EvaluatorConfig)
        cfg.tasks = ["gsm8k_shaped_local"]  # generation only: nothing to warm
        cfg.process_tasks()
        assert registry.get_model("m") is Model
        cfg.tasks = ["hellaswag_local"]
        cfg.process_tasks()
        assert isinstance(registry.get_model("m").create_from_arg_string(""), Model)
        assert calls == ["built", "warm"]
        assert isinstance(registry.get_model("p").create_from_arg_obj({}), Plain)
    assert registry.get_model is get_model  # put back


@pytest.mark.skipif(not (DATA / "stories260K").is_dir(), reason="needs ../shared/data")
def test_a_cpu_run_warms_up_before_the_documents_load(tmp_path, monkeypatch):
    argv = [
        "--model", "nakta",
        "--model_args",
        f"checkpoint={DATA / 'stories260K'},tokenizer={DATA / 'stories260K' / 'tokenizer.model'},"
        "dtype=fp32,device=cpu",
        "--include_path", str(OUR_TASKS), "--tasks", "hellaswag_local", "--limit", "6",
        "--metadata", json.dumps({"hellaswag_jsonl": str(DATA / "hellaswag_val_subset1000.jsonl")}),
    ]  # fmt: skip
    accs = []
    for early in ("1", "0"):  # the entry's order, then lm-eval's own (no head start at all)
        monkeypatch.setenv("NAKTA_LM_EVAL_PRELOAD", early)
        timing, out = tmp_path / f"t{early}.json", tmp_path / f"out{early}"
        monkeypatch.setenv("NAKTA_LM_EVAL_TIMING", str(timing))
        lm_eval_cli.main([*argv, "--output_path", str(out)])
        ev = json.loads(timing.read_text())["events"]
        if early == "1":
            assert ev["model_end"] <= ev["load_warm_up_start"] <= ev["tasks_load_start"]
        else:
            assert ev["load_warm_up_start"] >= ev["first_request"]  # at the first batch
        results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
        accs.append(results["hellaswag_local"])
    assert accs[0] == accs[1]
