"""lm-eval adapters ``nakta`` / ``llama_org`` and the offline ``hellaswag_local`` task.

End to end: lm-eval's own ``simple_evaluate`` runs the offline task through the ``nakta``
adapter on a tiny checkpoint and must report exactly the acc/acc_norm that the scoring engine
plus lm-eval's HellaSwag rules give directly. Generation and rolling log-likelihoods are
checked on the real stories260K model (greedy text of its reference) and between the adapters.
Skipped cleanly when lm-eval is not installed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from checkpoint_factory import TINY_PARAMS, train_tiny_tokenizer, write_meta_checkpoint  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from accuracy_test import lm_eval_adapter as adapter  # noqa: E402
from accuracy_test import lm_eval_args, models  # noqa: E402
from nakta_model import scoring  # noqa: E402
from nakta_model.tasks import hellaswag  # noqa: E402

TASKS = Path(__file__).resolve().parents[1] / "accuracy_test" / "tasks"

MOMENTS = {"build_start_unix", "read_end_unix", "ready_unix"}  # load_timings' wall-clock moments
WARM = {"warm_up_s", "warm_up_start_unix", "warm_up_end_unix"}  # once the scorer warmed up


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_lm_eval")
    ckpt = write_meta_checkpoint(root / "meta", {**TINY_PARAMS, "max_seq_len": 256}, seed=3)
    tok = train_tiny_tokenizer(root / "tok")
    return ckpt, tok


@pytest.fixture(autouse=True, scope="module")
def _llama_org_teardown():
    yield
    models.shutdown_llama_org()


def _docs_file(shared_data: Path, tmp_path: Path, n: int) -> Path:
    lines = (shared_data / "hellaswag_val_subset1000.jsonl").read_text().splitlines()[:n]
    path = tmp_path / "hs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_models_are_registered():
    from lm_eval.api.registry import get_model

    assert get_model("nakta") is adapter.NaktaLM
    assert get_model("llama_org") is adapter.LlamaOrgLM


def test_simple_evaluate_offline_task_matches_engine(tiny, shared_data, tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager

    ckpt, tok = tiny
    data = _docs_file(shared_data, tmp_path, 6)
    monkeypatch.setenv("NAKTA_HELLASWAG_JSONL", str(data))
    out = lm_eval.simple_evaluate(
        model="nakta",
        model_args={"checkpoint": str(ckpt), "tokenizer": str(tok), "dtype": "fp32"},
        tasks=["hellaswag_local"],
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        device="cpu",
        batch_size=8,
        log_samples=True,
    )
    res = out["results"]["hellaswag_local"]
    # the same docs scored directly by the engine, with lm-eval's metric rules
    docs = hellaswag.load_jsonl(data)
    import nakta_model

    model = nakta_model.load(ckpt, models.resolve_device("cpu"), models.parse_dtype("fp32"))
    t = nakta_model.Tokenizer(tok)
    reqs = hellaswag.build_requests(docs, lambda s: t.encode(s, bos=True, eos=False))
    lls = [r[0] for r in scoring.score(model, reqs)]
    del model
    metrics, results = hellaswag.evaluate(docs, lls)
    assert res["sample_len"] == 6
    assert res["acc,none"] == pytest.approx(metrics["acc"], abs=1e-12)
    assert res["acc_norm,none"] == pytest.approx(metrics["acc_norm"], abs=1e-12)
    samples = sorted(out["samples"]["hellaswag_local"], key=lambda s: s["doc_id"])
    assert [s["doc"]["query"] for s in samples] == [d.query for d in docs]
    got = [float(r[0][0]) for s in samples for r in s["resps"]]
    assert got == pytest.approx(lls, abs=1e-5)


def test_llama_org_adapter_agrees_with_nakta(tiny, shared_data):
    ckpt, tok = tiny
    docs = hellaswag.load_jsonl(shared_data / "hellaswag_val_subset1000.jsonl", limit=3)
    insts = [
        Instance("loglikelihood", {}, (ctx, cont), i)
        for d in docs
        for i, (ctx, cont) in enumerate(hellaswag.doc_requests(d))
    ]
    insts.append(Instance("loglikelihood", {}, ("", " the cat"), 0))  # empty context: BOS
    kw = dict(checkpoint=str(ckpt), tokenizer=str(tok), device="cpu", dtype="fp32", batch_size=4)
    nakta = adapter.NaktaLM(**kw)
    org = adapter.LlamaOrgLM(**kw)
    a, b = (
        nakta.loglikelihood(insts, disable_tqdm=True),
        org.loglikelihood(insts, disable_tqdm=True),
    )
    assert [x[0] for x in a] == pytest.approx([x[0] for x in b], abs=1e-4)
    assert [x[1] for x in a] == [x[1] for x in b]
    roll = [Instance("loglikelihood_rolling", {}, ("the cat saw a big red ball. " * 6,), 0)]
    ra, rb = nakta.loglikelihood_rolling(roll, True), org.loglikelihood_rolling(roll, True)
    assert ra == pytest.approx(rb, abs=1e-4)
    toks = nakta.tok_encode(roll[0].args[0], add_special_tokens=False)
    direct = scoring.score(nakta.model, [([nakta.prefix_token_id], toks)])[0][0]
    assert ra[0] == pytest.approx(direct, abs=1e-4)  # one window: the whole text given BOS
    nakta._max_length = org._max_length = 16  # several windows, each <= 16 tokens
    ra2, rb2 = nakta.loglikelihood_rolling(roll, True), org.loglikelihood_rolling(roll, True)
    assert ra2 == pytest.approx(rb2, abs=1e-4) and ra2[0] != pytest.approx(ra[0], abs=1e-3)
    nakta.close()
    assert nakta.model is None


def test_generate_until_reproduces_stories260k_greedy_text(shared_data):
    ref = json.loads((shared_data / "stories260K_greedy_reference.json").read_text())
    assert ref["text"].startswith("Once upon a time, there was a little girl named Lily. She")
    kw = dict(
        checkpoint=str(shared_data / "stories260K"),
        tokenizer=str(shared_data / "stories260K" / "tokenizer.model"),
        device="cpu",
        batch_size=2,
    )
    reqs = [
        Instance(
            "generate_until", {}, ("Once upon a time", {"until": ["Lily"], "max_gen_toks": 12}), 0
        ),
        Instance(
            "generate_until",
            {},
            ("Once upon a time, there was a little girl named Lily.", {"max_gen_toks": 12}),
            0,
        ),
    ]
    for cls in (adapter.NaktaLM, adapter.LlamaOrgLM):
        lm = cls(**kw)
        out = lm.generate_until(reqs, disable_tqdm=True)
        assert out[0] == ", there was a little girl named "
        assert out[1].startswith("She loved to play outside in the")
        assert ref["text"].startswith(
            "Once upon a time, there was a little girl named Lily. " + out[1]
        )
        if cls is adapter.NaktaLM:  # rows as long as the requests need, as many as the cap
            assert (lm._gen.max_seq_len, lm._gen.max_batch) == (256, 2)
            stats = lm.generation_stats  # the engine's counters (the timing hook reports them)
            assert stats["generated_tokens"] == lm._gen.stats.generated_tokens > 12
            assert stats["decode_steps"] > 0 and stats["prompt_tokens"] > 0
            assert "first_token_s" not in stats  # per-request latencies are not summed
            stats_before = stats["generated_tokens"]
            # rows sized for 300 new tokens; the stop ends it after the first sentence
            long = [
                Instance("generate_until", {}, ("Once", {"until": ["."], "max_gen_toks": 300}), 0)
            ]
            assert lm.generate_until(long, disable_tqdm=True) == [
                "upon a time, there was a little girl named Lily"
            ]
            assert lm._gen.max_seq_len == 512
            assert lm.generation_stats["generated_tokens"] > stats_before  # summed over calls


def test_adapter_argument_errors(tiny):
    ckpt, tok = tiny
    with pytest.raises(ValueError, match="boolean"):
        adapter._as_bool("maybe")
    with pytest.raises(ValueError, match="dtype"):
        adapter.NaktaLM(checkpoint=str(ckpt), tokenizer=str(tok), device="cpu", dtype="int8")
    with pytest.raises(ValueError, match="no such directory"):
        adapter.NaktaLM(checkpoint=str(ckpt / "nope"), tokenizer=str(tok), device="cpu")
    with pytest.raises(ValueError, match="nakta kv_cache: kv_cache must be 'bf16' or 'fp8'"):
        adapter.NaktaLM(checkpoint=str(ckpt), tokenizer=str(tok), device="cpu", kv_cache="q4")


@pytest.mark.parametrize(
    ("batch_size", "max_batch_size", "rows"),
    [
        (None, None, None),  # simple_evaluate's default
        (1, None, None),  # the CLI's default: lm-eval passes 1 when --batch_size is absent
        ("1", None, None),
        ("auto", None, None),
        ("auto:4", None, None),
        (8, None, 8),
        ("64", None, 64),
        (64, 16, 16),  # the smaller cap wins
        (None, 16, 16),
        ("auto", 1, None),
    ],
)
def test_batch_size_is_a_rows_cap_only_above_one(batch_size, max_batch_size, rows):
    assert adapter._rows(batch_size, max_batch_size) == rows


@pytest.mark.parametrize(
    ("batch_size", "max_batch_size", "match"),
    [("0", None, "batch_size must be >= 1"), ("big", None, "batch_size must be an int")]
    + [(None, "x", "max_batch_size must be an int"), ("auto", -2, "max_batch_size must be >= 1")],
)
def test_batch_size_errors_name_the_argument(batch_size, max_batch_size, match):
    with pytest.raises(ValueError, match=match):
        adapter._rows(batch_size, max_batch_size)


def test_default_batch_size_scores_with_the_token_budget_alone(tiny, monkeypatch):
    """lm-eval's default (1) must not turn into one row per forward (5x slower on an H200)."""
    ckpt, tok = tiny
    seen = []
    real = scoring.score
    kw = dict(checkpoint=str(ckpt), tokenizer=str(tok), device="cpu")
    lm = adapter.NaktaLM(**kw, batch_size=1)
    lm._scorer_ready()  # the warm-up batches (the first scoring call's), not counted
    monkeypatch.setattr(
        scoring, "score", lambda *a, **kw: seen.append(kw["max_rows"]) or real(*a, **kw)
    )
    lm.loglikelihood([Instance("loglikelihood", {}, ("a cat", " sat"), 0)], disable_tqdm=True)
    assert seen == [None]
    assert adapter.NaktaLM(**kw, batch_size=8, max_batch_size="auto").rows == 8
    # llama_org always needs a row count (Meta's KV cache is rows x max_length)
    assert adapter.LlamaOrgLM(**kw, batch_size=1).rows == adapter.LLAMA_ORG_ROWS
    assert adapter.LlamaOrgLM(**kw, batch_size="auto").llama.model.params.max_batch_size == 32
    assert adapter.LlamaOrgLM(**kw, batch_size=4).rows == 4


