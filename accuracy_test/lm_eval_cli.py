"""lm-eval plus Nakta's adapters: ``nakta-lm-eval ARGS`` or ``python -m accuracy_test.lm_eval_cli``.

Every lm-eval model (``hf``, ``vllm``, ``dummy``, ...) works here as in ``lm_eval``; ``nakta``
and ``llama_org`` are added, e.g.

    python -m accuracy_test.lm_eval_cli --model nakta \\
        --model_args checkpoint=DIR,tokenizer=FILE,dtype=bf16 \\
        --include_path accuracy_test/tasks --tasks hellaswag_local

Why a wrapper: lm-eval 0.4.13 finds models only in its in-process registry, which its
``lm_eval.models`` module fills with lazy ``"module:Class"`` placeholders; nothing reads
installed packages' entry points, so the plain ``lm_eval`` command cannot see ours. This entry
imports ``lm_eval.models`` first (``registry.get_model`` imports it only while the registry is
empty, so registering ours first hid every built-in), then adds ``nakta`` and ``llama_org`` as
placeholders: torch and Nakta are imported only when one of them is used.

Bad ``nakta`` / ``llama_org`` model_args or generation settings, and a checkpoint or tokenizer
that cannot be read (``ModelArgsError``), are one ``error:`` line and exit code 2 as well (under
``dp``/``tp``: from rank 0 only). A key given both in ``--model_args`` and by lm-eval
(``batch_size``, ``device``) is passed once, the model_args value winning. Given no device,
``nakta`` / ``llama_org`` take CUDA when present, else the CPU (not lm-eval's ``cuda:0``). Before lm-eval loads the model, the data file of the offline ``hellaswag_local`` task is checked
(``--metadata hellaswag_jsonl=...``, ``$NAKTA_HELLASWAG_JSONL`` or the defaults): a missing one
is one ``error:`` line and exit code 2, not a traceback after a long model load.

``NAKTA_LM_EVAL_TIMING=path.json`` (under torchrun rank N > 0 writes ``path.rankN.json``,
every file with its ``rank`` and ``world_size``): the seconds spent constructing the model
(``load_s``), in ``lm_eval.evaluator.evaluate`` (``scoring_s``: requests, model calls, metrics)
and inside the model's request methods (``requests_s``: the model's share of it; ``methods``:
per method) are written there at exit, for any model, with ``events`` (seconds since this
module was imported, ``entry_unix``: the process start (negative), lm-eval imported
(``lm_eval_imported``), its arguments parsed (``args_parsed``), its task index
(``task_index_start``/``_end``), the model's module imported (``get_model_start``/``_end``:
torch, Triton, Nakta for nakta), model start/end, lm-eval loading the tasks' documents
(``tasks_load_start``/``_end``), evaluate start/end, first request, the end of the last request
(``last_request_end``), exit; for nakta also ``preload_start``, ``load_build_start``,
``load_read_end``, ``load_ready``, the scorer's ``load_warm_up_start``/``_end``) and Nakta's own
``nakta_load`` timings (``speed_bench/lm_eval_speed.py`` reads them), the project's adapters'
``loglikelihood`` split into tokenizing and scoring (``loglikelihood``; under ``dp`` also
choosing the shard, ``shard_s``, and gathering the answers, ``gather_s``, with ``items``: this
replica's share), and ``generate_until``'s answers with their tokens (``generate_until``; for
nakta also its engine's counters, ``generate_until.engine``); on CUDA ``cuda_memory``: the
allocator's peak allocated / reserved bytes over the run and per request method.

Task index: lm-eval always indexes its ~14k built-in task files before it runs anything (11-16 s
per run on a slow CPU) and has no flag to skip that. When every task asked for is defined under
``--include_path``, this entry indexes those folders only; otherwise (a task only lm-eval has)
the built-in folder's index is read from a cache file kept while its files are unchanged
(``lm_eval_task_index``: the same entries, about 0.7 s). ``NAKTA_LM_EVAL_LOCAL_TASKS=1`` forces
the local index, ``=0`` turns both off (lm-eval builds its whole index).

Prompt templates: lm-eval compiles a task's Jinja template (``doc_to_text`` etc.) again for
every document it renders, shots included (``lm_eval.utils.apply_template``; lm-eval issue
#1286): 8,000 compiles and 7-10 s of a 1,140-question MMLU-shaped 5-shot run, for every model.
This entry compiles each template string once (same environment, same rendered text);
``NAKTA_LM_EVAL_TEMPLATE_CACHE=0`` turns that off.

Environment report: after the evaluation, lm-eval records ``torch.utils.collect_env``'s report
in its results (it runs ``pip list``, ``nvidia-smi`` and more: 0.5-2 s on the critical path).
This entry starts that collection when ``evaluate`` starts, on a thread that mostly waits on
those subprocesses while the model scores, and lm-eval receives the same report from it; the
modules lm-eval imports after the evaluation (transformers for its version, pytablewriter for
the table) are imported there too. Only in the process that writes the results (``LOCAL_RANK``
0): the other ranks of a grid never ask for it. ``NAKTA_LM_EVAL_ENV_PREFETCH=0`` turns that off.

Exit: once lm-eval has returned (results written), the process ends without the interpreter's
teardown (module collection, torch's destructors freeing GPU blocks one by one): threads are
joined, ``atexit`` handlers run and output flushed first (``exit_without_teardown``);
``NAKTA_LM_EVAL_FAST_EXIT=0`` turns that off.

These fixes serve every model alike, ``hf`` included, so a comparison through this entry
credits Nakta with none of them. One is Nakta's own: a ``nakta`` checkpoint's weights (each
rank's shard under ``tp``/``dp``) start streaming onto the GPU as this entry starts, read from the
command line before lm-eval's own imports (with a ``--config`` file: when lm-eval has built the
run's configuration), and the model's load takes them (``lm_eval_preload``;
``NAKTA_LM_EVAL_PRELOAD=0`` turns it off). Another: the model's scorer warms up
(``start_warm_up``: Triton's kernels, cuBLAS) on a thread as soon as lm-eval has constructed the
model when lm-eval's task index says a requested task scores (else when ``evaluate`` starts on
one), while lm-eval loads the documents and builds the requests on the main thread; the first
request waits for what is left (``NAKTA_LM_EVAL_PRELOAD=0`` turns both off).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from accuracy_test.lm_eval_preload import (
    PRELOAD_ENV,
    command_line_model,
    model_preloaded,
    start_early,
)
from nakta_model import knobs
from nakta_model.process_exit import exit_without_teardown

ENTRY_UNIX = time.time()  # this module is the entry's first import: process start + Python's

TIMING_ENV = "NAKTA_LM_EVAL_TIMING"
OUR_MODELS = {
    "nakta": "accuracy_test.lm_eval_adapter:NaktaLM",
    "llama_org": "accuracy_test.lm_eval_adapter:LlamaOrgLM",
}
LOCAL_TASKS_ENV = "NAKTA_LM_EVAL_LOCAL_TASKS"
TEMPLATE_CACHE_ENV = "NAKTA_LM_EVAL_TEMPLATE_CACHE"
ENV_PREFETCH_ENV = "NAKTA_LM_EVAL_ENV_PREFETCH"
FAST_EXIT_ENV = "NAKTA_LM_EVAL_FAST_EXIT"
SCORING_OUTPUT_TYPES = frozenset({"loglikelihood", "multiple_choice", "loglikelihood_rolling"})
TEMPLATE_CACHE_SIZE = 4096  # distinct template strings kept compiled (a task has a handful)
TASKS_DIR = Path(__file__).resolve().parent / "tasks"


def register_models() -> None:
    """lm-eval's built-in models, then ours as lazy placeholders (idempotent)."""
    import lm_eval.models  # noqa: F401  (fills the registry with the built-ins)
    from lm_eval.api.registry import model_registry

    for name, target in OUR_MODELS.items():
        if name not in model_registry:
            model_registry.register(name, target=target)


