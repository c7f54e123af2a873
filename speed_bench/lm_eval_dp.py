"""lm-eval through Nakta on 1 GPU vs data parallel over N, each run a fresh process as a user
types it, and a suite of tasks in one lm-eval call vs one call per task.

    python speed_bench/lm_eval_dp.py --preset 7B --tokenizer .data/llama_tokenizer.model \\
        --data .data/hellaswag_val_full.jsonl --runs 10:2000,0:all --gpus 2 \\
        --suite hellaswag_local,mmlu_shaped_local,gsm8k_shaped_local,bbh_shaped_local \\
        --suite-limit 100 --deadline-s 450

Weights: ``--checkpoint DIR`` (a Nakta checkpoint), else a random ``--preset`` LLaMA made with
transformers and converted by ``convert.py`` (``lm_eval_weights``, as ``lm_eval_speed`` does).
Runs, in this order (most important first): for each ``--runs`` entry ``SHOTS:LIMIT`` every
``--grids`` grid ``TPxDP`` (default ``1x1,1xGPUS``: one GPU, then ``dp=GPUS``; a grid of several
processes under each ``--launchers`` entry; tp > 1 on a copy converted for that tp), with
``--model hf`` beside the ``--hf-grids`` ones (one process; ``parallelize=True`` over tp GPUs:
accelerate's split; its wall is the row's ``hf_wall_s``); then the suite in one call and one
task per call (``--warmup-limit N`` first runs one untimed short run on the first grid, so that
the first timed run does not pay Triton's compiles and a cold page cache alone).

    python speed_bench/lm_eval_dp.py --preset 30B --tokenizer TOK --data HS --runs 0:2000 \
        --grids 4x1,2x2 --hf-grids 4x1 --hf-batch-size 64 --suite "" --launchers nakta A run that could not finish before ``--deadline-s`` (counted from this
command's start, from the run's own time limit) is not started: it is listed as skipped.

Each run's phases come from the driver's clock and every rank's timing file
(``lm_eval_dp_report``). Writes ``lm_eval_dp_summary.{json,md,png}`` and
``lm_eval_dp_ranks.json`` to ``--out`` (default ``speed_bench/results/<device>/lm_eval_dp``).
"""

from __future__ import annotations

import argparse
import contextlib
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
from speed_bench.lm_eval_dp_report import (  # noqa: E402
    markdown,
    rank_phases,
    rank_rows,
    run_phases,
    summary_record,
    write_outputs,
)
from speed_bench.lm_eval_weights import UsageError, resolve_device, status_of  # noqa: E402

TASK = "hellaswag_local"
SUITE = "hellaswag_local,mmlu_shaped_local,gsm8k_shaped_local,bbh_shaped_local"


def parse_runs(text: str) -> list[tuple[int, int | None]]:
    """``"10:2000,0:all"`` -> ``[(10, 2000), (0, None)]``."""
    out = []
    for item in text.split(","):
        shots, _, limit = item.strip().partition(":")
        try:
            n_shots = int(shots)
            n_limit = None if limit in ("", "all") else int(limit)
        except ValueError:
            raise UsageError(
                f"--runs: {item!r} is not SHOTS:LIMIT (LIMIT an int or 'all')"
            ) from None
        if n_shots < 0 or (n_limit is not None and n_limit < 1):
            raise UsageError(f"--runs: {item!r} needs SHOTS >= 0 and LIMIT >= 1")
        out.append((n_shots, n_limit))
    return out


