"""The lm-eval entry's early weight read (``accuracy_test.lm_eval_preload``): which runs
prefetch, what starts when lm-eval's configuration is built, what is dropped at exit.

Here too: the early weight read from the raw command line, and the scorer's warm-up while lm-eval builds the requests.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from checkpoint_factory import TINY_PARAMS, train_tiny_tokenizer, write_meta_checkpoint  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.config.evaluate_config import EvaluatorConfig  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import nakta_model.prefetch  # noqa: E402
from accuracy_test import lm_eval_adapter as adapter  # noqa: E402
from accuracy_test import lm_eval_cli, lm_eval_preload, lm_eval_task_index  # noqa: E402
from accuracy_test.lm_eval_preload import (  # noqa: E402
    command_line_model,
    constructor_kwargs,
    model_preloaded,
    prefetch_plan,
    prefetchable_checkpoint,
    start_early,
)
from nakta_model import scoring  # noqa: E402


def _nakta_dir(root, tp_size: int = 1, manifest: bool = True):
    root.mkdir(parents=True, exist_ok=True)
    (root / "params.json").write_text(json.dumps({"dim": 8, "tp_size": tp_size}))
    if manifest:
        (root / "manifest.json").write_text("{}")
    (root / "model.tp00-of-01.safetensors").write_bytes(b"")
    return root


def _cli(model: str, model_args: str, device: str = "cuda:0") -> argparse.Namespace:
    """What lm-eval's parser gives ``run`` (the fields the configuration reads)."""
    return argparse.Namespace(
        model=model, model_args=model_args, tasks="x", batch_size=1, device=device, command="run"
    )


def test_constructor_kwargs_are_what_lm_eval_passes():
    assert constructor_kwargs("a=1,b=x", {"batch_size": 4, "device": None}) == {
        "a": 1,
        "b": "x",
        "batch_size": 4,
    }
    assert constructor_kwargs({"a": 1}, None) == {"a": 1}
    # a key in both: model_args' value wins, as the model class merges them
    assert constructor_kwargs({"device": "cpu"}, {"device": "cuda"}) == {"device": "cpu"}
    assert constructor_kwargs(42, {}) is None


def test_only_a_single_gpu_nakta_checkpoint_is_prefetchable(tmp_path):
    one = str(_nakta_dir(tmp_path / "one"))
    assert prefetchable_checkpoint({"checkpoint": one}) == tmp_path / "one"  # cuda by default
    assert prefetchable_checkpoint({"checkpoint": one, "device": "cuda:1"}) is not None
    assert prefetchable_checkpoint({"checkpoint": one, "device": "cpu"}) is None
    assert prefetchable_checkpoint({"checkpoint": one, "tp": "2"}) is None
    assert prefetchable_checkpoint({"checkpoint": one, "dp": 2}) is None
    two = str(_nakta_dir(tmp_path / "two", tp_size=2))
    assert prefetchable_checkpoint({"checkpoint": two}) is None
    meta = str(_nakta_dir(tmp_path / "meta", manifest=False))  # Meta / HF: no manifest
    assert prefetchable_checkpoint({"checkpoint": meta}) is None
    assert prefetchable_checkpoint({"checkpoint": str(tmp_path / "none")}) is None
    assert prefetchable_checkpoint({}) is None


@pytest.fixture
def started(monkeypatch):
    """Prefetches started (path, device)."""
    calls: list = []
    monkeypatch.setattr(nakta_model.prefetch, "prefetch", lambda p, d: calls.append((p, d)))
    return calls


def test_the_read_starts_when_lm_eval_builds_its_configuration(tmp_path, started, monkeypatch):
    """Registered on lm-eval's main thread without importing torch (checked in a subprocess by
    ``test_registering_a_prefetch_imports_no_torch``)."""
    ckpt = _nakta_dir(tmp_path / "ckpt")
    dropped = []
    monkeypatch.setattr(nakta_model.prefetch, "discard", lambda: dropped.append(1))
    seen = []
    with model_preloaded(on_start=lambda: seen.append(1)) as state:
        assert started == []
        EvaluatorConfig.from_cli(_cli("nakta", f"checkpoint={ckpt},tokenizer=t"))
        assert started == [(ckpt / "model.tp00-of-01.safetensors", "cuda:0")]
        assert state["checkpoint"] == ckpt and seen == [1]
        EvaluatorConfig.from_cli(_cli("nakta", f"checkpoint={ckpt}"))  # once per run
        assert len(started) == 1
    assert dropped == [1]  # whatever nobody took is dropped at exit
    assert EvaluatorConfig.from_cli.__func__.__module__ == "lm_eval.config.evaluate_config"


