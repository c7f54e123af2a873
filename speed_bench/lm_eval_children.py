"""lm-eval child processes as the speed benches run them: the environment, a logged run with a
time limit, lm-eval's results file and the entry's timing file read back (shared by
``lm_eval_speed`` and ``lm_eval_dp``)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from speed_bench.lm_eval_report import TASK

__all__ = ["METRICS", "REPO", "TASKS", "child_env", "phases", "read_results", "run_logged"]

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "accuracy_test" / "tasks"


def child_env(extra: dict) -> dict:
    """This checkout first on the path; the hub left alone (everything here is local)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env["TOKENIZERS_PARALLELISM"] = "false"
    env.update(extra)
    return env


def run_logged(cmd: list, env: dict, log: Path, timeout: float | None) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n\n")
        f.flush()
        try:
            return subprocess.run(
                cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\n(killed after {timeout} s)\n")
            return 124


METRICS = ("acc", "acc_norm", "exact_match")


def read_results(output_dir: Path, task: str = TASK) -> dict:
    """acc / acc_norm / exact_match (those the task has) and the sample count, from lm-eval's
    newest ``results_*.json`` under the dir (a group's sample count: its tasks' sum)."""
    files = sorted(output_dir.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no lm-eval results_*.json under {output_dir}")
    data = json.loads(files[-1].read_text())
    res = data["results"][task]
    samples = data.get("n-samples", {})
    n = samples.get(task, {}).get("effective")
    if n is None and samples:  # a group: every task it ran
        n = sum(v.get("effective", 0) for v in samples.values())
    out = {m: res.get(f"{m},none") for m in METRICS}
    return {**out, "n": n}


def phases(timing: dict, spawn_unix: float) -> dict:
    """From the child's timing file: seconds inside the model's request methods (and of them
    tokenizing), from process start to the first request, and what that request still waited
    for a background load."""
    first = (timing.get("events") or {}).get("first_request")
    entry = timing.get("entry_unix")
    return {
        "requests_s": timing.get("requests_s"),
        # of which lm-eval's strings -> token pairs (the project's adapters, loglikelihood only)
        "tokenize_s": (timing.get("loglikelihood") or {}).get("tokenize_s"),
        "first_request_s": None if first is None or entry is None else entry + first - spawn_unix,
        "load_wait_s": (timing.get("nakta_load") or {}).get("wait_s"),
    }
