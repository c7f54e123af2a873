"""Worker script for tests/test_parallel.py, run as ``torchrun --nproc_per_node 2 _dist_worker.py``.

``grids JOB OUT``: in ONE world of two processes (one torchrun start costs ~10 s here), for every
case: tp=2 (one replica split over both ranks; loaded from the converted checkpoint, from each
rank's Meta shard and from the Meta dirs themselves) and dp=2 (two replicas, requests sharded
and gathered back in order) compute logits and lm-eval scores; then every bad configuration is
tried and each rank records the error it raised. Rank 0 saves everything to OUT for the test to
compare against one process.

``speed JOB OUT``: speed_bench's Nakta engine at tp=2 and at dp=2, then ``run_all`` at tp=2
(llama_org as Meta's model parallel over both ranks).

``accuracy JOB OUT``: the lm-eval adapter and parity.py at tp=2 and at dp=2.

``bad-world``: ``launch`` with tp=2, dp=2 in a world of 2: must exit 2 with one message.

``pinned-error``: ``launch`` starts the group, ``main`` imports fairscale (whose default
arguments pin the group) and fails: every rank must end with status 2 without the interpreter's
teardown (where a pinned gloo group aborted at random), ``atexit`` handlers still run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from nakta_model.cli import checked_on_every_rank
from nakta_model.config import ModelArgs
from nakta_model.data_parallel import data_parallel_map, map_requests, shard_requests
from nakta_model.loading import load
from nakta_model.parallel import (
    ParallelContext,
    collective_call,
    gather_objects,
    init_parallel,
    launch,
)
from nakta_model.scoring import score
from nakta_model.sources import MetaRankShard

DTYPE = torch.float32
KERNELS = "reference"


def run_case(case: dict, device: str) -> dict:
    tokens = torch.tensor(case["tokens"])
    requests = [(list(c), list(t)) for c, t in case["requests"]]
    out: dict = {}

    ctx = init_parallel(2, 1, checkpoint=case["ckpt_tp2"], device=device)
    model = load(case["ckpt_tp2"], None, DTYPE, ctx, kernels=KERNELS)
    tokens = tokens.to(model.device)
    out["tp_logits"] = model(tokens)
    out["tp_scores"] = score(model, requests)
    model.setup_cache(tokens.shape[0], tokens.shape[1])
    model(tokens[:, :-1], 0)
    out["tp_decode"] = model(tokens[:, -1:], tokens.shape[1] - 1)
    # Meta's own shard of this rank -> Nakta without convert.py (embedding all-gathered)
    shard = torch.load(
        Path(case["meta_mp2"]) / f"consolidated.{ctx.tp_rank:02d}.pth", weights_only=True
    )
    direct = load(MetaRankShard(shard, model.args), None, DTYPE, ctx, kernels=KERNELS)
    out["meta_shard_logits"] = direct(tokens)
    # the Meta dirs themselves (2 shards and 1), read in memory, each rank building its shard
    for name in ("meta_mp2", "meta_mp1"):
        if name in case:
            out[f"{name}_dir_logits"] = load(case[name], None, DTYPE, ctx, kernels=KERNELS)(tokens)
    del model, direct

    ctx = init_parallel(1, 2, checkpoint=case["ckpt_tp1"], device=device)
    model = load(case["ckpt_tp1"], None, DTYPE, ctx, kernels=KERNELS)
    out["dp_scores"] = map_requests(lambda r: score(model, r), requests, ctx)
    out["dp_shard_sizes"] = gather_objects(len(shard_requests(requests, ctx)))
    rows = list(tokens)
    out["dp_logits"] = torch.stack(
        data_parallel_map(lambda rs: [model(r[None])[0].cpu() for r in rs], rows, ctx)
    )
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in out.items()}


def _error_of(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- the test checks type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def _fail_on_rank_1() -> int:
    if torch.distributed.get_rank() == 1:
        raise FileNotFoundError("shard 1 is missing")
    return 0


def _bad_input_on(ranks: tuple[int, ...]) -> int:
    from nakta_model.cli import InputError

    if torch.distributed.get_rank() in ranks:
        raise InputError("--data /nope: no such file")
    return 0


def _one_shard_at_tp2(meta_dir: str, device: str) -> None:
    """The single shard of a 1-shard Meta checkpoint handed to both ranks of tp=2."""
    params = json.loads((Path(meta_dir) / "params.json").read_text())
    shard = torch.load(Path(meta_dir) / "consolidated.00.pth", weights_only=True)
    ctx = init_parallel(2, 1, device=device)
    load(MetaRankShard(shard, ModelArgs.from_meta_params(params)), None, DTYPE, ctx)


def bad_configs(job: dict, device: str) -> dict[str, list[str]]:
    """Each bad set-up, tried in turn; the errors every rank raised, in rank order."""
    bad_heads = ModelArgs(dim=48, n_layers=1, n_heads=3, vocab_size=64)
    cases = {
        "world": lambda: init_parallel(2, 2, device=device),
        "heads": lambda: init_parallel(2, 1, args=bad_heads, device=device),
        "checkpoint_tp": lambda: init_parallel(
            2, 1, checkpoint=job["cases"][0]["ckpt_tp1"], device=device
        ),
        "one_rank_fails": lambda: collective_call(_fail_on_rank_1),
        "input_error_everywhere": lambda: checked_on_every_rank(_bad_input_on, (0, 1)),
        "input_error_on_rank_1": lambda: checked_on_every_rank(_bad_input_on, (1,)),
        "meta_shard_count": lambda: _one_shard_at_tp2(job["cases"][0]["meta_mp1"], device),
        "corrupt_shard": lambda: load(
            job["corrupt_tp2"],
            None,
            DTYPE,
            init_parallel(2, 1, checkpoint=job["corrupt_tp2"], device=device),
        ),
        "checkpoint_tp_at_load": lambda: load(
            job["cases"][0]["ckpt_tp1"], None, DTYPE, init_parallel(2, 1, device=device)
        ),
    }
    return {name: gather_objects(_error_of(fn)) for name, fn in cases.items()}


def grids(job_path: str, out_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    device = job.get("device", "cpu")

    def main(ctx: ParallelContext) -> None:
        results = {
            "cases": [run_case(c, device) for c in job["cases"]],
            "errors": bad_configs(job, device),
        }
        results["describe"] = gather_objects(ctx.describe())
        if ctx.is_leader:
            torch.save(results, out_path)

    launch(main, tp=2, dp=1, device=device)


def speed(job_path: str, out_path: str) -> None:
    """speed_bench under grids: the engine on tp=2 and dp=2, then run_all's CLI at tp=2."""
    import torch.distributed as dist

    from speed_bench import run_all
    from speed_bench.engines import EngineConfig, make_engine
    from speed_bench.weights import RandomWeights
    from speed_bench.workload import synthetic_workload

    job = json.loads(Path(job_path).read_text())
    dist.init_process_group("gloo")  # one world for every grid below (init_parallel reuses it)
    weights = RandomWeights(ModelArgs(**job["args"]), "tiny", seed=3)
    workload = synthetic_workload(job["tasks"], weights.args.vocab_size, 1, 64)
    cfg = EngineConfig(torch.device("cpu"), DTYPE, token_budget=512, max_length=64, progress=False)
    out = {}
    for tp, dp in ((2, 1), (1, 2)):
        ctx = init_parallel(tp, dp, device="cpu")
        engine = make_engine("nakta_cache", weights, cfg, {}, ctx)
        out[f"tp{tp}_dp{dp}"] = engine.score(workload.requests)
    argv = ["--preset", "tiny", "--tp", "2", "--engines", "nakta_cache,llama_org,hf"]
    argv += ["--limit", "6"]
    out["summary"] = run_all.main([*argv, "--out", job["out_dir"], "--no-progress"])
    if dist.get_rank() == 0:
        torch.save(out, out_path)
    dist.destroy_process_group()


