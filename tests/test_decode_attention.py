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
"""

from __future__ import annotations

import math

import pytest
import torch
from tiers import slow_beyond

from nakta_model.kernels import decode_attention as da
from nakta_model.kernels.decode_attention import (
    attention_workspace,
    decode_attention,
    decode_attention_reference,
    decode_splits,
)

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
