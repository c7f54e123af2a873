"""Decode attention: one new query per batch row over its KV cache (split-K flash-decoding).

Why: at decode time attention reads the whole K/V cache for one query per row; with few rows
and heads, one program per (row, head) cannot keep the GPU's memory system busy. The sequence
is split into ``n_splits`` chunks, each program streams one chunk of one KV head for all its
query heads (GQA: K/V loaded once per group) and writes a partial result (running max, sum of
exponentials, unnormalised output: fp32 workspace); a second small kernel combines the splits.
With one split the first kernel writes the output directly (one launch).

Shared prefixes: with ``prefix_rows``/``prefix_lens`` a row reads its first keys from another
cache row, where a prompt prefix many rows share (a few-shot prompt) is held once. The rows'
programs for one KV head run side by side (the batch is the grid's fastest axis), so that
prefix is fetched from HBM about once per step and served from L2 to the other rows, instead
of every row streaming its own copy.

Cascade (``prefix_slots``): when the shared prefixes live in a few known cache rows (the
generation engine's prefix rows), one more kernel computes the prefix part for every row at
once: per slot and KV head, the queries of all the rows that read that prefix form one
tensor-core tile against the prefix keys, which are then read once per step instead of once
per row, and the split kernel covers only each row's own keys (``[prefix_lens[b],
cache_lens[b])``). Both write partials that the combining kernel merges (a row's prefix part is
one more split to it). Few-shot generation (GSM8K, BBH) spends most of a step's attention on
the shared prefix: batch 64 with a 768-token shared prompt read it 64 times per layer.

Paged KV cache (``block_table``): the caches are a pool of pages (``[n_pages, page, n_kv,
hd]``) and each row's keys are the pages its block table lists; every key tile (``BLOCK_S``
keys, a divisor of the page) lies in one page, so the paged read costs one table load per tile.
The row form (``rows``: row b reads cache row ``rows[b]``) is the table with one page a row.
Shared prefixes are then pages several tables hold (read once from HBM, served from L2 to the
other rows), and the cascade's slots are page tables too.

Sliding window (``window``, Mistral): a row attends to its last ``window`` keys only. The split
kernel's chunks and the cascade's prefix splits are laid over the keys inside the window, so a
long row's keys below it are never read (the pages stay in the pool; nothing is evicted).

CUDA-graph capturable: the grid ``(B, n_kv_heads, n_splits)`` depends on shapes only
(``n_splits`` from the batch, KV heads and cache length, never from ``cache_lens``' values);
each program derives its chunk from ``cache_lens[b]`` on the device (the valid keys are spread
over all splits), and a split past the end writes a neutral partial (max -inf, sum 0). Pass
``workspace`` (``attention_workspace``) and ``out`` to allocate nothing.

Numerics: scores and softmax in fp32 with ``exp2`` (scale folded with log2 e); output in q's
dtype. Every head layout uses ``tl.dot`` with the query group (1 for MHA) padded to 16 rows,
the probabilities rounded to the cache dtype for the P @ V product as flash attention does
(fp32 inputs: ``input_precision="ieee"``). The padding wastes tensor-core work nobody waits
for: an H200 run (``kernel_benchmark/bench_decode.py --attention-only``) read LLaMA-7B's MHA
cache at 100-105% of copy bandwidth this way at batch 32-64 and contexts 1024-2048, against
53% for the CUDA-core path (one query head, fp32 throughout; still there with ``_TUNE``
``USE_DOT=0``), and 41-60% against 28-33% at batch 1.
``cache_lens[b] == 0`` gives a zero output row (an idle slot of a static batch); a length
outside ``[0, S_max]`` gives NaN (no host sync on CUDA) or, on the CPU or with
``NAKTA_DEBUG=1``, a ValueError.
"""

from __future__ import annotations

import math

import torch
import triton

from nakta_model.kernels import _decode_attention_configs as _cfg
from nakta_model.kernels._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_dtype,
    check_index,
    check_ndim,
    check_no_overlap,
    check_positive_int,
    check_same_device,
    check_tensor,
    check_triton_device,
    debug_checks,
    dependent_launch,
    interpreter_enabled,
    tracing,
)
from nakta_model.kernels._decode_attention_configs import (
    _config,
    attention_workspace,
    cascade_splits,
    decode_splits,
)
from nakta_model.kernels._decode_attention_kernels import (
    _attn_combine_kernel,
    _attn_prefix_kernel,
    _attn_split_kernel,
)
from nakta_model.kernels.fp8_quant import FP8_DTYPE