def test_no_read_for_other_models_grids_or_cpus(tmp_path, started, monkeypatch):
    ckpt = _nakta_dir(tmp_path / "ckpt")
    for cli in (
        _cli("hf", f"pretrained={ckpt}"),
        _cli("llama_org", f"checkpoint={ckpt}"),
        _cli("nakta", f"checkpoint={ckpt}", device="cpu"),
    ):
        with model_preloaded() as state:
            EvaluatorConfig.from_cli(cli)
        assert "checkpoint" not in state
    monkeypatch.setenv("WORLD_SIZE", "2")  # a world of 2 but no dp=2 / tp=2 asked for
    with model_preloaded() as state:
        EvaluatorConfig.from_cli(_cli("nakta", f"checkpoint={ckpt}"))
    assert "checkpoint" not in state and started == []


def test_every_torchrun_rank_prefetches_its_own_shard_onto_its_own_gpu(
    tmp_path, started, monkeypatch
):
    """Under torchrun each rank's read overlaps lm-eval's start-up as a lone process's does:
    dp ranks read the one shard onto their own GPU, tp ranks their own shard."""
    one = _nakta_dir(tmp_path / "one")
    two = _nakta_dir(tmp_path / "two", tp_size=2)
    env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
    shard = "model.tp00-of-01.safetensors"
    assert prefetch_plan({"checkpoint": str(one), "dp": "2"}, env) == (one / shard, "cuda:1")
    assert prefetch_plan({"checkpoint": str(two), "tp": 2}, env) == (
        two / "model.tp01-of-02.safetensors",
        "cuda:1",
    )
    assert prefetch_plan({"checkpoint": str(one), "tp": 2}, env) is None  # sharded for tp=1
    assert prefetch_plan({"checkpoint": str(one), "dp": "3"}, env) is None  # not the world
    assert prefetch_plan({"checkpoint": str(one), "dp": "x"}, env) is None
    assert prefetch_plan({"checkpoint": str(one), "dp": 2, "device": "cpu"}, env) is None
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with model_preloaded() as state:
        EvaluatorConfig.from_cli(_cli("nakta", f"checkpoint={one},dp=2"))
    assert started == [(one / shard, "cuda:1")] and state["checkpoint"] == one


def test_a_missing_shard_starts_nothing(tmp_path):
    ckpt = _nakta_dir(tmp_path / "ckpt")
    (ckpt / "model.tp00-of-01.safetensors").unlink()
    assert not lm_eval_preload._start_prefetch(ckpt / "model.tp00-of-01.safetensors", "cuda")


def test_registering_a_prefetch_imports_no_torch(tmp_path):
    """torch is imported on the prefetch's thread, not on lm-eval's main thread."""
    import subprocess
    import sys
    from pathlib import Path

    ckpt = _nakta_dir(tmp_path / "ckpt")
    code = (
        "import sys, threading\n"
        "from pathlib import Path\n"
        "from accuracy_test.lm_eval_preload import _start_prefetch\n"
        "seen = []\n"
        "real = threading.Thread.start\n"
        "def start(self):\n"
        "    seen.append('torch' in sys.modules)\n"
        "    real(self)\n"
        "threading.Thread.start = start\n"
        f"assert _start_prefetch(Path({str(ckpt)!r}) / 'model.tp00-of-01.safetensors', 'cuda:0')\n"
        "print(seen)\n"
    )
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[False]"


# ------------------------------------------------------------------------------------------------
# The weight read started_on_gpu from the raw command line, before lm-eval is imported
# (``accuracy_test.lm_eval_preload.start_early``): which command lines start it, and that the
# configuration-time start then leaves it alone.
# ------------------------------------------------------------------------------------------------


pytest.importorskip("lm_eval")


SHARD = "model.tp00-of-01.safetensors"


@pytest.fixture
def started_on_gpu(monkeypatch):
    """Prefetches started_on_gpu (path, device), on a machine that looks like it has a GPU."""
    calls: list = []
    monkeypatch.setattr(nakta_model.prefetch, "prefetch", lambda p, d: calls.append((p, d)))
    monkeypatch.setattr(lm_eval_preload, "_cuda_plausible", lambda: True)
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    return calls


