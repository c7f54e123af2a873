"""lm-eval's ``generate_until`` at GSM8K's full size: ``--model nakta`` vs ``--model hf`` at its
best batch size, every run a fresh process through the project's entry (issue 28 item 5).

    python speed_bench/lm_eval_gsm8k.py --preset 7B --tokenizer .data/llama_tokenizer.model \\
        --hf-batch-sizes 64 --hf-limit 256 --nakta-on-hf-docs --deadline-s 390

Task ``gsm8k_shaped_full_local`` (1,319 synthetic GSM8K-shaped problems, 8 fixed shots, up to
256 new tokens, stops at "Question:"; ``accuracy_test/tasks/gsm8k_shaped_local/``). Weights: a
random ``--preset`` LLaMA made with transformers, or an HF LLaMA directory (``--hf``), converted
for nakta by ``convert.py`` (``lm_eval_weights``); or a Nakta ``--checkpoint`` (nakta only: hf
has no weights then and its runs are listed as skipped).

Runs, in this order: nakta as a user runs it (no ``--batch_size``: the adapter sizes its
continuous batch), then hf at each ``--hf-batch-sizes`` entry (``auto``: lm-eval's detection,
capped at its ``--max_batch_size`` 64; or a fixed N): on every doc, or with ``--hf-limit N`` on
the first N only (hf at 256 new tokens a doc can take many minutes on all 1,319) and
extrapolated to all docs in a column of its own (``lm_eval_gsm8k_report``); then, with
``--nakta-on-hf-docs``, nakta on hf's subset (a measured ratio on the same docs). A run that
could not end before ``--deadline-s`` (from this command's start, by the run's own time limit)
is not started and is listed as skipped. ``--limit N`` makes every run use the first N docs
(a smoke run); ``--max-gen-toks N`` overrides the task's 256 (lm-eval's ``--gen_kwargs``).

Per run: ``wall_s`` (process start to end, measured here), ``load_s`` and ``generate_s``
(inside the child: the entry's ``NAKTA_LM_EVAL_TIMING`` hook; ``generate_s`` is the time inside
``generate_until``), answer tokens (the same count for both models) and nakta's engine tokens,
``exact_match`` from lm-eval's results. Writes ``lm_eval_summary.{json,md,png}`` to ``--out``
(default ``speed_bench/results/<device>/lm_eval_gsm8k_full/``) after every run, atomically, so a
job cut short keeps the runs it finished; each child's log goes to ``logs/`` there.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if not __package__:  # run by path: import from this checkout, not from this script's folder
    sys.path[0] = str(REPO)

from speed_bench.lm_eval_children import TASKS, child_env, read_results, run_logged  # noqa: E402
from speed_bench.lm_eval_gsm8k_report import (  # noqa: E402
    RUN_KEYS,
    TARGET,
    extrapolate,
    markdown,
    ratios,
    write_outputs,
)
from speed_bench.lm_eval_weights import DTYPES, UsageError, Weights, resolve_device, status_of  # noqa: E402

TASK_DOCS = {"gsm8k_shaped_full_local": 1319, "gsm8k_shaped_local": 250}
TASK_MAX_GEN = 256  # the tasks' max_gen_toks (gsm8k_shaped_local.yaml)
DEFAULT = "default"  # no --batch_size: the model's own default


# ------------------------------------------------------------------ command line
def _batch_sizes(text: str) -> list[str]:
    """``auto``, ``auto:N`` or an int >= 1 each, as lm-eval's ``--batch_size`` takes."""
    sizes = [s.strip() for s in text.split(",") if s.strip()]
    for s in sizes:
        tail = s[len("auto:") :] if s.startswith("auto:") else s
        if s != "auto" and not (tail.isdigit() and int(tail) >= 1):
            raise UsageError(f"--hf-batch-sizes: {s!r} is not auto, auto:N or an int >= 1")
    return sizes


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python speed_bench/lm_eval_gsm8k.py", description=__doc__.split("\n\n")[0]
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="random weights of this shape: 7B, ..., tiny")
    src.add_argument("--hf", help="an HF LLaMA directory (config.json + weights)")
    src.add_argument("--checkpoint", help="a Nakta checkpoint (nakta runs only)")
    p.add_argument("--tokenizer", help="sentencepiece tokenizer.model (default: the checkpoint's)")
    p.add_argument("--task", default="gsm8k_shaped_full_local", choices=sorted(TASK_DOCS))
    p.add_argument("--num-fewshot", type=int, default=8)
    p.add_argument("--max-gen-toks", type=int, default=None, help="default: the task's 256")
    p.add_argument("--limit", type=int, default=None, help="every run on the first N docs")
    p.add_argument("--hf-batch-sizes", default="64", help="comma-separated: auto, auto:N, N")
    p.add_argument("--hf-limit", type=int, default=None, help="hf on the first N docs only")
    p.add_argument(
        "--nakta-on-hf-docs",
        action="store_true",
        help="also nakta on hf's --hf-limit docs (a measured ratio on the same docs)",
    )
    p.add_argument("--models", default="nakta,hf", help="comma-separated: nakta, hf")
    p.add_argument("--run-timeout-s", type=float, default=300.0, help="nakta's full run's limit")
    p.add_argument(
        "--subset-timeout-s", type=float, default=120.0, help="nakta on hf's docs: its limit"
    )
    p.add_argument("--hf-timeout-s", type=float, default=600.0, help="each hf run's limit")
    p.add_argument("--deadline-s", type=float, default=None, help="start no run past this")
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 on cuda")
    p.add_argument("--max-seq-len", type=int, default=2048, help="random model's context")
    p.add_argument("--seed", type=int, default=0, help="random weights' seed")
    p.add_argument("--out", default=None, help="default results/<device>/lm_eval_gsm8k_full/")
    p.add_argument("--work", default=None, help="folder for the weights and runs (default: tmp)")
    a = p.parse_args(argv)
    a.hf_sizes = _batch_sizes(a.hf_batch_sizes)
    a.model_list = [m.strip() for m in a.models.split(",") if m.strip()]
    if not a.model_list or set(a.model_list) - {"nakta", "hf"}:
        raise UsageError(f"--models: nakta and/or hf, got {a.models!r}")
    if "hf" in a.model_list and not a.hf_sizes:
        raise UsageError("--hf-batch-sizes is empty")
    for flag, n, low in (
        ("--limit", a.limit, 1),
        ("--hf-limit", a.hf_limit, 1),
        ("--max-gen-toks", a.max_gen_toks, 1),
        ("--num-fewshot", a.num_fewshot, 0),
    ):
        if n is not None and n < low:
            raise UsageError(f"{flag} must be >= {low}, got {n}")
    if a.nakta_on_hf_docs and a.hf_limit is None:
        raise UsageError("--nakta-on-hf-docs needs --hf-limit")
    if (a.preset or a.hf) and not a.tokenizer:
        raise UsageError("--preset / --hf need --tokenizer (the vocabulary both models read)")
    return a


