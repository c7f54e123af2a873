"""Tensor and data parallel (nakta_model.parallel): grid layout, request sharding, validation,
and real ``torchrun --nproc_per_node 2`` runs on gloo compared with one process.

The torchrun runs use ``_dist_worker.py`` in a subprocess with a hard timeout (the whole process
session is killed when it expires), so a hanging rank fails the test instead of hanging it.

Here too: nakta_model.spawn, torchrun's standalone launch without torch in the launcher.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from checkpoint_factory import TINY_PARAMS, write_meta_checkpoint

import convert
from accuracy_test.lm_eval_cli import requested_world
from nakta_model import spawn
from nakta_model.config import ModelArgs
from nakta_model.data_parallel import (
    data_parallel_map,
    gather_in_order,
    map_requests,
    shard_indices,
    shard_requests,
)
from nakta_model.loading import load
from nakta_model.parallel import (
    ParallelConfigError,
    ParallelContext,
    collective_call,
    grid_groups,
    grid_position,
    init_parallel,
    launch,
    validate_grid,
)
from nakta_model.scoring import score
from nakta_model.tasks import hellaswag

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_dist_worker.py")
TIMEOUT_S = 180


# ------------------------------------------------------------------------------- pure logic
def test_grid_puts_replicas_on_consecutive_ranks():
    assert grid_groups(2, 3) == ([[0, 1], [2, 3], [4, 5]], [[0, 2, 4], [1, 3, 5]])
    assert grid_groups(4, 1) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])
    assert [grid_position(r, 2, 2) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    with pytest.raises(ValueError, match="rank"):
        grid_position(4, 2, 2)


def test_context_validates_and_numbers_ranks():
    ctx = ParallelContext(tp_rank=1, tp_size=2, dp_rank=2, dp_size=3)
    assert (ctx.rank, ctx.world_size, ctx.is_leader) == (5, 6, False)
    assert ParallelContext().is_leader
    assert ParallelContext(1, 2).rank == 1  # the model's positional (tp_rank, tp_size) form
    for kw, match in [
        (dict(tp_size=0), "tp_size"),
        (dict(tp_rank=2, tp_size=2), "tp_rank"),
        (dict(dp_rank=1), "dp_rank"),
        (dict(dp_size=True), "dp_size"),
    ]:
        with pytest.raises(ValueError, match=match):
            ParallelContext(**kw)


def _requests(n_ctx: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """HellaSwag-like: ``n_ctx`` contexts of varied length, 4 endings each, interleaved a bit."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_ctx):
        ctx = [1] + [rng.randrange(3, 300) for _ in range(rng.randrange(2, 40))]
        out += [(ctx, [rng.randrange(3, 300) for _ in range(rng.randrange(1, 12))]) for _ in "abcd"]
    return out


@pytest.mark.parametrize("dp", [1, 2, 3, 8])
def test_request_shards_cover_everything_once_keep_contexts_together_and_balance(dp):
    reqs = _requests(37)
    shards = [shard_requests(reqs, ParallelContext(dp_rank=r, dp_size=dp)) for r in range(dp)]
    flat = sorted(i for s in shards for i in s)
    assert flat == list(range(len(reqs)))
    assert all(s == sorted(s) for s in shards)
    owner = {i: r for r, s in enumerate(shards) for i in s}
    for i, (c, _) in enumerate(reqs):
        for j, (c2, _) in enumerate(reqs):
            if c == c2:
                assert owner[i] == owner[j], "endings of one context were split"
    costs = [sum(len(reqs[i][0]) + len(reqs[i][1]) for i in s) for s in shards]
    group_cost: dict = {}
    for c, t in reqs:
        group_cost[tuple(c)] = group_cost.get(tuple(c), 0) + len(c) + len(t)
    assert max(costs) - min(costs) <= max(group_cost.values())  # greedy: within one group
    # TP ranks of one replica shard alike without talking: the result depends on dp only
    assert shard_requests(reqs, ParallelContext(1, 2, dp_rank=0, dp_size=dp)) == shards[0]