LOG2E = 1.4426950408889634

# ------------------------------------------------------------------------------------------------
# 2. Launch configuration, checks and launcher (1., the @triton.jit kernels: in
#    _decode_attention_kernels.py)
# ------------------------------------------------------------------------------------------------


def _check_cache(name: str, c: object, q: torch.Tensor) -> torch.Tensor:
    c = check_tensor(name, c)
    check_ndim(name, c, 4)
    if c.dtype not in (q.dtype, FP8_DTYPE):
        raise TypeError(f"{name} must have q's dtype {q.dtype} or {FP8_DTYPE}, got {c.dtype}")
    if c.shape[3] > 1 and c.stride(3) != 1:
        raise ValueError(f"{name} must be unit-stride in its last dimension, got {c.stride()}")
    return c


def _check_scales(k_cache, v_cache, k_scale, v_scale) -> None:
    """e4m3 caches (both or neither) come with fp32 scales of the caches' first three dims,
    unit-stride along the heads; caches in q's dtype take none."""
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(
            f"k_cache and v_cache must have one dtype, got {k_cache.dtype} and {v_cache.dtype}"
        )
    if k_cache.dtype != FP8_DTYPE:
        if k_scale is not None or v_scale is not None:
            raise ValueError("k_scale and v_scale go with e4m3 k_cache/v_cache")
        return
    for name, sc, c in (("k_scale", k_scale, k_cache), ("v_scale", v_scale, v_cache)):
        if sc is None:
            raise ValueError(f"e4m3 caches need {name} (fp32, the caches' first three dims)")
        check_tensor(name, sc)
        check_dtype(name, sc, (torch.float32,))
        if sc.shape != c.shape[:3] or (sc.shape[2] > 1 and sc.stride(2) != 1):
            raise ValueError(
                f"{name} must be fp32 of shape {tuple(c.shape[:3])} (the cache's [pages, page, "
                f"n_kv]), unit-stride along the heads, got shape {tuple(sc.shape)}, strides "
                f"{sc.stride()}"
            )
        if sc.device != c.device:
            raise ValueError(f"{name} is on {sc.device}, the caches on {c.device}")


