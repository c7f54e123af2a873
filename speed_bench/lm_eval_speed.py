"""lm-eval as a user runs it: ``--model hf`` vs ``--model nakta`` on the same weights.

    python speed_bench/lm_eval_speed.py --preset 7B \\
        --tokenizer ../shared/data/llama_tokenizer.model \\
        --fewshot 0,10 --batch-sizes default,64,auto --limit 3000 --fewshot-limit 500

Every run is a child process of the project's lm-eval entry, ``python -m
accuracy_test.lm_eval_cli ...`` (what a user types), on the offline ``hellaswag_local`` task
over ``--data`` (via ``NAKTA_HELLASWAG_JSONL``). The weights: an HF LLaMA directory (``--hf``),
or a random one made with transformers at a ``--preset`` shape (on the GPU in bf16 when there
is one; the vocabulary follows ``--tokenizer``), then converted for nakta with ``python
convert.py HF OUT --dtype DTYPE`` (timed). ``hf`` reads the same sentencepiece ``--tokenizer``
through ``AutoTokenizer`` (a ``tokenizer_config.json`` beside it: transformers then converts
the model file; ``LlamaTokenizer(vocab_file=...)`` alone encodes to ``[]`` in transformers 5;
Meta's Llama-3 tiktoken file becomes an HF Llama-3 ``tokenizer.json``, checked to agree).

Per run: ``wall_s`` (process start to end, measured here), ``load_s`` (model construction)
and ``scoring_s`` (``lm_eval.evaluator.evaluate``), both measured inside the child by the
entry's ``NAKTA_LM_EVAL_TIMING`` hook, and ``acc`` / ``acc_norm`` from lm-eval's
``--output_path`` results. ``default`` in ``--batch-sizes`` passes no ``--batch_size`` at all
(lm-eval then uses 1: one row per forward for ``hf``; the token budget for ``nakta``).

Writes ``lm_eval_summary.json`` (``runs`` + metadata), ``lm_eval_summary.md`` (the table, the
nakta/hf wall ratio at each shot count, nakta's default vs its best batch size) and
``lm_eval_summary.png`` to ``--out`` (default ``speed_bench/results/<device>/``), atomically;
each child's log goes to ``logs/`` there. In fp32 both models must report the same acc (same
weights, same requests); in bf16 rounding may flip a few near-ties.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if not __package__:  # run by path: import from this checkout, not from this script's folder
    sys.path[0] = str(REPO)

from accuracy_test.lm_eval_cli import (  # noqa: E402
    ENV_PREFETCH_ENV,
    FAST_EXIT_ENV,
    LOCAL_TASKS_ENV,
    TEMPLATE_CACHE_ENV,
)
from speed_bench.lm_eval_children import (  # noqa: E402
    METRICS,
    TASKS,
    child_env,
    phases,
    read_results,
    run_logged,
)
from speed_bench.lm_eval_report import DEFAULT, TASK, markdown, ratios, write_outputs  # noqa: E402
from speed_bench.lm_eval_weights import (  # noqa: E402
    DTYPES,
    UsageError,
    Weights,
    prepare_weights,
    resolve_device,
    status_of,
)

DEFAULT_DATA = REPO.parent / "shared" / "data" / "hellaswag_val_full.jsonl"
MODELS = ("hf", "nakta")
HF_HARNESS = ("fixed", "plain", "both")
# the entry's harness fixes (accuracy_test/lm_eval_cli.py), all off for a "plain" run
PLAIN_ENV = {
    name: "0" for name in (LOCAL_TASKS_ENV, TEMPLATE_CACHE_ENV, ENV_PREFETCH_ENV, FAST_EXIT_ENV)
}
REUSED = ("hf", "hf_tokenizer", "nakta")  # --reuse-work: what an earlier run left in --work


# ------------------------------------------------------------------ command line
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python speed_bench/lm_eval_speed.py",
        description="lm-eval speed: --model hf vs --model nakta on the same weights, run "
        "through the project's lm-eval entry as a user runs it.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", help="HF LLaMA directory (config.json + weights)")
    src.add_argument("--preset", help="random weights of this shape: 7B, 13B, ..., tiny")
    p.add_argument("--tokenizer", required=True, help="tokenizer.model (SentencePiece or Llama-3)")
    p.add_argument("--data", default=str(DEFAULT_DATA), help="HellaSwag jsonl")
    p.add_argument(
        "--task",
        default=TASK,
        help="comma-separated local tasks of accuracy_test/tasks, each NAME[:SHOTS[:LIMIT]] "
        "(SHOTS, LIMIT override --fewshot and the limits for that task): hellaswag_local "
        "(default), mmlu_shaped_local (57 subjects, 5 fixed shots), bbh_shaped_local, "
        "gsm8k_shaped_local (generation)",
    )
    p.add_argument("--fewshot", default="0,10", help="comma-separated shot counts")
    p.add_argument(
        "--batch-sizes", default="default,64,auto", help="comma-separated: default, N, auto"
    )
    p.add_argument("--limit", type=int, default=None, help="first N tasks of 0-shot runs")
    p.add_argument(
        "--fewshot-limit", type=int, default=None, help="N tasks of few-shot runs (default --limit)"
    )
    p.add_argument(
        "--hf-batch-sizes",
        default=None,
        help="batch sizes for hf only (default: --batch-sizes; hf at lm-eval's default of 1 "
        "row per forward takes minutes for a 3,000-task run)",
    )
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: hf, nakta")
    p.add_argument(
        "--hf-harness",
        choices=HF_HARNESS,
        default="fixed",
        help="hf through the entry with its harness fixes (fixed: lm-eval's own waste gone for "
        "both models, so only the model differs), as lm-eval ships (plain: the fixes off, what "
        "a user of lm_eval meets), or both",
    )
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when present)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 on cuda")
    p.add_argument("--max-seq-len", type=int, default=2048, help="random model's context")
    p.add_argument("--seed", type=int, default=0, help="random weights' seed")
    p.add_argument("--out", default=None, help="results folder (default results/<device>/)")
    p.add_argument("--work", default=None, help="keep the HF/Nakta checkpoints here (new dir)")
    p.add_argument(
        "--reuse-work",
        action="store_true",
        help="--work holds an earlier run's checkpoints (hf/, hf_tokenizer/, nakta/): use them",
    )
    p.add_argument(
        "--local-tasks-only",
        action="store_true",
        help="children skip lm-eval's built-in task index (NAKTA_LM_EVAL_LOCAL_TASKS; "
        "faster, but not what a user's run pays)",
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds per child run")
    p.add_argument(
        "--warmup",
        action="store_true",
        help="before each task and shot count, one extra nakta run like the first timed one, "
        "reported apart as the first run on this machine (it fills Triton's disk cache and the "
        "page cache, which any earlier nakta run leaves warm); the timed runs then compare "
        "batch sizes, not cache states",
    )
    return p.parse_args(argv)


def parse_fewshot(text: str) -> list[int]:
    try:
        shots = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UsageError(f"--fewshot must be comma-separated ints, got {text!r}") from None
    if not shots or any(s < 0 for s in shots):
        raise UsageError(f"--fewshot needs shot counts >= 0, got {text!r}")
    return shots


def parse_batch_sizes(text: str) -> list[str]:
    """``default``, ``auto``, ``auto:N`` or an int >= 1, as lm-eval's ``--batch_size`` takes."""
    sizes = [s.strip() for s in text.split(",") if s.strip()]
    for s in sizes:
        tail = s[len("auto:") :] if s.startswith("auto:") else s
        if s in (DEFAULT, "auto") or (tail.isdigit() and int(tail) >= 1):
            continue
        raise UsageError(f"--batch-sizes: {s!r} is not default, auto, auto:N or an int >= 1")
    if not sizes:
        raise UsageError("--batch-sizes is empty")
    return sizes


