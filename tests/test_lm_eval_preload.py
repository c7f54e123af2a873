"""The early model construction of the lm-eval entry (``accuracy_test.lm_eval_preload``): the
instance built while lm-eval starts up is the one lm-eval gets, only for equal constructor
arguments; a mismatch or a failure falls back to lm-eval's own construction."""

from __future__ import annotations

import argparse
import threading

import pytest

pytest.importorskip("lm_eval")

from lm_eval.api import registry  # noqa: E402
from lm_eval.config.evaluate_config import EvaluatorConfig  # noqa: E402

from accuracy_test.lm_eval_preload import constructor_kwargs, model_preloaded  # noqa: E402

FAKE = "nakta_preload_test_fake"


class _Fake:
    """Records where and with what it was built, and whether it was closed."""

    built: list = []

    def __init__(self, **kwargs):
        if kwargs.get("fail"):
            raise ValueError("bad fail argument")
        self.kwargs, self.thread, self.closed = kwargs, threading.current_thread().name, False
        _Fake.built.append(self)

    @classmethod
    def create_from_arg_string(cls, arg_string, additional_config=None):
        return cls(**constructor_kwargs(arg_string, additional_config))

    @classmethod
    def create_from_arg_obj(cls, arg_dict, additional_config=None):
        return cls(**constructor_kwargs(arg_dict, additional_config))

    def close(self):
        self.closed = True


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(_Fake, "built", [])
    original = registry.get_model
    monkeypatch.setattr(
        registry, "get_model", lambda name: _Fake if name == FAKE else original(name)
    )
    return _Fake


def _cli(model_args: str) -> argparse.Namespace:
    """What lm-eval's parser gives ``run`` (the fields the configuration reads)."""
    return argparse.Namespace(
        model=FAKE, model_args=model_args, tasks="x", batch_size=1, device="cpu", command="run"
    )


def test_constructor_kwargs_are_what_lm_eval_passes():
    assert constructor_kwargs("a=1,b=x", {"batch_size": 4, "device": None}) == {
        "a": 1,
        "b": "x",
        "batch_size": 4,
    }
    assert constructor_kwargs({"a": 1}, None) == {"a": 1}
    assert constructor_kwargs({"device": "cpu"}, {"device": "cuda"}) is None  # a duplicate
    assert constructor_kwargs(42, {}) is None


def test_early_instance_is_handed_to_lm_eval(fake):
    used = []
    with model_preloaded(on_used=lambda: used.append(1), models=frozenset({FAKE})) as state:
        cfg = EvaluatorConfig.from_cli(_cli("a=1"))
        assert "early" in state
        lm = registry.get_model(FAKE).create_from_arg_obj(
            cfg.model_args, {"batch_size": cfg.batch_size, "max_batch_size": None, "device": "cpu"}
        )
    assert fake.built == [lm] and lm.thread == "nakta-preload"  # built once, off the main thread
    assert used == [1]
    assert lm.kwargs == {"a": 1, "batch_size": 1, "device": "cpu"} and not lm.closed
    assert EvaluatorConfig.from_cli.__func__.__module__ == "lm_eval.config.evaluate_config"
    assert registry.get_model(FAKE) is fake  # the stand-in factory is gone with the block


def test_other_arguments_build_afresh_and_release_the_early_one(fake):
    used = []
    with model_preloaded(on_used=lambda: used.append(1), models=frozenset({FAKE})):
        EvaluatorConfig.from_cli(_cli("a=1"))
        lm = registry.get_model(FAKE).create_from_arg_string("a=2", {"device": "cpu"})
    early, fresh = fake.built
    assert fresh is lm and lm.kwargs == {"a": 2, "device": "cpu"} and lm.thread != "nakta-preload"
    assert early.closed and not lm.closed and used == []


def test_a_failed_early_build_fails_again_where_lm_eval_builds(fake):
    with model_preloaded(models=frozenset({FAKE})):
        EvaluatorConfig.from_cli(_cli("fail=1"))
        with pytest.raises(ValueError, match="bad fail argument"):
            registry.get_model(FAKE).create_from_arg_string("fail=1", {"device": "cpu"})
    assert fake.built == []


def test_never_asked_for_is_released_at_exit(fake):
    with model_preloaded(models=frozenset({FAKE})):
        EvaluatorConfig.from_cli(_cli("a=1"))
    (early,) = fake.built
    assert early.closed
    with model_preloaded(models=frozenset({FAKE})):  # the class was looked up, never called
        EvaluatorConfig.from_cli(_cli("a=1"))
        registry.get_model(FAKE)
    assert fake.built[1].closed


def test_other_models_and_torchrun_grids_do_not_preload(fake, monkeypatch):
    with model_preloaded(models=frozenset({"something_else"})) as state:
        EvaluatorConfig.from_cli(_cli("a=1"))
    assert "early" not in state and fake.built == []
    monkeypatch.setenv("WORLD_SIZE", "2")
    with model_preloaded(models=frozenset({FAKE})) as state:
        EvaluatorConfig.from_cli(_cli("a=1"))
    assert "early" not in state