def local_task_names(include_path: object) -> set[str]:
    """``task:`` and ``group:`` names of the yaml files under ``--include_path`` (one folder
    or a list)."""
    import re

    paths = include_path if isinstance(include_path, (list, tuple)) else [include_path]
    names: set[str] = set()
    for root in paths:
        if not root or not Path(str(root)).is_dir():
            continue
        for f in Path(str(root)).rglob("*.yaml"):
            with contextlib.suppress(OSError, UnicodeDecodeError):
                text = f.read_text()
                pattern = r"^(?:task|group):[ \t]*['\"]?([^'\"\s#]+)"
                for m in re.finditer(pattern, text, re.MULTILINE):
                    names.add(m.group(1))
    return names


def _only_local_tasks(args: argparse.Namespace) -> bool:
    """Whether every requested task comes from ``--include_path`` (or the env var says so)."""
    forced = knobs.get_bool(LOCAL_TASKS_ENV)
    if forced is not None:
        return forced
    tasks = getattr(args, "tasks", None) or []
    if isinstance(tasks, str):
        tasks = tasks.split(",")
    local = local_task_names(getattr(args, "include_path", None))
    return bool(tasks) and all(t in local for t in tasks)


def _index_choice(args: argparse.Namespace) -> str:
    """How this run's ``TaskManager`` indexes tasks: ``"local"`` (only ``--include_path``),
    ``"cached"`` (lm-eval's built-ins from the on-disk cache, plus ``--include_path``) or
    ``"lm_eval"`` (as lm-eval builds it: ``NAKTA_LM_EVAL_LOCAL_TASKS=0``)."""
    if _only_local_tasks(args):
        return "local"
    return "lm_eval" if knobs.get_bool(LOCAL_TASKS_ENV) is False else "cached"