def test_shard_indices_checks_its_inputs_and_gather_rebuilds_order():
    ctx = ParallelContext(dp_rank=0, dp_size=2)
    with pytest.raises(ValueError, match="keys has 2 entries"):
        shard_indices([1, 1, 1], ctx, keys=["a", "b"])
    with pytest.raises(ValueError, match="costs has 1 entries"):
        data_parallel_map(lambda xs: xs, [1, 2], ParallelContext(), costs=[1])
    # one replica: gather is the identity on its own indices, and checks coverage
    one = ParallelContext()
    assert gather_in_order(["b", "a"], [1, 0], 2, one) == ["a", "b"]
    with pytest.raises(RuntimeError, match="miss item 2"):
        gather_in_order(["a", "b"], [0, 1], 3, one)
    with pytest.raises(RuntimeError, match="overlap"):
        gather_in_order(["a", "b"], [0, 0], 2, one)
    with pytest.raises(ValueError, match="2 results for 1 indices"):
        gather_in_order(["a", "b"], [0], 2, one)
    assert data_parallel_map(lambda xs: [x * 10 for x in xs], [1, 2, 3], one) == [10, 20, 30]
    reqs = _requests(3)
    got = map_requests(lambda rs: [len(c) + len(t) for c, t in rs], reqs, one)
    assert got == [len(c) + len(t) for c, t in reqs]


# ------------------------------------------------------------------ validation, one process
def test_validate_grid_names_the_problem():
    args = ModelArgs(dim=48, n_layers=1, n_heads=3, vocab_size=64)
    cases = [
        (dict(tp=2, dp=2, world_size=2), r"world size 2 != tp 2 x dp 2 = 4"),
        (dict(tp=2, dp=1, world_size=1), r"torchrun --nproc_per_node 2"),
        (dict(tp=0, dp=1, world_size=1), r"--tp must be a positive integer"),
        (dict(tp=1, dp="2", world_size=2), r"--dp must be a positive integer"),
        (dict(tp=3, dp=1, world_size=3, args=args), r"--tp 3 cannot split .* hidden_dim"),
        (dict(tp=2, dp=1, world_size=2, args=args), r"--tp 2 cannot split .* n_heads = 3"),
    ]
    for kw, match in cases:
        with pytest.raises(ParallelConfigError, match=match):
            validate_grid(**kw)
    validate_grid(1, 4, 4, args=args)


def test_checkpoint_sharded_for_another_tp_is_refused(tmp_path):
    meta = write_meta_checkpoint(tmp_path / "meta", TINY_PARAMS)
    ckpt = convert.convert(meta, tmp_path / "tp2", tp=2, quiet=True)
    with pytest.raises(ParallelConfigError, match=r"sharded for tp=2, but this run has --tp 1"):
        validate_grid(1, 2, 2, checkpoint=ckpt)
    with pytest.raises(ParallelConfigError, match="cannot read checkpoint"):
        validate_grid(1, 1, 1, checkpoint=tmp_path / "nowhere")
    validate_grid(2, 3, 6, checkpoint=ckpt)


def test_single_process_needs_no_process_group_and_refuses_a_grid(capsys):
    ctx = init_parallel(1, 1, device="cpu")
    assert ctx == ParallelContext(device=torch.device("cpu"))
    assert not torch.distributed.is_initialized()
    with pytest.raises(ParallelConfigError, match="torchrun --nproc_per_node 4"):
        init_parallel(2, 2, device="cpu")
    assert collective_call(lambda x: x + 1, 1) == 2
    with pytest.raises(ParallelConfigError, match=r"failed on 1 rank\(s\): rank 0: KeyError"):
        collective_call(dict().__getitem__, "x")
    assert launch(lambda c: c.world_size, device="cpu") == 1
    with pytest.raises(SystemExit) as exc:
        launch(lambda c: None, tp=2, device="cpu")
    assert exc.value.code == 2
    assert capsys.readouterr().err.count("error: world size 1 != tp 2") == 1


# --------------------------------------------------------------------------- under torchrun
def _torchrun(args: list[str], tmp_path: Path, expect_ok: bool = True) -> tuple[str, float]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["--monitor-interval", "0.2", str(WORKER), *args]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks: our own session only
        output, _ = proc.communicate()
        pytest.fail(f"torchrun hung for {TIMEOUT_S}s:\n{output.decode()[-3000:]}")
    text = output.decode()
    assert (proc.returncode == 0) == expect_ok, text[-3000:]
    return text, time.perf_counter() - t0


