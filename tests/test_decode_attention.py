"""``decode_attention`` (split-K flash-decoding over the KV cache) against
``decode_attention_reference`` (fp32 softmax over each row's valid keys) and fp64.

Tolerances: fp32 within 2e-6 of the reference. The default (tensor-core) path rounds the
probabilities to the cache dtype for the ``tl.dot`` P @ V (as flash attention does): each
probability is off by at most the unit roundoff u (2^-9 bf16, 2^-12 fp16), so the output by at
most u * max |v| on top of ``assert_close``'s default tolerance (measured: ~25% of elements
differ by 1-2 ulps). The CUDA-core path (MHA with ``_TUNE`` ``USE_DOT=0``) runs in fp32
throughout, so fp16/bf16 outputs differ from the reference only by summation order before the
final rounding: at most 1% of elements differ in any bit, all within the default tolerance.
Against fp64: max error / max |value| below 1e-5 (fp32), 2^-8 (fp16), 2^-6 (bf16).

CPU runs use the Triton interpreter on tiny shapes; ``gpu`` tests use LLaMA shapes and
CUDA-graph capture.

Its paged form (``block_table``) and its e4m3 KV caches (``kv_cache="fp8"``) are checked here too.
"""

from __future__ import annotations

import math

import pytest
import torch
from tiers import slow_beyond

from nakta_model.kernels import decode_attention as da
from nakta_model.kernels.decode_attention import (
    attention_workspace,
    cascade_splits,
    decode_attention,
    decode_attention_reference,
    decode_splits,
)
from nakta_model.kernels.fp8_quant import FP8_DTYPE, quantize_rows_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FP64_TOL = {torch.float32: 1e-5, torch.float16: 2.0**-8, torch.bfloat16: 2.0**-6}
HALF_TOL = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}  # assert_close's
UNIT_ROUNDOFF = {torch.float16: 2.0**-12, torch.bfloat16: 2.0**-9}


def make_inputs(batch, n_q, n_kv, dtype, device, b_max=None, s_max=37, hd=24):
    """q as a strided view (heads of a wider buffer), caches as views of the model's flat
    ``[B_max * S_max, n_kv, hd]`` cache, lengths including 1 and S_max."""
    b_max = b_max or batch + 1
    qbuf = torch.randn(batch, n_q + 2, hd + 8, device=device).to(dtype)
    q = qbuf[:, 1 : n_q + 1, 4 : hd + 4]
    flat_k = torch.randn(b_max * s_max, n_kv, hd, device=device).to(dtype)
    flat_v = torch.randn(b_max * s_max, n_kv, hd, device=device).to(dtype)
    k_cache = flat_k.view(b_max, s_max, n_kv, hd)
    v_cache = flat_v.view(b_max, s_max, n_kv, hd)
    lens = torch.randint(1, s_max + 1, (batch,), device=device)
    lens[0] = 1
    if batch > 1:
        lens[1] = s_max
    return q, k_cache, v_cache, lens


def expected_fp64(q, k_cache, v_cache, lens, scale=None):
    batch, n_q, hd = q.shape
    n_kv = k_cache.shape[2]
    scale = scale or 1 / math.sqrt(hd)
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for b in range(batch):
        n = int(lens[b])
        for h in range(n_q):
            kv = h // (n_q // n_kv)
            k = k_cache[b, :n, kv].double()
            v = v_cache[b, :n, kv].double()
            p = torch.softmax(k @ q[b, h].double() * scale, dim=0)
            out[b, h] = p @ v
    return out


def assert_matches_reference(out, ref, v_cache, rounded_p: bool = True):
    """See the module docstring; ``v_cache`` bounds the error of rounded probabilities."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)
        return
    rtol, atol = HALF_TOL[out.dtype]
    if rounded_p:
        p_err = UNIT_ROUNDOFF[out.dtype] * v_cache.abs().max().item()
        torch.testing.assert_close(out, ref, rtol=rtol, atol=atol + p_err)
        return
    torch.testing.assert_close(out, ref)
    frac = (out != ref).double().mean().item()
    assert frac <= 0.01, f"{frac:.4f} of the elements differ from the reference"


def assert_near_fp64(out, expected, dtype):
    err = (out.double() - expected).abs().max() / expected.abs().max()
    assert err <= FP64_TOL[dtype], f"relative error {err:.3g} vs fp64"


def poisoned_out(q):
    """A NaN-filled out view with padding heads that must stay NaN."""
    batch, n_q, hd = q.shape
    base = torch.full((batch, n_q + 1, hd), float("nan"), dtype=q.dtype, device=q.device)
    return base[:, :n_q], base[:, n_q]


# ----------------------------------------------------------------------------- correctness

HEADS = ((4, 4), (8, 2))  # MHA, GQA
CASES = [(dt, h, b, s) for dt in DTYPES for h in HEADS for b in (1, 3) for s in (1, 3)]
CASES += [(torch.bfloat16, (4, 4), 33, 1), (torch.bfloat16, (8, 2), 16, 2)]
CASES += [(torch.bfloat16, (8, 2), 3, None)]


@pytest.mark.parametrize("dtype, heads, batch, n_splits", CASES)
def test_matches_reference_and_fp64(dtype, heads, batch, n_splits, device):
    """MHA and GQA, one split (single launch) or several (partials + combine), lengths from 1
    to S_max, strided q and cache views, a poisoned padded out and a poisoned workspace."""
    n_q, n_kv = heads
    q, k_cache, v_cache, lens = make_inputs(batch, n_q, n_kv, dtype, device)
    out, pad = poisoned_out(q)
    splits = n_splits or decode_splits(batch, n_kv, k_cache.shape[1], device)
    ws = attention_workspace(batch, n_q, q.shape[2], splits, device).fill_(float("nan"))
    got = decode_attention(q, k_cache, v_cache, lens, n_splits=n_splits, out=out, workspace=ws)
    assert got is out and torch.isnan(pad).all()
    ref = decode_attention_reference(q, k_cache, v_cache, lens)
    assert not torch.isnan(got).any()
    assert_matches_reference(got, ref, v_cache)
    assert_near_fp64(got, expected_fp64(q, k_cache, v_cache, lens), dtype)


def test_more_splits_than_keys_and_custom_scale(device):
    """Splits past a short row's keys write neutral partials; ``scale`` is honoured."""
    q, k_cache, v_cache, lens = make_inputs(3, 4, 2, torch.float32, device, s_max=40)
    lens = torch.tensor([1, 2, 40], device=device)
    got = decode_attention(q, k_cache, v_cache, lens, n_splits=16, scale=0.3)
    ref = decode_attention_reference(q, k_cache, v_cache, lens, scale=0.3)
    assert_matches_reference(got, ref, v_cache)
    assert_near_fp64(got, expected_fp64(q, k_cache, v_cache, lens, scale=0.3), torch.float32)


