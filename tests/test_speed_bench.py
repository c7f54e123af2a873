"""speed_bench: embedded workload, token accounting, shared weights, and run_all end to end.

The end-to-end run is the README's main job on the tiny preset: it must write a complete
summary, and the engines must agree with Meta's code on the same random weights (same
predictions, log-likelihoods equal to fp32 rounding).

Here too: read_bench (every reader, every condition) and families_report (the families' rows read
from the benches' own summaries).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from nakta_model.config import preset
from nakta_model.tasks.hellaswag import Doc, build_requests, load_jsonl, sentencepiece_encoder
from speed_bench import families_report, read_bench
from speed_bench.weights import RandomWeights, matmul_params
from speed_bench.workload import (
    HISTOGRAM_PATH,
    Workload,
    load_histogram,
    measure,
    mmlu_shaped_workload,
    synthetic_workload,
)


def _hist_mean(counts: dict[str, int]) -> float:
    return sum(int(k) * v for k, v in counts.items()) / sum(counts.values())


# ----------------------------------------------------------------------------- histogram
def test_committed_histogram_loads_and_describes_hellaswag():
    hist = load_histogram()
    assert hist["n_tasks"] == 10042
    assert sum(hist["context_tokens_with_bos"].values()) == 10042
    assert sum(hist["continuation_tokens"].values()) == 4 * 10042
    # HellaSwag under the LLaMA tokenizer: ~57-token contexts (with BOS), ~33-token endings.
    assert 50 < _hist_mean(hist["context_tokens_with_bos"]) < 65
    assert 28 < _hist_mean(hist["continuation_tokens"]) < 38
    assert 3.0 < hist["chars_per_continuation_token"] < 6.0


def test_histogram_rejects_missing_fields(tmp_path):
    bad = tmp_path / "h.json"
    bad.write_text(json.dumps({"context_tokens_with_bos": {"3": 1}}))
    with pytest.raises(ValueError, match="continuation_tokens"):
        load_histogram(bad)


def test_measure_matches_lm_eval_request_building(shared_data, tmp_path):
    """The histogram script counts exactly the tokens nakta's lm-eval request builder makes."""
    rows = (shared_data / "hellaswag_val_subset1000.jsonl").read_text().splitlines()[:40]
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(rows) + "\n")
    tok = shared_data / "llama_tokenizer.model"
    hist = measure(data, tok)
    requests = build_requests(load_jsonl(data), sentencepiece_encoder(tok))
    ctx_counts: dict[str, int] = {}
    cont_counts: dict[str, int] = {}
    for i, (ctx, cont) in enumerate(requests):
        if i % 4 == 0:
            ctx_counts[str(len(ctx))] = ctx_counts.get(str(len(ctx)), 0) + 1
        cont_counts[str(len(cont))] = cont_counts.get(str(len(cont)), 0) + 1
    assert hist["context_tokens_with_bos"] == dict(
        sorted(ctx_counts.items(), key=lambda kv: int(kv[0]))
    )
    assert hist["continuation_tokens"] == dict(
        sorted(cont_counts.items(), key=lambda kv: int(kv[0]))
    )


# ----------------------------------------------------------------------------- workload
def test_synthetic_workload_follows_histogram_and_is_seeded():
    hist = json.loads(HISTOGRAM_PATH.read_text())
    w = synthetic_workload(600, 32000, seed=3)
    assert w.n_tasks == 600 and len(w.requests) == 2400
    ctx_mean = sum(len(c) for c, _ in w.requests[::4]) / 600
    cont_mean = sum(len(x) for _, x in w.requests) / 2400
    assert abs(ctx_mean - _hist_mean(hist["context_tokens_with_bos"])) < 3
    assert abs(cont_mean - _hist_mean(hist["continuation_tokens"])) < 2
    assert all(c[0] == 1 and min(c[1:] + x) >= 3 and max(c + x) < 32000 for c, x in w.requests)
    # four endings share one context object per task
    assert all(w.requests[4 * t][0] == w.requests[4 * t + 3][0] for t in range(600))
    again = synthetic_workload(600, 32000, seed=3)
    assert again.requests == w.requests and [d.label for d in again.docs] == [
        d.label for d in w.docs
    ]
    assert synthetic_workload(600, 32000, seed=4).requests != w.requests