# ------------------------------------------------------------------ runs
@dataclasses.dataclass(frozen=True)
class Run:
    model: str
    batch_size: str  # DEFAULT: no --batch_size
    limit: int | None  # lm-eval's --limit (None: every doc)
    timeout_s: float

    @property
    def slug(self) -> str:
        return f"{self.model}_bs-{self.batch_size.replace(':', '-')}_{self.limit or 'all'}"


def plan(a: argparse.Namespace) -> list[Run]:
    """nakta on every doc, hf per batch size (on ``--hf-limit`` docs when given), then nakta
    on hf's docs when asked for."""
    runs = []
    if "nakta" in a.model_list:
        runs.append(Run("nakta", DEFAULT, a.limit, a.run_timeout_s))
    hf_limit = a.limit if a.hf_limit is None else min(a.hf_limit, a.limit or a.hf_limit)
    if "hf" in a.model_list:
        runs += [Run("hf", bs, hf_limit, a.hf_timeout_s) for bs in a.hf_sizes]
    if a.nakta_on_hf_docs and "nakta" in a.model_list and hf_limit != a.limit:
        runs.append(Run("nakta", DEFAULT, hf_limit, a.subset_timeout_s))
    return runs


def model_args(model: str, w: Weights | None, ckpt: Path | None, a) -> str | None:
    """``--model_args`` of a run; None when that model has no weights here."""
    if model == "hf":
        if w is None:
            return None
        return f"pretrained={w.hf_dir},tokenizer={w.hf_tokenizer},dtype={DTYPES[a.dtype]}"
    margs = f"checkpoint={w.nakta_dir if w else ckpt},dtype={a.dtype}"
    if a.tokenizer:
        margs += f",tokenizer={Path(a.tokenizer).resolve()}"
    return margs