def test_permuted_cache_layout(device):
    """Caches stored head-major (``[B, n_kv, S, hd]`` memory) and read through a permuted view."""
    dtype = torch.bfloat16
    q, _, _, lens = make_inputs(2, 4, 4, dtype, device, s_max=20)
    store_k = torch.randn(3, 4, 20, 24, device=device).to(dtype)
    store_v = torch.randn(3, 4, 20, 24, device=device).to(dtype)
    k_cache, v_cache = store_k.permute(0, 2, 1, 3), store_v.permute(0, 2, 1, 3)
    for n_splits in (1, 2):
        got = decode_attention(q, k_cache, v_cache, lens, n_splits=n_splits)
        ref = decode_attention_reference(q, k_cache, v_cache, lens)
        assert_matches_reference(got, ref, v_cache)


@pytest.mark.parametrize("n_splits", [1, 4])
def test_empty_row_gives_zeros(n_splits, device):
    """An idle slot of a static batch (length 0) attends to nothing: a zero row, not NaN."""
    q, k_cache, v_cache, lens = make_inputs(3, 4, 2, torch.bfloat16, device)
    lens[1] = 0
    got = decode_attention(q, k_cache, v_cache, lens, n_splits=n_splits)
    assert (got[1] == 0).all() and not torch.isnan(got).any()
    assert (decode_attention_reference(q, k_cache, v_cache, lens)[1] == 0).all()


def test_out_may_be_q(device):
    q, k_cache, v_cache, lens = make_inputs(3, 8, 2, torch.float32, device)
    ref = decode_attention_reference(q, k_cache, v_cache, lens)
    got = decode_attention(q, k_cache, v_cache, lens, n_splits=2, out=q)
    assert got is q
    assert_matches_reference(q, ref, v_cache)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's 0 / 0
@pytest.mark.parametrize("n_splits", [1, 3])
def test_length_out_of_range_gives_nan_on_the_device_path(n_splits, device):
    """On CUDA no host check runs: a length past S_max (or negative) makes that row NaN and
    reads nothing out of bounds (the launcher is called directly to get past the CPU check)."""
    q, k_cache, v_cache, lens = make_inputs(3, 4, 4, torch.float32, device)
    lens[0] = k_cache.shape[1] + 1
    lens[2] = -1
    out = torch.zeros_like(q)
    da._launch(q, k_cache, v_cache, lens, 0.2, n_splits, out, None)
    assert torch.isnan(out[0]).all() and torch.isnan(out[2]).all()
    assert not torch.isnan(out[1]).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_splits", [1, 2])
def test_mha_on_the_cuda_cores(dtype, n_splits, device, monkeypatch):
    """The CUDA-core path (MHA, ``USE_DOT=0``: fp32 throughout) when asked (bench/tuning)."""
    monkeypatch.setattr(da, "_TUNE", {"USE_DOT": 0})
    q, k_cache, v_cache, lens = make_inputs(3, 4, 4, dtype, device)
    got = decode_attention(q, k_cache, v_cache, lens, n_splits=n_splits)
    ref = decode_attention_reference(q, k_cache, v_cache, lens)
    assert_matches_reference(got, ref, v_cache, rounded_p=False)
    assert_near_fp64(got, expected_fp64(q, k_cache, v_cache, lens), dtype)
    with pytest.raises(ValueError, match="USE_DOT=0 needs one query head per KV head"):
        decode_attention(*make_inputs(3, 4, 2, dtype, device))


# ---------------------------------------------------------------------------- splits


@pytest.mark.parametrize(
    "batch, n_kv, s_max, splits",
    [
        (1, 32, 4096, 9),  # 32 programs -> 9 splits: 288 >= 2 x 132
        (1, 8, 4096, 16),  # GQA: capped by MIN_SPLIT_KEYS (4096 / 256)
        (32, 32, 4096, 1),  # 1024 programs already
        (1, 32, 128, 1),  # a cache of 128 keys is not split
        (4, 1, 1 << 20, 64),  # MAX_SPLITS
    ],
)
def test_decode_splits_from_shapes(batch, n_kv, s_max, splits):
    assert decode_splits(batch, n_kv, s_max, "cpu") == splits


def test_workspace_shape():
    ws = attention_workspace(2, 8, 128, 5, "cpu")
    assert ws.shape == (2, 8, 5, 130) and ws.dtype == torch.float32


