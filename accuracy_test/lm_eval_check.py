"""Does lm-eval, through the ``nakta`` / ``llama_org`` adapters, report parity.py's numbers?

    python -m accuracy_test.lm_eval_check --checkpoint ../shared/data/stories260K \\
        --tokenizer ../shared/data/stories260K/tokenizer.model \\
        --data ../shared/data/hellaswag_val_subset1000.jsonl --dtype bf16 --device cuda

Runs ``parity.py``'s comparison, then lm-eval's ``simple_evaluate`` on the offline
``hellaswag_local`` task (same data file, same batch limits) for both adapters, in one process,
and checks that lm-eval's acc / acc_norm equal parity.py's for each model. Writes JSON +
markdown (``accuracy_test/results/lm_eval_check_<model>_<dtype>_<device>.json`` by default);
exit code 1 when a number differs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from accuracy_test import parity
from nakta_model import knobs, scoring
from nakta_model.io_utils import atomic_write_text

TASKS = Path(__file__).resolve().parent / "tasks"
TASK = "hellaswag_local"


def lm_eval_metrics(
    model: str,
    model_args: dict,
    data: str | Path,
    *,
    limit: int | None,
    batch_size: int,
    device: str,
) -> dict:
    """acc / acc_norm (and the sample count) of one adapter on ``hellaswag_local`` over ``data``."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import accuracy_test.lm_eval_adapter  # noqa: F401  (registers the adapters)

    old = knobs.raw("NAKTA_HELLASWAG_JSONL")
    os.environ["NAKTA_HELLASWAG_JSONL"] = str(data)
    try:
        out = lm_eval.simple_evaluate(
            model=model,
            model_args=model_args,
            tasks=[TASK],
            task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
            device=device,
            batch_size=batch_size,
            limit=limit,
        )
    finally:
        if old is None:
            os.environ.pop("NAKTA_HELLASWAG_JSONL", None)
        else:
            os.environ["NAKTA_HELLASWAG_JSONL"] = old
    res = out["results"][TASK]
    return {"acc": res["acc,none"], "acc_norm": res["acc_norm,none"], "n": res["sample_len"]}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """This tool's own command line; parity.py's namespace is built from it (``parity_args``)."""
    p = argparse.ArgumentParser(
        prog="python -m accuracy_test.lm_eval_check",
        description=__doc__.split("\n\n")[0],
        epilog="Writes JSON + markdown; exit code 0 when every number matches, 1 when one "
        "differs, 2 on bad arguments. Both adapters load --checkpoint (a Meta dir).",
    )
    p.add_argument("--checkpoint", required=True, help="Meta checkpoint dir (both adapters)")
    p.add_argument("--tokenizer", required=True, help="sentencepiece tokenizer.model")
    p.add_argument(
        "--data", required=True, help="HellaSwag jsonl (original or preprocessed) or .txt[.bz2]"
    )
    p.add_argument("--limit", type=int, default=None, help="first N tasks only")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when present)")
    p.add_argument("--token-budget", type=int, default=scoring.DEFAULT_TOKEN_BUDGET)
    p.add_argument("--batch-size", type=int, default=64, help="max rows per batch (both paths)")
    p.add_argument("--out", default=None, help="result JSON path (markdown written beside it)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def parity_args(a: argparse.Namespace) -> argparse.Namespace:
    """parity.py's arguments for the same run (no fp32 truth pass: lm-eval is checked here)."""
    argv = ["--checkpoint", a.checkpoint, "--tokenizer", a.tokenizer, "--data", a.data]
    argv += ["--dtype", a.dtype, "--token-budget", str(a.token_budget)]
    argv += ["--batch-size", str(a.batch_size), "--truth", "none"]
    if a.limit is not None:
        argv += ["--limit", str(a.limit)]
    if a.device:
        argv += ["--device", a.device]
    if a.no_progress:
        argv.append("--no-progress")
    return parity.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    par = parity.run(parity_args(a))
    cfg = par["config"]
    model_args = {
        "checkpoint": a.checkpoint,
        "tokenizer": a.tokenizer,
        "dtype": a.dtype,
        "token_budget": a.token_budget,
    }
    rows, ok = [], True
    for name in ("nakta", "llama_org"):
        got = lm_eval_metrics(
            name, model_args, a.data, limit=a.limit, batch_size=a.batch_size, device=cfg["device"]
        )
        want = par[name]
        match = got["n"] == cfg["n_tasks"] and all(got[k] == want[k] for k in ("acc", "acc_norm"))
        ok &= match
        rows.append(
            {
                "model": name,
                "lm_eval": got,
                "parity": {k: want[k] for k in ("acc", "acc_norm")},
                "match": match,
            }
        )
    result = {"match": ok, "models": rows, "parity": par, "lm_eval_task": TASK}
    name = Path(a.checkpoint).resolve().name
    out = (
        Path(a.out)
        if a.out
        else parity.RESULTS / f"lm_eval_check_{name}_{a.dtype}_{cfg['device']}.json"
    )
    md = [
        f"# lm-eval through the adapters vs parity.py ({name}, {a.dtype}, {cfg['device']})",
        "",
        f"{cfg['n_tasks']} tasks from `{cfg['data']}`; lm-eval task `{TASK}` on the same file.",
        "",
        "| model | lm-eval acc | parity acc | lm-eval acc_norm | parity acc_norm | match |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        md.append(
            f"| {r['model']} | {r['lm_eval']['acc']:.4f} | {r['parity']['acc']:.4f} | "
            f"{r['lm_eval']['acc_norm']:.4f} | {r['parity']['acc_norm']:.4f} | {r['match']} |"
        )
    md += ["", f"nakta vs llama_org flips: {par['n_flips']}"]
    atomic_write_text(out, json.dumps(result, indent=2, sort_keys=True) + "\n")
    atomic_write_text(out.with_suffix(".md"), "\n".join(md) + "\n")
    print("\n".join(md))
    print(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