@pytest.mark.parametrize("cls", [adapter.NaktaLM, adapter.LlamaOrgLM])
def test_unknown_model_args_are_refused_with_the_known_ones(tiny, cls):
    ckpt, tok = tiny
    with pytest.raises(
        ValueError,
        match=r"unknown model_args dtyp, max_len \(did you mean dtype for dtyp, "
        r"max_length for max_len\?\); known: .*dtype",
    ):
        cls(checkpoint=str(ckpt), tokenizer=str(tok), device="cpu", dtyp="bf16", max_len=8)


def test_lm_eval_passes_exactly_the_extra_keys_the_adapters_accept(tiny):
    """``create_from_arg_*`` adds batch_size / max_batch_size / device (lm-eval's own keys)."""
    ckpt, tok = tiny
    extra = {"batch_size": 1, "max_batch_size": 8, "device": "cpu"}
    lm = adapter.NaktaLM.create_from_arg_string(f"checkpoint={ckpt},tokenizer={tok}", extra)
    assert lm.rows == 8 and lm.device.type == "cpu"
    lm = adapter.LlamaOrgLM.create_from_arg_obj(
        {"checkpoint": str(ckpt), "tokenizer": str(tok)}, extra
    )
    assert lm.rows == 8


def test_dtype_names_in_any_case(tiny):
    ckpt, tok = tiny
    lm = adapter.NaktaLM(checkpoint=str(ckpt), tokenizer=str(tok), device="cpu", dtype="FP32")
    assert lm.dtype == torch.float32
    assert models.parse_dtype(" BFloat16 ") is models.parse_dtype("bf16") is torch.bfloat16
    with pytest.raises(ValueError, match=r"dtype must be one of .* got 'FP8'"):
        models.parse_dtype("FP8")