def parse_grids(text: str) -> list[tuple[int, int]]:
    """``"1x1,2x2"`` -> ``[(1, 1), (2, 2)]`` (tp x dp); ``""`` -> ``[]``."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        tp, _, dp = item.partition("x")
        try:
            grid = (int(tp), int(dp))
        except ValueError:
            raise UsageError(f"--grids: {item!r} is not TPxDP (e.g. 2x2)") from None
        if min(grid) < 1:
            raise UsageError(f"--grids: {item!r} needs TP >= 1 and DP >= 1")
        out.append(grid)
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a Nakta checkpoint directory (tokenizer.model in it)")
    src.add_argument("--preset", help="make a random LLaMA of this shape (e.g. 7B), converted")
    p.add_argument("--tokenizer", help="tokenizer file (default: the checkpoint's own)")
    p.add_argument("--data", required=True, help="HellaSwag .jsonl for hellaswag_local")
    p.add_argument("--runs", default="10:2000,0:all", help="SHOTS:LIMIT,... (LIMIT 'all')")
    p.add_argument(
        "--gpus", type=int, default=2,
        help="the dp runs' replicas when --grids is not given (grids 1x1,1xGPUS)",
    )  # fmt: skip
    p.add_argument(
        "--grids", default=None,
        help="TPxDP,... of the nakta runs, each at every --runs entry (1x1: one GPU; 4x1: the "
        "model split over 4 GPUs; 2x2: 2 replicas of tp=2), checkpoints converted per tp",
    )  # fmt: skip
    p.add_argument(
        "--hf-grids", default="",
        help="TPxDP,... whose runs get an hf run beside them at the same shots and limit "
        "(--model hf in one process, parallelize=True over tp GPUs when tp > 1: "
        "accelerate's split); its wall is the row's hf_wall_s",
    )  # fmt: skip
    p.add_argument(
        "--nakta-reads-hf", action="store_true",
        help="--preset: the nakta runs read the random HF folder itself at every tp (no "
        "converted copies: a 30B's are 65 GB and two minutes each)",
    )  # fmt: skip
    p.add_argument("--suite", default=SUITE, help="tasks of the suite runs ('' for none)")
    p.add_argument("--suite-limit", type=int, default=100, help="--limit of the suite runs")
    p.add_argument("--suite-hf", action="store_true", help="the suite with --model hf too")
    p.add_argument(
        "--suite-hf-modes", default="one_call,one_by_one",
        help="hf's suite runs: one_call and/or one_by_one (one_call alone is the comparison a "
        "user makes; one by one costs hf's load per task)",
    )  # fmt: skip
    p.add_argument(
        "--hf-batch-size",
        default="auto",
        help="--batch_size of hf's suite runs (lm-eval's own default is 1 row per forward, "
        "unfairly slow; nakta keeps its default)",
    )
    p.add_argument(
        "--launchers", default="nakta,torchrun",
        help="how the dp runs start their ranks, in order: nakta (the entry's own, with dp=N) "
        "and/or torchrun; the summary holds the first one's runs",
    )  # fmt: skip
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    p.add_argument("--dtype", default=None, help="bf16 on CUDA, fp32 on the CPU by default")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-timeout-s", type=float, default=150.0, help="each run's time limit")
    p.add_argument(
        "--hf-timeout-s", type=float, default=300.0, help="the time limit of a --hf-grids run"
    )
    p.add_argument("--deadline-s", type=float, default=None, help="start no run past this")
    p.add_argument(
        "--warmup-limit",
        type=int,
        default=0,
        help="first an untimed 1-GPU 10-shot run of this many tasks (Triton's compile cache and "
        "the page cache filled for every timed run alike; 0: none)",
    )
    p.add_argument("--out", default=None)
    p.add_argument("--work", default=None, help="folder for the weights and runs (default: tmp)")
    a = p.parse_args(argv)
    a.run_list = parse_runs(a.runs)
    a.suite_tasks = [t for t in a.suite.split(",") if t]
    if not set(a.suite_hf_modes.split(",")) <= {"one_call", "one_by_one"}:
        p.error(f"--suite-hf-modes: one_call and/or one_by_one, got {a.suite_hf_modes!r}")
    a.launcher_list = [x for x in a.launchers.split(",") if x]
    if not a.launcher_list or set(a.launcher_list) - {"nakta", "torchrun"}:
        p.error(f"--launchers: nakta and/or torchrun, got {a.launchers!r}")
    try:
        a.grid_list = parse_grids(a.grids or f"1x1,1x{a.gpus}")
        a.hf_grid_list = parse_grids(a.hf_grids)
    except UsageError as e:
        p.error(str(e))
    if a.grids is None and a.gpus < 2:
        p.error("--gpus must be >= 2 (the dp runs), or give --grids")
    if set(a.hf_grid_list) - set(a.grid_list):
        p.error(f"--hf-grids {a.hf_grids}: every grid must be one of --grids")
    bs = a.hf_batch_size
    tail = bs[len("auto:") :] if bs.startswith("auto:") else bs
    if bs != "auto" and not (tail.isdigit() and int(tail) >= 1):
        p.error(f"--hf-batch-size: auto, auto:N or an int >= 1, got {bs!r}")
    return a


def _weights(a: argparse.Namespace, work: Path, out: Path) -> tuple[Path, Path | None, dict]:
    """``(nakta checkpoint, HF dir or None, what making them took)``."""
    if a.checkpoint:
        return Path(a.checkpoint).resolve(), None, {"weights": Path(a.checkpoint).name}
    from nakta_model.tokenizer import load_tokenizer
    from speed_bench.lm_eval_weights import (
        convert,
        make_random_hf,
        preset_args,
        write_hf_tokenizer,
    )

    args = preset_args(a.preset, load_tokenizer(a.tokenizer).n_words, a.max_seq_len)
    t0 = time.perf_counter()
    make_random_hf(work / "hf", args, a.dtype, a.device, a.seed)
    write_hf_tokenizer(work / "hf", a.tokenizer, args.max_seq_len)
    made = {"make_hf_s": time.perf_counter() - t0, "weights": f"{a.preset}-random-seed{a.seed}"}
    if a.nakta_reads_hf:  # the checkpoint the adapter reads at any tp, as a user's HF download
        return work / "hf", work / "hf", made
    tps = {tp for tp, _ in a.grid_list}
    if 1 in tps:  # (a 30B's copies are 65 GB each: none that no grid reads)
        made["convert_s"] = convert(
            work / "hf", work / "nakta", a.dtype, out / "logs" / "convert.log"
        )
    for tp in sorted(tps - {1}):  # a checkpoint sharded per tp
        made[f"convert_tp{tp}_s"] = convert(
            work / "hf", work / f"nakta_tp{tp}", a.dtype, out / "logs" / f"convert_tp{tp}.log", tp
        )
    return work / "nakta", work / "hf", made


def checkpoint_for(ckpt: Path, tp: int) -> Path:
    """The Nakta checkpoint of a run at ``tp``: ``ckpt`` itself at tp=1, else the copy converted
    for that tp beside it (``--preset``), or ``ckpt`` when it is sharded for it (``--checkpoint``,
    checked by the adapter)."""
    sharded = ckpt.parent / f"{ckpt.name}_tp{tp}"
    return sharded if tp > 1 and sharded.is_dir() else ckpt


def _command(
    a, model_args: str, model: str, tasks: str, shots, limit, gpus: int, out: Path,
    launcher: str = "torchrun", batch_size: str | None = None,
):  # fmt: skip
    """The child's command line. ``launcher`` for ``gpus > 1``: ``torchrun`` (``python -m
    torch.distributed.run --standalone``) or ``nakta`` (the entry starts its ``dp`` ranks
    itself through ``nakta_model.spawn``: the same command as one GPU, with ``dp=N``).
    ``batch_size``: lm-eval's ``--batch_size`` (None: not passed)."""
    cmd = [sys.executable]
    if gpus > 1 and launcher == "torchrun":
        cmd += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpus)]
    cmd += ["-m", "accuracy_test.lm_eval_cli", "--model", model, "--model_args", model_args]
    cmd += ["--include_path", str(TASKS), "--tasks", tasks, "--device", a.device]
    cmd += ["--output_path", str(out)]
    if shots is not None:
        cmd += ["--num_fewshot", str(shots)]
    if limit is not None:
        cmd += ["--limit", str(limit)]
    if batch_size is not None:
        cmd += ["--batch_size", str(batch_size)]
    return cmd