def test_synthetic_workload_respects_max_length_and_bad_args():
    w = synthetic_workload(50, 256, seed=0, max_length=40)
    assert w.max_length() <= 40 - 1
    assert w.max_token_id() < 256
    with pytest.raises(ValueError, match="max_length"):
        synthetic_workload(4, 256, max_length=10)
    with pytest.raises(ValueError, match="n_tasks"):
        synthetic_workload(0, 256)
    with pytest.raises(ValueError, match="vocab_size"):
        synthetic_workload(4, 2)


def test_token_accounting_by_hand():
    docs = [Doc("", ("aa", "bbb"), 0), Doc("", ("c",), 0)]
    requests = [([1, 5, 6], [7, 8]), ([1, 5, 6], [9]), ([1, 4], [3, 3, 3])]
    w = Workload("hand", docs, requests)
    assert w.request_tokens() == (3 + 2 - 1) + (3 + 1 - 1) + (2 + 3 - 1)  # 4 + 3 + 4
    # the trie of model inputs: [1 5 6 7], [1 5 6] inside it, [1 4 3 3] sharing BOS
    assert w.unique_tokens() == 4 + 0 + 3
    assert w.scored_tokens() == 6
    assert w.max_length() == 4
    sub = w.spread(1)
    assert sub.n_tasks == 1 and sub.requests == requests[:2]
    with pytest.raises(ValueError, match="requests"):
        Workload("bad", docs, requests[:2])
    # an ending repeated within a task is computed once by the shared-context scorer
    dup = Workload("dup", [Doc("", ("a", "a"), 0)], [([1, 2], [3, 4]), ([1, 2], [3, 4])])
    assert dup.unique_tokens() == 2 + 1 and dup.request_tokens() == 6


# ----------------------------------------------------------------------------- weights
def test_matmul_params_of_7b():
    blocks, head = matmul_params(preset("7B"))
    assert blocks == 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    assert head == 32000 * 4096


def test_random_weights_are_reproducible_and_sane():
    src = RandomWeights(preset("tiny"), "random-tiny", seed=1)
    a = src.state_dict(torch.device("cpu"), torch.float32)
    b = src.state_dict(torch.device("cpu"), torch.float32)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = RandomWeights(preset("tiny"), "random-tiny", seed=2).state_dict(
        torch.device("cpu"), torch.float32
    )
    assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])
    wq = a["layers.0.attention.wq.weight"]
    assert abs(wq.std().item() - wq.shape[1] ** -0.5) < 0.2 * wq.shape[1] ** -0.5
    assert torch.equal(a["norm.weight"], torch.ones_like(a["norm.weight"]))
    assert preset("tiny").to_meta_params()["n_kv_heads"] == 2
    assert "n_kv_heads" not in preset("7B").to_meta_params()  # LLaMA-1 params.json has none


def test_meta_shards_are_fairscale_splits_of_the_same_weights(shared_data):
    """Rank r's shard (llama_org under torchrun) is Meta's own MP split: the real 2-shard
    stories260K files, byte for byte, from the 1-shard checkpoint; random weights' shards
    concatenate back to the unsplit tensors, norms whole on every rank."""
    from nakta_model.layout import meta_split_dim
    from speed_bench.weights import CheckpointWeights

    cpu = torch.device("cpu")
    one = CheckpointWeights(shared_data / "stories260K")
    for rank in (0, 1):
        mine = one.meta_shard_state_dict(cpu, torch.float32, rank, 2)
        meta = torch.load(
            shared_data / "stories260K_mp2" / f"consolidated.0{rank}.pth", weights_only=True
        )
        meta = {k: v for k, v in meta.items() if k in mine}
        assert mine.keys() == meta.keys()
        assert all(torch.equal(mine[k], meta[k]) for k in mine), rank
    src = RandomWeights(preset("tiny"), "t", seed=4)
    full = src.state_dict(cpu, torch.float32)
    shards = [src.meta_shard_state_dict(cpu, torch.float32, r, 2) for r in (0, 1)]
    for name, t in full.items():
        dim = meta_split_dim(name)
        parts = [s[name] for s in shards]
        if dim is None:
            assert all(torch.equal(p, t) for p in parts), name
        else:
            assert all(p.is_contiguous() for p in parts)
            assert torch.equal(torch.cat(parts, dim), t), name
    with pytest.raises(ValueError, match="does not split into 3 shards"):
        src.meta_shard("layers.0.attention.wq.weight", cpu, torch.float32, 0, 3)