def test_default_cli_device_falls_back_to_the_cpu_with_a_warning(tiny, caplog):
    if torch.cuda.is_available():
        pytest.skip("the fallback is for machines without a GPU")
    ckpt, tok = tiny
    with caplog.at_level(logging.WARNING):
        lm = adapter.NaktaLM(checkpoint=str(ckpt), tokenizer=str(tok), device="cuda:0")
    assert lm.device.type == "cpu"
    assert "device 'cuda:0' requested but CUDA is not available; using cpu" in caplog.text
    with pytest.raises(ValueError, match="CUDA is not available"):
        models.resolve_device("cuda:0")  # parity.py and the tools keep refusing


def test_torchrun_ranks_take_their_own_gpu_not_the_cli_default_cuda_0():
    assert adapter._parallel_device(None) is None and adapter._parallel_device("cpu") == "cpu"
    want = "cuda" if torch.cuda.is_available() else "cpu"  # no GPU: the CPU, with the warning
    assert adapter._parallel_device("cuda:0") == want


def test_tokenizer_of_another_model_is_refused_at_load(shared_data, tiny):
    _, tok300 = tiny
    ckpt = shared_data / "stories260K"
    with pytest.raises(
        ValueError,
        match=r"tokenizer .*tokenizer.model has 300 pieces but "
        r"checkpoint .*stories260K has vocab_size 512",
    ):
        adapter.NaktaLM(checkpoint=str(ckpt), tokenizer=str(tok300), device="cpu")