# ---------------------------------------------------------------------------- bad inputs


def _bad_cases():
    q, k, v, lens = make_inputs(2, 4, 2, torch.float32, torch.device("cpu"))
    return [
        ((q.transpose(1, 2), k, v, lens), {}, ValueError, "q must be unit-stride"),
        ((q[0], k, v, lens), {}, ValueError, "q must have 3 dimensions"),
        ((q.double(), k, v, lens), {}, TypeError, "q must have dtype"),
        ((q, k.half(), v, lens), {}, TypeError, "k_cache must have q's dtype"),
        ((q, k, v[:, :5], lens), {}, ValueError, "k_cache and v_cache must have the same shape"),
        ((q, k[:1], v[:1], lens), {}, ValueError, r"B_max >= 2"),
        ((q, k[..., :8], v[..., :8], lens), {}, ValueError, "head_dim=24"),
        ((q[:, :3], k, v, lens), {}, ValueError, "must divide q's heads"),
        ((q, k, v, lens.float()), {}, TypeError, "cache_lens must have dtype"),
        ((q, k, v, lens[:1]), {}, ValueError, "cache_lens must have 2 entries"),
        ((q, k, v, lens + 100), {}, ValueError, r"cache_lens must lie in \[0, S_max=37\]"),
        ((q, k, v, lens), {"scale": -1.0}, ValueError, "scale must be a positive"),
        ((q, k, v, lens), {"n_splits": 0}, ValueError, "n_splits must be an int"),
        ((q, k, v, lens), {"out": torch.empty(2, 4, 23)}, ValueError, "out must have q's shape"),
        ((q, k, v, lens), {"out": k[0, :4].view(2, 4, 24)}, ValueError, "out overlaps k_cache"),
        ((q, k, v, lens), {"n_splits": 2, "workspace": torch.empty(10)}, ValueError,
         "workspace must be a contiguous fp32 tensor of at least"),
        ((q, k, v, lens), {"n_splits": 2, "workspace": torch.empty(2 * 4 * 2 * 26).half()},
         TypeError, "workspace must have dtype"),
    ]  # fmt: skip


@pytest.mark.parametrize("args, kwargs, exc, match", _bad_cases())
def test_bad_inputs_raise(args, kwargs, exc, match):
    for fn in (decode_attention, decode_attention_reference):
        with pytest.raises(exc, match=match):
            fn(*args, **kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(batch=0, n_kv_heads=1, max_seq=8), "batch must be a positive int"),
        (dict(batch=1, n_kv_heads=1, max_seq=True), "max_seq must be a positive int"),
    ],
)
def test_decode_splits_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        decode_splits(**kwargs, device="cpu")


# ---------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(32, 32), (32, 8)])
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_gpu_llama_shapes(heads, batch):
    device = torch.device("cuda")
    q, k_cache, v_cache, lens = make_inputs(batch, *heads, torch.bfloat16, device, s_max=2048,
                                            hd=128)  # fmt: skip
    got = decode_attention(q, k_cache, v_cache, lens)
    ref = decode_attention_reference(q, k_cache, v_cache, lens)
    assert_matches_reference(got, ref, v_cache)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_follows_lengths():
    """One capture serves every step: lengths and queries change in place between replays."""
    device = torch.device("cuda")
    q, k_cache, v_cache, lens = make_inputs(4, 32, 8, torch.bfloat16, device, s_max=1024,
                                            hd=128)  # fmt: skip
    splits = decode_splits(4, 8, 1024, device)
    assert splits > 1
    ws = attention_workspace(4, 32, 128, splits, device)
    out = torch.empty_like(q)
    decode_attention(q, k_cache, v_cache, lens, out=out, workspace=ws)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, k_cache, v_cache, lens, out=out, workspace=ws)
    for new_lens in ([1, 1024, 500, 0], [17, 3, 1000, 64]):
        lens.copy_(torch.tensor(new_lens, device=device))
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        ref = decode_attention_reference(q, k_cache, v_cache, lens)
        assert_matches_reference(out, ref, v_cache)


@pytest.mark.parametrize(
    "n_q, n_kv, n_splits",
    slow_beyond(
        {"mha": (4, 4), "gqa": (4, 2)}, {"1": 1, "3": 3}, fast={("mha", "3"), ("gqa", "1")}
    ),
)
def test_rows_pick_any_cache_row(n_q, n_kv, n_splits):
    """Continuous batching: batch row b reads cache row ``rows[b]`` (repeats allowed)."""
    q, k_cache, v_cache, lens = make_inputs(3, n_q, n_kv, torch.float32, "cpu", b_max=5)
    rows = torch.tensor([4, 0, 4], dtype=torch.int32)
    got = decode_attention(q, k_cache, v_cache, lens, rows=rows, n_splits=n_splits)
    gathered_k, gathered_v = k_cache[rows.long()], v_cache[rows.long()]
    want = decode_attention(q, gathered_k, gathered_v, lens, n_splits=n_splits)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    ref = decode_attention_reference(q, k_cache, v_cache, lens, rows=rows)
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(
        ref, expected_fp64(q, gathered_k, gathered_v, lens).float(), rtol=1e-5, atol=1e-5
    )
    with pytest.raises(ValueError, match=r"rows must lie in \[0, B_max=5\)"):
        decode_attention(q, k_cache, v_cache, lens, rows=torch.tensor([0, 5, 1]))
    with pytest.raises(ValueError, match="rows must have 3 entries"):
        decode_attention(q, k_cache, v_cache, lens, rows=rows[:2])