def _tiny_case(tmp_path: Path) -> dict:
    meta = write_meta_checkpoint(tmp_path / "tiny_meta", TINY_PARAMS, seed=5)
    meta2 = write_meta_checkpoint(tmp_path / "tiny_meta2", TINY_PARAMS, n_shards=2, seed=5)
    g = torch.Generator().manual_seed(0)
    return {
        "name": "tiny",
        "meta_mp2": str(meta2),
        "meta_mp1": str(meta),
        "ckpt_tp1": str(convert.convert(meta, tmp_path / "tiny_tp1", tp=1, quiet=True)),
        "ckpt_tp2": str(convert.convert(meta, tmp_path / "tiny_tp2", tp=2, quiet=True)),
        "tokens": torch.randint(3, 300, (3, 12), generator=g).tolist(),
        "requests": _requests(7, seed=1),
    }


def _stories_case(tmp_path: Path, data: Path) -> tuple[dict, list]:
    """The real 2-shard stories260K checkpoint (Meta's fairscale split) -> Nakta tp=2; the
    1-shard original -> tp=1; HellaSwag tasks tokenized with its own tokenizer."""
    docs = hellaswag.load_jsonl(data / "hellaswag_val_subset1000.jsonl", limit=6)
    encode = hellaswag.sentencepiece_encoder(data / "stories260K" / "tokenizer.model")
    ref = json.loads((data / "stories260K_greedy_reference.json").read_text())
    case = {
        "name": "stories260K",
        "meta_mp2": str(data / "stories260K_mp2"),
        "ckpt_tp1": str(convert.convert(data / "stories260K", tmp_path / "st1", quiet=True)),
        "ckpt_tp2": str(convert.convert(data / "stories260K_mp2", tmp_path / "st2", 2, quiet=True)),
        "tokens": [ref["tokens"][:40], ref["tokens"][20:60]],
        "requests": hellaswag.build_requests(docs, encode),
    }
    return case, docs


def _single_process(case: dict, device: str) -> dict:
    model = load(case["ckpt_tp1"], device, torch.float32, kernels="reference")
    tokens = torch.tensor(case["tokens"], device=model.device)
    return {"logits": model(tokens).cpu(), "scores": score(model, case["requests"])}


def _close_scores(got, want, tol: float = 1e-5):
    assert len(got) == len(want)
    for (ll, greedy), (ll_ref, greedy_ref) in zip(got, want):
        assert ll == pytest.approx(ll_ref, rel=tol, abs=10 * tol)
        assert greedy == greedy_ref


@pytest.fixture
def shared_data_or_none(request):
    try:
        return request.getfixturevalue("shared_data")
    except pytest.skip.Exception:
        return None


@pytest.mark.slow
def test_tp2_and_dp2_under_torchrun_equal_one_process(tmp_path, shared_data_or_none):
    # fp32 sums in another order (the all-reduce): 1 of 40,960 stories260K logits was 1.45e-5
    # off in one checkout on an AVX512 machine (and within 1e-5 in another)
    _check_grids(tmp_path, shared_data_or_none, "cpu", tol=3e-5)


@pytest.mark.gpu
def test_tp2_and_dp2_on_two_gpus_with_nccl_equal_one_gpu(tmp_path, shared_data_or_none):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _check_grids(tmp_path, shared_data_or_none, "cuda", tol=1e-4)


