"""A mixed lm-eval suite in ONE call vs one call per task on ``--model nakta``, every run a
fresh process through the project's entry: wall, peak GPU memory, and the answers compared
(issue 28 item 1: one KV pool for the scorer and the generation engine, capped while scoring).

    python speed_bench/lm_eval_one_pool.py --preset 7B --tokenizer .data/llama_tokenizer.model \\
        --data .data/hellaswag_val_full.jsonl --limit 40 --out $OUT/one_pool

Tasks (default ``gsm8k_shaped_local,hellaswag_local,mmlu_shaped_local``: ``generate_until``
8-shot, ``loglikelihood`` zero-shot and 5-shot): first all of them in one lm-eval call, then
each task alone. lm-eval runs a call's request types in the order their first task comes, so
the one call generates first (the engine's pool: ~80% of the free GPU memory) and then scores
(the pool trimmed to its cap while scoring). Per run: ``wall_s`` (process start to end), the
timing hook's ``cuda_memory`` (the allocator's peak allocated / reserved bytes over the run,
and per request method with ``allocated_after``: in the one call ``loglikelihood`` should
leave about what it leaves alone, not the engine's pool), and the metrics. The answers are compared doc by
doc from lm-eval's samples: for ``loglikelihood`` the largest |difference| of a
loglikelihood and the count of flipped greedy flags, for ``generate_until`` the answers that
differ (the one call packs other batches, so loglikelihoods may differ at bf16 rounding).

Weights: ``--checkpoint DIR`` (Nakta), else random ``--preset`` weights drawn on the device
(``speed_bench.weights.RandomWeights``, seconds) and written as a Nakta checkpoint into
``--work`` (kept there: a later run with the same preset, seed, dtype and tokenizer reuses it).
Writes ``one_pool_summary.{json,md}`` and the children's logs (``logs/``) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if not __package__:  # run by path: import from this checkout, not from this script's folder
    sys.path[0] = str(REPO)

from speed_bench.lm_eval_children import TASKS, child_env, read_results, run_logged  # noqa: E402
from speed_bench.lm_eval_weights import UsageError, resolve_device, status_of  # noqa: E402

SUITE = "gsm8k_shaped_local,hellaswag_local,mmlu_shaped_local"  # generation first (below)
GIB = 1 << 30


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python speed_bench/lm_eval_one_pool.py", description=__doc__.split("\n\n")[0]
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="random weights of this shape: 7B, ..., tiny")
    src.add_argument("--checkpoint", help="a Nakta checkpoint directory")
    p.add_argument("--tokenizer", required=True, help="sentencepiece model of the weights")
    p.add_argument("--data", required=True, help="HellaSwag .jsonl for hellaswag_local")
    p.add_argument("--tasks", default=SUITE, help="comma-separated lm-eval tasks")
    p.add_argument("--limit", type=int, default=40, help="lm-eval --limit of every run")
    p.add_argument("--max-gen-toks", type=int, default=None, help="override the tasks' budget")
    p.add_argument("--device", default=None, help="default: cuda when there is one")
    p.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp32"))
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-timeout-s", type=float, default=150.0, help="limit of each child")
    p.add_argument("--work", required=True, help="folder for the weights and the runs")
    p.add_argument("--out", required=True, help="folder for the summary and logs")
    a = p.parse_args(argv)
    a.task_list = [t for t in a.tasks.split(",") if t]
    if not a.task_list:
        p.error("--tasks: give at least one task")
    if a.limit < 1:
        p.error("--limit must be >= 1")
    return a


def make_weights(a: argparse.Namespace, work: Path) -> tuple[Path, dict]:
    """The Nakta checkpoint of the run (made, reused, or given) and what making it took."""
    if a.checkpoint:
        ckpt = Path(a.checkpoint).resolve()
        if not ckpt.is_dir():
            raise UsageError(f"--checkpoint {a.checkpoint} is not a directory")
        return ckpt, {"weights": ckpt.name}
    import torch

    from nakta_model.checkpoint import save_checkpoint
    from nakta_model.io_utils import atomic_write_text
    from nakta_model.tokenizer import load_tokenizer
    from speed_bench.lm_eval_weights import DTYPES, preset_args
    from speed_bench.weights import RandomWeights

    if not Path(a.tokenizer).is_file():
        raise UsageError(f"--tokenizer {a.tokenizer} is not a file")
    args = preset_args(a.preset, load_tokenizer(a.tokenizer).n_words, a.max_seq_len)
    stamp = {"preset": a.preset, "seed": a.seed, "dtype": a.dtype, "vocab": args.vocab_size,
             "max_seq_len": a.max_seq_len, "tokenizer": str(Path(a.tokenizer).resolve())}  # fmt: skip
    ckpt, made = work / "nakta", work / "made.json"
    name = f"{a.preset}-random-seed{a.seed}"
    if made.is_file() and json.loads(made.read_text()) == stamp:
        return ckpt, {"weights": name, "make_s": 0.0, "reused": True}
    made.unlink(missing_ok=True)
    t0 = time.perf_counter()
    dtype = getattr(torch, DTYPES[a.dtype])
    sd = RandomWeights(args, name, a.seed).state_dict(torch.device(a.device), dtype)
    save_checkpoint(ckpt, sd, args, dtype=dtype, force=True, tokenizer=a.tokenizer)
    del sd
    atomic_write_text(made, json.dumps(stamp) + "\n")
    return ckpt, {"weights": name, "make_s": time.perf_counter() - t0, "reused": False}


def run_child(a, ckpt: Path, tasks: list[str], name: str, work: Path, out: Path) -> dict:
    """One lm-eval call on ``tasks``: its record (wall, cuda_memory, metrics, error)."""
    run_dir = work / "runs" / name
    res, timing = run_dir / "lm_eval", run_dir / "timing.json"
    timing.unlink(missing_ok=True)
    margs = f"checkpoint={ckpt},dtype={a.dtype},tokenizer={Path(a.tokenizer).resolve()}"
    cmd = [sys.executable, "-m", "accuracy_test.lm_eval_cli", "--model", "nakta"]
    cmd += ["--model_args", margs, "--include_path", str(TASKS), "--tasks", ",".join(tasks)]
    cmd += ["--device", a.device, "--limit", str(a.limit), "--output_path", str(res)]
    cmd += ["--log_samples"]
    if a.max_gen_toks is not None:
        cmd += ["--gen_kwargs", f"max_gen_toks={a.max_gen_toks}"]
    env = child_env({"NAKTA_HELLASWAG_JSONL": str(Path(a.data).resolve())})
    env.update(NAKTA_LM_EVAL_TIMING=str(timing), NAKTA_LM_EVAL_LOCAL_TASKS="1")
    rec: dict = {"name": name, "tasks": tasks, "error": None, "log": f"logs/{name}.log"}
    t0 = time.time()
    rc = run_logged(cmd, env, out / "logs" / f"{name}.log", a.run_timeout_s)
    rec.update(wall_s=time.time() - t0, rc=rc, metrics={}, samples={})
    if rc != 0:
        rec["error"] = f"exit code {rc} (log: {rec['log']})"
        return rec
    t = json.loads(timing.read_text()) if timing.is_file() else {}
    rec.update(cuda_memory=t.get("cuda_memory"), methods_s=t.get("methods"))
    rec["load_s"] = t.get("load_s")
    for task in tasks:
        try:
            rec["metrics"][task] = read_results(res, task)
        except (OSError, KeyError, ValueError) as e:
            rec["error"] = f"no results for {task}: {e}"
    rec["samples"] = read_samples(res)
    return rec


def read_samples(res: Path) -> dict[str, dict[int, list]]:
    """``{task: {doc_id: resps}}`` from lm-eval's ``samples_<task>_<date>.jsonl`` files."""
    out: dict[str, dict[int, list]] = {}
    for f in sorted(res.rglob("samples_*.jsonl")):
        task = f.stem[len("samples_") :].rsplit("_", 1)[0]
        for line in f.read_text().splitlines():
            if line.strip():
                doc = json.loads(line)
                out.setdefault(task, {})[doc["doc_id"]] = doc["resps"]
    return out


