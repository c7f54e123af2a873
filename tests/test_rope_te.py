"""TE-compatible RoPE: ``apply_rotary_pos_emb`` (fused Triton vs reference) and the embedding.

The fused kernel is compared with the PyTorch reference run on ``t.float()`` and cast back,
with ``torch.testing.assert_close``'s default tolerances (TE's own test protocol), for forward
and backward with both gradient kinds. The reference itself is checked against an independent
fp64 oracle that spells out the position of every token. The CPU run (Triton interpreter) covers
every axis with small shapes, cycling the cheap axes instead of taking their full product;
``@pytest.mark.gpu`` tests take TE's sizes.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from nakta_model.kernels import rope_te
from nakta_model.kernels.rope_te import (
    RotaryPositionEmbedding,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_reference,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def overlapping_grad(out: torch.Tensor) -> torch.Tensor:
    """Gradient is an expanded (stride-0) scalar."""
    return out.sum() * 2


def non_overlapping_grad(out: torch.Tensor) -> torch.Tensor:
    """Gradient is a full tensor."""
    return torch.sum(out * torch.ones_like(out))


LOSSES = [overlapping_grad, non_overlapping_grad]


def run_fused_vs_unfused(t, emb, loss_func, **kw):
    """TE's protocol: unfused on ``t.float()`` cast back vs fused; outputs and gradients."""
    has_start = kw.get("start_positions") is not None
    out_ref = apply_rotary_pos_emb(t.float(), emb, fused=False, **kw).to(t.dtype)
    if not has_start:
        (g_ref,) = torch.autograd.grad(loss_func(out_ref), t)
    out = apply_rotary_pos_emb(t, emb, fused=True, **kw)
    if not has_start:
        (g,) = torch.autograd.grad(loss_func(out), t)
    torch.testing.assert_close(out, out_ref)
    assert out.is_contiguous()
    if not has_start:
        torch.testing.assert_close(g, g_ref)
    else:  # TE skips backward with start_positions; ours supports it: check against autograd
        (g,) = torch.autograd.grad(loss_func(out.float()), t)
        (g_ref,) = torch.autograd.grad(loss_func(out_ref.float()), t)
        torch.testing.assert_close(g, g_ref)


def with_layout(t: torch.Tensor, transpose) -> torch.Tensor:
    """Same values, other strides (TE's ``transpose`` trick)."""
    if transpose:
        t = t.transpose(*transpose).contiguous().transpose(*transpose)
    return t


# ---------------------------------------------------------------------------- sbhd / bshd

# Full product of the layout axes; dtype, head size, rotary_percent, margin/start and loss
# cycle through the cases so every value meets every layout at least once.
_LAYOUTS = list(itertools.product(["sbhd", "bshd"], [None, (0, 1), (2, 3)], [False, True], [1, 2]))
_CYCLE = dict(
    dtype=DTYPES,
    hidden=[16, 32],
    rotary_percent=[0.5, 1.0],
    margin_start=[(0, False), (2, False), (2, True)],
    loss=LOSSES,
)
SBHD_CASES = [
    (fmt, tr, il, cp, *(vals[i % len(vals)] for vals in _CYCLE.values()))
    for i, (fmt, tr, il, cp) in enumerate(_LAYOUTS)
]


def _case_id(case) -> str:
    fmt, tr, il, cp, dtype, hidden, rp, (margin, start), loss = case
    tr_s = "x".join(map(str, tr)) if tr else "id"
    return (
        f"{fmt}-T{tr_s}-{'il' if il else 'half'}-cp{cp}-{str(dtype)[6:]}-d{hidden}-rp{rp}"
        f"-m{margin}{'-start' if start else ''}-{loss.__name__[:4]}"
    )