def _check_grids(tmp_path: Path, shared_data_or_none, device: str, tol: float) -> None:
    """tp=2 and dp=2 on ``device`` (fp32, reference kernels) == one process; bad set-ups fail
    the same way on both ranks."""
    cases, docs = [_tiny_case(tmp_path)], None
    if shared_data_or_none is not None:
        stories, docs = _stories_case(tmp_path, shared_data_or_none)
        cases.append(stories)
    corrupt = tmp_path / "corrupt_tp2"
    shutil.copytree(cases[0]["ckpt_tp2"], corrupt)
    shard1 = corrupt / "model.tp01-of-02.safetensors"
    shard1.write_bytes(shard1.read_bytes()[:-64])  # rank 1 alone sees a truncated shard
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"cases": cases, "corrupt_tp2": str(corrupt), "device": device}))
    out = tmp_path / "out.pt"
    _torchrun(["grids", str(job), str(out)], tmp_path)
    got = torch.load(out, weights_only=False)

    where = ["cpu", "cpu"] if device == "cpu" else ["cuda:0", "cuda:1"]
    assert got["describe"] == [
        f"rank 0/2: tp 0/2, dp 0/1, {where[0]}",
        f"rank 1/2: tp 1/2, dp 0/1, {where[1]}",
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = [_single_process(c, device) for c in cases]
    finally:
        torch.set_num_threads(threads)
    close = dict(rtol=tol, atol=tol)  # tp: the all-reduce sums in another order
    for case, g, w in zip(cases, got["cases"], want):
        torch.testing.assert_close(g["tp_logits"], w["logits"], **close, msg=case["name"])
        torch.testing.assert_close(g["tp_decode"], w["logits"][:, -1:], **close, msg=case["name"])
        _close_scores(g["tp_scores"], w["scores"], tol)
        # the same weights, straight from Meta's rank shards or the Meta dirs read in memory:
        # the very same numbers as through convert.py --tp 2
        assert torch.equal(g["meta_shard_logits"], g["tp_logits"]), case["name"]
        for name in ("meta_mp2", "meta_mp1"):
            if name in case:
                assert torch.equal(g[f"{name}_dir_logits"], g["tp_logits"]), (case["name"], name)
        # dp: each replica runs the unsplit model on its share
        torch.testing.assert_close(g["dp_logits"], w["logits"], **close, msg=case["name"])
        _close_scores(g["dp_scores"], w["scores"], tol)
        assert sum(g["dp_shard_sizes"]) == len(case["requests"])
        assert min(g["dp_shard_sizes"]) > 0, "one replica got no work"
    if docs is not None:  # the real model: same HellaSwag predictions on every grid
        lls = lambda scores: [ll for ll, _ in scores]  # noqa: E731
        _, ref_docs = hellaswag.evaluate(docs, lls(want[1]["scores"]))
        for key in ("tp_scores", "dp_scores"):
            _, docs_res = hellaswag.evaluate(docs, lls(got["cases"][1][key]))
            assert [(d.pred, d.pred_norm) for d in docs_res] == [
                (d.pred, d.pred_norm) for d in ref_docs
            ]

    errors = got["errors"]
    for name, per_rank in errors.items():
        assert per_rank[0] == per_rank[1], f"{name}: ranks raised different errors {per_rank}"
    expect = {
        "world": r"ParallelConfigError: world size 2 != tp 2 x dp 2 = 4",
        "heads": r"ParallelConfigError: --tp 2 cannot split .* n_heads = 3",
        "checkpoint_tp": r"ParallelConfigError: checkpoint .*tiny_tp1 is sharded for tp=1, but",
        "one_rank_fails": r"failed on 1 rank\(s\): rank 1: FileNotFoundError: shard 1 is missing",
        "input_error_everywhere": r"^ParallelConfigError: --data /nope: no such file$",
        "input_error_on_rank_1": r"^ParallelConfigError: rank 1: --data /nope: no such file$",
        "meta_shard_count": r"failed on 2 rank\(s\): rank 0: CheckpointError: .*shape .*2 shards",
        "corrupt_shard": r"read_rank_state failed on 1 rank\(s\): rank 1: CheckpointError: "
        r".*tp01-of-02",
        "checkpoint_tp_at_load": r"ParallelConfigError: checkpoint .*tiny_tp1 is sharded for tp=1",
    }
    for name, pattern in expect.items():
        assert re.search(pattern, errors[name][0]), errors[name][0]


@pytest.mark.slow
def test_bad_grid_under_torchrun_exits_every_rank_with_one_message(tmp_path):
    text, seconds = _torchrun(["bad-world"], tmp_path, expect_ok=False)
    assert text.count("error: world size 2 != tp 2 x dp 2 = 4") == 1, text[-3000:]
    assert "must not run" not in text
    assert "ParallelConfigError" not in text and '_dist_worker.py", line' not in text  # no trace
    assert "exitcode  : 2" in text  # rank 0 exits by itself (status 2), not killed by torchrun
    assert seconds < 60


@pytest.mark.slow
def test_error_with_a_pinned_group_ends_without_the_interpreter_teardown(tmp_path):
    """fairscale imported while the group is up pins it; the error exit must not leave the
    group to the interpreter's teardown (it aborted there at random: SIGABRT, not status 2)."""
    text, _ = _torchrun(["pinned-error"], tmp_path, expect_ok=False)
    assert text.count("error: --data /nope: no such file") == 1, text[-3000:]
    assert "atexit ran on rank 0" in text  # the program's own exit handlers still run
    assert "interpreter teardown ran" not in text, text[-3000:]
    assert "terminate called" not in text and "SIGABRT" not in text
    assert "exitcode  : 2" in text


@pytest.mark.slow
def test_speed_bench_engine_and_cli_under_torchrun(tmp_path):
    """The bench's Nakta engine gives one process's scores at tp=2 and at dp=2 (the same
    random weights, built shard by shard), and run_all --tp 2 writes one summary from rank 0,
    with llama_org as Meta's model parallel over both ranks agreeing with nakta_cache."""
    from speed_bench.engines import EngineConfig, make_engine
    from speed_bench.weights import RandomWeights
    from speed_bench.workload import synthetic_workload

    args = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, multiple_of=16)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"args": args, "tasks": 12, "out_dir": str(tmp_path / "res")}))
    out = tmp_path / "out.pt"
    _torchrun(["speed", str(job), str(out)], tmp_path)
    got = torch.load(out, weights_only=False)

    weights = RandomWeights(ModelArgs(**args), "tiny", seed=3)
    workload = synthetic_workload(12, 512, 1, 64)
    cfg = EngineConfig(torch.device("cpu"), torch.float32, 512, 64, progress=False)
    want = make_engine("nakta_cache", weights, cfg, {}).score(workload.requests)
    _close_scores(got["tp2_dp1"], want)
    _close_scores(got["tp1_dp2"], want)

    summary = got["summary"]
    assert (summary["gpus"], summary["tp"], summary["dp"]) == (2, 2, 1)
    assert list(summary["engines"]) == ["nakta_cache", "llama_org"]
    assert "single-GPU engine" in summary["skipped"]["hf"]
    # the same weights split two ways (Nakta tp=2, fairscale MP=2): the same scores
    assert summary["reference_engine"] == "llama_org"
    assert summary["engines"]["nakta_cache"]["pred_agree_vs_ref"] == 1.0
    assert summary["engines"]["nakta_cache"]["max_abs_ll_diff_vs_ref"] < 1e-4
    assert len(summary["peak_matmul_tflops_per_gpu"]) == 2
    saved = json.loads((tmp_path / "res" / "summary.json").read_text())
    assert saved["engines"]["nakta_cache"]["tasks_per_s"] > 0