def _check_args(
    q, k_cache, v_cache, cache_lens, scale, n_splits, out, workspace, *, for_kernel: bool,
    rows=None, prefix_rows=None, prefix_lens=None, prefix_slots=None, block_table=None,
    window=None, k_scale=None, v_scale=None,
) -> tuple[float, int, int]:  # fmt: skip
    """Validate a ``decode_attention`` call; returns ``(scale, n_splits, n_psplits)`` (the
    cascade's splits per slot, 0 without ``prefix_slots``)."""
    q = check_tensor("q", q)
    check_dtype("q", q, FLOAT_DTYPES)
    check_ndim("q", q, 3)
    if q.shape[2] > 1 and q.stride(2) != 1:
        raise ValueError(f"q must be unit-stride in its last dimension, got {q.stride()}")
    batch, n_q, head_dim = q.shape
    if batch < 1 or n_q < 1 or head_dim < 1:
        raise ValueError(f"q must have shape [B>0, n_q_heads>0, head_dim>0], got {tuple(q.shape)}")
    k_cache = _check_cache("k_cache", k_cache, q)
    v_cache = _check_cache("v_cache", v_cache, q)
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} "
            f"and {tuple(v_cache.shape)}"
        )
    _check_scales(k_cache, v_cache, k_scale, v_scale)
    b_max, s_max, n_kv, hd = k_cache.shape
    paged = block_table is not None
    need_rows = 1 if rows is not None or paged else batch
    if hd != head_dim or b_max < need_rows or s_max < 1 or n_kv < 1:
        raise ValueError(
            f"k_cache must have shape [B_max >= {need_rows}, S_max > 0, n_kv_heads, "
            f"head_dim={head_dim}], got {tuple(k_cache.shape)}"
        )
    if paged:
        block_table = _check_block_table(block_table, rows, prefix_rows, prefix_slots, q)
        s_max = block_table.shape[1] * k_cache.shape[1]  # the most keys a row can hold
    if rows is not None:
        rows = check_index("rows", rows, batch, per="row of q")
        if rows.device != q.device:
            raise ValueError(f"rows is on {rows.device} but q is on {q.device}")
    if (prefix_rows is None) != (prefix_lens is None):
        raise ValueError("prefix_rows and prefix_lens go together: give both or neither")
    if prefix_rows is not None:
        prefix_rows = check_index("prefix_rows", prefix_rows, batch, per="row of q")
        prefix_lens = check_index("prefix_lens", prefix_lens, batch, per="row of q")
        for name, t in (("prefix_rows", prefix_rows), ("prefix_lens", prefix_lens)):
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if n_q % n_kv:
        raise ValueError(f"the caches' n_kv_heads ({n_kv}) must divide q's heads ({n_q})")
    cache_lens = check_index("cache_lens", cache_lens, batch, per="row of q")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive float, got {scale!r}")
    if window is not None:
        check_positive_int("window", window)
    seen = s_max if window is None else min(s_max, window)  # the most keys a row attends to
    if n_splits is None:
        n_splits = decode_splits(batch, n_kv, seen, q.device)
    if isinstance(n_splits, bool) or not isinstance(n_splits, int) or not 1 <= n_splits <= 1024:
        raise ValueError(f"n_splits must be an int in [1, 1024], got {n_splits!r}")
    if out is not None:
        out = check_tensor("out", out)
        check_dtype("out", out, (q.dtype,))
        if out.shape != q.shape:
            raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
        if head_dim > 1 and out.stride(2) != 1:
            raise ValueError(f"out must be unit-stride in its last dimension, got {out.stride()}")
    n_psplits = 0
    if prefix_slots is not None:
        slot_rows, slot_lens = _check_slots(prefix_slots, prefix_rows, q, paged)
        n_psplits = cascade_splits(batch, n_q, n_kv, slot_rows.shape[0], seen, q.device)
    if paged and for_kernel and block_table.shape[1] > 1:
        page = k_cache.shape[1]
        kinds = ("dot" if _cfg._TUNE.get("USE_DOT", 1) else "fma",) + (
            ("cascade",) if prefix_slots is not None else ()
        )
        for kind in kinds:
            if page % _config(kind)["BLOCK_S"]:
                raise ValueError(
                    f"the page size (k_cache.shape[1] = {page}) must be a multiple of the "
                    f"{kind} kernel's BLOCK_S={_config(kind)['BLOCK_S']} (a key tile in one page)"
                )
    if workspace is not None:
        n_slots = 0 if prefix_slots is None else slot_rows.shape[0]
        _check_workspace(workspace, batch, n_q, head_dim, n_splits + n_slots * n_psplits)
    check_same_device(
        q=q, k_cache=k_cache, v_cache=v_cache, cache_lens=cache_lens, out=out, workspace=workspace
    )
    _check_no_aliasing(q, k_cache, v_cache, out, workspace)
    if for_kernel:
        check_triton_device("q", q)
    if not q.is_cuda or debug_checks() or not for_kernel:
        lo, hi = int(cache_lens.min()), int(cache_lens.max())
        if lo < 0 or hi > s_max:
            raise ValueError(f"cache_lens must lie in [0, S_max={s_max}], got [{lo}, {hi}]")
        if paged:
            _check_pages("block_table", block_table, cache_lens, k_cache.shape[1], b_max)
        for name, t in (("rows", rows), ("prefix_rows", None if paged else prefix_rows)):
            if t is not None and (int(t.min()) < 0 or int(t.max()) >= b_max):
                raise ValueError(
                    f"{name} must lie in [0, B_max={b_max}), got [{int(t.min())}, {int(t.max())}]"
                )
        if prefix_lens is not None and (
            int(prefix_lens.min()) < 0 or int(prefix_lens.max()) > s_max
        ):
            raise ValueError(
                f"prefix_lens must lie in [0, S_max={s_max}], got "
                f"[{int(prefix_lens.min())}, {int(prefix_lens.max())}]"
            )
        if prefix_slots is not None:
            _check_slot_values(
                slot_rows, slot_lens, prefix_rows, prefix_lens, b_max, s_max, k_cache.shape[1]
            )
    return float(scale), n_splits, n_psplits