class Runner:
    """Runs children against the deadline; each one's record (or why it failed / was skipped)."""

    def __init__(self, a: argparse.Namespace, out: Path, work: Path, started: float):
        self.a, self.out, self.work, self.started = a, out, work, started

    def _time_left(self, timeout_s: float) -> bool:
        if self.a.deadline_s is None:
            return True
        return time.perf_counter() - self.started + timeout_s <= self.a.deadline_s

    def run(
        self, name: str, cmd: list, extra_env: dict | None = None, timeout_s: float | None = None
    ) -> dict:
        """One child: wall, exit status, its rank timing files read back."""
        work = self.work / "runs" / name
        timing = work / "timing.json"
        env = child_env({"NAKTA_HELLASWAG_JSONL": str(Path(self.a.data).resolve())})
        env.update(NAKTA_LM_EVAL_TIMING=str(timing), NAKTA_LM_EVAL_LOCAL_TASKS="1")
        env.update(extra_env or {})
        rec: dict = {"name": name, "error": None, "log": f"logs/{name}.log"}
        timeout_s = self.a.run_timeout_s if timeout_s is None else timeout_s
        if not self._time_left(timeout_s):
            rec["error"] = "skipped: not enough time left before --deadline-s"
            return rec
        spawn = time.time()
        rc = run_logged(cmd, env, self.out / "logs" / f"{name}.log", timeout_s)
        end = time.time()
        rec.update(spawn_unix=spawn, end_unix=end, wall_s=end - spawn, rc=rc)
        files = sorted(timing.parent.glob("timing*.json")) if timing.parent.is_dir() else []
        rec["ranks"] = [rank_phases(json.loads(f.read_text())) for f in files]
        rec["ranks"].sort(key=lambda r: r["rank"])
        rec["lm_eval_out"] = str(work / "lm_eval")
        if rc != 0:
            rec["error"] = f"exit code {rc} (log: {rec['log']})"
        return rec


