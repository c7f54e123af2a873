"""The scorer's warm-up started on a thread when lm-eval starts building a scoring task's
requests (``NaktaLM.start_warm_up``, called by ``lm_eval_cli``): the same answers as a warm-up
at the first request, its error raised at the first request, generation waits for it, and the
entry starts it only for tasks that score."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("lm_eval")

from checkpoint_factory import TINY_PARAMS, train_tiny_tokenizer, write_meta_checkpoint  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from accuracy_test import lm_eval_adapter as adapter  # noqa: E402
from accuracy_test import lm_eval_cli  # noqa: E402
from nakta_model import scoring  # noqa: E402


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