def _check_block_table(block_table, rows, prefix_rows, prefix_slots, q) -> torch.Tensor:
    """The paged form's table: int ``[B, pages per row]``, unit-stride columns; shared
    prefixes are pages of it (``prefix_rows`` only names the cascade's slots)."""
    if rows is not None:
        raise ValueError("give rows or block_table, not both (rows is the one-page-a-row table)")
    if prefix_rows is not None and prefix_slots is None:
        raise ValueError(
            "with block_table, prefix_rows/prefix_lens only go with prefix_slots (a shared "
            "prefix is read through the rows' block tables, which hold its pages)"
        )
    t = check_tensor("block_table", block_table)
    check_dtype("block_table", t, INDEX_DTYPES)
    check_ndim("block_table", t, 2)
    if t.shape[0] != q.shape[0] or t.shape[1] < 1:
        raise ValueError(
            f"block_table must have shape [B={q.shape[0]}, pages >= 1], got {tuple(t.shape)}"
        )
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"block_table must be unit-stride along its columns, got {t.stride()}")
    if t.device != q.device:
        raise ValueError(f"block_table is on {t.device} but q is on {q.device}")
    return t


def _check_pages(name: str, table, lens, page: int, n_pages: int) -> None:
    """CPU/debug: the pages that hold each row's ``lens[b]`` keys lie in ``[0, n_pages)``."""
    need = (lens.long().cpu() + page - 1) // page
    cols = torch.arange(table.shape[1])[None, :]
    used = table.long().cpu()[cols < need[:, None]]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= n_pages):
        raise ValueError(
            f"{name} must hold pages in [0, {n_pages}) for every key it covers, got "
            f"[{int(used.min())}, {int(used.max())}]"
        )