def measure_dp(a, runner: Runner, ckpt: Path, hf: Path | None = None) -> tuple[list[dict], dict]:
    """Every ``--runs`` entry on every ``--grids`` grid (a grid of several processes under each
    launcher), and hf beside the ``--hf-grids`` ones; the summary's runs are the one-process
    runs and the first launcher's, with hf's wall (the others are in ``ranks``, by name)."""
    runs, ranks = [], {}
    for shots, limit in a.run_list:
        for tp, dp in a.grid_list:
            gpus = tp * dp
            row: dict = {}
            for launcher in [None] if gpus == 1 else a.launcher_list:
                name = f"{TASK}_{shots}shot_{limit or 'all'}_{gpus}gpu"
                name += f"_tp{tp}" if tp > 1 else ""
                if launcher and launcher != a.launcher_list[0]:
                    name += f"_{launcher}"
                margs = f"checkpoint={checkpoint_for(ckpt, tp)},dtype={a.dtype}"
                margs += (f",tp={tp}" if tp > 1 else "") + (f",dp={dp}" if dp > 1 else "")
                if a.tokenizer:
                    margs += f",tokenizer={Path(a.tokenizer).resolve()}"
                out = runner.work / "runs" / name / "lm_eval"
                cmd = _command(a, margs, "nakta", TASK, shots, limit, gpus, out, launcher or "")
                rec = runner.run(name, cmd)
                got = dict(gpus=gpus, tp=tp, dp=dp, task=TASK, num_fewshot=shots, limit=limit)
                got.update(wall_s=None, first_request_s=None, scoring_s=None, after_scoring_s=None)
                got.update(preset=a.preset, acc=None, hf_wall_s=None)
                if "spawn_unix" in rec:
                    got.update(run_phases(rec["ranks"], rec["spawn_unix"], rec["end_unix"]))
                if rec["error"] is None:
                    try:
                        got["acc"] = read_results(Path(rec["lm_eval_out"]), TASK)["acc"]
                    except (OSError, KeyError, ValueError) as e:
                        rec["error"] = f"no results: {e}"
                print(f"{name}: {_describe(got, rec)}", flush=True)
                info = {k: rec.get(k) for k in ("spawn_unix", "end_unix", "ranks", "error", "log")}
                info.update(ranks=info["ranks"] or [], launcher=launcher, preset=a.preset)
                info.update(tp=tp, dp=dp, num_fewshot=shots, limit=limit)
                if got.get("wall_s") is not None:
                    info["wall_s"] = got["wall_s"]
                ranks[name] = info
                if launcher in (None, a.launcher_list[0]):
                    row = got
            if (tp, dp) in a.hf_grid_list and hf is not None:
                row["hf_wall_s"], ranks[f"hf_{shots}shot_{limit or 'all'}_tp{tp}"] = _hf_run(
                    a, runner, hf, shots, limit, tp
                )
            runs.append(summary_record(row))
    return runs, ranks