@pytest.mark.parametrize(
    "n_q, n_kv, n_splits, dtype",
    slow_beyond(
        {"mha": (4, 4), "gqa": (4, 2)},
        {"1": 1, "3": 3},
        {"fp32": torch.float32, "bf16": torch.bfloat16},
        fast={("mha", "1", "fp32"), ("gqa", "3", "bf16")},
    ),
)
def test_prefix_rows_read_a_shared_prefix_without_copies(n_q, n_kv, n_splits, dtype):
    """Keys below ``prefix_lens[b]`` come from cache row ``prefix_rows[b]``: the output is the
    one the rows would give with the prefix copied in (bit for bit), including a prefix longer
    than the row's keys, no prefix (0) and a prefix tile boundary inside a split."""
    q, k_cache, v_cache, lens = make_inputs(4, n_q, n_kv, dtype, "cpu", b_max=6)
    lens = torch.tensor([1, 37, 20, 29])
    rows = torch.tensor([3, 0, 1, 2], dtype=torch.int32)
    prefix_rows = torch.tensor([5, 5, 4, 5], dtype=torch.int32)
    prefix_lens = torch.tensor([9, 17, 0, 33], dtype=torch.int32)
    got = decode_attention(
        q, k_cache, v_cache, lens, rows=rows, n_splits=n_splits,
        prefix_rows=prefix_rows, prefix_lens=prefix_lens,
    )  # fmt: skip
    copied_k, copied_v = k_cache[rows.long()].clone(), v_cache[rows.long()].clone()
    for b in range(4):
        n = int(prefix_lens[b])
        copied_k[b, :n] = k_cache[int(prefix_rows[b]), :n]
        copied_v[b, :n] = v_cache[int(prefix_rows[b]), :n]
    want = decode_attention(q, copied_k, copied_v, lens, n_splits=n_splits)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    ref = decode_attention_reference(
        q, k_cache, v_cache, lens, rows=rows, prefix_rows=prefix_rows, prefix_lens=prefix_lens
    )
    assert torch.equal(ref, decode_attention_reference(q, copied_k, copied_v, lens))
    assert_near_fp64(got, expected_fp64(q, copied_k, copied_v, lens), dtype)


def test_prefix_arguments_are_checked():
    q, k_cache, v_cache, lens = make_inputs(2, 4, 4, torch.float32, "cpu", b_max=3)
    pr, pl = torch.tensor([2, 2]), torch.tensor([3, 3])
    with pytest.raises(ValueError, match="prefix_rows and prefix_lens go together"):
        decode_attention(q, k_cache, v_cache, lens, prefix_rows=pr)
    with pytest.raises(ValueError, match=r"prefix_rows must lie in \[0, B_max=3\)"):
        decode_attention(q, k_cache, v_cache, lens, prefix_rows=pr + 1, prefix_lens=pl)
    with pytest.raises(ValueError, match=r"prefix_lens must lie in \[0, S_max=37\]"):
        decode_attention(q, k_cache, v_cache, lens, prefix_rows=pr, prefix_lens=pl + 40)
    with pytest.raises(ValueError, match="prefix_lens must have 2 entries"):
        decode_attention(q, k_cache, v_cache, lens, prefix_rows=pr, prefix_lens=pl[:1])
    with pytest.raises(TypeError, match="prefix_rows"):
        decode_attention(q, k_cache, v_cache, lens, prefix_rows=pr.float(), prefix_lens=pl)


def _cascade_case(batch, n_q, n_kv, dtype, s_max=37):
    """Rows over cache rows 0..batch-1; slots in rows batch (holds 30 keys) and batch + 1 (21
    keys); rows read slot A, slot B (a prefix shorter than the slot's, one longer than the
    row's keys) or nothing."""
    q, k_cache, v_cache, lens = make_inputs(batch, n_q, n_kv, dtype, "cpu", batch + 2, s_max)
    a, b = batch, batch + 1
    slots = (torch.tensor([a, b], dtype=torch.int32), torch.tensor([30, 21], dtype=torch.int32))
    pick = [(a, 30), (b, 21), (a, 0), (b, 12), (a, 30)]
    pre_rows = torch.tensor([pick[i % 5][0] for i in range(batch)], dtype=torch.int32)
    pre_lens = torch.tensor([pick[i % 5][1] for i in range(batch)], dtype=torch.int32)
    lens = torch.randint(1, s_max + 1, (batch,))
    lens[0], lens[batch - 1] = 5, s_max  # a row shorter than its prefix, a full one
    rows = torch.randperm(batch).to(torch.int32)
    kw = dict(rows=rows, prefix_rows=pre_rows, prefix_lens=pre_lens)
    return q, k_cache, v_cache, lens, slots, kw