@pytest.mark.parametrize("case", SBHD_CASES, ids=[_case_id(c) for c in SBHD_CASES])
def test_fused_rope_sbhd_bshd(case, device):
    fmt, transpose, interleaved, cp_size, dtype, hidden, rotary_percent, ms, loss = case
    margin, start = ms
    if start and cp_size > 1:
        start = False  # start_positions is inference-only (cp_size == 1)
    seq, batch, heads = 6, 2, 3
    t = torch.rand(seq - margin if margin else seq, batch, heads, hidden, device=device)
    t = t.to(dtype)
    if fmt == "bshd":
        t = t.transpose(0, 1).contiguous()
    t = with_layout(t, transpose).requires_grad_()
    emb = RotaryPositionEmbedding(hidden, rotary_percent, interleaved=interleaved, device=device)(
        seq * cp_size
    )
    starts = torch.randint(0, margin, (batch,), dtype=torch.int32, device=device) if start else None
    for cp_rank in range(cp_size):
        run_fused_vs_unfused(
            t, emb, loss, tensor_format=fmt, start_positions=starts, interleaved=interleaved,
            cp_size=cp_size, cp_rank=cp_rank,
        )  # fmt: skip


@pytest.mark.parametrize("hidden", [64, 80, 96, 128, 256])
def test_head_dims(hidden, device):
    """Head sizes of real models, incl. ones whose half is not a power of two (80, 96)."""
    t = torch.rand(3, 2, 2, hidden, device=device).to(torch.bfloat16).requires_grad_()
    for interleaved in (False, True):
        emb = RotaryPositionEmbedding(hidden, interleaved=interleaved, device=device)(5)
        run_fused_vs_unfused(t, emb, non_overlapping_grad, interleaved=interleaved)


def test_fused_is_default_and_input_untouched(device):
    t = torch.rand(4, 1, 2, 8, device=device)
    before = t.clone()
    emb = RotaryPositionEmbedding(8, device=device)(4)
    out = apply_rotary_pos_emb(t, emb)
    assert not torch.equal(out, t) and torch.equal(t, before)
    torch.testing.assert_close(out, apply_rotary_pos_emb_reference(t, emb))


def test_positions_near_2_pow_20(device):
    n = (1 << 20) + 8
    emb = RotaryPositionEmbedding(8, device=device)(n)
    t = torch.rand(4, 2, 2, 8, device=device)
    starts = torch.tensor([n - 4, (1 << 20) - 2], dtype=torch.int32, device=device)
    out = apply_rotary_pos_emb(t, emb, start_positions=starts)
    torch.testing.assert_close(out, apply_rotary_pos_emb_reference(t, emb, start_positions=starts))
    torch.testing.assert_close(out, oracle(t, emb, "sbhd", starts, False, None, 1, 0))


@pytest.mark.parametrize(
    "tune",
    [
        dict(
            BLOCK_B=1, TARGET=8, MIN_PROGRAMS=1, MIN_SPLIT=1
        ),  # one program walks all heads, 1 at a time
        dict(
            BLOCK_B=2, TARGET=16, MIN_PROGRAMS=1, MIN_SPLIT=1
        ),  # ... 2 heads at a time, ragged last step
        dict(
            BLOCK_B=4, TARGET=16, MIN_PROGRAMS=12, MIN_SPLIT=12
        ),  # heads split over 2 programs, uneven
        dict(BLOCK_B=16, TARGET=4096, MIN_PROGRAMS=1, MIN_SPLIT=1, num_warps=2),
        dict(
            BLOCK_B=2, TARGET=16, MIN_PROGRAMS=1, MIN_SPLIT=1, JOINT=True
        ),  # one [2, half] load per row
        dict(BLOCK_B=4, TARGET=16, MIN_PROGRAMS=12, MIN_SPLIT=12, JOINT=False),  # two loads per row
        dict(BLOCK_B=1, TARGET=8, MIN_PROGRAMS=1, MIN_SPLIT=1, PREFETCH=True),  # pipelined walk
        dict(BLOCK_B=4, TARGET=16, MIN_PROGRAMS=12, MIN_SPLIT=12, PREFETCH=True, JOINT=True),
        # several positions per program: 2 x 2 rows over s=3, b=3 (ragged in both)
        dict(BLOCK_B=2, ROWS=4, TARGET=16, MIN_PROGRAMS=1, MIN_SPLIT=1),
        dict(BLOCK_B=1, ROWS=4, TARGET=8, MIN_PROGRAMS=1, MIN_SPLIT=1, PREFETCH=True),
        dict(
            BLOCK_B=4, ROWS=16, TARGET=64, MIN_PROGRAMS=2, MIN_SPLIT=2
        ),  # ROWS capped to keep 2 programs
    ],
)
def test_block_configs(tune, monkeypatch, device):
    """Every loop/split shape of the heads walk gives the reference's result."""
    monkeypatch.setattr(rope_te, "_TUNE", tune)
    t = torch.rand(3, 3, 5, 16, device=device).requires_grad_()
    starts = torch.tensor([0, 2, 1], dtype=torch.int32, device=device)
    emb = RotaryPositionEmbedding(16, 0.5, device=device)(6)
    run_fused_vs_unfused(t, emb, non_overlapping_grad, start_positions=starts)
    run_fused_vs_unfused(t, emb, overlapping_grad, interleaved=True)
    if "JOINT" in tune:  # the [2, half] load with a half (40) that is not a power of 2
        d80 = torch.rand(2, 3, 2, 80, device=device).requires_grad_()
        emb80 = RotaryPositionEmbedding(80, device=device)(2)
        run_fused_vs_unfused(d80, emb80, non_overlapping_grad)