@pytest.mark.parametrize("cls", [adapter.NaktaLM, adapter.LlamaOrgLM])
def test_max_length_above_the_checkpoint_is_refused(tiny, cls):
    ckpt, tok = tiny
    kw = dict(checkpoint=str(ckpt), tokenizer=str(tok), device="cpu")
    with pytest.raises(ValueError, match=r"max_length=257 exceeds max_seq_len=256"):
        cls(**kw, max_length=257)
    assert cls(**kw, max_length="64").max_length == 64


def test_llama_org_says_when_the_checkpoint_does_not_exist(tiny, tmp_path):
    _, tok = tiny
    with pytest.raises(ValueError, match=r"nope does not exist"):
        adapter.LlamaOrgLM(checkpoint=str(tmp_path / "nope"), tokenizer=str(tok), device="cpu")
    with pytest.raises(ValueError, match=r"must be a Meta dir \(params.json"):
        adapter.LlamaOrgLM(checkpoint=str(tmp_path), tokenizer=str(tok), device="cpu")


@pytest.mark.parametrize(
    ("kwargs", "refused"),
    [
        ({"repetition_penalty": 1.3}, "repetition_penalty=1.3"),
        ({"num_beams": 4, "top_k": 40}, "num_beams=4"),
        ({"max_new_tokens": 8}, "max_new_tokens=8"),
    ],
)
def test_unimplemented_generation_settings_are_refused(kwargs, refused):
    with pytest.raises(ValueError, match=f"not implemented by this engine: {refused} "):
        adapter.generation_settings({"until": ["\n"], **kwargs}, 16, "")


def test_generation_settings_the_engine_implements():
    g = adapter.generation_settings(
        {"until": "\n", "max_gen_toks": 5, "do_sample": True, "temperature": 0.7, "top_p": 0.9}
        | {"num_beams": 1, "top_k": 0, "repetition_penalty": 1.0},  # no-ops are fine
        16,
        "</s>",
    )
    assert g == lm_eval_args.GenSettings(("\n", "</s>"), 5, 0.7, 0.9)
    k = adapter.generation_settings({"do_sample": True, "temperature": 1.0, "top_k": 40}, 16, "")
    assert k.top_k == 40  # the nakta engine samples top-k; llama_org refuses it when it runs
    greedy = adapter.generation_settings({"temperature": 0.7, "do_sample": "false"}, 16, "")
    assert greedy.temperature == 0.0 and greedy.max_gen == 16


def test_generate_until_refuses_before_generating(shared_data):
    lm = adapter.NaktaLM(
        checkpoint=str(shared_data / "stories260K"),
        tokenizer=str(shared_data / "stories260K" / "tokenizer.model"),
        device="cpu",
    )
    reqs = [
        Instance("generate_until", {}, ("Once", {"max_gen_toks": 4}), 0),
        Instance("generate_until", {}, ("Once", {"max_gen_toks": 4, "num_beams": 3}), 1),
    ]
    lm._generate = lambda *a: pytest.fail("generated before refusing")
    with pytest.raises(ValueError, match="num_beams=3"):
        lm.generate_until(reqs, disable_tqdm=True)


def test_cli_wrapper_registers_and_forwards(capsys):
    from accuracy_test import lm_eval_cli

    with pytest.raises(SystemExit) as e:
        lm_eval_cli.main(["run", "--help"])
    assert e.value.code == 0
    assert "--model_args" in capsys.readouterr().out