@dataclasses.dataclass(frozen=True)
class TaskPlan:
    """One task's runs: its name, shot counts and limits (0-shot / few-shot)."""

    name: str
    shots: tuple[int, ...]
    limit: int | None
    fewshot_limit: int | None


def parse_tasks(
    text: str, fewshot: str, limit: int | None, fewshot_limit: int | None
) -> list[TaskPlan]:
    """``NAME[:SHOTS[:LIMIT]],...``: a task's own shot count and limit override the flags."""
    default_shots = tuple(parse_fewshot(fewshot))
    few_limit = fewshot_limit if fewshot_limit is not None else limit
    plans = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        name, *rest = item.split(":")
        if not name or len(rest) > 2:
            raise UsageError(f"--task: {item!r} is not NAME[:SHOTS[:LIMIT]]")
        shots, lim, few = default_shots, limit, few_limit
        if rest:
            if not rest[0].isdigit():
                raise UsageError(f"--task: {item!r} needs SHOTS as an int >= 0")
            shots = (int(rest[0]),)
        if len(rest) == 2:
            if not rest[1].isdigit() or int(rest[1]) < 1:
                raise UsageError(f"--task: {item!r} needs a LIMIT >= 1")
            lim = few = int(rest[1])
        plans.append(TaskPlan(name, shots, lim, few))
    if not plans:
        raise UsageError("--task is empty")
    return plans


