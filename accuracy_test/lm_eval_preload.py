"""Start building a ``nakta`` model as soon as lm-eval's command line is parsed.

Between parsing its arguments and constructing the model, lm-eval imports its task machinery
(datasets, pandas, pyarrow), indexes and loads the tasks and imports torch: 7-12 s of one
process's start-up on the H200 host, during which the GPU idles. Nakta's adapter already reads
the weights on a worker thread once lm-eval constructs it (``background_load``); this module
moves that construction itself to the moment the run's configuration exists
(``EvaluatorConfig.from_cli``), on a thread: importing torch, Triton and Nakta, reading the
checkpoint and compiling the scorer's kernels then overlap lm-eval's own start-up.

lm-eval still constructs the model where it always does, with the same arguments: the stand-in
factory returns the instance built early only when the constructor's keyword arguments are
equal to the ones it was built with (so a ``--config`` file, a changed default or anything else
that makes them differ builds a fresh one, and the early one is dropped first). A failed early
construction is discarded: lm-eval's own constructor call then raises the error where it always
did. Only single-process runs preload (a ``torchrun`` grid constructs through collectives).
``NAKTA_LM_EVAL_PRELOAD=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator

PRELOAD_ENV = "NAKTA_LM_EVAL_PRELOAD"
PRELOADABLE = frozenset({"nakta"})  # llama_org builds Meta's model parallel: no early start


def constructor_kwargs(model_args: object, additional: dict | None) -> dict | None:
    """The keyword arguments lm-eval's ``create_from_arg_*`` passes to the model class (its
    ``additional_config`` without ``None`` values), or None where they cannot be known here."""
    from lm_eval.utils import simple_parse_args_string

    if isinstance(model_args, str):
        args = simple_parse_args_string(model_args)
    elif isinstance(model_args, dict):
        args = dict(model_args)
    else:
        return None
    extra = {k: v for k, v in (additional or {}).items() if v is not None}
    if set(args) & set(extra):
        return None  # the class would refuse the duplicate itself: let it
    return {**args, **extra}


class EarlyModel:
    """One model's construction on a worker thread: the model class is resolved there too
    (resolving ``nakta`` imports torch, Triton and Nakta: seconds, off the main thread)."""

    def __init__(self, name: str, resolve: Callable[[], type], kwargs: dict):
        self.name, self.kwargs, self.taken = name, kwargs, False
        self._lm = self._error = None
        self._thread = threading.Thread(
            target=self._build, args=(resolve,), name="nakta-preload", daemon=False
        )
        self._thread.start()

    def _build(self, resolve: Callable[[], type]) -> None:
        try:
            self._lm = resolve()(**self.kwargs)
        except BaseException as e:  # lm-eval's own constructor call raises it again
            self._error = e

    def take(self, kwargs: dict | None) -> object | None:
        """The instance, when it was built with ``kwargs``; else None, and the early one (if
        any) is closed so that its memory is free for lm-eval's own construction."""
        self._thread.join()
        self.taken = True
        lm, self._lm = self._lm, None
        if lm is not None and kwargs == self.kwargs:
            return lm
        close = getattr(lm, "close", None)
        if close is not None:
            close()
        return None


class _PreloadingFactory:
    """Stands in for the model class ``get_model`` returns: hands out the early instance."""

    def __init__(self, cls: type, early: EarlyModel, on_used: Callable[[], None] | None):
        self._cls, self._early, self._on_used = cls, early, on_used

    def __getattr__(self, name: str):
        return getattr(self._cls, name)

    def create_from_arg_string(self, arg_string: str, additional_config: dict | None = None):
        lm = self._take(arg_string, additional_config)
        return (
            lm
            if lm is not None
            else self._cls.create_from_arg_string(arg_string, additional_config)
        )

    def create_from_arg_obj(self, arg_dict: dict, additional_config: dict | None = None):
        lm = self._take(arg_dict, additional_config)
        return lm if lm is not None else self._cls.create_from_arg_obj(arg_dict, additional_config)

    def _take(self, model_args: object, additional: dict | None) -> object | None:
        early, self._early = self._early, None  # one hand-out
        if early is None:
            return None
        lm = early.take(constructor_kwargs(model_args, additional))
        if lm is not None and self._on_used is not None:
            self._on_used()
        return lm


def _single_process() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) <= 1


@contextlib.contextmanager
def model_preloaded(
    on_start: Callable[[], None] | None = None,
    on_used: Callable[[], None] | None = None,
    models: frozenset[str] = PRELOADABLE,
) -> Iterator[dict]:
    """Inside the block, a run of one of ``models`` starts constructing its model when lm-eval's
    configuration is built; ``get_model`` hands that instance to lm-eval's constructor call.
    Yields a dict that holds the ``EarlyModel`` (key ``early``) once one started; ``on_start``
    is called then, ``on_used`` when lm-eval receives the early instance (the timing hook
    records both moments)."""
    from lm_eval.api import registry
    from lm_eval.config.evaluate_config import EvaluatorConfig

    state: dict = {}
    original_from_cli = EvaluatorConfig.__dict__["from_cli"]
    get_model = registry.get_model

    def from_cli(cls, namespace):
        cfg = original_from_cli.__get__(None, cls)(namespace)
        model = getattr(cfg, "model", None)
        if model in models and "early" not in state and _single_process():
            additional = {
                "batch_size": cfg.batch_size,
                "max_batch_size": cfg.max_batch_size,
                "device": cfg.device,
            }
            kwargs = constructor_kwargs(cfg.model_args, additional)
            if kwargs is not None:
                state["early"] = EarlyModel(model, lambda: get_model(model), kwargs)
                if on_start is not None:
                    on_start()
        return cfg

    def preloading_get_model(name: str):
        cls = get_model(name)
        early = state.get("early")
        if early is not None and early.name == name and not state.get("handed_out"):
            state["handed_out"] = True
            return _PreloadingFactory(cls, early, on_used)
        return cls

    EvaluatorConfig.from_cli = classmethod(from_cli)
    registry.get_model = preloading_get_model
    try:
        yield state
    finally:
        EvaluatorConfig.from_cli = original_from_cli
        registry.get_model = get_model
        early = state.get("early")
        if early is not None and not early.taken:
            early.take(None)  # never asked for (the run failed first): release it