def child_command(run: Run, margs: str, a: argparse.Namespace, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "accuracy_test.lm_eval_cli", "--model", run.model]
    cmd += ["--model_args", margs, "--include_path", str(TASKS), "--tasks", a.task]
    cmd += ["--num_fewshot", str(a.num_fewshot), "--device", a.device, "--output_path", str(out)]
    if run.batch_size != DEFAULT:
        cmd += ["--batch_size", run.batch_size]
    if run.limit is not None:
        cmd += ["--limit", str(run.limit)]
    if a.max_gen_toks is not None:
        cmd += ["--gen_kwargs", f"max_gen_toks={a.max_gen_toks}"]
    return cmd


def _results_max_gen(output_dir: Path, task: str) -> int | None:
    """The max_gen_toks lm-eval ran the task with (its results' config), if it says."""
    files = sorted(output_dir.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        return None
    config = json.loads(files[-1].read_text()).get("configs", {}).get(task, {})
    value = (config.get("generation_kwargs") or {}).get("max_gen_toks")
    return int(value) if value is not None else None


ENGINE_KEYS = ("prefill_s", "decode_s", "decode_steps", "prefill_chunks", "prefilled_tokens",
               "prompt_tokens", "peak_pages", "max_batch")  # fmt: skip


def fill_from_child(rec: dict, timing: dict, results: dict) -> None:
    """The child's own numbers: timing hook (load, generate_until, tokens) and results."""
    rec["load_s"] = timing.get("load_s")
    methods = timing.get("methods") or {}
    rec["generate_s"] = methods.get("generate_until", timing.get("requests_s"))
    gen = timing.get("generate_until") or {}
    rec["answer_tokens"] = gen.get("answer_tokens")
    engine = gen.get("engine") or {}
    rec["engine_tokens"] = engine.get("generated_tokens")
    # where nakta's time goes (the engine's counters, the load's parts, the process's moments)
    rec["engine"] = {k: engine.get(k) for k in ENGINE_KEYS if k in engine} or None
    rec["nakta_load"] = timing.get("nakta_load")
    rec["events"] = timing.get("events")
    rec["exact_match"] = results.get("exact_match")
    rec["docs"] = results.get("n") or gen.get("answers")
    if rec["docs"] and rec["generate_s"]:
        rec["docs_s"] = rec["docs"] / rec["generate_s"]
    if rec["model"] == "hf":  # nakta has its own run on every doc
        rec["extrapolated_full_wall_s"] = extrapolate(rec)


class Runner:
    """Runs children against the deadline; each one's record (or why it failed / was skipped)."""

    def __init__(self, a: argparse.Namespace, out: Path, work: Path, started: float):
        self.a, self.out, self.work, self.started = a, out, work, started

    def fits(self, timeout_s: float) -> bool:
        if self.a.deadline_s is None:
            return True
        return time.perf_counter() - self.started + timeout_s <= self.a.deadline_s

    def record(self, run: Run) -> dict:
        rec = dict.fromkeys(RUN_KEYS)
        full = min(self.a.limit or TASK_DOCS[self.a.task], TASK_DOCS[self.a.task])
        rec.update(model=run.model, batch_size=run.batch_size, task=self.a.task)
        rec.update(full_docs=full, num_fewshot=self.a.num_fewshot, timeout_s=run.timeout_s)
        rec["max_gen_toks"] = self.a.max_gen_toks or TASK_MAX_GEN
        rec["docs"] = min(run.limit or full, full)  # asked for; lm-eval's count replaces it
        return rec

    def run(self, run: Run, margs: str | None) -> dict:
        rec = self.record(run)
        if margs is None:
            rec["error"] = "skipped: no HF weights (--checkpoint is a Nakta checkpoint)"
            return rec
        if not self.fits(run.timeout_s):
            rec["error"] = f"skipped: a {run.timeout_s:.0f} s run would end past --deadline-s"
            return rec
        work = self.work / "runs" / run.slug
        timing = work / "timing.json"
        env = child_env({"NAKTA_LM_EVAL_TIMING": str(timing)})
        log = self.out / "logs" / f"{run.slug}.log"
        rec["log"] = f"logs/{log.name}"
        cmd = child_command(run, margs, self.a, work / "lm_eval")
        t0 = time.perf_counter()
        rc = run_logged(cmd, env, log, run.timeout_s)
        rec["wall_s"] = time.perf_counter() - t0
        try:
            if rc != 0:
                raise RuntimeError("timed out" if rc == 124 else f"exit code {rc}")
            fill_from_child(rec, json.loads(timing.read_text()), read_results(work, self.a.task))
            rec["max_gen_toks"] = _results_max_gen(work, self.a.task) or rec["max_gen_toks"]
        except (RuntimeError, OSError, KeyError, ValueError) as e:
            rec["error"] = f"{e} (log: {rec['log']})"
        return rec


# ------------------------------------------------------------------ main
def _sample_texts() -> list[str]:
    """Shots and problems of the task: hf's and nakta's tokenizers must agree on them."""
    from nakta_model.tasks.shaped import gsm8k_docs

    docs = gsm8k_docs("train") + gsm8k_docs("test", 16)
    return [f"Question: {d['question']}\nAnswer: {d['answer']}" for d in docs]


def _weights(a, work: Path, out: Path) -> tuple[Weights | None, Path | None, dict]:
    if a.checkpoint:
        ckpt = Path(a.checkpoint).resolve()
        if not ckpt.is_dir():
            raise UsageError(f"--checkpoint {a.checkpoint} is not a directory")
        return None, ckpt, {"weights": ckpt.name}
    from speed_bench.lm_eval_weights import prepare_weights

    if not Path(a.tokenizer).is_file():
        raise UsageError(f"--tokenizer {a.tokenizer} is not a file")
    if a.hf and not (Path(a.hf) / "config.json").is_file():
        raise UsageError(f"--hf {a.hf} has no config.json (an HF LLaMA directory is expected)")
    a.reuse_work = False
    weights, made = prepare_weights(a, work, out, _sample_texts())
    return weights, None, made


def _setup(a, made: dict) -> dict:
    import importlib.metadata as md

    import torch

    setup = {"dtype": a.dtype, "device": a.device, "lm_eval": md.version("lm_eval")}
    with contextlib.suppress(md.PackageNotFoundError):
        setup["transformers"] = md.version("transformers")
    setup.update(torch=torch.__version__, **made)
    return setup


def summarize(device_name: str, gpus: int, runs: list[dict], setup: dict) -> dict:
    summary = {"device_name": device_name, "gpus_available": gpus, "runs": runs}
    summary.update(ratios(runs), target_hf_over_nakta=TARGET, setup=setup)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    return status_of(lambda: _main(parse_args(argv), started))


def _main(a: argparse.Namespace, started: float) -> int:
    import torch

    from bench_common.ceilings import device_slug

    resolve_device(a)
    on_gpu = a.device.startswith("cuda")
    device_name = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    gpus = torch.cuda.device_count() if on_gpu else 0
    default_out = REPO / "speed_bench" / "results" / device_slug(a.device) / "lm_eval_gsm8k_full"
    out = Path(a.out) if a.out else default_out
    out.mkdir(parents=True, exist_ok=True)
    runs_planned = plan(a)
    ctx = contextlib.nullcontext(a.work) if a.work else tempfile.TemporaryDirectory("gsm8k")
    with ctx as work_name:
        work = Path(work_name)
        work.mkdir(parents=True, exist_ok=True)
        weights, ckpt, made = _weights(a, work, out)
        setup = _setup(a, made)
        print(f"weights ready at {time.perf_counter() - started:.1f} s: {made}", flush=True)
        runner, runs = Runner(a, out, work, started), []
        for i, run in enumerate(runs_planned, 1):
            rec = runner.run(run, model_args(run.model, weights, ckpt, a))
            runs.append(rec)
            print(f"[{i}/{len(runs_planned)}] {_describe(rec)}", flush=True)
            write_outputs(summarize(device_name, gpus, runs, setup), out)  # kept if cut short
    summary = summarize(device_name, gpus, runs, setup)
    write_outputs(summary, out)
    print(markdown(summary))
    print(f"wrote {out / 'lm_eval_summary.json'}, .md and .png")
    failed = [r for r in runs if r["error"] and not r["error"].startswith("skipped:")]
    return 1 if failed else 0


def _describe(r: dict) -> str:
    head = f"{r['model']} batch {r['batch_size']}, {r['docs']} docs"
    if r["error"]:
        return f"{head}: {r['error']}"
    tail = ""
    if r["extrapolated_full_wall_s"] is not None:
        tail = f"; all {r['full_docs']} docs extrapolated: {r['extrapolated_full_wall_s']:.1f} s"
    return (
        f"{head}: wall {r['wall_s']:.1f} s (load {r['load_s']:.1f}, generate "
        f"{r['generate_s']:.1f}), {r['answer_tokens']} answer tokens, exact_match "
        f"{r['exact_match']}{tail}"
    )


if __name__ == "__main__":
    sys.exit(main())