def accuracy(job_path: str, out_path: str) -> None:
    """The lm-eval adapter and parity.py on tp=2 and on dp=2 (Meta's 2-shard checkpoint)."""
    import torch.distributed as dist
    from lm_eval.api.instance import Instance

    from accuracy_test import lm_eval_adapter as adapter
    from accuracy_test import parity

    job = json.loads(Path(job_path).read_text())
    dist.init_process_group("gloo")  # one world for every grid below
    out: dict = {}
    for tp, dp in ((2, 1), (1, 2)):
        lm = adapter.NaktaLM(
            checkpoint=job["meta_mp2"], tokenizer=job["tokenizer"], device="cpu",
            dtype="fp32", batch_size=4, tp=tp, dp=dp,
        )  # fmt: skip
        lls = [Instance("loglikelihood", {}, tuple(p), i) for i, p in enumerate(job["pairs"])]
        out[f"ll_tp{tp}_dp{dp}"] = lm.loglikelihood(lls, disable_tqdm=True)
        gens = [Instance("generate_until", {}, (p, {"max_gen_toks": 8}), 0) for p in job["prompts"]]
        out[f"gen_tp{tp}_dp{dp}"] = lm.generate_until(gens, disable_tqdm=True)
        out[f"describe_tp{tp}_dp{dp}"] = lm.parallel.describe()
        dist.barrier()
        lm.close()
        res = Path(job["out_dir"]) / f"parity_tp{tp}_dp{dp}.json"
        argv = ["--checkpoint", job["meta_mp2"], "--tokenizer", job["tokenizer"], "--no-progress"]
        argv += ["--data", job["data"], "--limit", "6", "--device", "cpu", "--out", str(res)]
        parity.main([*argv, "--tp", str(tp), "--dp", str(dp)])
    if dist.get_rank() == 0:
        torch.save(out, out_path)
    dist.barrier()
    dist.destroy_process_group()


def bad_world() -> None:
    launch(lambda ctx: print("must not run", flush=True), tp=2, dp=2, device="cpu")


class _TeardownWitness:
    """Prints when the interpreter's teardown collects it (never after ``os._exit``)."""

    def __del__(self) -> None:
        print("interpreter teardown ran", flush=True)


def pinned_error() -> None:
    import atexit

    import torch.distributed as dist

    def main(ctx: ParallelContext) -> None:
        import fairscale.optim.oss  # noqa: F401  (``group=dist.group.WORLD`` defaults: a pin)

        globals()["witness"] = _TeardownWitness()
        atexit.register(print, f"atexit ran on rank {dist.get_rank()}", flush=True)
        checked_on_every_rank(_fail_everywhere)

    launch(main, tp=2, dp=1, device="cpu")


def _fail_everywhere() -> None:
    from nakta_model.cli import InputError

    raise InputError("--data /nope: no such file")


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "grids":
        grids(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "speed":
        speed(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "accuracy":
        accuracy(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "bad-world":
        bad_world()
    elif sys.argv[1] == "pinned-error":
        pinned_error()
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}")