def index_local_tasks_only() -> None:
    """Make lm-eval's ``TaskManager`` skip its built-in tasks (the CLI builds it by name)."""
    import lm_eval.tasks

    base = lm_eval.tasks.TaskManager

    class LocalTaskManager(base):
        def __init__(self, *a, **kw):
            kw["include_defaults"] = False
            super().__init__(*a, **kw)

    lm_eval.tasks.TaskManager = LocalTaskManager


@contextlib.contextmanager
def cached_prompt_templates() -> Iterator[None]:
    """lm-eval's ``apply_template`` with each template string compiled once, inside the block.

    A compiled Jinja template is a pure function of its source and the environment (lm-eval's
    one module-level ``env``), so rendering a cached one gives the very text a fresh compile
    gives; only ``env.from_string`` per call goes."""
    import functools

    import lm_eval.utils as lm_utils

    original = lm_utils.apply_template
    compiled = functools.lru_cache(maxsize=TEMPLATE_CACHE_SIZE)(lm_utils.env.from_string)

    def apply_template(template: str, doc: dict) -> str:
        return compiled(template).render(**doc)

    apply_template.compiled = compiled  # type: ignore[attr-defined]  (its cache_info)
    lm_utils.apply_template = apply_template
    try:
        yield
    finally:
        lm_utils.apply_template = original


@contextlib.contextmanager
def env_report_prefetched() -> Iterator[None]:
    """Inside the block, every ``lm_eval.evaluator.evaluate`` starts collecting
    ``torch.utils.collect_env``'s report on a thread; the report's next request returns it (or
    raises its error, which lm-eval records as before) and the function is put back.

    lm-eval asks for the report AFTER ``evaluate`` has returned (``simple_evaluate`` then calls
    ``add_env_info``), so the prefetched one stays installed until it is asked for or the block
    ends (an earlier version put the original back when ``evaluate`` returned: the report was
    then collected again, on the critical path, and the prefetch was wasted)."""
    import lm_eval.evaluator as evaluator

    evaluate = evaluator.evaluate
    installed: list = []  # (collect_env module, original, ours) of the evaluate in flight

    def evaluate_with_env_prefetch(*a, **kw):
        from concurrent.futures import ThreadPoolExecutor

        import torch.utils.collect_env as collect_env

        _restore(installed)  # a previous evaluate's report nobody asked for
        original = collect_env.get_pretty_env_info
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nakta-env")
        future = pool.submit(original)
        pool.submit(_import_quietly, AFTER_EVALUATE_IMPORTS)
        pool.shutdown(wait=False)

        def get_pretty_env_info() -> str:
            collect_env.get_pretty_env_info = original  # one report per evaluate
            return future.result()

        collect_env.get_pretty_env_info = get_pretty_env_info
        installed.append((collect_env, original, get_pretty_env_info))
        return evaluate(*a, **kw)

    evaluator.evaluate = evaluate_with_env_prefetch
    try:
        yield
    finally:
        evaluator.evaluate = evaluate
        _restore(installed)