def parse_models(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [n for n in names if n not in MODELS]
    if bad or not names:
        raise UsageError(f"--models must be a subset of {','.join(MODELS)}, got {text!r}")
    return names


def _check_inputs(a: argparse.Namespace) -> None:
    for flag, path in (("--tokenizer", a.tokenizer), ("--data", a.data)):
        if not Path(path).is_file():
            raise UsageError(f"{flag} {path} is not a file")
    if a.hf and not (Path(a.hf) / "config.json").is_file():
        raise UsageError(f"--hf {a.hf} has no config.json (an HF LLaMA directory is expected)")
    for flag, n in (("--limit", a.limit), ("--fewshot-limit", a.fewshot_limit)):
        if n is not None and n < 1:
            raise UsageError(f"{flag} must be >= 1, got {n}")
    if a.max_seq_len < 2:
        raise UsageError(f"--max-seq-len must be >= 2, got {a.max_seq_len}")
    if a.reuse_work:
        missing = [d for d in REUSED if not (Path(a.work or "") / d).is_dir()]
        if not a.work or missing:
            raise UsageError(f"--reuse-work needs --work with {', '.join(REUSED)} in it")
        if a.hf:
            raise UsageError("--reuse-work reuses --work's HF checkpoint; leave out --hf")
    elif a.work and Path(a.work).exists() and any(Path(a.work).iterdir()):
        raise UsageError(f"--work {a.work} exists and is not empty")


# ------------------------------------------------------------------ children
@dataclasses.dataclass(frozen=True)
class RunSpec:
    model: str
    num_fewshot: int
    batch_size: str
    limit: int | None
    task: str = TASK
    warmup: bool = False  # an untimed first run (--warmup), reported apart
    harness: str = "fixed"  # "plain": lm-eval as shipped (the entry's fixes off)

    @property
    def slug(self) -> str:
        bs = self.batch_size.replace(":", "-")
        tail = ("_plain" if self.harness == "plain" else "") + ("_warmup" if self.warmup else "")
        return f"{self.task}_{self.model}_{self.num_fewshot}shot_bs-{bs}{tail}"


def model_args(model: str, w: Weights, dtype_name: str) -> str:
    if model == "hf":
        return f"pretrained={w.hf_dir},tokenizer={w.hf_tokenizer},dtype={DTYPES[dtype_name]}"
    return f"checkpoint={w.nakta_dir},tokenizer={w.sp_model},dtype={dtype_name}"


def child_command(
    spec: RunSpec, w: Weights, dtype_name: str, device: str, out: Path, task: str | None = None
) -> list:
    task = task or spec.task
    cmd = [sys.executable, "-m", "accuracy_test.lm_eval_cli", "--model", spec.model]
    cmd += ["--model_args", model_args(spec.model, w, dtype_name)]
    cmd += ["--include_path", str(TASKS), "--tasks", task]
    cmd += ["--num_fewshot", str(spec.num_fewshot), "--device", device, "--output_path", str(out)]
    if spec.limit is not None:
        cmd += ["--limit", str(spec.limit)]
    if spec.batch_size != DEFAULT:
        cmd += ["--batch_size", spec.batch_size]
    return cmd


def run_one(spec: RunSpec, w: Weights, a: argparse.Namespace, out: Path) -> dict:
    """One child run: its record (numbers, or the error and where its log is)."""
    work = out / "runs" / spec.slug
    shutil.rmtree(work, ignore_errors=True)
    timing = work / "timing.json"
    env = child_env({"NAKTA_HELLASWAG_JSONL": str(Path(a.data).resolve())})
    env["NAKTA_LM_EVAL_TIMING"] = str(timing)
    if a.local_tasks_only:
        env[LOCAL_TASKS_ENV] = "1"
    if spec.harness == "plain":
        env.update(PLAIN_ENV)
    log = out / "logs" / f"{spec.slug}.log"
    task = spec.task
    cmd = child_command(spec, w, a.dtype, a.device, work / "lm_eval", task)
    t0, spawn_unix = time.perf_counter(), time.time()
    rc = run_logged(cmd, env, log, a.timeout)
    record = {
        "model": spec.model,
        "num_fewshot": spec.num_fewshot,
        "batch_size": spec.batch_size,
        "harness": spec.harness,
        "task": task,
        "tasks": task,
        "limit": spec.limit,
        "wall_s": time.perf_counter() - t0,
        "load_s": None,
        "scoring_s": None,
        "requests_s": None,
        "first_request_s": None,
        "load_wait_s": None,
        "acc": None,
        "acc_norm": None,
        "exact_match": None,
        "n": None,
        "request_tokens": None,
        "unique_tokens": None,
        "computed_tokens": None,
        "log": str(log.relative_to(out)),
        "error": None,
    }
    if spec.warmup:
        record["warmup"] = True
    try:
        if rc != 0:
            raise RuntimeError(f"exit code {rc}")
        t = json.loads(timing.read_text())
        record.update(load_s=t["load_s"], scoring_s=t["scoring_s"], **read_results(work, task))
        record.update(phases(t, spawn_unix))
        tokens = t.get("tokens") or {}
        for key in ("request_tokens", "unique_tokens", "computed_tokens"):
            record[key] = tokens.get(key)
    except (RuntimeError, OSError, KeyError, ValueError) as e:
        record["error"] = f"{e} (log: {log})"
    return record


# ------------------------------------------------------------------ main
def plan(a: argparse.Namespace) -> list[RunSpec]:
    """Task, then shot count, then batch size, then model: the two models' runs side by side;
    with ``--warmup``, a copy of each (task, shots)' first nakta run goes first."""
    sizes = parse_batch_sizes(a.batch_sizes)
    hf_text = getattr(a, "hf_batch_sizes", None)
    hf_sizes = parse_batch_sizes(hf_text) if hf_text else sizes
    choice = getattr(a, "hf_harness", "fixed")
    hf_harnesses = ("fixed", "plain") if choice == "both" else (choice,)
    specs = [
        RunSpec(model, shot, bs, t.limit if shot == 0 else t.fewshot_limit, t.name, harness=h)
        for t in parse_tasks(a.task, a.fewshot, a.limit, a.fewshot_limit)
        for shot in t.shots
        for bs in dict.fromkeys(sizes + hf_sizes)
        for model in parse_models(a.models)
        if bs in (hf_sizes if model == "hf" else sizes)
        for h in (hf_harnesses if model == "hf" else ("fixed",))
    ]
    if not getattr(a, "warmup", False):
        return specs
    out, warmed = [], set()
    for spec in specs:
        if spec.model == "nakta" and (spec.task, spec.num_fewshot) not in warmed:
            warmed.add((spec.task, spec.num_fewshot))
            out.append(dataclasses.replace(spec, warmup=True))
        out.append(spec)
    return out


def _environment(a: argparse.Namespace) -> dict:
    import importlib.metadata as md

    import torch

    from bench_common.ceilings import device_slug

    name = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu"
    return {
        "device": device_slug(a.device),
        "device_name": name,
        "dtype": a.dtype,
        "lm_eval": md.version("lm_eval"),
        "transformers": md.version("transformers"),
        "torch": torch.__version__,
    }


def main(argv: Sequence[str] | None = None) -> int:
    return status_of(lambda: _main(parse_args(argv)))


def _main(a: argparse.Namespace) -> int:

    specs = plan(a)
    _check_inputs(a)
    resolve_device(a)
    meta = _environment(a)
    out = Path(a.out) if a.out else REPO / "speed_bench" / "results" / meta["device"]
    out.mkdir(parents=True, exist_ok=True)
    work_ctx = (
        contextlib.nullcontext(a.work) if a.work else tempfile.TemporaryDirectory("lm_eval_speed")
    )
    with work_ctx as work_name:
        work = Path(work_name)
        work.mkdir(parents=True, exist_ok=True)
        weights, made = prepare_weights(a, work, out)
        meta.update(made)
        meta.update(
            task=a.task,
            data=Path(a.data).name,
            tokenizer=Path(a.tokenizer).name,
            preset=a.preset,
            hf=a.hf,
            limit=a.limit,
            fewshot_limit=a.fewshot_limit if a.fewshot_limit is not None else a.limit,
            local_tasks_only=a.local_tasks_only,
        )
        runs = []
        for i, spec in enumerate(specs, 1):
            record = run_one(spec, weights, a, out)
            runs.append(record)
            print(f"[{i}/{len(specs)}] {_describe(record)}", flush=True)
    warmups = [r for r in runs if r.get("warmup")]
    runs = [r for r in runs if not r.get("warmup")]
    summary = {"runs": runs, "ratios": ratios(runs), "warmups": warmups, **meta}
    write_outputs(summary, out)
    print(markdown(summary))
    print(f"wrote {out / 'lm_eval_summary.json'}, .md and .png")
    failed = [r for r in runs + warmups if r["error"]]
    return 1 if failed else 0


def _describe(r: dict) -> str:
    plain = " (lm-eval as shipped)" if r.get("harness") == "plain" else ""
    head = f"{r['model']}{plain} {r['num_fewshot']}-shot batch {r['batch_size']}"
    head += f"{' (warm-up)' if r.get('warmup') else ''}: wall {r['wall_s']:.1f} s"
    if r["error"]:
        return f"{head}, FAILED {r['error']}"
    metrics = ", ".join(f"{m} {r[m]:.4f}" for m in METRICS if r.get(m) is not None)
    tokens = ""
    if r.get("computed_tokens"):
        tokens = (
            f", tokens computed {r['computed_tokens']} / unique {r['unique_tokens']} "
            f"/ requested {r['request_tokens']}"
        )
    first = r.get("first_request_s")
    at = f", first request at {first:.1f}" if first is not None else ""
    model = f", model calls {r['requests_s']:.1f}" if r.get("requests_s") is not None else ""
    return (
        f"{head} (load {r['load_s']:.1f}{at}, scoring {r['scoring_s']:.1f}{model}), "
        f"{metrics}{tokens}"
    )


if __name__ == "__main__":
    sys.exit(main())