def test_default_blocks_at_benchmark_shapes():
    """The launch rule the H200 tune chose: s=512, b=16 keeps 512 whole-head programs (no
    head split below MIN_PROGRAMS, only below MIN_SPLIT) and pipelines their 16-step walk; a
    batch of 2 trades positions per program for 1024 programs, unpipelined; 8 heads are too
    short a walk to pipeline; tiny grids still split their heads."""
    keys = ("BLOCK_S", "BLOCK_B", "BLOCK_H", "HEADS_PER_PROG", "PREFETCH")
    block_s, block_b, block_h, heads_per_prog, prefetch = map(
        rope_te._config(512, 16, 32, 64).get, keys
    )
    assert (block_s, block_b, block_h, heads_per_prog, prefetch) == (1, 16, 2, 32, True)
    block_s, block_b, _, heads_per_prog, prefetch = map(rope_te._config(4096, 2, 32, 64).get, keys)
    assert (block_s, block_b, heads_per_prog, prefetch) == (4, 2, 32, False)
    assert rope_te._config(4096, 16, 8, 64)["PREFETCH"] is False
    cfg = rope_te._config(8, 1, 64, 128)
    assert cfg["HEADS_PER_PROG"] == cfg["BLOCK_H"] == 32


@pytest.mark.parametrize("rows", [4, 8])
def test_multi_position_tiles(rows, monkeypatch, device):
    """Several positions per program (BLOCK_S > 1) with ragged tails, for every position rule:
    thd search (empty sequence, start positions), context parallel, bshd strides."""
    monkeypatch.setattr(rope_te, "_TUNE", dict(BLOCK_B=2, ROWS=rows, MIN_PROGRAMS=1, MIN_SPLIT=1))
    assert rope_te._config(7, 3, 3, 8)["BLOCK_S"] == rows // 2
    cu = torch.tensor([0, 5, 8, 8, 15], dtype=torch.int32, device=device)
    starts = torch.tensor([1, 0, 3, 2], dtype=torch.int32, device=device)
    t = torch.rand(15, 3, 16, device=device).requires_grad_()
    emb = RotaryPositionEmbedding(16, 0.5, device=device)(12)
    run_fused_vs_unfused(t, emb, non_overlapping_grad, tensor_format="thd", cu_seqlens=cu)
    run_fused_vs_unfused(
        t, emb, non_overlapping_grad, tensor_format="thd", cu_seqlens=cu, start_positions=starts
    )
    cu2 = torch.tensor([0, 4, 8, 8, 20], dtype=torch.int32, device=device)
    t2 = torch.rand(10, 2, 16, device=device).requires_grad_()
    emb2 = RotaryPositionEmbedding(16, interleaved=True, device=device)(20)
    for rank in range(2):
        run_fused_vs_unfused(
            t2, emb2, overlapping_grad, tensor_format="thd", cu_seqlens=cu2, cp_size=2,
            cp_rank=rank, interleaved=True,
        )  # fmt: skip
    tb = with_layout(torch.rand(3, 6, 3, 16, device=device), (2, 3)).requires_grad_()
    for rank in range(2):
        run_fused_vs_unfused(
            tb, emb, non_overlapping_grad, tensor_format="bshd", cp_size=2, cp_rank=rank
        )
    ts = torch.rand(7, 3, 3, 16, device=device).requires_grad_()
    s3 = torch.tensor([0, 4, 2], dtype=torch.int32, device=device)
    run_fused_vs_unfused(ts, emb, non_overlapping_grad, start_positions=s3)