@contextlib.contextmanager
def scorer_warmed_during_request_build() -> Iterator[None]:
    """Inside the block, an ``lm_eval.evaluator.evaluate`` of a task that scores (loglikelihood,
    multiple choice, rolling) first calls the model's ``start_warm_up`` when it has one
    (``nakta``): lm-eval then builds every request on this thread, and the scorer's warm-up
    runs beside that instead of after it (the first request waits for what is left)."""
    import lm_eval.evaluator as evaluator

    evaluate = evaluator.evaluate

    def evaluate_with_warm_up(*a, **kw):
        lm = kw.get("lm", a[0] if a else None)
        task_dict = kw.get("task_dict", a[1] if len(a) > 1 else None)
        start = getattr(lm, "start_warm_up", None)
        if callable(start) and SCORING_OUTPUT_TYPES & _output_types(task_dict):
            start()
        return evaluate(*a, **kw)

    evaluator.evaluate = evaluate_with_warm_up
    try:
        yield
    finally:
        evaluator.evaluate = evaluate


@contextlib.contextmanager
def scorer_warmed_from_construction() -> Iterator[None]:
    """Inside the block, a model with ``start_warm_up`` (``nakta``) starts its scorer's warm-up
    as soon as lm-eval has constructed it, when lm-eval's task index already says that a
    requested task scores: the warm-up then runs beside lm-eval loading the tasks' documents as
    well as building the requests (:func:`scorer_warmed_during_request_build` starts it only at
    ``evaluate``). Tasks the index cannot tell (a yaml path, an inline config, a Python task, no
    ``output_type``) leave it to ``evaluate``'s start, as before."""
    import lm_eval.api.registry as registry
    from lm_eval.config.evaluate_config import EvaluatorConfig

    from accuracy_test import lm_eval_task_index

    found: dict = {}
    process_tasks = EvaluatorConfig.__dict__["process_tasks"]
    get_model = registry.get_model

    def process_tasks_noted(self, *a, **kw):
        manager = process_tasks(self, *a, **kw)
        found["types"] = lm_eval_task_index.requested_output_types(
            manager, getattr(self, "tasks", None)
        )
        return manager

    def get_model_warming(name: str):
        cls = get_model(name)
        types = found.get("types")
        if types is None or not SCORING_OUTPUT_TYPES & types:
            return cls
        return _WarmingModelFactory(cls)

    EvaluatorConfig.process_tasks = process_tasks_noted
    registry.get_model = get_model_warming
    try:
        yield
    finally:
        EvaluatorConfig.process_tasks = process_tasks
        registry.get_model = get_model


class _WarmingModelFactory:
    """Stands in for the model class ``get_model`` returns; starts the constructed model's
    warm-up (when it has one)."""

    def __init__(self, cls: type):
        self._cls = cls

    def __getattr__(self, name: str):
        return getattr(self._cls, name)

    def _warming(self, method: str, *a, **kw):
        lm = getattr(self._cls, method)(*a, **kw)
        start = getattr(lm, "start_warm_up", None)
        if callable(start):
            start()
        return lm

    def create_from_arg_obj(self, *a, **kw):
        return self._warming("create_from_arg_obj", *a, **kw)

    def create_from_arg_string(self, *a, **kw):
        return self._warming("create_from_arg_string", *a, **kw)


def _output_types(tree: object) -> set[str]:
    """The ``OUTPUT_TYPE`` of every task in lm-eval's (nested) task dict."""
    found: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(getattr(node, "OUTPUT_TYPE", None), str):
            found.add(node.OUTPUT_TYPE)
    return found


def _restore(installed: list) -> None:
    """Put back every original report function still replaced by a prefetched one."""
    while installed:
        module, original, ours = installed.pop()
        if module.get_pretty_env_info is ours:
            module.get_pretty_env_info = original


