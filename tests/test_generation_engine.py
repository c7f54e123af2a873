"""The continuous-batching generation engine against Meta's generation (llama_org) and itself.

Greedy tokens must equal llama_org's, prompt by prompt, in fp32 (the real stories260K weights
and tiny random GQA / MHA / HF-pairing models); the engine's paths (reference kernels, Triton
kernels in the interpreter, CUDA graphs on a GPU) must agree with each other; stops, budgets,
sampling settings and bad requests behave as documented.
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from checkpoint_factory import TINY_PARAMS, TINY_PARAMS_MHA, meta_state_dict

from llama_org import Llama
from llama_org.distributed import shutdown
from nakta_model.config import ModelArgs
from nakta_model.generation import (
    GenerationRequest,
    Generator,
    SamplingParams,
    StopStrings,
    generate_tokens,
    greedy_requests,
)
from nakta_model.generation.engine import max_rows
from nakta_model.generation.step import DecodeStep
from nakta_model.loading import load
from nakta_model.sources import state_dict_source

MAX_SEQ = 48


@pytest.fixture(scope="module", autouse=True)
def _one_thread_and_cleanup():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    shutdown()


def tiny_model(params=TINY_PARAMS, kernels="reference", seed=3, interleaved=True, device="cpu"):
    args = ModelArgs.from_meta_params(params, max_seq_len=MAX_SEQ)
    sd = meta_state_dict(params, seed=seed)
    if not interleaved:  # HF's rotate-half rows: the same model with permuted q/k
        from hf_factory import hf_permute

        sd = dict(sd)
        for i in range(args.n_layers):
            p = f"layers.{i}.attention."
            sd[p + "wq.weight"] = hf_permute(sd[p + "wq.weight"], args.n_heads)
            sd[p + "wk.weight"] = hf_permute(sd[p + "wk.weight"], args.n_kv_heads)
        args = args.replace(rope_interleaved=False)
    return load(state_dict_source(sd, args), device, kernels=kernels)


def prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, vocab) for _ in range(rng.randint(0, 9))] for _ in range(n)]


def meta_greedy(model, ps, n):
    out = generate_tokens(model, ps, n, eos_id=2, pad_id=-1, max_seq_len=MAX_SEQ)
    model.clear_cache()
    return [o[len(p) :] for o, p in zip(out, ps)]


@pytest.mark.parametrize(
    "params, interleaved",
    [(TINY_PARAMS, True), (TINY_PARAMS_MHA, True), (TINY_PARAMS, False)],
    ids=["gqa", "mha", "hf-pairs"],
)
def test_greedy_equals_meta_loop_with_continuous_batching(params, interleaved):
    """7 prompts through 3 rows: rows finish and take the next prompt mid-run."""
    model = tiny_model(params, interleaved=interleaved)
    ps = prompts(params["vocab_size"], 7)
    want = meta_greedy(model, ps, 12)
    gen = Generator(model, max_batch=3, max_seq_len=MAX_SEQ, chunk=5)
    got = gen.generate(greedy_requests(ps, 12, eos_id=2))
    assert [r.tokens for r in got] == want
    assert gen.stats.generated_tokens == sum(len(w) for w in want)


def test_stories260k_greedy_equals_llama_org_per_prompt(shared_data):
    """The real checkpoint, fp32: the engine's tokens are Meta's, prompt by prompt."""
    ckpt = shared_data / "stories260K"
    llama = Llama.build(
        str(ckpt), str(ckpt / "tokenizer.model"), 128, 4, device="cpu", dtype=torch.float32
    )
    ps = [[1], [1, 403, 407, 261], [1, 403, 407, 261, 378, 432, 383, 286, 261, 376], [1, 376]]
    want = [llama.generate([p], 40, temperature=0.0, eos_id=2)[0][0] for p in ps]
    model = load(ckpt, "cpu", torch.float32)
    got = Generator(model, max_batch=2, max_seq_len=128, chunk=8).generate(
        greedy_requests(ps, 40, eos_id=2)
    )
    assert [r.tokens for r in got] == want


def test_triton_kernels_agree_with_the_reference_path():
    """The fused decode kernels (interpreter) give the reference path's tokens and logits."""
    ref, tri = tiny_model(), tiny_model(kernels="triton")
    ps = prompts(300, 2, seed=1)
    a = Generator(ref, max_batch=2, max_seq_len=MAX_SEQ, chunk=2).generate(
        greedy_requests(ps, 3, None)
    )
    b = Generator(tri, max_batch=2, max_seq_len=MAX_SEQ, chunk=2).generate(
        greedy_requests(ps, 3, None)
    )
    assert [r.tokens for r in a] == [r.tokens for r in b]