def _check_slots(
    prefix_slots: object, prefix_rows, q, paged: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slot_rows [P], slot_lens [P])``; paged: ``(slot_table [P, pages], slot_lens [P])``
    (``prefix_rows`` names a slot by its first page)."""
    if not isinstance(prefix_slots, (tuple, list)) or len(prefix_slots) != 2:
        raise TypeError("prefix_slots must be a pair (slot_rows, slot_lens) of int tensors")
    if prefix_rows is None:
        raise ValueError("prefix_slots needs prefix_rows and prefix_lens")
    slot_rows = check_tensor("prefix_slots[0]", prefix_slots[0])
    ndim = 2 if paged else 1
    n = slot_rows.shape[0] if slot_rows.dim() == ndim else 0
    if n < 1:
        what = "2-D [slots >= 1, pages] (page tables)" if paged else "1-D with >= 1 slot"
        raise ValueError(f"prefix_slots[0] must be {what}, got {tuple(slot_rows.shape)}")
    if paged:
        check_dtype("prefix_slots[0]", slot_rows, INDEX_DTYPES)
        if slot_rows.shape[1] > 1 and slot_rows.stride(1) != 1:
            raise ValueError("prefix_slots[0] must be unit-stride along its columns")
    else:
        slot_rows = check_index("prefix_slots[0]", slot_rows, n, per="slot")
    slot_lens = check_index("prefix_slots[1]", prefix_slots[1], n, per="slot")
    for name, t in (("prefix_slots[0]", slot_rows), ("prefix_slots[1]", slot_lens)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    return slot_rows, slot_lens


def _check_slot_values(
    slot_rows, slot_lens, prefix_rows, prefix_lens, b_max, s_max, page: int = 0
) -> None:
    """CPU/debug: the slots' rows (paged: the pages of their keys) and lengths in range, and
    every row with a prefix reads one of them, no further than the slot holds."""
    lens = slot_lens.long().cpu()
    if int(lens.min()) < 0 or int(lens.max()) > s_max:
        raise ValueError(f"prefix_slots[1] must lie in [0, S_max={s_max}]")
    if slot_rows.dim() == 2:
        _check_pages("prefix_slots[0]", slot_rows, slot_lens, page, b_max)
        rows = slot_rows[:, 0].long().cpu()
    else:
        rows = slot_rows.long().cpu()
        if int(rows.min()) < 0 or int(rows.max()) >= b_max:
            raise ValueError(f"prefix_slots[0] must lie in [0, B_max={b_max})")
    held = dict(zip(rows.tolist(), lens.tolist()))
    for r, n in zip(prefix_rows.long().cpu().tolist(), prefix_lens.long().cpu().tolist()):
        if n > 0 and (r not in held or n > held[r]):
            raise ValueError(
                f"with prefix_slots every prefix must be read from a slot: prefix row {r} "
                f"({n} keys) is not a slot holding that many (slots {held})"
            )


def _check_workspace(ws: object, batch: int, n_q: int, head_dim: int, n_splits: int) -> None:
    ws = check_tensor("workspace", ws)
    check_dtype("workspace", ws, (torch.float32,))
    need = batch * n_q * n_splits * (head_dim + 2)
    if not ws.is_contiguous() or ws.numel() < need:
        raise ValueError(
            f"workspace must be a contiguous fp32 tensor of at least {need} elements "
            f"(attention_workspace({batch}, {n_q}, {head_dim}, {n_splits})), got shape "
            f"{tuple(ws.shape)} contiguous={ws.is_contiguous()}"
        )


def _check_no_aliasing(q, k_cache, v_cache, out, workspace) -> None:
    """``out`` may be ``q`` itself (a program reads its heads' queries before writing them);
    any other sharing with the inputs is a race."""
    if tracing():
        return
    if out is not None:
        same_as_q = out.data_ptr() == q.data_ptr() and out.stride() == q.stride()
        if not same_as_q:
            check_no_overlap("out", out, "q", q)
        check_no_overlap("out", out, "k_cache", k_cache)
        check_no_overlap("out", out, "v_cache", v_cache)
    if workspace is not None:
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
            if t is not None:
                check_no_overlap("workspace", workspace, name, t)


# At batch 1 the last attention launch lets the next kernel launch at once (``wo``, a
# programmatic dependent, whose blocks load their first weight tile while attention runs and
# then wait for its output: ``decode_linear``'s ``EARLY_W``). Attention itself stays an ordinary
# launch (as a dependent it measured slower: docs/experiments.md).
TRIGGER_MAX_BATCH = 1


def _launch(
    q, k_cache, v_cache, cache_lens, scale, n_splits, out, workspace, rows=None, prefix=None,
    slots=None, n_psplits=0, block_table=None, window=None, k_scale=None, v_scale=None,
) -> None:  # fmt: skip
    batch, n_q, head_dim = q.shape
    kv_fp8 = k_cache.dtype == FP8_DTYPE
    fp8_args = {}
    if kv_fp8:
        fp8_args = dict(
            KS=k_scale, VS=v_scale, stride_ksb=k_scale.stride(0), stride_kss=k_scale.stride(1),
            stride_vsb=v_scale.stride(0), stride_vss=v_scale.stride(1), KV_FP8=True,
        )  # fmt: skip
    page, n_kv = k_cache.shape[1], k_cache.shape[2]
    s_max = page  # the row form: one page of S_max keys a row
    table, stride_tb = cache_lens, 0  # unused without a table
    if block_table is not None:
        table, stride_tb = block_table, block_table.stride(0)
        s_max = block_table.shape[1] * page
    elif rows is not None:
        table, stride_tb = rows, rows.stride(0)
    group = n_q // n_kv
    use_dot = bool(_cfg._TUNE.get("USE_DOT", 1))
    cfg = _config("dot" if use_dot else "fma")
    block_g = max(16, triton.next_power_of_2(group)) if use_dot else 1
    if not use_dot and group > 1:
        raise ValueError("_TUNE USE_DOT=0 needs one query head per KV head (MHA)")
    block_d = max(16 if use_dot else 1, triton.next_power_of_2(head_dim))
    interp = interpreter_enabled()
    upcast = interp and q.dtype == torch.bfloat16
    prec = "ieee" if (q.dtype == torch.float32 or upcast) else None
    cascade = slots is not None
    total = n_splits + (slots[0].shape[0] * n_psplits if cascade else 0)  # partials per head
    single = total == 1
    trigger = batch <= TRIGGER_MAX_BATCH and dependent_launch(q.device)
    if single:
        ws = q  # unused
        ws_strides = (0, 0, 0)
    else:
        if workspace is None:
            workspace = attention_workspace(batch, n_q, head_dim, total, q.device)
        ws = workspace.view(-1)[: batch * n_q * total * (head_dim + 2)]
        ws = ws.view(batch, n_q, total, head_dim + 2)
        ws_strides = ws.stride()[:3]
    _attn_split_kernel[(batch, n_kv, n_splits)](
        q, k_cache, v_cache, cache_lens, table, *(prefix or (cache_lens, cache_lens)), out, ws,
        s_max, page, n_splits, stride_tb, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        *ws_strides, scale * LOG2E,
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=cfg["BLOCK_S"],
        USE_DOT=use_dot, SINGLE=single, PREC=prec, UPCAST=upcast, EMULATE_RNE=interp,
        HAS_TABLE=block_table is not None or rows is not None, HAS_PREFIX=prefix is not None, CASCADE=cascade,
        LAUNCH_DEPENDENTS=trigger and single, WINDOW=window or 0, **fp8_args,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if cascade:
        cc = _config("cascade")
        # fp32 operands take twice the registers: half the tile keeps them out of local memory
        widest = cc["BLOCK_Q"] // (2 if q.dtype == torch.float32 else 1)
        block_q = max(16, min(widest, triton.next_power_of_2(batch * group)))
        tiles = triton.cdiv(batch * group, block_q)
        _attn_prefix_kernel[(slots[0].shape[0], n_kv, n_psplits * tiles)](
            q, k_cache, v_cache, cache_lens, *prefix, *slots, ws, batch, s_max, page, n_splits,
            n_psplits, slots[0].stride(0), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            *ws_strides, scale * LOG2E,
            GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            BLOCK_Q=block_q, BLOCK_S=cc["BLOCK_S"], PREC=prec, UPCAST=upcast,
            EMULATE_RNE=interp, WINDOW=window or 0, **fp8_args,
            num_warps=cc["num_warps"], num_stages=cc["num_stages"],
        )  # fmt: skip
    if single:
        return
    _attn_combine_kernel[(batch, n_q)](
        ws, cache_lens, out, s_max, total, *ws_strides, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SPLITS=triton.next_power_of_2(total), EMULATE_RNE=interp,
        LAUNCH_DEPENDENTS=trigger, num_warps=1,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------
# 4. Public function
# ------------------------------------------------------------------------------------------------


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    *,
    scale: float | None = None,
    n_splits: int | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    prefix_rows: torch.Tensor | None = None,
    prefix_lens: torch.Tensor | None = None,
    prefix_slots: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_table: torch.Tensor | None = None,
    window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q [B, n_q, hd]`` (one query per row) over ``k_cache``/``v_cache``
    ``[B_max, S_max, n_kv, hd]`` rows ``0..B-1`` (or cache rows ``rows[b]``), keys
    ``0 .. cache_lens[b] - 1``; query head h reads KV head ``h // (n_q / n_kv)``. With
    ``prefix_rows``/``prefix_lens`` (int ``[B]``), keys ``< prefix_lens[b]`` are read from cache
    row ``prefix_rows[b]`` instead (a shared prompt prefix held once). ``prefix_slots``
    ``(slot_rows [P], slot_lens [P])``, the cache rows that hold shared prefixes and their
    lengths (every row with a prefix reads one of them): the cascade computes each slot's
    prefix once for all its rows (module docstring); same result.

    Paged form, ``block_table`` (int ``[B, W]``): the caches are ``[n_pages, page, n_kv, hd]``
    and key s of row b is ``k_cache[block_table[b, s // page], s % page]`` (rows hold up to
    ``W * page`` keys; ``page`` a multiple of the kernels' ``BLOCK_S`` unless ``W == 1``; the
    row form is the table ``rows[:, None]`` with one page of S_max keys). Shared prefixes are
    pages several block tables hold; with ``prefix_slots = (slot_table [P, W'], slot_lens)``
    the cascade reads slot p's keys through its page table for the rows whose
    ``prefix_rows[b]`` is that table's first page (their first ``prefix_lens[b]`` keys).
    ``window`` (sliding-window attention, Mistral): row b attends to its last ``window`` keys
    only, ``cache_lens[b] - window .. cache_lens[b] - 1`` (the query is the row's last
    position); the splits and the cascade cover just those, the keys below are never read
    (``None``: every key; the kernels compile without it).
    ``scale`` defaults to ``1 / sqrt(hd)``, ``n_splits`` to ``decode_splits(...)`` (of the
    keys a row attends to: at most ``window``). Returns ``out`` (allocated when None), shape
    and dtype of q. e4m3 caches (``kv_cache="fp8"``) come with ``k_scale``/``v_scale``, fp32
    ``[B_max or n_pages, S_max or page, n_kv]``: key s stands for ``codes * scale``, read
    dequantized in registers (the codes widened to q's dtype, the scales applied in fp32)."""
    scale, n_splits, n_psplits = _check_args(
        q, k_cache, v_cache, cache_lens, scale, n_splits, out, workspace, for_kernel=True,
        rows=rows, prefix_rows=prefix_rows, prefix_lens=prefix_lens, prefix_slots=prefix_slots,
        block_table=block_table, window=window, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    prefix = None if prefix_rows is None else (prefix_rows, prefix_lens)
    _launch(
        q, k_cache, v_cache, cache_lens, scale, n_splits, out, workspace, rows, prefix,
        prefix_slots, n_psplits, block_table, window, k_scale, v_scale,
    )  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------------
# 5. Reference
# ------------------------------------------------------------------------------------------------


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    *,
    scale: float | None = None,
    n_splits: int | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    prefix_rows: torch.Tensor | None = None,
    prefix_lens: torch.Tensor | None = None,
    prefix_slots: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_table: torch.Tensor | None = None,
    window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch (any device): fp32 scores and softmax over each row's valid keys, output
    in q's dtype (zeros for a row with no keys). ``n_splits``/``workspace`` are checked like
    the kernel's and otherwise unused; so is ``prefix_slots`` in the row form (a row's prefix
    is ``prefix_rows[b]``'s row either way). Paged: each row's keys gathered through its block
    table, the first ``prefix_lens[b]`` through its slot's page table. ``window``: only each
    row's last ``window`` keys. e4m3 caches: dequantized first (``codes * scale`` in fp32)."""
    args = (q, k_cache, v_cache, cache_lens, scale, n_splits, out, workspace)
    scale, _, _ = _check_args(
        *args, for_kernel=False, rows=rows, prefix_rows=prefix_rows, prefix_lens=prefix_lens,
        prefix_slots=prefix_slots, block_table=block_table, window=window, k_scale=k_scale,
        v_scale=v_scale,
    )  # fmt: skip
    if k_cache.dtype == FP8_DTYPE:
        k_cache = k_cache.float() * k_scale[..., None]
        v_cache = v_cache.float() * v_scale[..., None]
    batch, n_q, _ = q.shape
    n_kv = k_cache.shape[2]
    kv_head = torch.arange(n_q, device=q.device) // (n_q // n_kv)
    if block_table is not None:
        k, v = _gather_pages(k_cache, block_table), _gather_pages(v_cache, block_table)
        if prefix_rows is not None:  # with prefix_slots (checked): the slots' pages
            table, lens = prefix_slots
            pick = (prefix_rows.long()[:, None] == table[:, 0].long()[None, :]).long().argmax(1)
            pk, pv = _gather_pages(k_cache, table[pick]), _gather_pages(v_cache, table[pick])
            n = min(pk.shape[1], k.shape[1])
            shared = torch.arange(n, device=q.device)[None, :] < prefix_lens[:, None]
            k[:, :n] = torch.where(shared[:, :, None, None], pk[:, :n], k[:, :n])
            v[:, :n] = torch.where(shared[:, :, None, None], pv[:, :n], v[:, :n])
        k, v = k.float()[:, :, kv_head], v.float()[:, :, kv_head]
    else:
        picked = slice(0, batch) if rows is None else rows.long()
        k = k_cache[picked].float()[:, :, kv_head]  # [B, S, n_q, hd]
        v = v_cache[picked].float()[:, :, kv_head]
        if prefix_rows is not None:
            s_max = k_cache.shape[1]
            shared = torch.arange(s_max, device=q.device)[None, :] < prefix_lens[:, None]
            shared = shared[:, :, None, None]
            k = torch.where(shared, k_cache[prefix_rows.long()].float()[:, :, kv_head], k)
            v = torch.where(shared, v_cache[prefix_rows.long()].float()[:, :, kv_head], v)
    scores = torch.einsum("bhd,bshd->bhs", q.float(), k) * scale
    key = torch.arange(k.shape[1], device=q.device)[None, :]
    lens = cache_lens.to(q.device).long()[:, None]
    valid = key < lens
    if window is not None:
        valid &= key >= lens - window
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no keys: all -inf -> 0
    y = torch.einsum("bhs,bshd->bhd", p, v).to(q.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def _gather_pages(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``[B, W * page, n_kv, hd]``: each row's pages in order (pages past a row's keys may be
    anything in range; a table entry outside the pool reads page 0, never used)."""
    n_pages = cache.shape[0]
    t = table.long()
    t = torch.where((t >= 0) & (t < n_pages), t, 0)
    return cache[t].flatten(1, 2)