def test_lm_eval_check_reproduces_parity(tiny, shared_data, tmp_path):
    from accuracy_test import lm_eval_check

    ckpt, tok = tiny
    out = tmp_path / "check.json"
    argv = ["--checkpoint", str(ckpt), "--tokenizer", str(tok), "--device", "cpu"]
    argv += ["--data", str(shared_data / "hellaswag_val_full.txt.bz2"), "--limit", "4"]
    argv += ["--batch-size", "4", "--out", str(out), "--no-progress"]
    assert lm_eval_check.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["match"] is True
    assert [r["model"] for r in result["models"]] == ["nakta", "llama_org"]
    assert all(r["lm_eval"]["n"] == 4 for r in result["models"])
    assert out.with_suffix(".md").is_file()


def test_the_scorer_compiles_at_the_first_scoring_call_only(tiny, monkeypatch):
    """Not at load: generating never warms the scorer up; the first scoring call does, once."""
    ckpt, tok = tiny
    calls = []
    real = adapter.scoring.warm_up
    monkeypatch.setattr(
        adapter.scoring, "warm_up", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    lm = adapter.NaktaLM(checkpoint=str(ckpt), tokenizer=str(tok), device="cpu", dtype="fp32")
    gen = [Instance("generate_until", {}, ("the cat", {"max_gen_toks": 3}), 0)]
    assert len(lm.generate_until(gen, disable_tqdm=True)) == 1
    assert calls == [] and "warm_up_s" not in lm.load_timings
    ll = [Instance("loglikelihood", {}, ("the cat", " sat"), 0)]
    first = lm.loglikelihood(ll, disable_tqdm=True)
    assert calls == [1] and lm.load_timings["warm_up_s"] >= 0
    assert lm.loglikelihood(ll, disable_tqdm=True) == first and calls == [1]


def test_background_load_overlaps_the_caller_and_scores_like_a_blocking_one(tiny, monkeypatch):
    """The constructor returns while the weights are still being read (lm-eval builds its
    requests meanwhile); the first request waits for them; the numbers equal a blocking load's."""
    import threading

    import nakta_model.loading

    ckpt, tok = tiny
    kw = dict(checkpoint=str(ckpt), tokenizer=str(tok), device="cpu", dtype="fp32")
    insts = [Instance("loglikelihood", {}, ("the cat", " sat on a mat"), 0)]
    insts.append(Instance("loglikelihood", {}, ("the cat", " ran"), 1))
    blocking = adapter.NaktaLM(**kw, background_load="false")
    assert blocking._pending is None
    assert set(blocking.load_timings) == {"read_s", "prefetched"} | MOMENTS
    want = blocking.loglikelihood(insts, disable_tqdm=True)
    assert set(blocking.load_timings) == {"read_s", "prefetched"} | WARM | MOMENTS
    release, threads = threading.Event(), []
    real_load = nakta_model.loading.load

    def held_load(*a, **k):
        threads.append(threading.current_thread().name)
        assert release.wait(30)
        return real_load(*a, **k)

    monkeypatch.setattr(nakta_model.loading, "load", held_load)
    lm = adapter.NaktaLM(**kw, background_load="true")  # returns with the load still held
    assert lm._pending is not None and not lm._pending.done()
    assert lm.max_length == 256  # known from params alone
    assert set(lm.load_timings) <= {"build_start_unix"}  # the read has not ended
    release.set()
    assert lm.loglikelihood(insts, disable_tqdm=True) == want
    assert threads and threads[0].startswith("nakta-load")
    assert set(lm.load_timings) == {"read_s", "prefetched", "wait_s"} | WARM | MOMENTS
    t = lm.load_timings
    assert t["build_start_unix"] <= t["read_end_unix"] <= t["ready_unix"]


def test_a_failed_background_load_raises_its_error_at_the_first_request(tiny, tmp_path):
    """A damaged shard is not hidden by the worker thread: the first request (and any later
    one) raises the loader's error, as one line naming the checkpoint (``ModelArgsError``, the
    loader's ``CheckpointError`` as its cause; a wrong tokenizer fails in the constructor still:
    ``test_tokenizer_of_another_model_is_refused_at_load`` runs with the background load on)."""
    from convert import convert
    from nakta_model.layout import CheckpointError

    ckpt, tok = tiny
    nakta_dir = convert(ckpt, tmp_path / "nakta", quiet=True)
    shard = next(nakta_dir.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-8:] = b"\x00" * 8  # same size, other bytes: the manifest's sampled hash differs
    shard.write_bytes(bytes(data))
    kw = dict(checkpoint=str(nakta_dir), tokenizer=str(tok), device="cpu")
    lm = adapter.NaktaLM(**kw, background_load="true")
    inst = [Instance("loglikelihood", {}, ("the cat", " sat"), 0)]
    match = rf"nakta checkpoint {nakta_dir}: cannot load it: .*"
    for _ in range(2):
        with pytest.raises(adapter.ModelArgsError, match=match) as exc:
            lm.loglikelihood(inst, disable_tqdm=True)
        assert isinstance(exc.value.__cause__, CheckpointError)
    with pytest.raises(adapter.ModelArgsError, match=match):  # the default loads at once
        adapter.NaktaLM(**kw)


def test_the_background_load_runs_on_the_callers_cuda_device(monkeypatch):
    """The current CUDA device is per thread: the worker sets the caller's, also for a plain
    ``cuda`` (lm-eval's ``--device cuda``), which ``torch.cuda.set_device`` refuses as is."""
    import threading

    chosen = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda i: chosen.append((i, threading.current_thread().name))
    )
    for device, index in ((torch.device("cuda"), 3), (torch.device("cuda", 1), 1)):
        assert adapter._start_in_background(lambda: "done", device).result() == "done"
        assert chosen[-1][0] == index and chosen[-1][1].startswith("nakta-load")
    assert adapter._start_in_background(lambda: 7, torch.device("cpu")).result() == 7
    assert len(chosen) == 2  # the CPU sets no device


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_gpu_background_load_scores_like_a_blocking_one(tiny, device):
    """On the GPU: the worker thread reads the weights onto the caller's device and compiles
    the Triton kernels there (plain ``cuda`` too); the scores equal a blocking load's."""
    ckpt, tok = tiny
    kw = dict(checkpoint=str(ckpt), tokenizer=str(tok), device=device, dtype="bf16")
    insts = [Instance("loglikelihood", {}, ("the cat", " sat on a mat"), 0)]
    insts.append(Instance("loglikelihood", {}, ("the cat", " ran"), 1))
    want = adapter.NaktaLM(**kw, background_load=False).loglikelihood(insts, disable_tqdm=True)
    lm = adapter.NaktaLM(**kw, background_load=True)
    assert lm.loglikelihood(insts, disable_tqdm=True) == want
    assert lm.model.device == torch.device("cuda", 0)
    assert set(lm.load_timings) == {"read_s", "prefetched", "wait_s"} | WARM | MOMENTS