# imported by lm-eval after ``evaluate`` returns (add_env_info reads transformers' version, the
# results table is written with pytablewriter): imported on the report's thread while the model
# scores instead (1-3 s of a run's tail on the H200 host's file system)
AFTER_EVALUATE_IMPORTS = ("transformers", "pytablewriter")


def _import_quietly(names: Sequence[str]) -> None:
    """Import what is installed of ``names``; lm-eval reports a missing one itself later."""
    import importlib

    for name in names:
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def writes_results() -> bool:
    """Whether lm-eval finishes the run in this process: it asks for the environment report,
    prints the table and writes results only where ``LOCAL_RANK`` is 0 (its rule for every
    rank of a torchrun grid, which all report rank 0). The other ranks of a ``tp``/``dp`` run
    end when ``evaluate`` returns: collecting a report there (``pip list``, ``nvidia-smi``) and
    importing what the table needs is work nobody reads, beside the scoring and before its
    exit."""
    return os.environ.get("LOCAL_RANK", "0") in ("", "0")


def _env_flag(name: str) -> bool:
    return bool(knobs.get_bool(name))


@contextlib.contextmanager
def device_left_to_our_models() -> Iterator[None]:
    """Inside the block, a ``nakta`` / ``llama_org`` run given no device (no ``--device``, none
    in a ``--config`` file) hands the model None, not lm-eval's default ``cuda:0``: the model
    then takes CUDA when present, else the CPU, and a CPU machine gets no warning about a device
    nobody asked for. Other models keep lm-eval's default."""
    from lm_eval.config.evaluate_config import EvaluatorConfig

    original = EvaluatorConfig.__dict__["from_cli"]

    def from_cli(cls, namespace):
        cfg = original.__get__(None, cls)(namespace)
        if getattr(cfg, "model", None) in OUR_MODELS and not getattr(namespace, "device", None):
            used_config = getattr(namespace, "config", None)
            from_file = cls.load_yaml_config(used_config).get("device") if used_config else None
            if not from_file:
                cfg.device = None
        return cfg

    EvaluatorConfig.from_cli = classmethod(from_cli)
    try:
        yield
    finally:
        EvaluatorConfig.from_cli = original


# ------------------------------------------------------------------ task data, before the model
def _metadata(args: argparse.Namespace) -> dict:
    """lm-eval's task metadata for this run: ``model_args`` overridden by ``--metadata``."""
    merged: dict = {}
    for part in (getattr(args, "model_args", None), getattr(args, "metadata", None)):
        if isinstance(part, dict):
            merged.update(part)
    return merged


def task_data_error(args: argparse.Namespace) -> str | None:
    """Why a requested local task cannot read its data, or None (only ``hellaswag_local``)."""
    tasks = getattr(args, "tasks", None) or []
    if "hellaswag_local" not in tasks:
        return None
    utils = _load_task_utils(TASKS_DIR / "hellaswag_local" / "utils.py")
    try:
        utils.data_path(_metadata(args).get("hellaswag_jsonl"))
    except FileNotFoundError as e:
        return str(e)
    return None


