"""Start reading a ``nakta`` checkpoint's weights onto the GPU as soon as lm-eval's command line
is parsed.

Between parsing its arguments and constructing the model, lm-eval imports its task machinery
and loads the tasks: 3-5 s of one process's pure-Python start-up on the H200 host. Python work
on a second thread only takes turns with that under the GIL: constructing the whole model there
(this module's first design) finished when lm-eval asked for it and no sooner, and the two
threads' switching made the run 1-2 s slower (``speed_bench/results/nvidia-h200/
lm_eval_load_matrix``). The weight read is different: file reads and host-to-device copies,
which overlap the start-up at 89% of their solo speed once the GIL changes hands every 0.5 ms
(``speed_bench/read_bench.py``). So only the read starts early (``nakta_model.prefetch``); the
model is constructed where lm-eval constructs it, and ``load_rank_state_dict`` takes the
prefetched tensors if they are of the very file it was about to read, onto the same device.

When the command line alone says what will be loaded (``start_early``: ``--model nakta`` with
its ``--model_args``, no ``--config`` file, a CUDA driver present), the read starts as the entry
starts, before lm-eval's own imports (its CLI and task machinery, ``datasets`` among them),
which it then overlaps too; otherwise when lm-eval's configuration is built.

Prefetched: a Nakta checkpoint directory (``params.json`` + ``manifest.json``) on a CUDA
device (lm-eval's default ``cuda:0`` included): in one process its one shard; under ``torchrun``
(a ``tp x dp`` grid) each rank's own shard onto its own GPU (``prefetch_plan``). Anything
else (a Meta or HF directory, a checkpoint sharded for another ``tp``, no GPU, a failed read)
simply is not prefetched: the constructor reads, and raises, as it always did. A prefetch lm-eval never takes
(another checkpoint in a ``--config`` file, a failed run) is dropped at exit.
``NAKTA_LM_EVAL_PRELOAD=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

PRELOAD_ENV = "NAKTA_LM_EVAL_PRELOAD"
PRELOADABLE = frozenset({"nakta"})  # llama_org reads Meta shards through fairscale: not here


def constructor_kwargs(model_args: object, additional: dict | None) -> dict | None:
    """The keyword arguments the model class receives from lm-eval's ``create_from_arg_*``
    (model_args merged with its ``additional_config`` as ``ScoringLM`` merges them: a model_args
    value wins), or None where they cannot be known here."""
    from lm_eval.utils import simple_parse_args_string

    if isinstance(model_args, str):
        args = simple_parse_args_string(model_args)
    elif isinstance(model_args, dict):
        args = dict(model_args)
    else:
        return None
    from accuracy_test.lm_eval_args import merged_model_args

    return merged_model_args(args, additional, warn=False)  # as the class merges them


def prefetchable_checkpoint(kwargs: dict) -> Path | None:
    """The checkpoint directory of a single-GPU Nakta load these constructor kwargs ask for
    (checked from the files' names and ``params.json`` alone: no torch), else None."""
    plan = prefetch_plan(kwargs, {})
    return plan[0].parent if plan is not None else None


def prefetch_plan(kwargs: dict, environ: Mapping[str, str]) -> tuple[Path, str] | None:
    """``(shard file, device)`` this process's Nakta load will read, or None.

    One process: shard 0 of a ``tp_size = 1`` checkpoint onto the CUDA device asked for. Under
    torchrun (``WORLD_SIZE`` in ``environ``, a ``tp x dp`` grid the size of the world): this
    rank's shard (``RANK % tp``) of a checkpoint sharded for that ``tp``, onto the rank's own
    GPU (``cuda:LOCAL_RANK``, where ``init_parallel`` puts it), so every rank's read overlaps
    lm-eval's start-up as a lone process's does."""
    ckpt = kwargs.get("checkpoint")
    device = str(kwargs.get("device") or "cuda")
    if not isinstance(ckpt, str) or not device.startswith("cuda"):
        return None
    try:
        tp, dp = int(str(kwargs.get("tp", 1))), int(str(kwargs.get("dp", 1)))
        world = int(environ.get("WORLD_SIZE", "1"))
        rank, local_rank = int(environ.get("RANK", "0")), int(environ.get("LOCAL_RANK", "0"))
    except ValueError:
        return None  # the constructor / init_parallel refuse it with their own message
    if tp < 1 or dp < 1 or tp * dp != world:
        return None
    from nakta_model.checkpoint_names import MANIFEST, PARAMS, shard_file_name

    path = Path(ckpt)
    try:
        params = json.loads((path / PARAMS).read_text())
    except (OSError, ValueError):
        return None
    if not (path / MANIFEST).is_file() or not isinstance(params, dict):
        return None
    if params.get("tp_size") != tp:
        return None
    if world > 1:
        device = f"cuda:{local_rank}"
    return path / shard_file_name(rank % tp, tp), device


def _start_prefetch(file: Path, device: str) -> bool:
    """Register the read of shard ``file`` and start its thread; whether it started. Nothing
    here imports torch: torch, CUDA and the read all happen on the prefetch's thread while
    lm-eval's start-up goes on (a machine without CUDA fails there, unseen; the constructor
    then falls back to the CPU as always, and a failed read is the constructor's to report)."""
    from nakta_model.prefetch import prefetch

    try:
        prefetch(file, device)
    except OSError:  # no shard file: the constructor says so
        return False
    return True


def command_line_model(argv: Sequence[str]) -> tuple[str | None, dict[str, object], str | None]:
    """``(--model, its --model_args as key -> value, --device)`` read from the raw command line,
    before lm-eval is imported (the values as strings; the model None when not given).

    Read as lm-eval 0.4.13 reads them: ``-M``/``-a`` as well, ``--model_args`` taking every word
    up to the next option (``checkpoint=DIR dp=2``) or one JSON object, and given again merging
    into the earlier ones (a later key wins)."""
    args = list(argv)
    model: str | None = None
    device: str | None = None
    kv: dict[str, object] = {}
    for i, arg in enumerate(args):
        flag, eq, inline = arg.partition("=")
        value = inline if eq else (args[i + 1] if i + 1 < len(args) else None)
        if flag in ("--model", "-M"):
            model = value
        elif flag == "--device":
            device = value
        elif flag in ("--model_args", "-a"):
            words = [inline] if eq else _words_after(args, i + 1)
            kv.update(_model_args_words(words))
    return model, kv, device


def _words_after(args: list[str], start: int) -> list[str]:
    """The values of an ``nargs="+"`` option: the words up to the next option."""
    end = start
    while end < len(args) and not args[end].startswith("-"):
        end += 1
    return args[start:end]


def _model_args_words(words: list[str]) -> dict[str, object]:
    """``key=value`` pairs of ``--model_args``' words (comma lists, or a JSON object first)."""
    if words and words[0].lstrip().startswith("{"):
        with contextlib.suppress(ValueError):
            obj = json.loads(words[0])
            if isinstance(obj, dict):
                return obj
    return dict(p.split("=", 1) for w in words for p in w.split(",") if "=" in p)


def _cuda_plausible() -> bool:
    """Whether this machine may have a CUDA GPU for this process, without importing torch (the
    NVIDIA driver's ``/proc`` entry, no ``CUDA_VISIBLE_DEVICES`` hiding every GPU)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return Path("/proc/driver/nvidia/gpus").is_dir()


def start_early(argv: Sequence[str], models: frozenset[str] = PRELOADABLE) -> dict:
    """Start the weight read from the raw command line, before lm-eval is even imported.

    lm-eval's own imports (its CLI, the task machinery with ``datasets``: 1-2 s of one process)
    come before its configuration is built, so a read started here overlaps them as well. Only
    where the command line alone decides the plan: ``lm-eval run`` (or no subcommand) of one of
    ``models``, no ``--config`` file (it may set the model or its arguments), no ``--help``, a
    CUDA driver present; the rest is left to :func:`model_preloaded`'s start when the
    configuration is built. Returns the state to hand :func:`model_preloaded` (key
    ``checkpoint`` once a prefetch started)."""
    args = list(argv)
    state: dict = {}
    if args and not args[0].startswith("-") and args[0] != "run":
        return state  # ls, validate, ...: no model is built
    if any(a in ("-h", "--help") or a.partition("=")[0] in ("--config", "-C") for a in args):
        return state
    model, kv, device = command_line_model(args)
    if model not in models or not _cuda_plausible():
        return state
    from accuracy_test.lm_eval_args import merged_model_args

    kwargs = merged_model_args(kv, {"device": device}, warn=False)
    plan = prefetch_plan(kwargs, os.environ)
    if plan is not None and _start_prefetch(*plan):
        state["checkpoint"] = plan[0].parent
    return state


@contextlib.contextmanager
def model_preloaded(
    on_start: Callable[[], None] | None = None,
    models: frozenset[str] = PRELOADABLE,
    state: dict | None = None,
) -> Iterator[dict]:
    """Inside the block, a run of one of ``models`` starts reading its weights when lm-eval's
    configuration is built, unless :func:`start_early` already started it (its ``state``).
    Yields a dict with key ``checkpoint`` once a prefetch started; ``on_start`` is called when
    this block starts one (the timing hook records that moment)."""
    from lm_eval.config.evaluate_config import EvaluatorConfig

    state = {} if state is None else state
    original_from_cli = EvaluatorConfig.__dict__["from_cli"]

    def from_cli(cls, namespace):
        cfg = original_from_cli.__get__(None, cls)(namespace)
        if getattr(cfg, "model", None) in models and "checkpoint" not in state:
            kwargs = constructor_kwargs(cfg.model_args, {"device": cfg.device})
            plan = prefetch_plan(kwargs, os.environ) if kwargs else None
            if plan is not None and _start_prefetch(*plan):
                state["checkpoint"] = plan[0].parent
                if on_start is not None:
                    on_start()
        return cfg

    EvaluatorConfig.from_cli = classmethod(from_cli)
    try:
        yield state
    finally:
        EvaluatorConfig.from_cli = original_from_cli
        if "checkpoint" in state:  # a prefetch started: one nobody took is dropped
            from nakta_model import prefetch

            prefetch.discard()