def test_prefill_logits_equal_the_plain_forward():
    model = tiny_model()
    ps = prompts(300, 3, seed=2)
    model.setup_cache(4, MAX_SEQ)
    flat = [t for p in ps for t in p]
    pos = [i for p in ps for i in range(len(p))]
    starts, at = [], 0
    for p in ps:
        starts += [at] * len(p)
        at += len(p)
    slots = [r * MAX_SEQ + i for r, p in enumerate(ps) for i in range(len(p))]
    last = torch.tensor([s + len(p) - 1 for s, p in zip(sorted(set(starts)), ps)])
    i64 = dict(dtype=torch.int64)
    logits = model.forward_prefill(
        torch.tensor(flat), torch.tensor(pos, **i64), torch.tensor(starts, **i64),
        torch.tensor(slots, **i64), last,
    )  # fmt: skip
    model.clear_cache()
    for row, p in enumerate(ps):
        want = model(torch.tensor([p]))[0, -1]
        torch.testing.assert_close(logits[row].float(), want, rtol=1e-5, atol=1e-5)


def test_stop_tokens_strings_and_budgets():
    model = tiny_model()
    ps = prompts(300, 3, seed=4)
    free = Generator(model, max_batch=2, max_seq_len=MAX_SEQ, chunk=4).generate(
        greedy_requests(ps, 10, None)
    )
    assert all(len(r.tokens) == 10 and r.finish == "length" for r in free)
    # stopping at a token the free run produces: the continuation ends right before it
    stop_tok = free[0].tokens[5]
    first = free[0].tokens.index(stop_tok)
    req = GenerationRequest(ps[0], 10, stop_token_ids=(stop_tok,))
    (res,) = Generator(model, max_batch=1, max_seq_len=MAX_SEQ).generate([req])
    assert res.tokens == free[0].tokens[:first] and res.finish == "stop"
    # a stop string: the text is cut before it, decoding stops once it appears
    decode = lambda toks: " ".join(str(t) for t in toks)  # noqa: E731
    stop = str(free[1].tokens[4])
    req = GenerationRequest(ps[1], 10, stop=StopStrings([" " + stop], decode))
    (res,) = Generator(model, max_batch=1, max_seq_len=MAX_SEQ, chunk=2).generate([req])
    want_text = decode(free[1].tokens).split(" " + stop)[0]
    assert res.text == want_text and res.finish == "stop" and len(res.tokens) < 10
    # the cache bounds the continuation: prompt + tokens <= max_seq_len
    long = [1] + [5] * 40
    (res,) = Generator(model, max_batch=1, max_seq_len=MAX_SEQ).generate(
        greedy_requests([long], 30, None)
    )
    assert len(long) + len(res.tokens) == MAX_SEQ and res.finish == "length"


def test_sampling_settings():
    model = tiny_model()
    ps = prompts(300, 4, seed=5)
    greedy = Generator(model, max_batch=4, max_seq_len=MAX_SEQ).generate(
        greedy_requests(ps, 6, None)
    )
    top1 = [GenerationRequest(p, 6, SamplingParams(1.5, top_k=1)) for p in ps]
    gen = Generator(model, max_batch=4, max_seq_len=MAX_SEQ)
    assert [r.tokens for r in gen.generate(top1)] == [r.tokens for r in greedy]
    hot = [GenerationRequest(p, 6, SamplingParams(5.0)) for p in ps]
    torch.manual_seed(0)
    a = [r.tokens for r in gen.generate(hot)]
    torch.manual_seed(0)
    b = [r.tokens for r in gen.generate(hot)]
    assert a == b and a != [r.tokens for r in greedy]  # seeded, and really sampled


@pytest.mark.parametrize(
    "req, exc, msg",
    [
        (GenerationRequest([], 3), ValueError, "empty prompt"),
        (GenerationRequest([1, 999], 3), ValueError, "outside"),
        (GenerationRequest([1] * MAX_SEQ, 3), ValueError, "leaves no room"),
        (GenerationRequest([1], 0), ValueError, "max_new_tokens"),
        (GenerationRequest([1], 2, sampling="greedy"), TypeError, "SamplingParams"),
    ],
)
def test_bad_requests(req, exc, msg):
    with pytest.raises(exc, match=msg):
        Generator(tiny_model(), max_batch=1, max_seq_len=MAX_SEQ).generate([req])