def test_scaling_report_compares_each_grid_with_its_one_gpu_run(tmp_path):
    from speed_bench import scaling

    def run(name, tp, dp, tasks_per_s, preds):
        s = {
            "device": "gpu-x",
            "model": "random-7B",
            "tp": tp,
            "dp": dp,
            "gpus": tp * dp,
            "dtype": "bfloat16",
            "workload": {"name": "hellaswag", "tasks": 4},
            "engines": {
                "nakta_cache": {
                    "tasks_per_s": tasks_per_s,
                    "tokens_per_s": 10 * tasks_per_s,
                    "mfu": 0.5,
                    "peak_mem_gb": 20.0,
                    "acc": 0.25,
                    "acc_norm": 0.5,
                }
            },
            "predictions": {"nakta_cache": {"acc": preds, "acc_norm": "0123"}},
        }
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(s))
        return str(tmp_path / name)

    runs = [
        run("a", 1, 1, 100.0, "0123"),
        run("b", 1, 2, 190.0, "0123"),
        run("c", 2, 1, 150, "0120"),
    ]
    df = scaling.main([*runs, "--out", str(tmp_path / "out")])
    by = {(r.tp, r.dp): r for r in df.itertuples()}
    assert by[(1, 2)].speedup_vs_1gpu == pytest.approx(1.9)
    assert by[(1, 2)].efficiency == pytest.approx(0.95)
    assert by[(1, 2)].pred_agree_vs_1gpu == 1.0
    assert by[(2, 1)].pred_agree_vs_1gpu == 0.75
    for f in ("scaling.csv", "scaling.md", "scaling.json", "scaling.png"):
        assert (tmp_path / "out" / f).is_file()
    with pytest.raises(FileNotFoundError, match="no run_all summary"):
        scaling.load_summary(tmp_path / "nowhere")