def _load_task_utils(path: Path):
    """The task's own ``utils.py`` (the rule lm-eval will apply), loaded by file path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_nakta_task_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------ timing
class _TimedModelFactory:
    """Stands in for the model class ``get_model`` returns; times its construction."""

    def __init__(self, cls: type, timings: dict):
        self._cls, self._timings = cls, timings

    def __getattr__(self, name: str):
        return getattr(self._cls, name)

    def _timed(self, method: str, *a, **kw):
        t0 = time.perf_counter()
        _event(self._timings, "model_start")
        lm = getattr(self._cls, method)(*a, **kw)
        _sync_cuda()
        _event(self._timings, "model_end")
        self._timings["load_s"] = time.perf_counter() - t0
        self._timings["model_class"] = f"{type(lm).__module__}.{type(lm).__qualname__}"
        self._timings["_lm"] = lm  # read for its token counts at exit (not written)
        _time_requests(lm, self._timings)
        return lm

    def create_from_arg_obj(self, *a, **kw):
        return self._timed("create_from_arg_obj", *a, **kw)

    def create_from_arg_string(self, *a, **kw):
        return self._timed("create_from_arg_string", *a, **kw)


REQUEST_METHODS = ("loglikelihood", "loglikelihood_rolling", "generate_until")


def _event(timings: dict, name: str) -> None:
    """Seconds since the entry started, once per name (the first occurrence counts)."""
    timings["events"].setdefault(name, time.time() - ENTRY_UNIX)


# moments before the timing hook exists (lm-eval imported, its command line parsed): seconds
# since the entry started, copied into the events when the hook starts
EARLY_EVENTS: dict[str, float] = {}


def _early_event(name: str) -> None:
    EARLY_EVENTS.setdefault(name, time.time() - ENTRY_UNIX)


@contextlib.contextmanager
def _timed_between(timings: dict, owner: object, attr: str, name: str) -> Iterator[None]:
    """Inside the block, every call of ``owner.attr`` records events ``<name>_start`` (its
    first call) and ``<name>_end`` (its last return)."""
    original = owner.__dict__[attr]

    def timed(*a, **kw):
        _event(timings, f"{name}_start")
        try:
            return original(*a, **kw)
        finally:
            timings["events"][f"{name}_end"] = time.time() - ENTRY_UNIX

    setattr(owner, attr, timed)
    try:
        yield
    finally:
        setattr(owner, attr, original)


def _time_requests(lm: object, timings: dict) -> None:
    """Add the seconds inside the model's request methods to ``requests_s`` and per method to
    ``methods`` (this instance's methods only: lm-eval calls them by name on it); keep
    ``generate_until``'s answers to count their tokens at exit."""
    for name in REQUEST_METHODS:
        method = getattr(lm, name, None)
        if method is None:
            continue

        def timed(*a, _method=method, _name=name, **kw):
            _event(timings, "first_request")
            _note_cuda_peaks(timings, reset=True)  # the method's own window starts
            t0 = time.perf_counter()
            out = None
            try:
                out = _method(*a, **kw)
                return out
            finally:
                _sync_cuda()
                _note_cuda_peaks(timings, _name, reset=True)
                seconds = time.perf_counter() - t0
                timings["requests_s"] += seconds
                methods = timings.setdefault("methods", {})
                methods[_name] = methods.get(_name, 0.0) + seconds
                timings["events"]["last_request_end"] = time.time() - ENTRY_UNIX
                if _name == "generate_until" and out is not None:
                    timings.setdefault("_answers", []).extend(out)

        setattr(lm, name, timed)


def _generated(lm: object, answers: list[str]) -> dict:
    """``generate_until``'s answers: how many, and their tokens (each answer as returned,
    after lm-eval's stop-string cut, encoded again by the model's tokenizer without BOS; the
    same count for every model). Nakta's engine adds what it decoded (``engine``)."""
    out: dict = {"answers": len(answers), "answer_tokens": None}
    try:
        out["answer_tokens"] = sum(
            len(lm.tok_encode(a, add_special_tokens=False)) for a in answers if a
        )
    except (AttributeError, TypeError, ValueError) as e:  # no usable tok_encode: said why
        out["answer_tokens_error"] = f"{type(e).__name__}: {e}"
    stats = getattr(lm, "generation_stats", None)
    if stats:
        out["engine"] = dict(stats)
    return out


def process_start_unix() -> float | None:
    """When this process started (Linux ``/proc``, 10 ms resolution); None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _sync_cuda() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _note_cuda_peaks(timings: dict, method: str | None = None, reset: bool = False) -> None:
    """Fold the CUDA allocator's peaks since its last reset into ``cuda_memory`` (the run's
    ``max_allocated`` / ``max_reserved`` bytes, and ``methods[method]``'s with
    ``allocated_after``, the bytes allocated when it returned); ``reset`` starts a new window.
    Nothing without CUDA in use."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    peaks = {"max_allocated": torch.cuda.max_memory_allocated(),
             "max_reserved": torch.cuda.max_memory_reserved()}  # fmt: skip
    if reset:
        torch.cuda.reset_peak_memory_stats()
    mem = timings.setdefault("cuda_memory", {"max_allocated": 0, "max_reserved": 0})
    targets = [mem] + ([mem.setdefault("methods", {}).setdefault(method, {})] if method else [])
    if method:  # what the method left allocated (a KV pool it grew or trimmed)
        peaks["allocated_after"] = torch.cuda.memory_allocated()
    for target in targets:
        for key, value in peaks.items():
            target[key] = max(target.get(key, 0), value)
    mem.pop("allocated_after", None)