@pytest.mark.parametrize(
    "n_q, n_kv, batch, n_splits, dtype",
    slow_beyond(
        {"mha": (4, 4, 5), "gqa": (8, 2, 7), "gqa-two-query-tiles": (8, 2, 21)},
        {"1": 1, "3": 3},
        {"fp32": torch.float32, "bf16": torch.bfloat16},
        fast={("mha", "3", "bf16"), ("gqa", "1", "fp32"), ("gqa-two-query-tiles", "1", "bf16")},
    ),
)
def test_cascade_computes_each_slots_prefix_once_for_all_its_rows(n_q, n_kv, batch, n_splits,
                                                                  dtype):  # fmt: skip
    """``prefix_slots``: the prefix part of every row that reads a slot is one tile against
    the slot's keys, the rest of each row its own splits; the output is the plain path's (up
    to summation order) and the reference's, whatever the rows' prefix and key counts."""
    q, k_cache, v_cache, lens, slots, kw = _cascade_case(batch, n_q, n_kv, dtype)
    out, pad = poisoned_out(q)
    got = decode_attention(
        q, k_cache, v_cache, lens, n_splits=n_splits, prefix_slots=slots, out=out, **kw
    )
    assert got is out and torch.isnan(pad).all()  # every head written, the padding not
    plain = decode_attention(q, k_cache, v_cache, lens, n_splits=n_splits, **kw)
    ref = decode_attention_reference(q, k_cache, v_cache, lens, prefix_slots=slots, **kw)
    assert_matches_reference(got, ref, v_cache)
    assert_matches_reference(plain, ref, v_cache)
    copied_k, copied_v = k_cache[kw["rows"].long()].clone(), v_cache[kw["rows"].long()].clone()
    for i in range(batch):
        n = int(kw["prefix_lens"][i])
        copied_k[i, :n] = k_cache[int(kw["prefix_rows"][i]), :n]
        copied_v[i, :n] = v_cache[int(kw["prefix_rows"][i]), :n]
    assert_near_fp64(got, expected_fp64(q, copied_k, copied_v, lens), dtype)


def test_cascade_workspace_and_arguments_are_checked():
    q, k_cache, v_cache, lens, slots, kw = _cascade_case(5, 4, 4, torch.float32)
    ps = da.cascade_splits(5, 4, 4, 2, 37, "cpu")
    ws = attention_workspace(5, 4, 24, 3 + 2 * ps, "cpu")
    got = decode_attention(q, k_cache, v_cache, lens, n_splits=3, workspace=ws,
                           prefix_slots=slots, **kw)  # fmt: skip
    torch.testing.assert_close(
        got, decode_attention_reference(q, k_cache, v_cache, lens, **kw), rtol=2e-6, atol=2e-6
    )
    with pytest.raises(ValueError, match="workspace must be a contiguous fp32 tensor"):
        decode_attention(q, k_cache, v_cache, lens, n_splits=3, prefix_slots=slots,
                         workspace=attention_workspace(5, 4, 24, 3, "cpu"), **kw)  # fmt: skip
    with pytest.raises(ValueError, match="every prefix must be read from a slot"):
        decode_attention(
            q, k_cache, v_cache, lens, prefix_slots=(slots[0][:1], slots[1][:1]), **kw
        )  # fmt: skip  (rows reading the second slot's row)
    with pytest.raises(ValueError, match="every prefix must be read from a slot"):
        decode_attention(q, k_cache, v_cache, lens, prefix_slots=(slots[0], slots[1] - 20), **kw)
    with pytest.raises(ValueError, match="prefix_slots needs prefix_rows"):
        decode_attention(q, k_cache, v_cache, lens, prefix_slots=slots, rows=kw["rows"])
    with pytest.raises(TypeError, match="prefix_slots must be a pair"):
        decode_attention(q, k_cache, v_cache, lens, prefix_slots=slots[0], **kw)
    with pytest.raises(ValueError, match=r"prefix_slots\[0\] must lie in \[0, B_max=7\)"):
        decode_attention(q, k_cache, v_cache, lens, prefix_slots=(slots[0] + 9, slots[1]), **kw)
    assert da.cascade_splits(64, 32, 32, 2, 1280, "cpu") >= 1
    with pytest.raises(ValueError, match="n_slots must be a positive int"):
        da.cascade_splits(64, 32, 32, 0, 1280, "cpu")


def test_env_override_of_the_launch_config_reaches_the_split_rule(monkeypatch):
    """A benchmark tries another split rule in a fresh process through the environment."""
    from nakta_model.kernels import decode_attention as cfg

    base = decode_splits(1, 32, 256, "cpu")
    monkeypatch.setenv(cfg.ENV_TUNE, "MIN_SPLIT_KEYS=64")
    assert base == 1 and decode_splits(1, 32, 256, "cpu") == 4  # 256 keys in splits of 64
    monkeypatch.setenv(cfg.ENV_TUNE, "MIN_SPLIT_KEYS=64, MAX_SPLITS=2")
    assert decode_splits(1, 32, 256, "cpu") == 2
    for bad in ("MIN_SPLIT_KEYS", "NOPE=3", "MIN_SPLIT_KEYS=0", "BLOCK_S=x"):
        monkeypatch.setenv(cfg.ENV_TUNE, bad)
        with pytest.raises(ValueError, match=cfg.ENV_TUNE):
            decode_splits(1, 32, 256, "cpu")


# ------------------------------------------------------------------------------------------------
# ``decode_attention``'s paged form (``block_table``): keys read through per-row page tables of
# one page pool, against a plain fp32 softmax over the keys gathered page by page (written here,
# independent of the module's reference) and against the module's reference.
#
# Pages are random and non-contiguous (rows share some, as a shared prefix's pages), lengths odd
# (a row ending inside a page, one page exactly, a full table); GQA and MHA; fp32 / fp16 / bf16;
# one split and several; with and without the cascade over prefix slots given as page tables.
# Tolerances as in ``test_decode_attention.py``.
# ------------------------------------------------------------------------------------------------


PAGE = 64  # the kernels' BLOCK_S (64) divides it


def pool(n_pages, n_kv, hd, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n_pages * PAGE, n_kv, hd, generator=g).to(dtype)
    v = torch.randn(n_pages * PAGE, n_kv, hd, generator=g).to(dtype)
    return k.view(n_pages, PAGE, n_kv, hd), v.view(n_pages, PAGE, n_kv, hd)