def compare(one: dict, alone: dict, tasks: list[str]) -> dict:
    """Per task of ``tasks`` (a group's subtasks counted under it): docs compared, the largest
    |delta loglikelihood|, greedy flags flipped and generated answers that differ."""
    out: dict[str, dict] = {}
    for task, docs in one.get("samples", {}).items():
        other = alone.get("samples", {}).get(task, {})
        owner = next((t for t in tasks if task.startswith(t.removesuffix("_local"))), task)
        rec = out.setdefault(
            owner, {"docs": 0, "max_abs_dll": 0.0, "greedy_flips": 0, "answers_differ": 0}
        )
        for doc_id, resps in docs.items():
            if doc_id not in other:
                continue
            rec["docs"] += 1
            for x, y in zip(_flat(resps), _flat(other[doc_id])):
                if isinstance(x, list) and len(x) == 2 and isinstance(x[0], (int, float)):
                    rec["max_abs_dll"] = max(rec["max_abs_dll"], abs(x[0] - y[0]))
                    rec["greedy_flips"] += bool(x[1]) != bool(y[1])
                elif x != y:
                    rec["answers_differ"] += 1
    return out


def _values(metrics: dict) -> dict:
    """The metrics without the sample count (a group's count sums every task of its call)."""
    return {t: {k: v for k, v in m.items() if k != "n"} for t, m in metrics.items()}