def test_bad_engine_arguments():
    model = tiny_model()
    with pytest.raises(ValueError, match="max_batch"):
        Generator(model, max_batch=0)
    with pytest.raises(ValueError, match="max_batch"):
        Generator(model, max_batch=max_rows() + 1)
    with pytest.raises(ValueError, match="prefill_chunk"):
        Generator(model, prefill_chunk=0)
    with pytest.raises(ValueError, match="pages must be an int >= 2"):
        Generator(model, pages=1)
    with pytest.raises(ValueError, match="chunk"):
        Generator(model, chunk=0)
    with pytest.raises(ValueError, match="graph_mode"):
        Generator(model, graph_mode="graphs")
    with pytest.raises(ValueError, match="graphs or graph_mode"):
        Generator(model, graphs=False, graph_mode="eager")
    model.setup_cache(2, MAX_SEQ)
    with pytest.raises(ValueError, match="graph_mode"):
        DecodeStep(model, 1, 2, sampling=False, graph_mode="reduce-overhead")
    with pytest.raises(ValueError, match="capture"):
        DecodeStep(model, 1, 2, sampling=False, graph_mode="eager").capture()


@pytest.mark.slow  # torch.compile: inductor builds the step's CPU kernels (~20 s)
@pytest.mark.skipif(not shutil.which("g++"), reason="inductor needs a C++ compiler")
def test_compiled_step_decodes_the_default_steps_tokens():
    """graph_mode="compile" (the step under torch.compile, reduce-overhead) is the same math:
    greedy tokens equal the default step's on the fp32 tiny model (reference kernels)."""
    shutdown()  # a live process group (llama_org's) gets a compile-time group that outlives it
    model = tiny_model()
    ps = prompts(300, 2, seed=10)
    want = Generator(model, max_batch=2, max_seq_len=MAX_SEQ, chunk=2).generate(
        greedy_requests(ps, 3, None)
    )
    gen = Generator(model, max_batch=2, max_seq_len=MAX_SEQ, chunk=2, graph_mode="compile")
    try:
        got = gen.generate(greedy_requests(ps, 3, None))
    finally:
        torch._dynamo.reset()
    assert gen.graph_mode == "compile" and gen.stats.decode_steps == 2
    assert [r.tokens for r in got] == [r.tokens for r in want]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_graphs_equal_eager_and_meta(dtype):
    """CUDA graphs (fused kernels) vs eager steps vs Meta's loop on a GPU model."""
    from nakta_model.loading import random_model

    args = ModelArgs(dim=256, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=512, max_seq_len=96)
    model = random_model(args, "cuda", dtype, seed=1)
    ps = prompts(512, 9, seed=7)
    graphed = Generator(model, max_batch=4, chunk=8).generate(greedy_requests(ps, 20, None))
    eager = Generator(model, max_batch=4, chunk=8, graphs=False).generate(
        greedy_requests(ps, 20, None)
    )
    assert [r.tokens for r in graphed] == [r.tokens for r in eager]
    if dtype == torch.float32:
        want = generate_tokens(model, ps, 20, eos_id=-1, pad_id=-1)
        model.clear_cache()
        assert [r.tokens for r in graphed] == [w[len(p) :] for w, p in zip(want, ps)]


def _tp_worker(rank: int, world: int, init_file: str, ps: list, out_file: str) -> None:
    import torch.distributed as dist

    from nakta_model.parallel import ParallelContext

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        args = ModelArgs.from_meta_params(TINY_PARAMS, max_seq_len=MAX_SEQ)
        sd = meta_state_dict(TINY_PARAMS, seed=3)
        model = load(
            state_dict_source(sd, args), "cpu", None, ParallelContext(rank, world),
            kernels="reference",
        )  # fmt: skip
        res = Generator(model, max_batch=2, max_seq_len=MAX_SEQ, chunk=3).generate(
            greedy_requests(ps, 8, None)
        )
        if rank == 0:
            torch.save([r.tokens for r in res], out_file)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two fresh interpreters: a few seconds
def test_tensor_parallel_decode_two_gloo_ranks_equals_one_process(tmp_path):
    """tp=2: each rank holds half the heads and FFN columns; the all-reduces sit in the step."""
    import torch.multiprocessing as mp

    ps = prompts(300, 3, seed=8)
    out = tmp_path / "tp.pt"
    mp.start_processes(
        _tp_worker, args=(2, str(tmp_path / "rdv"), ps, str(out)), nprocs=2, join=True,
        start_method="spawn",
    )  # fmt: skip
    want = Generator(tiny_model(), max_batch=2, max_seq_len=MAX_SEQ, chunk=3).generate(
        greedy_requests(ps, 8, None)
    )
    assert torch.load(out) == [r.tokens for r in want]