def gathered_attention(q, k_pages, v_pages, table, lens):
    """fp32 softmax over row b's first ``lens[b]`` keys, gathered through ``table`` key by key."""
    batch, n_q, hd = q.shape
    n_kv = k_pages.shape[2]
    out = torch.zeros(batch, n_q, hd)
    for b in range(batch):
        n = int(lens[b])
        if n == 0:
            continue
        idx = [(int(table[b, s // PAGE]), s % PAGE) for s in range(n)]
        k = torch.stack([k_pages[p, i] for p, i in idx]).float()  # [n, n_kv, hd]
        v = torch.stack([v_pages[p, i] for p, i in idx]).float()
        for h in range(n_q):
            kv = h // (n_q // n_kv)
            p = torch.softmax(k[:, kv] @ q[b, h].float() / hd**0.5, dim=0)
            out[b, h] = p @ v[:, kv]
    return out


def paged_case(batch, n_q, n_kv, dtype, width=3, n_pages=11, hd=24, seed=1):
    """Random non-contiguous tables (entries past a row's keys point anywhere, even out of the
    pool: never read); rows 0 and 1 share their first page; odd lengths."""
    g = torch.Generator().manual_seed(seed)
    k, v = pool(n_pages, n_kv, hd, dtype, seed)
    table = torch.stack([torch.randperm(n_pages, generator=g)[:width] for _ in range(batch)])
    lens = torch.randint(1, width * PAGE + 1, (batch,), generator=g)
    lens[0] = 1
    if batch > 1:
        table[1, 0] = table[0, 0]
        lens[1] = width * PAGE  # a full table
    if batch > 2:
        lens[2] = PAGE  # exactly one page
    for b in range(batch):  # columns past the row's pages: garbage
        used = -(-int(lens[b]) // PAGE)
        table[b, used:] = 10_000
    qbuf = torch.randn(batch, n_q + 2, hd + 8, generator=g).to(dtype)
    q = qbuf[:, 1 : n_q + 1, 4 : hd + 4]  # a strided view
    return q, k, v, table.to(torch.int32), lens


@pytest.mark.parametrize(
    "dtype, heads, batch, n_splits",
    slow_beyond(
        {str(dt).removeprefix("torch."): dt for dt in DTYPES},
        {"mha": ((4, 4),), "gqa": ((8, 2),)},
        {"b1": 1, "b5": 5},
        {"s1": 1, "s3": 3},
        # each dtype, head layout, batch and split count at least once
        fast={
            ("float32", "mha", "b5", "s3"),
            ("float16", "gqa", "b1", "s3"),
            ("bfloat16", "gqa", "b5", "s1"),
            ("bfloat16", "mha", "b1", "s1"),
        },
    ),
)
def test_paged_matches_gathered_reference(dtype, heads, batch, n_splits):
    n_q, n_kv = heads
    q, k, v, table, lens = paged_case(batch, n_q, n_kv, dtype)
    got = decode_attention(q, k, v, lens, block_table=table, n_splits=n_splits)
    want = gathered_attention(q, k, v, table, lens).to(dtype)
    ref = decode_attention_reference(q, k, v, lens, block_table=table)
    assert_matches_reference(got, ref, v)
    assert_matches_reference(ref, want, v, rounded_p=False)
    assert_matches_reference(got, want, v)


def test_the_row_form_is_the_one_page_table():
    """``rows`` and ``block_table = rows[:, None]`` over ``[B_max, S_max]`` rows (S_max = 37: a
    page need not be a tile multiple when rows hold one page) give the same bits."""
    g = torch.Generator().manual_seed(3)
    k = torch.randn(5, 37, 2, 16, generator=g)
    v = torch.randn(5, 37, 2, 16, generator=g)
    q = torch.randn(3, 4, 16, generator=g)
    lens = torch.tensor([37, 1, 20])
    rows = torch.tensor([4, 0, 4], dtype=torch.int32)
    a = decode_attention(q, k, v, lens, rows=rows, n_splits=2)
    b = decode_attention(q, k, v, lens, block_table=rows[:, None].contiguous(), n_splits=2)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def _paged_cascade_case(batch, n_q, n_kv, dtype):
    """Two held prefixes as page tables (150 keys: 2 full pages + 22; 64 keys: one page); rows
    share the full pages and own a copy of the partial one, then their own pages; some rows read
    no slot, one row's prefix is shorter than its slot's, one row ends inside its prefix."""
    n_pages, width, hd = 48, 4, 16
    k, v = pool(n_pages, n_kv, hd, dtype, seed=5)
    slot_table = torch.tensor([[3, 7, 11, 0], [5, 0, 0, 0]], dtype=torch.int32)
    slot_lens = torch.tensor([150, 64], dtype=torch.int32)
    free = iter([p for p in range(n_pages) if p not in (3, 7, 11, 5)])
    table = torch.zeros(batch, width, dtype=torch.int32)
    pre_rows = torch.zeros(batch, dtype=torch.int32)
    pre_lens = torch.zeros(batch, dtype=torch.int32)
    lens = torch.zeros(batch, dtype=torch.long)
    g = torch.Generator().manual_seed(6)
    for b in range(batch):
        kind = b % 4
        if kind == 0:  # reads slot 0, 150 keys: pages 3, 7 shared, page 11's keys copied
            own = next(free)
            k[own, :22], v[own, :22] = k[11, :22], v[11, :22]
            table[b, :3] = torch.tensor([3, 7, own])
            table[b, 3] = next(free)
            pre_rows[b], pre_lens[b] = 3, 150
            lens[b] = int(torch.randint(151, width * PAGE + 1, (1,), generator=g))
        elif kind == 1:  # reads slot 1 (one full page), then its own pages
            table[b] = torch.tensor([5, next(free), next(free), 9999])
            pre_rows[b], pre_lens[b] = 5, 64
            lens[b] = int(torch.randint(65, 3 * PAGE + 1, (1,), generator=g))
        elif kind == 2:  # no shared prefix
            table[b] = torch.tensor([next(free), next(free), 9999, 9999])
            lens[b] = int(torch.randint(1, 2 * PAGE + 1, (1,), generator=g))
        else:  # a 100-key prefix of slot 0 (shorter than the slot), the row ends at key 90
            table[b, :2] = torch.tensor([3, 7])
            table[b, 2:] = 9999
            pre_rows[b], pre_lens[b] = 3, 100
            lens[b] = 90
    q = torch.randn(batch, n_q, hd, generator=g).to(dtype)
    kw = dict(block_table=table, prefix_rows=pre_rows, prefix_lens=pre_lens)
    return q, k, v, lens, (slot_table, slot_lens), kw


@pytest.mark.parametrize(
    "n_q, n_kv, batch, n_splits, dtype",
    slow_beyond(
        {"mha": (4, 4, 5), "gqa": (8, 2, 7), "gqa-two-query-tiles": (8, 2, 21)},
        {"1": 1, "3": 3},
        {"fp32": torch.float32, "bf16": torch.bfloat16},
        fast={("mha", "3", "bf16"), ("gqa", "1", "fp32"), ("gqa-two-query-tiles", "1", "bf16")},
    ),
)
def test_paged_cascade_reads_each_slots_pages_once(n_q, n_kv, batch, n_splits, dtype):
    """The cascade over slot page tables equals the plain paged read (the rows' tables hold
    the same keys) and the gathered reference; a row's own keys start mid-tile (150)."""
    q, k, v, lens, slots, kw = _paged_cascade_case(batch, n_q, n_kv, dtype)
    got = decode_attention(q, k, v, lens, n_splits=n_splits, prefix_slots=slots, **kw)
    plain = decode_attention(q, k, v, lens, n_splits=n_splits, block_table=kw["block_table"])
    want = gathered_attention(q, k, v, kw["block_table"], lens).to(dtype)
    ref = decode_attention_reference(q, k, v, lens, prefix_slots=slots, **kw)
    assert_matches_reference(ref, want, v, rounded_p=False)
    assert_matches_reference(got, want, v)
    assert_matches_reference(plain, want, v)


def test_paged_cascade_workspace_and_slot_reads():
    """A caller workspace sized for splits + slot splits; a row's keys past the prefix really
    come from its own pages (poisoning the slot's page past its length changes nothing, while
    poisoning a shared page inside the prefix does)."""
    q, k, v, lens, slots, kw = _paged_cascade_case(6, 4, 2, torch.float32)
    ps = cascade_splits(6, 4, 2, 2, 4 * PAGE, "cpu")
    ws = attention_workspace(6, 4, 16, 2 + 2 * ps, "cpu").fill_(float("nan"))
    got = decode_attention(q, k, v, lens, n_splits=2, workspace=ws, prefix_slots=slots, **kw)
    assert_matches_reference(got, decode_attention_reference(q, k, v, lens, **{
        "block_table": kw["block_table"]}), v)  # fmt: skip
    k2 = k.clone()
    k2[11, 22:] = 1e4  # slot 0's last page past its 150 keys
    again = decode_attention(q, k2, v, lens, n_splits=2, prefix_slots=slots, **kw)
    torch.testing.assert_close(again, got, rtol=0, atol=0)
    k3 = k.clone()
    k3[3, :5] = 3.0  # a shared page inside the prefix
    changed = decode_attention(q, k3, v, lens, n_splits=2, prefix_slots=slots, **kw)
    assert not torch.allclose(changed, got)


def test_paged_arguments_are_checked():
    q, k, v, table, lens = paged_case(3, 4, 2, torch.float32)
    with pytest.raises(ValueError, match="rows or block_table, not both"):
        decode_attention(q, k, v, lens, block_table=table, rows=table[:, 0])
    with pytest.raises(ValueError, match=r"block_table must have shape \[B=3"):
        decode_attention(q, k, v, lens, block_table=table[:2])
    with pytest.raises(TypeError, match="block_table"):
        decode_attention(q, k, v, lens, block_table=table.float())
    with pytest.raises(ValueError, match=r"cache_lens must lie in \[0, S_max=192\]"):
        decode_attention(q, k, v, lens + 200, block_table=table)
    bad = table.clone()
    bad[0, 0] = 11
    with pytest.raises(ValueError, match=r"block_table must hold pages in \[0, 11\)"):
        decode_attention(q, k, v, lens, block_table=bad)
    with pytest.raises(ValueError, match="only go with prefix_slots"):
        decode_attention(
            q, k, v, lens, block_table=table, prefix_rows=table[:, 0], prefix_lens=lens
        )
    k40, v40 = (
        k.reshape(-1, 2, 24)[: 11 * 40].view(11, 40, 2, 24),
        v.reshape(-1, 2, 24)[: 11 * 40].view(11, 40, 2, 24),
    )
    with pytest.raises(ValueError, match="page size .* multiple of the dot kernel's BLOCK_S"):
        decode_attention(q, k40, v40, lens.clamp(max=40), block_table=table)
    q2, k2, v2, lens2, slots, kw = _paged_cascade_case(5, 4, 4, torch.float32)
    with pytest.raises(ValueError, match=r"prefix_slots\[0\] must be 2-D"):
        decode_attention(q2, k2, v2, lens2, prefix_slots=(slots[0][:, 0], slots[1]), **kw)
    with pytest.raises(ValueError, match="every prefix must be read from a slot"):
        decode_attention(q2, k2, v2, lens2, prefix_slots=(slots[0][:1], slots[1][:1]), **kw)


def test_splits_follow_the_tables_width():
    """The split rule sees W * page keys a row (a shape: graph capture keeps its grid)."""
    assert decode_splits(1, 8, 4 * PAGE, "cpu") == decode_splits(1, 8, 256, "cpu")


# ------------------------------------------------------------------------------------------------
# ``decode_attention`` over e4m3 KV caches (``kv_cache="fp8"``): codes plus one fp32 scale per
# (key, KV head), dequantized in registers. The kernel against its reference (which dequantizes
# first, then the fp32 softmax) with ``test_decode_attention.py``'s tolerances, in the row form,
# paged, through the cascade over held prefixes, with a sliding window; fp32 / fp16 / bf16
# queries, GQA and MHA, one split and several. The quantization's own error is judged against the
# unquantized cache (a loose bound: e4m3 keeps 3 mantissa bits).
# ------------------------------------------------------------------------------------------------


def quantized(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes of ``cache [P, page, n_kv, hd]`` and their scales ``[P, page, n_kv]``."""
    qr = quantize_rows_reference(cache)
    return qr.q.view(cache.shape), qr.scale.view(cache.shape[:3])


def dequantized(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale[..., None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("n_q", "n_kv", "batch", "n_splits"), [(6, 2, 3, 1), (4, 4, 4, 3)])
@pytest.mark.parametrize("window", [None, 70])
def test_paged_fp8_matches_reference(dtype, n_q, n_kv, batch, n_splits, window):
    q, k, v, table, lens = paged_case(batch, n_q, n_kv, dtype, hd=24)
    (kc, ks), (vc, vs) = quantized(k), quantized(v)
    kw = dict(block_table=table, window=window, k_scale=ks, v_scale=vs)
    got = decode_attention(q, kc, vc, lens, n_splits=n_splits, **kw)
    ref = decode_attention_reference(q, kc, vc, lens, **kw)
    assert_matches_reference(got, ref, dequantized(vc, vs))
    # against the unquantized cache: e4m3's relative step is 1/16 at worst, 1/32 on average
    full = decode_attention_reference(q, k, v, lens, block_table=table, window=window)
    err = (got.float() - full.float()).abs().max().item()
    assert err < 0.15, err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 120])
def test_cascade_fp8_matches_reference(dtype, n_splits, window):
    q, k, v, lens, slots, kw = _paged_cascade_case(7, 8, 2, dtype)
    (kc, ks), (vc, vs) = quantized(k), quantized(v)
    kw = dict(kw, window=window, k_scale=ks, v_scale=vs)
    got = decode_attention(q, kc, vc, lens, n_splits=n_splits, prefix_slots=slots, **kw)
    ref = decode_attention_reference(q, kc, vc, lens, prefix_slots=slots, **kw)
    plain = decode_attention(
        q, kc, vc, lens, n_splits=n_splits, block_table=kw["block_table"], window=window,
        k_scale=ks, v_scale=vs,
    )  # fmt: skip
    vd = dequantized(vc, vs)
    assert_matches_reference(got, ref, vd)
    assert_matches_reference(plain, ref, vd)


def test_row_form_with_prefix_rows_fp8():
    """The row form (one page a row) reading a shared prefix row in place, odd S_max."""
    g = torch.Generator().manual_seed(4)
    k = torch.randn(5, 37, 2, 16, generator=g).to(torch.bfloat16)
    v = torch.randn(5, 37, 2, 16, generator=g).to(torch.bfloat16)
    q = torch.randn(3, 4, 16, generator=g).to(torch.bfloat16)
    (kc, ks), (vc, vs) = quantized(k), quantized(v)
    lens = torch.tensor([37, 1, 20])
    kw = dict(
        rows=torch.tensor([4, 0, 2], dtype=torch.int32),
        prefix_rows=torch.tensor([1, 1, 3], dtype=torch.int32),
        prefix_lens=torch.tensor([10, 0, 20], dtype=torch.int32), k_scale=ks, v_scale=vs,
    )  # fmt: skip
    got = decode_attention(q, kc, vc, lens, n_splits=2, **kw)
    ref = decode_attention_reference(q, kc, vc, lens, **kw)
    assert_matches_reference(got, ref, dequantized(vc, vs))


@pytest.mark.parametrize("fn", [decode_attention, decode_attention_reference])
def test_fp8_scales_are_checked(fn):
    q, k, v, table, lens = paged_case(2, 4, 2, torch.bfloat16)
    (kc, ks), (vc, vs) = quantized(k), quantized(v)
    with pytest.raises(ValueError, match="e4m3 caches need k_scale"):
        fn(q, kc, vc, lens, block_table=table)
    with pytest.raises(ValueError, match=r"v_scale must be fp32 of shape \(11, 64, 2\)"):
        fn(q, kc, vc, lens, block_table=table, k_scale=ks, v_scale=vs[:, :3])
    with pytest.raises(TypeError, match="k_scale must have dtype"):
        fn(q, kc, vc, lens, block_table=table, k_scale=ks.half(), v_scale=vs)
    with pytest.raises(TypeError, match="k_cache and v_cache must have one dtype"):
        fn(q, kc, v, lens, block_table=table, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match="k_scale and v_scale go with e4m3"):
        fn(q, k, v, lens, block_table=table, k_scale=ks, v_scale=vs)
    assert kc.dtype == FP8_DTYPE