HF_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _hf_run(a, runner: Runner, hf: Path, shots: int, limit, tp: int) -> tuple[float | None, dict]:
    """``--model hf`` on the same weights, one process (``parallelize=True``: accelerate splits
    the model over ``tp`` GPUs); its wall (None when it failed) and its record."""
    name = f"hf_{shots}shot_{limit or 'all'}_tp{tp}"
    margs = f"pretrained={hf},tokenizer={hf},dtype={HF_DTYPES[a.dtype]}"
    margs += ",parallelize=True" if tp > 1 else ""
    out = runner.work / "runs" / name / "lm_eval"
    cmd = _command(a, margs, "hf", TASK, shots, limit, 1, out, "", a.hf_batch_size)
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(tp))} if tp > 1 else None
    rec = runner.run(name, cmd, env, a.hf_timeout_s)
    info = {k: rec.get(k) for k in ("spawn_unix", "end_unix", "error", "log", "wall_s")}
    info.update(ranks=[], launcher=None, preset=a.preset, tp=tp, dp=1, model="hf")
    info.update(num_fewshot=shots, limit=limit)
    if rec["error"] is None:
        with contextlib.suppress(OSError, KeyError, ValueError):
            info["acc"] = read_results(Path(rec["lm_eval_out"]), TASK)["acc"]
    print(f"{name}: wall {rec.get('wall_s') or 0:.1f} s {rec['error'] or ''}", flush=True)
    return (rec.get("wall_s") if rec["error"] is None else None), info


def measure_suite(a, runner: Runner, ckpt: Path, hf: Path | None) -> list[dict]:
    """The suite in one call, then one call per task; nakta (its default batch size), and hf
    (at ``--hf-batch-size``) when asked for."""
    if not a.suite_tasks:
        return []
    models = [("nakta", f"checkpoint={ckpt},dtype={a.dtype}", None)]
    if a.tokenizer:
        models[0] = ("nakta", models[0][1] + f",tokenizer={Path(a.tokenizer).resolve()}", None)
    if a.suite_hf and hf is not None:
        margs = f"pretrained={hf},tokenizer={hf},dtype={HF_DTYPES[a.dtype]}"
        models.append(("hf", margs, a.hf_batch_size))
    out = []
    hf_modes = [m for m in a.suite_hf_modes.split(",") if m]
    for model, margs, batch_size in models:
        for mode in ("one_call", "one_by_one"):
            if model == "hf" and mode not in hf_modes:
                continue
            groups = [a.suite_tasks] if mode == "one_call" else [[t] for t in a.suite_tasks]
            rec = {"model": model, "mode": mode, "tasks": a.suite_tasks, "limit": a.suite_limit}
            rec.update(batch_size=batch_size or "default", wall_s=0.0, acc={}, error=None)
            for tasks in groups:
                name = f"suite_{model}_{mode}_{'+'.join(tasks) if len(tasks) == 1 else 'all'}"
                res = runner.work / "runs" / name / "lm_eval"
                cmd = _command(
                    a, margs, model, ",".join(tasks), None, a.suite_limit, 1, res, "", batch_size
                )
                got = runner.run(name, cmd)
                rec["wall_s"] += got.get("wall_s") or 0.0
                if got["error"]:
                    rec["error"] = f"{name}: {got['error']}"
                    break
                for task in tasks:
                    with contextlib.suppress(OSError, KeyError, ValueError):
                        r = read_results(res, task)
                        rec["acc"][task] = r["acc"] if r["acc"] is not None else r["exact_match"]
            print(
                f"suite {model} {mode}: wall {rec['wall_s']:.1f} s {rec['error'] or ''}", flush=True
            )
            out.append(rec)
    return out