# ---------------------------------------------------------------------------- thd

THD_CASES = [
    (il, cp, tr, start, DTYPES[i % 3], [0.5, 1.0][i % 2], LOSSES[(i // 2) % 2])
    for i, (il, cp, tr, start) in enumerate(
        itertools.product([False, True], [1, 2], [None, (1, 2)], [False, True])
    )
    if not (start and cp > 1)
]


@pytest.mark.parametrize("case", THD_CASES)
def test_fused_rope_thd(case, device):
    interleaved, cp_size, transpose, start, dtype, rotary_percent, loss = case
    hidden, heads, margin = 16, 2, 4
    cu_seqlens = [0, 5, 8, 8, 14]  # ragged, with an empty sequence
    padded = [0]
    for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        step = 2 * cp_size if cp_size > 1 else 1
        padded.append(padded[-1] + math.ceil((b - a) / step) * step)
    cu = torch.tensor(padded, dtype=torch.int32, device=device)
    n_seqs = len(padded) - 1
    starts = (
        torch.randint(0, margin, (n_seqs,), dtype=torch.int32, device=device) if start else None
    )
    t = torch.rand(padded[-1] // cp_size, heads, hidden, device=device).to(dtype)
    t = with_layout(t, transpose).requires_grad_()
    emb = RotaryPositionEmbedding(hidden, rotary_percent, interleaved=interleaved, device=device)(
        padded[-1] + margin
    )
    for cp_rank in range(cp_size):
        run_fused_vs_unfused(
            t, emb, loss, tensor_format="thd", start_positions=starts, interleaved=interleaved,
            cu_seqlens=cu, cp_size=cp_size, cp_rank=cp_rank,
        )  # fmt: skip


# ---------------------------------------------------------------------------- reference vs oracle


def oracle(t, freqs, fmt, starts, interleaved, cu, cp_size, cp_rank):
    """fp64, token by token: the angle row of local index j in a sequence of local length L."""

    def pos_of(j, L):
        if cp_size == 1:
            return j
        half = L // 2
        if j < half:
            return cp_rank * half + j
        return L * cp_size - (cp_rank + 1) * half + (j - half)

    x = t.double()
    f = freqs[:, 0, 0, :].double()
    d2 = f.shape[-1]
    out = x.clone()

    def rotate(vec, ang):  # vec [h, d]
        y = vec.clone()
        if interleaved:
            pairs = [(2 * i, 2 * i + 1) for i in range(d2 // 2)]
        else:
            pairs = [(i, i + d2 // 2) for i in range(d2 // 2)]
        for a, b in pairs:
            y[:, a] = vec[:, a] * torch.cos(ang[a]) - vec[:, b] * torch.sin(ang[a])
            y[:, b] = vec[:, b] * torch.cos(ang[b]) + vec[:, a] * torch.sin(ang[b])
        return y

    if fmt == "thd":
        bounds = [int(c) // cp_size for c in cu]
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            for j in range(b - a):
                p = pos_of(j, b - a) + (int(starts[i]) if starts is not None else 0)
                out[a + j] = rotate(x[a + j], f[p])
        return out.to(t.dtype)
    seq_dim = 0 if fmt == "sbhd" else 1
    L = t.shape[seq_dim]
    for j in range(L):
        for b in range(t.shape[1 - seq_dim]):
            p = pos_of(j, L) + (int(starts[b]) if starts is not None else 0)
            idx = (j, b) if seq_dim == 0 else (b, j)
            out[idx] = rotate(x[idx], f[p])
    return out.to(t.dtype)


@pytest.mark.parametrize(
    "fmt, cp_size, start, interleaved",
    [("sbhd", 1, True, False), ("bshd", 2, False, True), ("sbhd", 2, False, False),
     ("thd", 1, True, True), ("thd", 2, False, False)],
)  # fmt: skip
def test_reference_and_fused_match_fp64_oracle(fmt, cp_size, start, interleaved, device):
    d, d2 = 8, 6  # partial rotary with freqs whose pair members differ: per-channel angles
    freqs = torch.rand(40, 1, 1, d2, device=device) * 50
    cu = None
    if fmt == "thd":
        cu = torch.tensor([0, 4, 12, 20], dtype=torch.int32, device=device)
        t = torch.rand(20 // cp_size, 2, d, device=device)
        n = 3
    else:
        t = torch.rand(4, 4, 2, d, device=device)
        n = 4
    starts = torch.tensor([1, 5, 3, 2][:n], dtype=torch.int32, device=device) if start else None
    for rank in range(cp_size):
        want = oracle(t, freqs, fmt, starts, interleaved, cu, cp_size, rank)
        kw = dict(start_positions=starts, interleaved=interleaved, cu_seqlens=cu,
                  cp_size=cp_size, cp_rank=rank)  # fmt: skip
        torch.testing.assert_close(apply_rotary_pos_emb_reference(t, freqs, fmt, **kw), want)
        torch.testing.assert_close(apply_rotary_pos_emb(t, freqs, fmt, **kw), want)


def test_backward_with_per_channel_angles(device):
    """Pair members with different angles: the backward is the transpose, not R(-theta)."""
    freqs = torch.rand(6, 1, 1, 8, device=device) * 10
    for interleaved in (False, True):
        t = torch.rand(5, 2, 2, 8, device=device, dtype=torch.float64).float().requires_grad_()
        g = torch.rand(5, 2, 2, 8, device=device)
        out = apply_rotary_pos_emb(t, freqs, interleaved=interleaved)
        ref = apply_rotary_pos_emb_reference(t, freqs, interleaved=interleaved)
        (ga,) = torch.autograd.grad(out, t, g)
        (gr,) = torch.autograd.grad(ref, t, g)
        torch.testing.assert_close(ga, gr)


# ---------------------------------------------------------------------------- embedding


def test_rotary_position_embedding_values(device):
    rpe = RotaryPositionEmbedding(16, rotary_percent=0.5, rotary_base=100.0, device=device)
    emb = rpe(5, offset=2)
    assert emb.shape == (5, 1, 1, 8) and emb.dtype == torch.float32 and emb.is_contiguous()
    inv = 1.0 / 100.0 ** (torch.arange(0, 8, 2, dtype=torch.float32, device=device) / 8)
    f = torch.outer(torch.arange(2, 7, dtype=torch.float32, device=device), inv)
    torch.testing.assert_close(emb[:, 0, 0], torch.cat((f, f), dim=-1))
    il = RotaryPositionEmbedding(16, 0.5, rotary_base=100.0, interleaved=True, device=device)(5, 2)
    torch.testing.assert_close(il[:, 0, 0, 0::2], f)
    torch.testing.assert_close(il[:, 0, 0, 1::2], f)
    half_speed = RotaryPositionEmbedding(16, seq_len_interpolation_factor=2, device=device)(8)
    full = RotaryPositionEmbedding(16, device=device)(4)
    torch.testing.assert_close(half_speed[0::2], full)


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("fused", [True, False])
def test_bad_arguments_raise(fused, device, monkeypatch):
    monkeypatch.setenv("NAKTA_DEBUG", "1")  # CUDA checks bounds on the host only then
    t = torch.rand(4, 2, 2, 8, device=device)
    emb = RotaryPositionEmbedding(8, device=device)(4)
    cu = torch.tensor([0, 3, 6], dtype=torch.int32, device=device)
    packed = torch.rand(6, 2, 8, device=device)

    def call(*args, **kw):
        return apply_rotary_pos_emb(*args, fused=fused, **kw)

    with pytest.raises(ValueError, match="t must have 4 dimensions"):
        call(t[0], emb)
    with pytest.raises(ValueError, match="t must have 3 dimensions"):
        call(t, emb, "thd", cu_seqlens=cu)
    with pytest.raises(ValueError, match="tensor_format must be one of"):
        call(t, emb, "hbsd")
    with pytest.raises(ValueError, match="d2 must be even"):
        call(t, emb[..., :5])
    with pytest.raises(ValueError, match="d2=16 must be <= t's head dimension d=8"):
        call(t, torch.cat((emb, emb), -1))
    with pytest.raises(ValueError, match=r"freqs must have shape \[s2, 1, 1, d2\]"):
        call(t, emb.expand(4, 2, 1, 8))
    with pytest.raises(ValueError, match="freqs has 3 positions but the input needs 4"):
        call(t, emb[:3])
    with pytest.raises(ValueError, match="freqs has 4 positions but the input needs 8"):
        call(t, emb, cp_size=2, cp_rank=1)
    starts = torch.tensor([0, 1], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="freqs has 4 positions but the input needs 5"):
        call(t, emb, start_positions=starts)
    with pytest.raises(ValueError, match="start_positions must have one entry per sequence"):
        call(t, emb, start_positions=starts[:1])
    with pytest.raises(ValueError, match="start_positions is only supported with cp_size == 1"):
        call(t, RotaryPositionEmbedding(8, device=device)(20), start_positions=starts, cp_size=2)
    with pytest.raises(ValueError, match="cp_rank must be an int in"):
        call(t, emb, cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="cu_seqlens must be given"):
        call(packed, emb, "thd")
    with pytest.raises(TypeError, match="cu_seqlens must have dtype in"):
        call(packed, emb, "thd", cu_seqlens=cu.long())
    with pytest.raises(ValueError, match="non-decreasing"):
        call(
            packed,
            emb,
            "thd",
            cu_seqlens=torch.tensor([0, 4, 3, 6], dtype=torch.int32, device=device),
        )
    with pytest.raises(ValueError, match="must equal t's token count 6"):
        call(
            packed, emb, "thd", cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32, device=device)
        )
    with pytest.raises(ValueError, match="freqs has 4 positions but the input needs 5"):
        call(
            packed, emb, "thd", cu_seqlens=torch.tensor([0, 1, 6], dtype=torch.int32, device=device)
        )
    with pytest.raises(ValueError, match="cu_seqlens is only valid"):
        call(t, emb, cu_seqlens=cu)
    with pytest.raises(TypeError, match="t must be a torch.Tensor"):
        call(t.tolist(), emb)


def test_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    t = torch.rand(4, 2, 2, 8)
    emb = RotaryPositionEmbedding(8, device="cpu")(4)
    with pytest.raises(ValueError, match="t is on cpu"):
        apply_rotary_pos_emb(t, emb, fused=True)
    apply_rotary_pos_emb(t, emb, fused=False)  # the reference still runs


# ---------------------------------------------------------------------------- GPU, TE's sizes

GPU_CASES = [
    (fmt, tr, il, cp, DTYPES[i % 3], [128, 256][i % 2], [0.5, 1.0][(i // 2) % 2],
     [(0, False), (10, False), (10, True)][i % 3], LOSSES[(i // 3) % 2])
    for i, (fmt, tr, il, cp) in enumerate(_LAYOUTS)
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[_case_id(c) for c in GPU_CASES])
def test_gpu_te_sizes(case):
    fmt, transpose, interleaved, cp_size, dtype, hidden, rotary_percent, ms, loss = case
    margin, start = ms
    start = start and cp_size == 1
    seq, batch, heads = 2048, 2, 64
    t = torch.rand(seq - margin, batch, heads, hidden, device="cuda", dtype=dtype)
    if fmt == "bshd":
        t = t.transpose(0, 1).contiguous()
    t = with_layout(t, transpose).requires_grad_()
    emb = RotaryPositionEmbedding(hidden, rotary_percent, interleaved=interleaved)(seq * cp_size)
    starts = torch.randint(0, margin, (batch,), dtype=torch.int32, device="cuda") if start else None
    for cp_rank in range(cp_size):
        run_fused_vs_unfused(
            t, emb, loss, tensor_format=fmt, start_positions=starts, interleaved=interleaved,
            cp_size=cp_size, cp_rank=cp_rank,
        )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("case", THD_CASES)
def test_gpu_thd_te_sizes(case):
    interleaved, cp_size, transpose, start, dtype, rotary_percent, loss = case
    cu_seqlens = [0, 400, 542, 711, 727, 752, 1270, 1426, 1450, 1954, 2044, 2048]
    padded = [0]
    for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        padded.append(padded[-1] + math.ceil((b - a) / (2 * cp_size)) * (2 * cp_size))
    cu = torch.tensor(padded if cp_size > 1 else cu_seqlens, dtype=torch.int32, device="cuda")
    total = int(cu[-1])
    starts = (
        torch.randint(0, 10, (len(cu_seqlens) - 1,), dtype=torch.int32, device="cuda")
        if start
        else None
    )
    t = torch.rand(total // cp_size, 64, 128, device="cuda", dtype=dtype)
    t = with_layout(t, transpose).requires_grad_()
    emb = RotaryPositionEmbedding(128, rotary_percent, interleaved=interleaved)(total + 10)
    for cp_rank in range(cp_size):
        run_fused_vs_unfused(
            t, emb, loss, tensor_format="thd", start_positions=starts, interleaved=interleaved,
            cu_seqlens=cu, cp_size=cp_size, cp_rank=cp_rank,
        )  # fmt: skip


@pytest.mark.gpu
def test_gpu_large_tensor_int64_offsets():
    """More than 2**31 elements: offsets must not overflow int32."""
    free, _ = torch.cuda.mem_get_info()
    if free < 12 * 2**30:
        pytest.skip("needs ~12 GiB of free GPU memory")
    t = torch.empty(4096, 16, 64, 512, device="cuda", dtype=torch.bfloat16)  # 2**31 elements
    t[-1].uniform_()
    t[:-1].zero_()
    emb = RotaryPositionEmbedding(512, 0.5)(4096)
    out = apply_rotary_pos_emb(t, emb)
    # the last slice is local position 0 of a one-row table holding position 4095's angles
    want = apply_rotary_pos_emb_reference(t[-1:].float(), emb[-1:]).to(t.dtype)
    torch.testing.assert_close(out[-1:], want)
    assert not out[:-1].any()


@pytest.mark.gpu
@pytest.mark.parametrize("tune", [{}, dict(BLOCK_B=2, ROWS=8, MIN_PROGRAMS=1, MIN_SPLIT=1)])
def test_gpu_start_position_past_table_poisons_with_nan(tune, monkeypatch):
    """A fused CUDA call does not synchronise on start_positions: a bad one gives NaN rows
    (also with several positions per program)."""
    monkeypatch.setattr(rope_te, "_TUNE", tune)
    t = torch.rand(4, 2, 2, 8, device="cuda")
    emb = RotaryPositionEmbedding(8)(6)
    starts = torch.tensor([0, 5], dtype=torch.int32, device="cuda")  # 5 + 4 > 6 positions
    out = apply_rotary_pos_emb(t, emb, start_positions=starts)
    assert not torch.isnan(out[:, 0]).any()
    assert torch.isnan(out[1:, 1]).any() and not torch.isnan(out[0, 1]).any()