@contextlib.contextmanager
def timing(path: str | os.PathLike) -> Iterator[dict]:
    """Time model construction and ``evaluate`` without changing lm-eval; JSON at exit."""
    import lm_eval.api.registry as registry
    import lm_eval.evaluator as evaluator
    from lm_eval.config.evaluate_config import EvaluatorConfig
    from lm_eval.tasks.manager import TaskManager  # the class itself (the CLI may subclass it)

    timings: dict = {"load_s": None, "scoring_s": None, "requests_s": 0.0, "argv": sys.argv[1:]}
    timings.update(entry_unix=ENTRY_UNIX, events=dict(EARLY_EVENTS))
    started = process_start_unix()
    if started is not None:  # Python's own start-up, before this module: negative
        timings["events"]["process_start"] = started - ENTRY_UNIX
    get_model, evaluate = registry.get_model, evaluator.evaluate

    def timed_get_model(name: str):  # the model's module imported here (torch, Nakta, Triton)
        _event(timings, "get_model_start")
        factory = _TimedModelFactory(get_model(name), timings)
        _event(timings, "get_model_end")
        return factory

    def timed_evaluate(*a, **kw):
        t0 = time.perf_counter()
        _event(timings, "evaluate_start")
        out = evaluate(*a, **kw)
        _sync_cuda()
        _event(timings, "evaluate_end")
        timings["scoring_s"] = time.perf_counter() - t0
        return out

    registry.get_model, evaluator.evaluate = timed_get_model, timed_evaluate
    t_start = time.perf_counter()
    try:
        with contextlib.ExitStack() as phases:  # lm-eval's task index, then its task loading
            phases.enter_context(
                _timed_between(timings, EvaluatorConfig, "process_tasks", "task_index")
            )
            phases.enter_context(_timed_between(timings, TaskManager, "load", "tasks_load"))
            yield timings
    finally:
        registry.get_model, evaluator.evaluate = get_model, evaluate
        timings["total_s"] = time.perf_counter() - t_start
        _event(timings, "exit")
        _note_cuda_peaks(timings)
        lm = timings.pop("_lm", None)
        if getattr(lm, "load_timings", None):
            load = dict(lm.load_timings)
            for key in [k for k in load if k.endswith("_unix")]:  # moments -> events
                timings["events"]["load_" + key[: -len("_unix")]] = load.pop(key) - ENTRY_UNIX
            timings["nakta_load"] = load
        if getattr(lm, "request_timings", None):  # loglikelihood: tokenizing vs scoring
            timings["loglikelihood"] = dict(lm.request_timings)
        answers = timings.pop("_answers", None)
        if answers is not None:  # generate_until ran: answers and their tokens
            timings["generate_until"] = _generated(lm, answers)
        stats = getattr(lm, "score_stats", None)
        if stats is not None:  # nakta: tokens requested / unique / computed
            import dataclasses

            timings["tokens"] = dataclasses.asdict(stats)
        from nakta_model.io_utils import atomic_write_text

        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        timings.update(rank=rank, world_size=world)
        atomic_write_text(rank_timing_path(path, rank), json.dumps(timings, indent=2) + "\n")


def rank_timing_path(path: str | os.PathLike, rank: int) -> Path:
    """Where rank ``rank`` writes its timings: ``path`` itself for rank 0 (and one process),
    ``<stem>.rank<N><suffix>`` beside it for the others."""
    path = Path(path)
    return path if rank == 0 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