def test_command_line_model_reads_as_lm_eval_does():
    argv = ["run", "--model", "nakta", "--model_args", "checkpoint=A,dtype=bf16", "dp=2"]
    argv += ["--device=cuda:1", "--tasks", "t", "-a", "dtype=fp16"]
    assert command_line_model(argv) == (
        "nakta",
        {"checkpoint": "A", "dtype": "fp16", "dp": "2"},  # a later key wins
        "cuda:1",
    )
    assert command_line_model(["-M", "hf", "-a", '{"pretrained": "x", "n": 2}']) == (
        "hf",
        {"pretrained": "x", "n": 2},
        None,
    )
    assert command_line_model([]) == (None, {}, None)


def test_the_read_starts_from_the_command_line(tmp_path, started_on_gpu):
    ckpt = _nakta_dir(tmp_path / "ckpt")
    base = ["--model", "nakta", "--model_args", f"checkpoint={ckpt},dtype=bf16", "--tasks", "t"]
    state = start_early(base)
    assert started_on_gpu == [(ckpt / SHARD, "cuda")] and state == {"checkpoint": ckpt}  # cuda:0
    started_on_gpu.clear()
    assert start_early(["run", *base, "--device", "cuda:1"]) == {"checkpoint": ckpt}
    assert started_on_gpu == [(ckpt / SHARD, "cuda:1")]
    started_on_gpu.clear()
    for argv in (
        ["ls", "tasks"],  # no model is built
        [*base, "--config", "c.yaml"],  # the file may change the model or its args
        [*base, "-h"],
        [*base, "--device", "cpu"],
        ["--model", "hf", "--model_args", f"pretrained={ckpt}"],
        ["--model", "nakta", "--model_args", f"checkpoint={ckpt},tp=2"],  # not this world
    ):
        assert start_early(argv) == {}, argv
    assert started_on_gpu == []


def test_no_gpu_driver_no_early_read(tmp_path, started_on_gpu, monkeypatch):
    ckpt = _nakta_dir(tmp_path / "ckpt")
    monkeypatch.setattr(lm_eval_preload, "_cuda_plausible", lambda: False)
    assert start_early(["--model", "nakta", "--model_args", f"checkpoint={ckpt}"]) == {}
    assert started_on_gpu == []
    monkeypatch.undo()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not lm_eval_preload._cuda_plausible()


def test_an_early_read_is_not_started_again_and_dropped_at_exit(
    tmp_path, started_on_gpu, monkeypatch
):
    from lm_eval.config.evaluate_config import EvaluatorConfig

    ckpt = _nakta_dir(tmp_path / "ckpt")
    dropped: list = []
    monkeypatch.setattr(nakta_model.prefetch, "discard", lambda: dropped.append(1))
    early = start_early(["--model", "nakta", "--model_args", f"checkpoint={ckpt}"])
    seen: list = []
    with model_preloaded(on_start=lambda: seen.append(1), state=early) as state:
        cli = argparse.Namespace(
            model="nakta", model_args=f"checkpoint={ckpt}", tasks="x", batch_size=1,
            device="cuda:0", command="run",
        )  # fmt: skip
        EvaluatorConfig.from_cli(cli)
        assert state is early and len(started_on_gpu) == 1 and seen == []
    assert dropped == [1]


def test_the_early_start_imports_neither_lm_eval_nor_torch(tmp_path):
    """What makes it early: registering the read needs only the standard library and Nakta's
    torch-free modules (torch is imported on the prefetch's own thread)."""
    ckpt = _nakta_dir(tmp_path / "ckpt")
    code = (
        "import sys\n"
        "import nakta_model.prefetch as p\n"
        "from accuracy_test import lm_eval_preload as lp\n"
        "calls = []\n"
        "p.prefetch = lambda f, d: calls.append((str(f), d))\n"
        "lp._cuda_plausible = lambda: True\n"
        f"state = lp.start_early(['--model', 'nakta', '--model_args', 'checkpoint={ckpt}'])\n"
        "print(len(calls), 'checkpoint' in state, 'torch' in sys.modules, "
        "any(m == 'lm_eval' or m.startswith('lm_eval.') for m in sys.modules))\n"
    )
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["1", "True", "False", "False"]


# ------------------------------------------------------------------------------------------------
# The scorer's warm-up started on a thread when lm-eval starts building a scoring task's requests
# (``NaktaLM.start_warm_up``, called by ``lm_eval_cli``): the same answers as a warm-up at the
# first request, its error raised at the first request, generation waits for it, and the entry
# starts it only for tasks that score.
# ------------------------------------------------------------------------------------------------


pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_warm_up")
    ckpt = write_meta_checkpoint(root / "meta", {**TINY_PARAMS, "max_seq_len": 256}, seed=5)
    tok = train_tiny_tokenizer(root / "tok")
    return dict(checkpoint=str(ckpt), tokenizer=str(tok), device="cpu", dtype="fp32")