def test_hf_weight_conversion_round_trips():
    from nakta_model.layout import from_hf_state_dict
    from speed_bench.hf_speed import meta_to_hf

    args = preset("tiny")
    meta = RandomWeights(args, "t", seed=0).state_dict(torch.device("cpu"), torch.float32)
    back = from_hf_state_dict(meta_to_hf(dict(meta), args), args)
    assert back.keys() == meta.keys()
    assert all(torch.equal(back[k], meta[k]) for k in meta)


# ----------------------------------------------------------------------------- end to end
def test_run_all_tiny_end_to_end(tmp_path, capsys):
    from speed_bench.hf_speed import unavailable_reason
    from speed_bench.run_all import main

    engines = ["nakta", "nakta_cache", "llama_org"] + ([] if unavailable_reason() else ["hf"])
    summary = main(
        ["--preset", "tiny", "--limit", "6", "--warmup", "1", "--device", "cpu",
         "--engines", ",".join(engines), "--out", str(tmp_path), "--no-progress"]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert f"results -> {tmp_path}" in printed and "nakta_cache_vs_llama_org" in printed
    for f in ("summary.json", "speed.csv", "speed.md", "speed.png"):
        assert (tmp_path / f).stat().st_size > 0, f
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["engines"].keys() == set(engines) == summary["engines"].keys()
    wl = on_disk["workload"]
    assert wl["tasks"] == 6 and wl["unique_tokens"] < wl["request_tokens"]
    assert on_disk["reference_engine"] == "llama_org"
    assert on_disk["peak_matmul_tflops"] > 0
    sustained = on_disk["sustained_matmul_tflops"]  # measured on a GPU only
    assert (sustained is None) == (not torch.cuda.is_available())
    for name, r in on_disk["engines"].items():
        for key in ("tasks_per_s", "tokens_per_s", "mfu", "mfu_unique", "acc", "acc_norm",
                    "wall_s", "computed_tokens"):  # fmt: skip
            assert key in r, (name, key)
        assert "peak_mem_gb" in r  # None on the CPU
        assert r["tasks_per_s"] > 0 and r["tokens_per_s"] > 0
        assert 0 < r["mfu_unique"] <= r["mfu"]
        if torch.cuda.is_available():  # a CPU's measured matmul rate is too noisy to bound MFU
            assert r["mfu"] < 1.0
        assert math.isclose(r["tokens_per_s"] / r["tasks_per_s"], wl["request_tokens"] / 6)
        # same weights, same requests: same predictions as Meta's code, lls to fp32 rounding
        assert r["pred_agree_vs_ref"] == 1.0, name
        assert r["max_abs_ll_diff_vs_ref"] < 1e-3, name
    acc = {n: (r["acc"], r["acc_norm"]) for n, r in on_disk["engines"].items()}
    assert len(set(acc.values())) == 1, acc
    # contexts once per row (a task whose endings overflow the tiny model's 128 tokens takes
    # several rows); at least the unique tokens (the trie counts the common BOS once)
    from nakta_model.score_batches import build_rows
    from speed_bench.workload import synthetic_workload as wl_of

    reqs = wl_of(6, 256, 0, 128).requests
    rows, _ = build_rows([(list(c), list(x)) for c, x in reqs], True, 128)
    cached = on_disk["engines"]["nakta_cache"]["computed_tokens"]
    assert wl["unique_tokens"] <= cached == sum(len(r) for r in rows) < wl["request_tokens"]
    assert on_disk["engines"]["nakta"]["computed_tokens"] == wl["request_tokens"]
    assert set(on_disk["ratios_tasks_per_s"]) == {f"nakta_cache_vs_{e}" for e in engines} - {
        "nakta_cache_vs_nakta_cache"
    }


def test_synthetic_fewshot_workload_prepends_shots_per_task():
    from speed_bench.workload import FEWSHOT_SEPARATOR

    plain = synthetic_workload(40, 32000, seed=5)
    assert synthetic_workload(40, 32000, seed=5, shots=0).requests == plain.requests
    w = synthetic_workload(40, 32000, seed=5, shots=10)
    assert w.name == "synthetic-hellaswag-10shot-40" and w.n_tasks == 40
    contexts = [ctx for ctx, _ in w.requests[::4]]
    for t, ctx in enumerate(contexts):
        assert ctx[0] == 1 and ctx.count(FEWSHOT_SEPARATOR) >= 10  # random ids may hit 13 too
        assert all(c == ctx for c, _ in w.requests[4 * t : 4 * t + 4])  # 4 endings, one context
    # drawn anew per task: no two contexts share their first shot
    assert len({tuple(c[:8]) for c in contexts}) == len(contexts)
    per_task = w.unique_tokens() / w.n_tasks
    assert 700 < per_task < 1500  # HellaSwag 10-shot: ~1,010 unique tokens a task
    assert synthetic_workload(40, 32000, seed=5, shots=10).requests == w.requests  # seeded
    short = synthetic_workload(30, 512, seed=1, max_length=120, shots=10)
    assert max(len(c) + len(x) for c, x in short.requests) <= 120
    with pytest.raises(ValueError, match="shots"):
        synthetic_workload(4, 256, shots=-1)


# ----------------------------------------------------------------------------- MMLU-shaped
def test_mmlu_shaped_workload_has_mmlus_structure():
    w = mmlu_shaped_workload(120, 32000, seed=3)
    assert w.n_tasks == 120 and len(w.requests) == 480
    ctxs = [c for c, _ in w.requests[::4]]
    assert all(c[0] == 1 for c in ctxs)
    assert {tuple(x) for _, x in w.requests} == {(4,), (5,), (6,), (7,)}  # one letter each
    assert all(
        w.requests[4 * t][0] == w.requests[4 * t + k][0] for t in range(120) for k in (1, 2, 3)
    )
    # 12 subjects: tasks t and t + 12 are one subject, sharing the 5-shot prefix
    from nakta_model.score_batches import common_prefix_len as _lcp

    assert 5 * 65 < _lcp(ctxs[0], ctxs[12]) < len(ctxs[0]) and _lcp(ctxs[0], ctxs[1]) < 64
    assert 400 < sum(map(len, ctxs)) / len(ctxs) < 1100
    # with 10 questions a subject the prefixes are most of the work: the unique tokens are a
    # fraction of the per-question contexts (lm-eval's tokens / 4)
    ten = mmlu_shaped_workload(570, 32000, seed=3)
    assert ten.unique_tokens() < 0.3 * ten.request_tokens() / 4
    assert mmlu_shaped_workload(120, 32000, seed=3).requests == w.requests  # seeded
    short = mmlu_shaped_workload(10, 512, max_length=256)
    assert short.max_length() <= 256
    with pytest.raises(ValueError, match="n_tasks"):
        mmlu_shaped_workload(0, 32000)


def test_run_all_mmlu_shaped_prefix_cache_computes_unique_tokens(tmp_path):
    """On MMLU-shaped work the prefix cache computes each subject's shots once: tokens
    computed within 1.2x of the unique ones, far below the per-task cache's, same results."""
    from speed_bench.run_all import main

    engines = ["nakta", "nakta_ctx", "nakta_cache"]
    summary = main(
        ["--preset", "tiny", "--workload", "mmlu", "--limit", "20", "--warmup", "0",
         "--device", "cpu", "--engines", ",".join(engines), "--out", str(tmp_path),
         "--no-progress", "--passes", "2"]
    )  # fmt: skip
    wl, rows = summary["workload"], summary["engines"]
    assert wl["name"] == "synthetic-mmlu-20" and rows.keys() == set(engines)
    assert rows["nakta"]["computed_tokens"] == wl["request_tokens"]
    assert rows["nakta_cache"]["computed_tokens"] <= 1.2 * wl["unique_tokens"]
    assert rows["nakta_cache"]["computed_tokens"] < 0.8 * rows["nakta_ctx"]["computed_tokens"]
    for r in rows.values():
        assert r["pred_agree_vs_ref"] == 1.0 and r["max_abs_ll_diff_vs_ref"] < 1e-3
        # --passes 2: the tables keep the last pass; the first is reported beside it
        assert r["first_pass_s"] > 0 and r["first_over_last"] == r["first_pass_s"] / r["wall_s"]


def test_run_all_fewshot_workload_and_its_argument_errors(tmp_path, capsys):
    from speed_bench.run_all import main

    summary = main(
        ["--preset", "tiny", "--shots", "3", "--limit", "4", "--warmup", "0", "--device",
         "cpu", "--engines", "nakta_cache", "--out", str(tmp_path), "--no-progress"]
    )  # fmt: skip
    assert summary["workload"]["name"] == "synthetic-hellaswag-3shot-4"
    assert summary["engines"]["nakta_cache"]["pred_agree_vs_ref"] == 1.0
    for bad, why in (
        (["--shots", "-1"], "--shots must be >= 0"),
        (["--shots", "2", "--workload", "mmlu"], "--shots goes with"),
    ):
        with pytest.raises(SystemExit):
            main(["--preset", "tiny", *bad])
        assert why in capsys.readouterr().err


def test_run_engine_times_each_pass_after_the_warm_up():
    from types import SimpleNamespace

    from speed_bench.run_measure import run_engine

    calls = []

    class Engine:
        def score(self, requests):
            calls.append(requests)
            return [(float(len(calls)), True)]

    cfg = SimpleNamespace(device=torch.device("cpu"))
    work, warm = SimpleNamespace(requests="work"), SimpleNamespace(requests="warm")
    results, seconds, peak = run_engine(Engine(), work, warm, cfg, passes=3)
    assert calls == ["warm", "work", "work", "work"] and len(seconds) == 3
    assert results == [(4.0, True)] and all(t >= 0 for t in seconds) and math.isnan(peak)
    with pytest.raises(ValueError, match="passes must be >= 1"):
        run_engine(Engine(), work, None, cfg, passes=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sustained_matmul_rate_is_the_burst_rate_or_below():
    from bench_common.ceilings import matmul_tflops, matmul_tflops_sustained, sustained_ms

    burst = matmul_tflops(4096)
    kept = matmul_tflops_sustained(4096, seconds=1.0)
    assert 0.5 * burst < kept < 1.1 * burst
    a = torch.randn(1024, 1024, device="cuda")
    assert sustained_ms(lambda: a @ a, seconds=0.3) > 0


# ------------------------------------------------------------------------------------------------
# speed_bench/read_bench.py: every reader, every condition, on a small file on the CPU.
# ------------------------------------------------------------------------------------------------


def test_read_bench_measures_every_reader_alone_and_beside_a_busy_thread(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(512, 1024), "b": torch.randn(7)}, str(path))
    out = tmp_path / "out"
    read_bench.main(
        ["--file", str(path), "--device", "cpu", "--repeats", "1"]
        + ["--ceiling-mib", "8", "--out", str(out)]
    )
    got = json.loads((out / "read_bench.json").read_text())
    runs = got["runs"]
    assert len(runs) == len(read_bench.READERS) * len(read_bench.CONDITIONS)
    assert {r["method"] for r in runs} == {"pinned", "mapped", "mapped_populate"}
    assert all(r["seconds"] > 0 and r["gb_s"] > 0 for r in runs)
    busy = [r for r in runs if r["condition"] != "alone"]
    assert all(r["busy_thread_slowed"] is not None for r in busy)
    assert all(r["busy_thread_slowed"] is None for r in runs if r["condition"] == "alone")
    assert got["ceiling_gb_s"] > 0
    for ext in ("csv", "md", "png"):
        assert (out / f"read_bench.{ext}").stat().st_size > 0


def test_busy_thread_counts_its_loops():
    assert read_bench.busy_rate(0.05) > 0


@pytest.mark.parametrize("bad", [["--repeats", "0"], ["--ceiling-mib", "0"]])
def test_bad_arguments_are_one_error(tmp_path, bad):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(4)}, str(path))
    with pytest.raises(SystemExit, match="must be >= 1"):
        read_bench.main(["--file", str(path), "--device", "cpu", *bad])
    with pytest.raises(SystemExit, match="is not a file"):
        read_bench.main(["--file", str(tmp_path / "none"), "--device", "cpu"])