# ------------------------------------------------------------------ entry
def main(argv: Sequence[str] | None = None) -> None:
    """lm-eval's ``cli_evaluate`` with the task-data check between parsing and running."""
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    early: dict = {}
    if _env_flag(PRELOAD_ENV):  # the weight read, before lm-eval's imports when it can
        early = start_early(sys.argv[1:])
        if "checkpoint" in early:
            _early_event("preload_start")
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    register_models()
    _early_event("lm_eval_imported")
    setup_logging()
    parser = HarnessCLI()
    args = parser.parse_args()
    _early_event("args_parsed")
    if getattr(args, "command", None) == "run" and (error := task_data_error(args)):
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2)
    index = _index_choice(args) if getattr(args, "command", None) == "run" else "lm_eval"
    if index == "local":
        index_local_tasks_only()
    timing_path = knobs.get_path(TIMING_ENV)
    with contextlib.ExitStack() as fixes:
        if index == "cached":
            from accuracy_test.lm_eval_task_index import builtin_index_cached

            fixes.enter_context(builtin_index_cached())
        fixes.enter_context(device_left_to_our_models())  # first: the preload reads the device
        if _env_flag(TEMPLATE_CACHE_ENV):
            fixes.enter_context(cached_prompt_templates())
        if _env_flag(ENV_PREFETCH_ENV) and writes_results():
            fixes.enter_context(env_report_prefetched())
        if _env_flag(PRELOAD_ENV):  # Nakta's head start: its weights early, its scorer warm
            fixes.enter_context(scorer_warmed_during_request_build())
        timed: dict = {}
        if _env_flag(PRELOAD_ENV):  # its start is recorded in the timing hook's events
            fixes.enter_context(
                model_preloaded(
                    on_start=lambda: "events" in timed and _event(timed, "preload_start"),
                    state=early,
                )
            )
        if timing_path:
            timed = fixes.enter_context(timing(timing_path))
        if _env_flag(PRELOAD_ENV):  # after the timing hook: its model_end comes first
            fixes.enter_context(scorer_warmed_from_construction())
        try:
            parser.execute(args)
        except ValueError as e:
            if not _is_model_args_error(e):
                raise
            from nakta_model.cli import exit_with_error  # torch is imported by now

            exit_with_error(str(e))  # one line, from rank 0 only under torchrun


def _is_model_args_error(e: BaseException) -> bool:
    """Raised by our adapters for bad model_args / generation settings or a checkpoint that
    cannot be loaded (a user's input)."""
    args = sys.modules.get("accuracy_test.lm_eval_args")  # never imported: not ours
    return args is not None and isinstance(e, args.ModelArgsError)


def requested_world(argv: Sequence[str]) -> int:
    """``tp x dp`` of ``--model nakta --model_args ...,tp=T,dp=D`` read from the raw command
    line (no lm-eval, no torch: this decides whether to start the ranks at all); 1 otherwise.

    Read as lm-eval 0.4.13 reads them: ``-M``/``-a`` as well, ``--model_args`` taking every
    word up to the next option (``checkpoint=DIR dp=2``) or one JSON object, and given again
    merging into the earlier ones (a later key wins)."""
    model, kv, _ = command_line_model(argv)
    if model != "nakta":
        return 1
    try:
        return max(1, int(str(kv.get("tp", 1)))) * max(1, int(str(kv.get("dp", 1))))
    except ValueError:
        return 1  # the adapter refuses it with its own message


def cli() -> None:
    """The command-line entry (console script ``nakta-lm-eval``, ``python -m``): ``main``, then
    a quick exit on success (``NAKTA_LM_EVAL_FAST_EXIT=0``: Python's normal exit). In-process
    callers use ``main``, which returns.

    ``--model nakta --model_args ...,dp=N`` (or ``tp``) without torchrun starts the ``tp x dp``
    ranks itself (``nakta_model.spawn``: no torch in the launcher, so the ranks start at once;
    torchrun's own start-up measured 4.0 s on an H100 host)."""
    world = requested_world(sys.argv[1:])
    if world > 1 and "WORLD_SIZE" not in os.environ:
        from nakta_model.spawn import spawn

        raise SystemExit(spawn(["-m", "accuracy_test.lm_eval_cli", *sys.argv[1:]], world))
    main()
    if _env_flag(FAST_EXIT_ENV):
        exit_without_teardown(0)


if __name__ == "__main__":
    cli()