def shared_prompts(n_prefixes=2, per=3, prefix_len=70, seed=9):
    rng = random.Random(seed)
    out = []
    for _ in range(n_prefixes):
        pre = [1] + [rng.randrange(3, 300) for _ in range(prefix_len - 1)]
        out += [pre + [rng.randrange(3, 300) for _ in range(rng.randint(1, 8))] for _ in range(per)]
    return out


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_shared_prompt_prefixes_prefill_once_and_decode_the_same(kernels, monkeypatch):
    model = tiny_model(kernels=kernels)
    ps = shared_prompts(per=3 if kernels == "reference" else 2)
    n_new = 6 if kernels == "reference" else 2
    plain = Generator(model, max_batch=2, max_seq_len=96, prefix_rows=0).generate(
        greedy_requests(ps, n_new, None)
    )
    from nakta_model.kernels import decode_attention as da

    seen = []  # the prefix lengths decode attention was asked to read from the prefix rows
    for name in ("decode_attention", "decode_attention_reference"):
        fn = getattr(da, name)

        def spy(*a, _fn=fn, **kw):
            if kw.get("prefix_lens") is not None:
                seen.append(int(kw["prefix_lens"].max()))
            slots.append(kw.get("prefix_slots"))
            return _fn(*a, **kw)

        monkeypatch.setattr(da, name, spy)
    slots = []  # the cascade's slots: the prefix rows and what they hold
    gen = Generator(model, max_batch=2, max_seq_len=96, prefix_rows=2)
    shared = gen.generate(greedy_requests(ps, n_new, None))
    assert [r.tokens for r in shared] == [r.tokens for r in plain]
    assert max(seen) == 70  # decoding read the prefix from the held prefix's pages
    held = sorted(h.pages[0] for h in gen.pages.held.values())
    assert len(held) == 2 and all(s is not None and s[0].dim() == 2 for s in slots)
    assert sorted(slots[-1][0][:, 0].tolist()) == held  # the slots: the held prefixes' pages
    assert max(max(s[1].tolist()) for s in slots) == 70  # ... computed once a step (cascade)
    slots.clear()
    row_by_row = Generator(model, max_batch=2, max_seq_len=96, prefix_rows=2, cascade=False)
    assert [r.tokens for r in row_by_row.generate(greedy_requests(ps, n_new, None))] == [
        r.tokens for r in plain
    ]
    assert slots and all(s is None for s in slots)
    # each 70-token prefix ran once, whatever the admission wave; the rest ran per prompt
    suffixes = sum(len(p) - 70 for p in ps)
    assert gen.stats.prefilled_tokens == 2 * 70 + suffixes
    assert gen.stats.prompt_tokens == sum(map(len, ps))


def test_more_prefixes_than_prefix_rows_and_a_scorer_in_between():
    """Three prefixes through one prefix row (LRU), then the scorer's prefix pool replaces the
    KV cache: the engine sets its cache up again and still decodes the same tokens."""
    from nakta_model import scoring

    model = tiny_model()
    ps = shared_prompts(n_prefixes=3, per=2)
    want = [r.tokens for r in Generator(model, max_batch=3, max_seq_len=96, prefix_rows=0)
            .generate(greedy_requests(ps, 4, None))]  # fmt: skip
    gen = Generator(model, max_batch=3, max_seq_len=96, prefix_rows=1)
    assert [r.tokens for r in gen.generate(greedy_requests(ps, 4, None))] == want
    reqs = [(p, [5]) for p in ps]
    scoring.score(model, reqs)  # builds (and frees) its own prefix pool in the model's cache
    assert [r.tokens for r in gen.generate(greedy_requests(ps, 4, None))] == want


def test_the_cascade_step_runs_only_while_a_held_prefix_is_read(monkeypatch):
    """A batch with no shared prefix decodes with the plain step (no cascade launches), even
    in an engine with prefix rows; the cascade's step is a graph of its own."""
    from nakta_model.kernels import decode_attention as da

    model = tiny_model()
    seen = []
    ref = da.decode_attention_reference

    def spy(*a, **kw):
        seen.append(kw.get("prefix_slots") is not None)
        return ref(*a, **kw)

    monkeypatch.setattr(da, "decode_attention_reference", spy)
    rng = random.Random(4)
    prompts = [[1] + [rng.randrange(3, 300) for _ in range(9)] for _ in range(3)]
    gen = Generator(model, max_batch=3, max_seq_len=96, prefix_rows=2)
    gen.generate(greedy_requests(prompts, 3, None))
    assert seen and not any(seen)
    assert all(not cascade for _, _, cascade in gen._steps)
    seen.clear()
    gen.generate(greedy_requests(shared_prompts(n_prefixes=1, per=2), 3, None))
    assert seen and all(seen)
    assert {cascade for _, _, cascade in gen._steps} == {False, True}