# ------------------------------------------------------------------------------------------------
# speed_bench.families_report: the families' rows read from the benches' own summaries.
# ------------------------------------------------------------------------------------------------


def _write(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def _lm_eval_run(model, wall, acc, limit=None, n=10042):
    return {"model": model, "wall_s": wall, "acc": acc, "num_fewshot": 0, "limit": limit,
            "n": n, "error": None}  # fmt: skip


def test_collect_reads_every_measure(tmp_path):
    root = tmp_path / "families"
    _write(
        root / "llama3-8B" / "lm_eval" / "lm_eval_summary.json",
        {"device_name": "GPU X", "runs": [_lm_eval_run("nakta", 40.0, 0.25),
                                          _lm_eval_run("hf", 120.0, 0.251),
                                          _lm_eval_run("hf", 100.0, 0.251)]},
    )  # fmt: skip
    _write(
        root / "llama3-8B" / "decode" / "decode_summary.json",
        {"runs": [
            {"engine": "nakta", "batch": 1, "prompt": 512, "pct_of_floor": 80.0},
            {"engine": "nakta", "batch": 1, "prompt": 64, "pct_of_floor": 86.0},
            {"engine": "hf", "batch": 1, "prompt": 64, "pct_of_floor": 30.0},
            {"engine": "nakta", "batch": 8, "prompt": 64, "pct_of_floor": 70.0},
        ]},
    )  # fmt: skip
    _write(
        root / "llama3-8B" / "throughput" / "throughput_summary.json",
        {"device_name": "GPU X", "runs": [
            {"engine": "nakta", "max_batch": 256, "output_tok_s": 15000.0},
            {"engine": "nakta", "max_batch": 512, "output_tok_s": 17000.0},
            {"engine": "hf", "max_batch": 128, "output_tok_s": 7000.0},
        ]},
    )  # fmt: skip
    _write(
        root / "llama3-8B" / "throughput_fp8" / "throughput_summary.json",
        {"runs": [{"engine": "nakta_fp8", "max_batch": 512, "output_tok_s": 24000.0},
                  {"engine": "nakta_fp8_kv8", "max_batch": 512, "output_tok_s": 26000.0},
                  {"engine": "nakta_fp8_kv8", "max_batch": 1024, "output_tok_s": 27000.0}]},
    )  # fmt: skip
    summary, missing = families_report.collect(root)
    rows = {(r["preset"], r["measure"]): r for r in summary["runs"]}
    assert summary["device_name"] == "GPU X"
    assert rows["llama3-8B", "lm_eval_hellaswag_full_0shot_s"]["nakta"] == 40.0
    assert rows["llama3-8B", "lm_eval_hellaswag_full_0shot_s"]["peer_value"] == 100.0
    assert rows["llama3-8B", "lm_eval_acc"]["peer_value"] == 0.251
    assert rows["llama3-8B", "decode_b1_pct_floor"]["nakta"] == 86.0  # the shortest prompt
    assert rows["llama3-8B", "decode_b1_pct_floor"]["peer_value"] == 30.0
    assert rows["llama3-8B", "throughput_128_128_tok_s"]["nakta"] == 17000.0
    fp8 = rows["llama3-8B", "throughput_128_128_fp8_tok_s"]
    assert (fp8["nakta"], fp8["peer_value"]) == (24000.0, 7000.0)  # HF from the bf16 run
    kv8 = rows["llama3-8B", "throughput_128_128_fp8_kv8_tok_s"]  # FP8 KV: its best row count
    assert (kv8["nakta"], kv8["peer_value"]) == (27000.0, 7000.0)
    assert families_report.ratio(rows["llama3-8B", "throughput_128_128_tok_s"]) == 17000 / 7000
    assert missing == []
    assert families_report.ratio(rows["llama3-8B", "lm_eval_hellaswag_full_0shot_s"]) == 2.5
    families_report.write_outputs(summary, root, missing)
    written = json.loads((root / "families_summary.json").read_text())
    assert set(written) == {"device_name", "runs"}
    assert set(written["runs"][0]) == {"preset", "measure", "nakta", "peer", "peer_value"}
    assert "throughput_128_128_fp8_tok_s" in (root / "families.md").read_text()
    assert (root / "families.png").stat().st_size > 0


def test_a_limited_lm_eval_run_is_named_by_its_task_count(tmp_path):
    rows = families_report.lm_eval_rows(
        "mistral-7B",
        {"runs": [_lm_eval_run("nakta", 9.0, 0.26, 1000, 1000), _lm_eval_run("hf", 20.0, 0.26)]},
    )
    assert rows[0]["measure"] == "lm_eval_hellaswag_1000_0shot_s"


def test_errors_name_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match="no families results"):
        families_report.collect(tmp_path)
    with pytest.raises(ValueError, match="nakta and an hf"):
        families_report.lm_eval_rows("x", {"runs": [_lm_eval_run("nakta", 1.0, 0.2)]})
    assert families_report.main(["--root", str(tmp_path)]) == 2