def test_quant_fp8_model_arg(tiny, monkeypatch):
    """quant=fp8 builds the FP8 model (the CPU only under the interpreter, as the tests run);
    its log-likelihoods stay near the full-precision ones; a bad quant is one ModelArgsError."""
    ckpt, tok = tiny
    kw = dict(checkpoint=str(ckpt), tokenizer=str(tok), device="cpu", dtype="fp32")
    insts = [Instance("loglikelihood", {}, ("the cat saw", " a big red ball"), 0)]
    plain = adapter.NaktaLM(**kw).loglikelihood(insts, disable_tqdm=True)
    lm = adapter.NaktaLM(**kw, quant="fp8")
    assert lm.model.quant == "fp8"
    got = lm.loglikelihood(insts, disable_tqdm=True)
    assert got[0][0] == pytest.approx(plain[0][0], rel=0.2) and got[0][0] != plain[0][0]
    with pytest.raises(adapter.ModelArgsError, match="quant"):
        adapter.NaktaLM(**kw, quant="int4")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(adapter.ModelArgsError, match="compute capability"):
        adapter.NaktaLM(**kw, quant="fp8")


def test_bad_tp_dp_is_one_model_args_error(tiny, monkeypatch):
    """``tp=x`` or a grid this launch cannot run (``dp=2`` in a world of one) is the user's
    input: a ModelArgsError (one ``error:`` line from the CLI), not a ValueError's traceback."""
    ckpt, tok = tiny
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    kw = dict(checkpoint=str(ckpt), tokenizer=str(tok), device="cpu")
    with pytest.raises(adapter.ModelArgsError, match="tp must be an int"):
        adapter.NaktaLM(**kw, tp="x")
    with pytest.raises(adapter.ModelArgsError, match="dp must be >= 1"):
        adapter.NaktaLM(**kw, dp=0)
    with pytest.raises(adapter.ModelArgsError, match=r"dp=2: world size 1 != tp 1 x dp 2"):
        adapter.NaktaLM(**kw, dp="2")