def _flat(resps: list) -> list:
    """A doc's responses, one per request (lm-eval nests each in a one-element list)."""
    return [r[0] if isinstance(r, list) and len(r) == 1 else r for r in resps]


def markdown(summary: dict) -> str:
    lines = [f"# One lm-eval call vs one per task ({summary['device']}, limit {summary['limit']})"]
    lines += [
        "",
        "| run | wall s | peak alloc GiB | peak reserved GiB | per method: peak / after GiB |",
    ]
    lines += ["|---|---|---|---|---|"]
    for r in summary["runs"]:
        mem = r.get("cuda_memory") or {}
        per = ", ".join(
            f"{k} {v['max_allocated'] / GIB:.1f} / {v['allocated_after'] / GIB:.1f}"
            for k, v in (mem.get("methods") or {}).items()
        )
        alloc = f"{mem['max_allocated'] / GIB:.1f}" if mem else "-"
        res = f"{mem['max_reserved'] / GIB:.1f}" if mem else "-"
        wall = f"{r['wall_s']:.1f}" + (f" ({r['error']})" if r["error"] else "")
        lines.append(f"| {r['name']} | {wall} | {alloc} | {res} | {per or '-'} |")
    lines += ["", "| task | metrics (one call) | metrics (alone) | docs | max abs dLL | flips |"]
    lines += ["|---|---|---|---|---|---|"]
    for task, c in summary["compare"].items():
        m1, m2 = summary["metrics_one_call"].get(task), summary["metrics_alone"].get(task)
        flips = c["greedy_flips"] + c["answers_differ"]
        lines.append(f"| {task} | {m1} | {m2} | {c['docs']} | {c['max_abs_dll']:.3g} | {flips} |")
    lines += ["", f"metrics equal: {summary['metrics_equal']}", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return status_of(lambda: _main(parse_args(argv)))


def _main(a: argparse.Namespace) -> int:
    resolve_device(a)
    if not Path(a.data).is_file():
        raise UsageError(f"--data {a.data} is not a file")
    work, out = Path(a.work).resolve(), Path(a.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    ckpt, made = make_weights(a, work)
    print(f"weights: {made}", flush=True)
    runs: list[dict] = []
    samples: dict[str, dict] = {}
    plan = [("one_call", a.task_list)] + [(f"alone_{t}", [t]) for t in a.task_list]
    for name, tasks in plan:  # the summary is rewritten after every run: a cut job keeps them
        rec = run_child(a, ckpt, tasks, name, work, out)
        print(f"{name}: {rec['wall_s']:.1f} s {rec['error'] or ''}", flush=True)
        samples[name] = rec.pop("samples")
        runs.append(rec)
        write_summary(a, out, made, runs, samples)
    print(markdown(json.loads((out / "one_pool_summary.json").read_text())), flush=True)
    return 0 if len(runs) == len(plan) and all(r["error"] is None for r in runs) else 1


def write_summary(a, out: Path, made: dict, runs: list[dict], samples: dict) -> None:
    """``one_pool_summary.{json,md}`` from the runs so far (atomically)."""
    from nakta_model.io_utils import atomic_write_text

    one = runs[0]["metrics"]
    alone = {"samples": {}, "metrics": {}}
    for r in runs[1:]:
        alone["samples"].update(samples[r["name"]])
        alone["metrics"].update(r["metrics"])
    summary = {"device": _device_name(a.device), "limit": a.limit, "tasks": a.task_list}
    summary.update(made=made, metrics_one_call=one, metrics_alone=alone["metrics"])
    summary["compare"] = compare({"samples": samples["one_call"]}, alone, a.task_list)
    summary["metrics_equal"] = bool(one) and _values(one) == _values(alone["metrics"])
    summary["runs"] = runs
    atomic_write_text(out / "one_pool_summary.json", json.dumps(summary, indent=2) + "\n")
    atomic_write_text(out / "one_pool_summary.md", markdown(summary))


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"


if __name__ == "__main__":
    raise SystemExit(main())
