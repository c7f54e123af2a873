"""nakta_model.Transformer: KV cache, packed tree scoring, logits gather, TP, dtypes, errors.

Parity with Meta's code is in test_parity_llama_org.py; here the model is checked against itself
along independent paths (cache vs no cache, packed tree vs separate sequences, Triton vs
reference kernels, tp=2 vs tp=1) and the attention helpers against plain math.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.multiprocessing as mp
from checkpoint_factory import TINY_PARAMS, TINY_PARAMS_MHA, meta_state_dict

from nakta_model import attention
from nakta_model.config import ModelArgs
from nakta_model.loading import load, random_model
from nakta_model.parallel import ParallelContext
from nakta_model.sources import state_dict_source

VOCAB = TINY_PARAMS["vocab_size"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make(params=TINY_PARAMS, dtype=torch.float32, kernels="reference", seed=0, rank=0, tp=1):
    args = ModelArgs.from_meta_params(params, max_seq_len=64)
    source = state_dict_source(meta_state_dict(params, seed=seed), args)
    ctx = ParallelContext(rank, tp) if tp > 1 else None
    return load(source, "cpu", dtype, ctx, kernels=kernels)


# ----------------------------------------------------------------------------- attention helpers


def naive_attention(q, k, v, allowed):
    """fp64 softmax attention; ``allowed`` [b or 1, s, t] bool; GQA by repeating KV heads."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    scores = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return (scores.softmax(-1) @ v).to(q.dtype)


@pytest.mark.parametrize("s, t", [(5, 5), (1, 7), (3, 8)])
def test_causal_attention_is_bottom_right_aligned_with_gqa(s, t):
    q, k, v = torch.randn(2, 4, s, 8), torch.randn(2, 2, t, 8), torch.randn(2, 2, t, 8)
    allowed = torch.arange(t)[None, :] <= torch.arange(s)[:, None] + (t - s)
    out = attention.causal_attention(q, k, v)
    torch.testing.assert_close(out, naive_attention(q, k, v, allowed[None]), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="suffix"):
        attention.causal_attention(torch.randn(1, 4, 9, 8), k[:1], v[:1])


# ------------------------------------------------------------------------------------ KV cache


@pytest.mark.parametrize("params", [TINY_PARAMS, TINY_PARAMS_MHA], ids=["gqa", "mha"])
def test_kv_cache_prefill_chunk_and_decode_equal_full_forward(params):
    model = make(params)
    tokens = torch.randint(0, VOCAB, (2, 13))
    full = model(tokens)
    model.setup_cache(max_batch_size=3, max_seq_len=20)
    parts = [model(tokens[:, :6], 0), model(tokens[:, 6:9], 6)]  # prefill, then a 3-token chunk
    parts += [model(tokens[:, i : i + 1], i) for i in range(9, 13)]  # one token at a time
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)
    # forward_last = last position of forward; a smaller batch reuses the cache
    torch.testing.assert_close(
        model.forward_last(tokens[:1, :5], 0), full[:1, 4], rtol=1e-5, atol=1e-5
    )
    with pytest.raises(ValueError, match="exceed the KV cache"):
        model(tokens[:, :2], 19)
    with pytest.raises(ValueError, match="exceed the KV cache"):
        model(torch.zeros(4, 1, dtype=torch.long), 0)
    model.clear_cache()
    torch.testing.assert_close(model(tokens), full)