def _describe(row: dict, rec: dict) -> str:
    if rec["error"]:
        return f"FAILED/SKIPPED {rec['error']}"
    parts = [
        f"{k[:-2]} {row[k]:.1f}"
        for k in ("wall_s", "first_request_s", "scoring_s", "after_scoring_s")
        if row[k] is not None
    ]
    return ", ".join(parts) + f", acc {row['acc']}"


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    return status_of(lambda: _main(parse_args(argv), started))


def _main(a: argparse.Namespace, started: float) -> int:
    import torch

    from bench_common.ceilings import device_slug

    resolve_device(a)
    if not Path(a.data).is_file():
        raise UsageError(f"--data {a.data}: no such file")
    if a.preset and not a.tokenizer:
        raise UsageError("--preset needs --tokenizer (the random model's vocabulary)")
    on_gpu = a.device.startswith("cuda")
    most = max(tp * dp for tp, dp in a.grid_list)
    if on_gpu and torch.cuda.device_count() < most:
        raise UsageError(f"grid of {most} GPUs: only {torch.cuda.device_count()} GPU(s) visible")
    out = (
        Path(a.out)
        if a.out
        else REPO / "speed_bench" / "results" / device_slug(a.device) / "lm_eval_dp"
    )
    out.mkdir(parents=True, exist_ok=True)
    ctx = contextlib.nullcontext(a.work) if a.work else tempfile.TemporaryDirectory("lm_eval_dp")
    with ctx as work_name:
        work = Path(work_name)
        ckpt, hf, made = _weights(a, work, out)
        print(f"weights ready at {time.perf_counter() - started:.1f} s: {made}", flush=True)
        runner = Runner(a, out, work, started)
        if a.warmup_limit:  # on the first grid (its checkpoint: no tp=1 copy needed)
            tp, dp = a.grid_list[0]
            margs = f"checkpoint={checkpoint_for(ckpt, tp)},dtype={a.dtype}"
            margs += (f",tp={tp}" if tp > 1 else "") + (f",dp={dp}" if dp > 1 else "")
            res = work / "runs" / "warmup" / "lm_eval"
            cmd = _command(a, margs, "nakta", TASK, 10, a.warmup_limit, tp * dp, res, "nakta")
            warm = runner.run("warmup", cmd)
            print(f"warm-up: {warm.get('wall_s', 0):.1f} s {warm['error'] or ''}", flush=True)
        runs, ranks = measure_dp(a, runner, ckpt, hf)
        suite = measure_suite(a, runner, ckpt, hf)
    summary = {
        "device_name": torch.cuda.get_device_name(0) if on_gpu else "cpu",
        "gpus_available": torch.cuda.device_count() if on_gpu else 0,
        "runs": runs,
        "ranks": rank_rows(ranks),
    }
    write_outputs(summary, out, ranks, suite)
    print(markdown(summary, ranks, suite))
    print(f"wrote {out / 'lm_eval_dp_summary.json'}, .md, .png and lm_eval_dp_ranks.json")
    failed = [r for r in ranks.values() if r["error"]] + [s for s in suite if s["error"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