@pytest.mark.slow
def test_lm_eval_adapter_and_parity_under_torchrun(tmp_path, shared_data):
    """Meta's real 2-shard stories260K under torchrun: the nakta adapter at tp=2 and at dp=2
    gives one process's log-likelihoods and generations; parity.py finds nakta (on each grid)
    and llama_org (Meta's model parallel over both ranks) in full agreement."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from accuracy_test import lm_eval_adapter as adapter

    docs = hellaswag.load_jsonl(shared_data / "hellaswag_val_subset1000.jsonl", limit=3)
    pairs = [list(p) for d in docs for p in hellaswag.doc_requests(d)] + [["", " the cat"]]
    prompts = ["Once upon a time", "Lily went to the park. She", "The dog"]
    tok = str(shared_data / "stories260K" / "tokenizer.model")
    job = tmp_path / "job.json"
    job.write_text(
        json.dumps(
            {
                "meta_mp2": str(shared_data / "stories260K_mp2"),
                "tokenizer": tok,
                "data": str(shared_data / "hellaswag_val_subset1000.jsonl"),
                "pairs": pairs,
                "prompts": prompts,
                "out_dir": str(tmp_path),
            }
        )
    )
    out = tmp_path / "out.pt"
    _torchrun(["accuracy", str(job), str(out)], tmp_path)
    got = torch.load(out, weights_only=False)

    one = adapter.NaktaLM(
        checkpoint=str(shared_data / "stories260K"), tokenizer=tok, device="cpu", dtype="fp32",
        batch_size=4,
    )  # fmt: skip
    want_ll = one.loglikelihood(
        [Instance("loglikelihood", {}, tuple(p), i) for i, p in enumerate(pairs)], True
    )
    want_gen = one.generate_until(
        [Instance("generate_until", {}, (p, {"max_gen_toks": 8}), 0) for p in prompts], True
    )
    one.close()
    assert got["describe_tp2_dp1"] == "rank 0/2: tp 0/2, dp 0/1, cpu"
    assert got["describe_tp1_dp2"] == "rank 0/2: tp 0/1, dp 0/2, cpu"
    for grid in ("tp2_dp1", "tp1_dp2"):
        _close_scores(got[f"ll_{grid}"], want_ll)
        assert got[f"gen_{grid}"] == want_gen
        res = json.loads((tmp_path / f"parity_{grid}.json").read_text())
        assert res["identical_predictions"], grid
        assert res["ll_abs_diff"]["max"] < 1e-3
        assert (res["config"]["nakta_tp"], res["config"]["nakta_dp"]) == (
            (2, 1) if grid == "tp2_dp1" else (1, 2)
        )
        assert res["config"]["llama_org_mp"] == 2


# ------------------------------------------------------------------------------------------------
# nakta_model.spawn: torchrun's standalone launch without torch in the launcher, and the lm-eval
# entry that starts its own dp ranks with it.
# ------------------------------------------------------------------------------------------------


def _run(args: list[str], timeout: float = 60.0, env: dict | None = None):
    return subprocess.run(
        [sys.executable, "-m", "nakta_model.spawn", *args], capture_output=True, text=True,
        timeout=timeout, cwd=REPO, env=env,
    )  # fmt: skip


def test_parse():
    assert spawn.parse(["--nproc", "2", "-m", "x", "--a", "b"]) == (2, ["-m", "x", "--a", "b"])
    assert spawn.parse(["--nproc_per_node=3", "s.py"]) == (3, ["s.py"])
    for bad, msg in ((["-m", "x"], "first argument"), (["--nproc", "0", "x"], ">= 1"),
                     (["--nproc", "two", "x"], "int"), (["--nproc", "2"], "give what to run")):  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            spawn.parse(bad)


def test_every_rank_gets_its_environment_and_no_torch_is_imported():
    # One os.write a rank: three ranks share the pipe, and print() under PYTHONUNBUFFERED=1
    # writes each argument by itself, so lines could interleave mid-line.
    code = (
        "import os, sys; e = os.environ; os.write(1, (' '.join([e['RANK'], e['LOCAL_RANK'], "
        "e['WORLD_SIZE'], e['LOCAL_WORLD_SIZE'], e['MASTER_ADDR'], e['MASTER_PORT'], "
        "str('torch' in sys.modules)]) + '\\n').encode())"
    )
    out = _run(["--nproc", "3", "-c", code])
    assert out.returncode == 0, out.stderr
    lines = sorted(out.stdout.split("\n")[:-1])
    assert [ln.split()[:4] for ln in lines] == [[str(r), str(r), "3", "3"] for r in range(3)]
    assert len({ln.split()[5] for ln in lines}) == 1  # one port for all
    assert all(ln.split()[6] == "False" for ln in lines)
    check = "import nakta_model.spawn, sys; print('torch' in sys.modules)"
    assert subprocess.check_output([sys.executable, "-c", check], cwd=REPO, text=True) == "False\n"


def test_first_failure_ends_the_others_with_its_status():
    code = (
        "import os, sys, time; r = int(os.environ['RANK']); time.sleep(0.2);"
        " sys.exit(3) if r == 1 else time.sleep(60)"
    )
    t0 = time.monotonic()
    out = _run(["--nproc", "2", "-c", code])
    assert out.returncode == 3 and time.monotonic() - t0 < 20


def test_bad_usage_is_one_line_and_status_2():
    out = _run(["--nproc", "x", "-c", "pass"])
    assert out.returncode == 2 and out.stderr.startswith("spawn: error: --nproc must be an int")


@pytest.mark.parametrize(
    "argv, world",
    [
        (["--model", "nakta", "--model_args", "checkpoint=c,dp=2"], 2),
        (["--model=nakta", "--model_args=checkpoint=c,tp=2,dp=2"], 4),
        (["--model", "nakta", "--model_args", "checkpoint=c"], 1),
        (["--model", "hf", "--model_args", "pretrained=p,dp=2"], 1),
        (["--model", "nakta", "--model_args", "checkpoint=c,dp=x"], 1),
        # lm-eval 0.4.13's forms: words up to the next option, repeats merged, -M/-a, JSON
        (["--model", "nakta", "--model_args", "checkpoint=c", "dp=2", "--tasks", "t"], 2),
        (["--model", "nakta", "--model_args", "dp=2", "--model_args", "checkpoint=c"], 2),
        (["--model", "nakta", "-a", "tp=2", "-a", "dp=3,tp=1"], 3),
        (["-M", "nakta", "-a", "checkpoint=c,tp=2"], 2),
        (["--model", "nakta", "--model_args", '{"checkpoint": "c", "dp": 2}'], 2),
    ],
)
def test_lm_eval_entry_reads_the_world_it_must_start(argv, world):
    assert requested_world(argv) == world


@pytest.mark.slow
def test_lm_eval_entry_starts_its_dp_ranks_itself(tmp_path, shared_data):
    """``--model_args ...,dp=2`` without torchrun: two ranks, one results table, status 0."""
    import convert

    ckpt = convert.convert(shared_data / "stories260K", tmp_path / "ck", quiet=True)
    env = {**os.environ, "NAKTA_HELLASWAG_JSONL": str(shared_data / "hellaswag_val_full.jsonl"),
           "NAKTA_LM_EVAL_LOCAL_TASKS": "1", "NAKTA_LM_EVAL_TIMING": str(tmp_path / "t.json")}  # fmt: skip
    env.pop("WORLD_SIZE", None)
    out = subprocess.run(
        [sys.executable, "-m", "accuracy_test.lm_eval_cli", "--model", "nakta", "--model_args",
         f"checkpoint={ckpt},dp=2", "--device", "cpu", "--include_path", "accuracy_test/tasks",
         "--tasks", "hellaswag_local", "--limit", "6"],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("|hellaswag_local|") == 1  # rank 0 alone prints lm-eval's table
    assert (tmp_path / "t.json").is_file() and (tmp_path / "t.rank1.json").is_file()