def test_hf_rope_layout_gives_the_same_model():
    """rope_interleaved=False on HF-permuted q/k rows == Meta pairing on Meta rows."""
    from hf_factory import hf_permute

    args = ModelArgs.from_meta_params(TINY_PARAMS, max_seq_len=64)
    meta = meta_state_dict(TINY_PARAMS, seed=0)
    hf_rows = dict(meta)
    for i in range(args.n_layers):
        p = f"layers.{i}.attention."
        hf_rows[p + "wq.weight"] = hf_permute(meta[p + "wq.weight"], args.n_heads)
        hf_rows[p + "wk.weight"] = hf_permute(meta[p + "wk.weight"], args.n_kv_heads)
    hf_args = args.replace(rope_interleaved=False)
    hf_model = load(state_dict_source(hf_rows, hf_args), "cpu", kernels="reference")
    tokens = torch.randint(0, VOCAB, (2, 9))
    torch.testing.assert_close(hf_model(tokens), make()(tokens), rtol=1e-5, atol=1e-5)


def test_forward_without_cache_at_an_offset_rotates_from_start_pos():
    model = make()
    tokens = torch.randint(0, VOCAB, (1, 6))
    # Positions shift every q/k rotation equally, so attention scores (and logits) are unchanged.
    torch.testing.assert_close(model(tokens, 10), model(tokens, 0), rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------ forward_packed


def tree_stream(c=5, a=3, b=4, plain=9, pad=2):
    """One packed stream: a row of context C with branches A and B (each sees C and its own
    prefix), then a plain causal row of ``plain`` tokens, then ``pad`` pad tokens (each a
    sequence of its own). Returns tokens, positions, seq_start, span_end and the row lengths."""
    row0 = c + a + b
    n = row0 + plain + pad
    tokens = torch.randint(3, VOCAB, (n,))
    positions = torch.cat(
        [
            torch.arange(c),
            torch.arange(c, c + a),
            torch.arange(c, c + b),
            torch.arange(plain),
            torch.zeros(pad, dtype=torch.long),
        ]
    )
    seq_start = torch.tensor([0] * row0 + [row0] * plain + list(range(row0 + plain, n)))
    span_end = torch.tensor(
        [row0] * c + [c + a] * a + [row0] * b + [row0 + plain] * plain
        + list(range(row0 + plain + 1, n + 1))
    )  # fmt: skip
    return tokens, positions, seq_start, span_end, (c, a, b, plain, n)


@pytest.mark.parametrize("params", [TINY_PARAMS, TINY_PARAMS_MHA], ids=["gqa", "mha"])
@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_forward_packed_equals_separate_forwards(params, kernels):
    model = make(params, kernels=kernels)
    tokens, positions, seq_start, span_end, (c, a, b, plain, n) = tree_stream()
    index = torch.arange(n)  # every token, pads included (they must stay finite)
    out = model.forward_packed(tokens, positions, seq_start, span_end, index)
    assert out.dtype == torch.float32 and out.shape == (n, VOCAB) and torch.isfinite(out).all()
    ref = make(params)
    ca = ref(torch.cat([tokens[:c], tokens[c : c + a]])[None])[0]
    cb = ref(torch.cat([tokens[:c], tokens[c + a : c + a + b]])[None])[0]
    row1 = ref(tokens[c + a + b : c + a + b + plain][None])[0]
    tol = dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(out[:c], ca[:c], **tol)
    torch.testing.assert_close(out[c : c + a], ca[c:], **tol)
    torch.testing.assert_close(out[c + a : c + a + b], cb[c:], **tol)
    torch.testing.assert_close(out[c + a + b : c + a + b + plain], row1, **tol)


def test_a_trie_row_equals_a_forward_of_each_path():
    """Continuations that share their first tokens share those nodes: context C, then the trie
    x-y-{z1, z2} and w in depth-first order; each node's logits are its own path's."""
    model = make(kernels="triton")
    c = 5
    tokens = torch.randint(3, VOCAB, (c + 5,))
    x, y, z1, z2, w = range(c, c + 5)
    positions = torch.tensor(list(range(c)) + [c, c + 1, c + 2, c + 2, c])
    seq_start = torch.zeros(c + 5, dtype=torch.long)
    span_end = torch.tensor([c + 5] * c + [w, w, z1 + 1, z2 + 1, w + 1])
    out = model.forward_packed(tokens, positions, seq_start, span_end, torch.arange(c + 5))
    ref = make()
    for path in ([x, y, z1], [x, y, z2], [w]):
        alone = ref(torch.cat([tokens[:c], tokens[path]])[None])[0]
        torch.testing.assert_close(out[path], alone[c:], rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(out[:c], alone[:c], rtol=2e-5, atol=2e-5)


def test_logits_index_gathers_rows_and_the_lm_head_sees_only_them():
    model = make()
    tokens, positions, seq_start, span_end, (_, _, _, _, n) = tree_stream()
    full = model.forward_packed(tokens, positions, seq_start, span_end, torch.arange(n))
    index = torch.tensor([13, 4, 5, 20, 6, 4])  # any order, repeats allowed
    rows_seen = []
    hook = model.output.register_forward_hook(lambda m, i, o: rows_seen.append(i[0].shape[0]))
    try:
        got = model.forward_packed(tokens, positions, seq_start, span_end, index)
    finally:
        hook.remove()
    assert rows_seen == [len(index)]
    torch.testing.assert_close(got, full[index], rtol=1e-6, atol=1e-6)


def test_forward_packed_ignores_the_kv_cache_and_returns_plain_tensors():
    model = make()
    tokens, positions, seq_start, span_end, (_, _, _, _, n) = tree_stream()
    idx = torch.arange(n)
    before = model.forward_packed(tokens, positions, seq_start, span_end, idx)
    model.setup_cache(1, 4)  # too small for this batch: must not be touched
    after = model.forward_packed(tokens, positions, seq_start, span_end, idx)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    after.sub_(after.max())  # callers may edit logits in place (no inference tensors)
    assert not after.is_inference()


def test_forward_packed_rejects_bad_inputs():
    model = make()
    tokens, positions, seq_start, span_end, _ = tree_stream()
    idx = torch.tensor([0])
    with pytest.raises(ValueError, match="positions must be a tensor of shape"):
        model.forward_packed(tokens, positions[:-1], seq_start, span_end, idx)
    with pytest.raises(TypeError, match="span_end must be an int64/int32"):
        model.forward_packed(tokens, positions, seq_start, span_end.float(), idx)
    with pytest.raises(TypeError, match="logits_index must be an int64/int32"):
        model.forward_packed(tokens, positions, seq_start, span_end, idx.float())
    with pytest.raises(ValueError, match=r"tokens must have shape \[T>0\]"):
        model.forward_packed(tokens[None], positions, seq_start, span_end, idx)
    backwards = seq_start.clone()
    backwards[-1] = 0  # the last token claims the first sequence: not contiguous
    with pytest.raises(ValueError, match="seq_start must be non-decreasing"):
        model.forward_packed(tokens, positions, backwards, span_end, idx)
    with pytest.raises(ValueError, match=r"seq_start\[t\] must lie in \[0, t\]"):
        model.forward_packed(tokens, positions, seq_start.flip(0), span_end, idx)
    with pytest.raises(TypeError, match="tokens must be an int64/int32"):
        model(tokens[None].float())
    with pytest.raises(ValueError, match="start_pos must be an int"):
        model(tokens[None], -1)


# ------------------------------------------------------------------------- kernels and dtypes


def test_triton_kernels_match_reference_path():
    """The Triton kernels (interpreter on CPU) give the reference path's logits, all three paths."""
    ref, tri = make(kernels="reference"), make(kernels="triton")
    tokens, positions, seq_start, span_end, (_, _, _, _, n) = tree_stream()
    idx = torch.arange(n)
    tol = dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(
        tri.forward_packed(tokens, positions, seq_start, span_end, idx),
        ref.forward_packed(tokens, positions, seq_start, span_end, idx),
        **tol,
    )
    rows = tokens[:12].view(2, 6)
    for m in (ref, tri):
        m.setup_cache(2, 16)
    a = [m(rows[:, :5], 0) for m in (ref, tri)]
    b = [m(rows[:, 5:6], 5) for m in (ref, tri)]
    torch.testing.assert_close(a[1], a[0], **tol)
    torch.testing.assert_close(b[1], b[0], **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_forward_tracks_fp32(dtype):
    tokens, positions, seq_start, span_end, (_, _, _, _, n) = tree_stream()
    idx = torch.arange(n)
    want = make().forward_packed(tokens, positions, seq_start, span_end, idx)
    model = make(dtype=dtype)
    assert model.dtype == dtype
    got = model.forward_packed(tokens, positions, seq_start, span_end, idx)
    assert got.dtype == torch.float32
    # bf16 keeps 8 bits of mantissa: a few percent of the logit scale after 2 layers
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.8


# ---------------------------------------------------------------------------------- random init


def test_random_model_is_seeded_and_stays_finite_over_80_layers():
    args = ModelArgs(dim=64, n_layers=80, n_heads=4, vocab_size=128, multiple_of=16)
    m1 = random_model(args, "cpu", torch.bfloat16, seed=3, kernels="reference")
    m2 = random_model(args, "cpu", torch.bfloat16, seed=3, kernels="reference")
    m3 = random_model(args, "cpu", torch.bfloat16, seed=4, kernels="reference")
    assert m1.dtype == torch.bfloat16 and m1.device.type == "cpu"
    assert torch.equal(m1.layers[7].attention.wqkv.weight, m2.layers[7].attention.wqkv.weight)
    assert not torch.equal(m1.layers[7].attention.wqkv.weight, m3.layers[7].attention.wqkv.weight)
    logits = m1(torch.randint(0, 128, (2, 16)))
    assert torch.isfinite(logits).all()
    assert 0.1 < logits.std().item() < 10.0


def test_random_model_and_a_warm_up_import_no_sympy():
    """``Module.to_empty`` imports sympy through torch._refs (seconds of start-up; it made the
    lm-eval adapter's load-time warm-up model cost 7 s beside lm-eval's own imports)."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, torch\n"
        "from nakta_model.config import ModelArgs\n"
        "from nakta_model.loading import random_model\n"
        "from nakta_model import scoring\n"
        "args = ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=128, multiple_of=16)\n"
        "scoring.warm_up(random_model(args, 'cpu', torch.float32, kernels='reference'))\n"
        "print(sorted(m for m in ('sympy', 'torch._dynamo') if m in sys.modules))\n"
    )
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_random_model_under_tp_holds_only_its_shard():
    args = ModelArgs.from_meta_params(TINY_PARAMS)
    r0 = random_model(args, "cpu", torch.float32, parallel=ParallelContext(0, 2))
    r1 = random_model(args, "cpu", torch.float32, parallel=ParallelContext(1, 2))
    hd = args.head_dim
    assert r0.layers[0].attention.wqkv.weight.shape == ((2 + 2 * 1) * hd, args.dim)
    assert r0.layers[0].feed_forward.w13.weight.shape == (args.hidden_dim, args.dim)
    assert r0.output.weight.shape == (args.vocab_size // 2, args.dim)
    assert r0.tok_embeddings.weight.shape == (args.vocab_size, args.dim)
    assert not torch.equal(r0.layers[0].attention.wo.weight, r1.layers[0].attention.wo.weight)
    # the embedding is replicated under TP: every rank must hold the same one
    assert torch.equal(r0.tok_embeddings.weight, r1.tok_embeddings.weight)


def test_loading_a_state_dict_is_strict():
    args = ModelArgs.from_meta_params(TINY_PARAMS)
    sd = meta_state_dict(TINY_PARAMS)
    with pytest.raises(ValueError, match=r"missing tensors \['norm.weight'\]"):
        load(state_dict_source({k: v for k, v in sd.items() if k != "norm.weight"}, args), "cpu")
    with pytest.raises(ValueError, match="shape"):
        load(state_dict_source({**sd, "norm.weight": sd["norm.weight"][:-1]}, args), "cpu")
    with pytest.raises(ValueError, match="kernels must be one of"):
        load(state_dict_source(sd, args), "cpu", kernels="fast")


# ------------------------------------------------------------------------ tensor parallel (gloo)


def _tp_worker(rank: int, world: int, init_file: str, inputs: dict, out_file: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = make(rank=rank, tp=world)
        rows = inputs.pop("rows")
        res = {"scored": model.forward_packed(**inputs), "full": model(rows)}
        model.setup_cache(2, 16)
        model(rows[:, :5], 0)
        res["decode"] = model(rows[:, 5:6], 5)
        if rank == 0:
            torch.save(res, out_file)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two fresh interpreters importing torch: a few seconds
def test_tensor_parallel_two_gloo_ranks_match_single_process(tmp_path):
    tokens, positions, seq_start, span_end, (_, _, _, _, n) = tree_stream()
    inputs = dict(
        tokens=tokens,
        positions=positions,
        seq_start=seq_start,
        span_end=span_end,
        logits_index=torch.arange(0, n, 3),
        rows=tokens[:12].view(2, 6),
    )
    out_file = tmp_path / "tp.pt"
    mp.start_processes(
        _tp_worker,
        args=(2, str(tmp_path / "rdv"), inputs, str(out_file)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    got = torch.load(out_file, weights_only=True)
    model = make()
    tol = dict(rtol=1e-5, atol=1e-5)
    rows = inputs.pop("rows")
    torch.testing.assert_close(got["scored"], model.forward_packed(**inputs), **tol)
    torch.testing.assert_close(got["full"], model(rows), **tol)
    torch.testing.assert_close(got["decode"], model(rows[:, :6])[:, 5:], **tol)


# --------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_paths_agree_with_fp32_and_the_packed_tree(dtype):
    """On CUDA: Triton kernels (packed attention included); tree rows == separate forwards."""
    args = ModelArgs(dim=512, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=1000, multiple_of=64)
    model = random_model(args, "cuda", dtype, seed=1)
    ref = random_model(args, "cuda", torch.float32, seed=1)
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    ref.kernels = "reference"
    c, a, b, rows = 37, 11, 9, 4
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(3, 1000, (rows, c + a + b), device="cuda", generator=gen)
    row = c + a + b
    positions = torch.cat([torch.arange(c), torch.arange(c, c + a), torch.arange(c, c + b)])
    span = torch.tensor([row] * c + [c + a] * a + [row] * b)  # offsets within a row
    seq_start = torch.arange(rows).repeat_interleave(row).mul(row)
    flat = dict(
        tokens=tokens.reshape(-1),
        positions=positions.repeat(rows).cuda(),
        seq_start=seq_start.cuda(),
        span_end=(span.repeat(rows) + seq_start).cuda(),
        logits_index=torch.arange(rows * row, device="cuda"),
    )
    out = model.forward_packed(**flat).view(rows, row, -1)
    want = ref.forward_packed(**flat).view(rows, row, -1)
    assert torch.isfinite(out).all()
    scale = want.abs().max()
    assert (out - want).abs().max() < 0.05 * scale
    ca = model(torch.cat([tokens[:, :c], tokens[:, c : c + a]], 1))
    cb = model(torch.cat([tokens[:, :c], tokens[:, c + a :]], 1))
    sep = torch.cat([ca, cb[:, c:]], 1)
    assert (out - sep).abs().max() < 0.03 * scale
    model.setup_cache(rows, row)
    pre = model(tokens[:, :c], 0)
    dec = torch.cat([model(tokens[:, i : i + 1], i) for i in range(c, c + 5)], 1)
    model.clear_cache()
    full = model(tokens[:, : c + 5])
    assert (torch.cat([pre, dec], 1) - full).abs().max() < 0.03 * scale