INSTS = [
    Instance("loglikelihood", {}, ("the cat", " sat on a mat"), 0),
    Instance("loglikelihood", {}, ("the cat", " ran"), 1),
    Instance("loglikelihood", {}, ("a dog", " barked at the cat"), 2),
]


def test_warm_up_on_a_thread_scores_as_the_first_request_would(tiny):
    want = adapter.NaktaLM(**tiny).loglikelihood(INSTS, disable_tqdm=True)
    lm = adapter.NaktaLM(**tiny)
    lm.start_warm_up()
    assert lm._warming is not None
    lm.start_warm_up()  # once
    assert lm.loglikelihood(INSTS, disable_tqdm=True) == want
    t = lm.load_timings
    assert lm._warming is None and t["warm_up_s"] > 0 and t["warm_up_wait_s"] >= 0
    assert t["ready_unix"] <= t["warm_up_start_unix"] <= t["warm_up_end_unix"]
    lm.start_warm_up()  # warm already: nothing started
    assert lm._warming is None


def test_a_failed_warm_up_raises_at_the_first_request(tiny, monkeypatch):
    def broken(model, **kw):
        raise RuntimeError("warm-up broke")

    lm = adapter.NaktaLM(**tiny)
    monkeypatch.setattr(scoring, "warm_up", broken)
    lm.start_warm_up()
    with pytest.raises(RuntimeError, match="warm-up broke"):
        lm.loglikelihood(INSTS, disable_tqdm=True)


def test_generation_waits_for_the_warm_up(tiny, monkeypatch):
    """The generator takes pages from the model's KV pool, which the warm-up's temporary
    prefix cache also uses: a generate_until waits for the warm-up first."""
    import threading

    release = threading.Event()
    real = scoring.warm_up

    def held(model, **kw):
        assert release.wait(30)
        return real(model, **kw)

    lm = adapter.NaktaLM(**tiny, max_gen_toks=4)
    monkeypatch.setattr(scoring, "warm_up", held)
    lm.start_warm_up()
    waited: list[bool] = []
    real_await = lm._await_warm_up

    def await_warm_up():
        waited.append(lm._warming is not None and not lm._warming.done())
        release.set()
        real_await()

    lm._await_warm_up = await_warm_up
    out = lm.generate_until([Instance("generate_until", {}, ("the cat", {"until": ["."]}), 0)])
    assert waited == [True] and len(out) == 1 and "warm_up_s" in lm.load_timings


def _task(output_type: str):
    return types.SimpleNamespace(OUTPUT_TYPE=output_type)


def test_the_entry_starts_it_for_scoring_tasks_only(monkeypatch):
    import lm_eval.evaluator as evaluator

    calls: list[str] = []

    class Model:
        def start_warm_up(self):
            calls.append("warm")

    def fake_evaluate(lm, task_dict, **kw):
        calls.append("evaluate")
        return "results"

    monkeypatch.setattr(evaluator, "evaluate", fake_evaluate)
    scoring_tasks = {"tasks": {"a": _task("generate_until"), "b": _task("multiple_choice")}}
    generating = {"tasks": {"a": _task("generate_until")}}
    with lm_eval_cli.scorer_warmed_during_request_build():
        assert evaluator.evaluate(lm=Model(), task_dict=scoring_tasks) == "results"
        assert calls == ["warm", "evaluate"]
        calls.clear()
        evaluator.evaluate(Model(), generating)  # positional, nothing that scores
        assert calls == ["evaluate"]
        calls.clear()
        evaluator.evaluate(lm=object(), task_dict=scoring_tasks)  # a model without it (hf)
        assert calls == ["evaluate"]
    assert evaluator.evaluate is fake_evaluate
    assert lm_eval_cli._output_types({"g": {"t": _task("loglikelihood")}, "x": 3}) == {
        "loglikelihood"
    }


# ------------------------------------------------------------------------------------------------
# The scorer's warm-up started as soon as lm-eval has constructed the model, when lm-eval's task
# index already says a requested task scores (``lm_eval_cli.scorer_warmed_from_construction``):
# the output types read from the index (groups and tags expanded), nothing started for generation-
# only or undecidable task lists, and a CPU run through the entry whose warm-up starts before lm-
# eval loads the documents, with the same results as lm-eval's own order.
# ------------------------------------------------------------------------------------------------


pytest.importorskip("lm_eval")


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
    types = lm_eval_task_index.requested_output_types
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
