"""Loglikelihood engine: lm-eval's ``loglikelihood`` contract, computed with little waste.

A request is ``(context_tokens, continuation_tokens)``; its result is ``(sum of the
continuation's log-probs, whether greedy decoding would produce it)``, exactly what lm-eval's
HF backend computes (same left truncation, same per-token log-softmax in fp32).

Why an engine and not a loop over requests: multiple-choice benchmarks score several
continuations of ONE context (HellaSwag: 4 endings of ~17 tokens after a ~34-token context).
With ``use_cache=True`` the requests sharing a context become one row

    [ctx..., cont1[:-1]..., cont2[:-1]..., ...]

whose positions restart at ``len(ctx)`` for every continuation, under a tree mask (each
continuation sees the whole context and its own causal prefix). The context is computed once,
with no K/V copies, and the first token of every continuation is predicted from the one shared
last-context position. That halves the tokens of a HellaSwag run. Only the scored positions go
through the LM head and the log-softmax (``forward_packed``'s ``logits_index``), never
``[rows, len, vocab]``.

Batches are packed, not padded: rows go back to back into one token stream of at most
``token_budget`` tokens (best fit decreasing, so batches come out nearly full), and the model's
packed attention keeps each row to itself. No token is spent on padding except the few that
round a stream up to a multiple of ``PAD_MULTIPLE``; every full batch has (nearly) the same
token count, so the forward meets few distinct shapes and no per-shape planning.
``score_with_forward`` is the plain (no-cache) scorer for any model callable
``tokens [b, s] -> logits [b, s, V]`` (llama_org, HF peers): same requests, same truncation,
right-padded rows under the same limits, same log-prob gather, so speed and parity comparisons
are like for like.

Truncation (as lm-eval's HF causal LM): a request longer than ``max_length + 1`` tokens keeps
``(ctx + cont)[-(max_length + 1):][:-1]`` as model input, i.e. the context loses tokens on the
LEFT; a continuation longer than ``max_length`` cannot be scored (ValueError).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from nakta_model.kernels.logprobs import target_logprobs
from nakta_model.kernels.packed_attention import PREFIX_ALIGN

Request = tuple[Sequence[int], Sequence[int]]
DEFAULT_TOKEN_BUDGET = 16384


@dataclass
class _Row:
    """One model input row: a context followed by one or more continuation branches; the
    first ``prefix`` context tokens come from the prefix cache instead of the stream."""

    ctx: list[int]
    branches: list[tuple[int, list[int]]] = field(default_factory=list)  # (request idx, cont)
    prefix: int = 0

    def __len__(self) -> int:
        return len(self.ctx) + sum(len(c) - 1 for _, c in self.branches)

    @property
    def stream_len(self) -> int:
        """Tokens this row puts in the packed stream."""
        return len(self) - self.prefix


# --------------------------------------------------------------------------- validation


def _check_requests(
    requests: Sequence[Request], vocab_size: int | None, max_length: int
) -> list[tuple[list[int], list[int]]]:
    """Validate and left-truncate; returns (effective context, continuation) per request."""
    if max_length is None or max_length < 1:
        raise ValueError(f"max_length must be a positive int, got {max_length!r}")
    out = []
    for i, req in enumerate(requests):
        if not isinstance(req, (tuple, list)) or len(req) != 2:
            raise TypeError(f"requests[{i}] must be a (context_tokens, continuation_tokens) pair")
        ctx, cont = (list(req[0]), list(req[1]))
        if not cont:
            raise ValueError(f"requests[{i}] has an empty continuation")
        if not ctx:
            raise ValueError(
                f"requests[{i}] has an empty context (lm-eval conditions on BOS/EOS there; "
                "pass [bos_id] as the context)"
            )
        for name, toks in (("context", ctx), ("continuation", cont)):
            # min/max first: one C-speed pass per list keeps validation off the timed path
            bad = next((t for t in toks if type(t) is not int), None)
            if bad is not None:
                raise TypeError(f"requests[{i}] {name} holds {bad!r}; expected int token ids")
            lo, hi = min(toks), max(toks)
            if lo < 0 or (vocab_size is not None and hi >= vocab_size):
                t = lo if lo < 0 else hi
                raise ValueError(
                    f"requests[{i}] {name} token id {t} outside the vocabulary "
                    f"[0, {vocab_size if vocab_size is not None else 'inf'})"
                )
        if len(cont) > max_length:
            raise ValueError(
                f"requests[{i}] continuation has {len(cont)} tokens, more than "
                f"max_length={max_length}: it cannot be scored"
            )
        keep = max_length + 1 - len(cont)  # context tokens that fit (lm-eval's left truncation)
        out.append((ctx[-keep:] if len(ctx) > keep else ctx, cont))
    return out


def _check_budget(token_budget: int, max_rows: int | None) -> None:
    if not isinstance(token_budget, int) or token_budget < 1:
        raise ValueError(f"token_budget must be a positive int, got {token_budget!r}")
    if max_rows is not None and (not isinstance(max_rows, int) or max_rows < 1):
        raise ValueError(f"max_rows/batch_size must be a positive int or None, got {max_rows!r}")


# --------------------------------------------------------------------------- packing


def _build_rows(
    reqs: list[tuple[list[int], list[int]]], use_cache: bool, max_length: int
) -> tuple[list[_Row], dict[int, int]]:
    """Group requests into rows. Returns rows and ``duplicate -> original`` request indices.

    With the cache, requests whose (truncated) context tokens are equal share a row (split
    into several rows only if the packed row would grow past ``max_length`` tokens); identical
    (context, continuation) pairs are computed once.
    """
    if not use_cache:
        return [_Row(ctx, [(i, cont)]) for i, (ctx, cont) in enumerate(reqs)], {}
    groups: dict[tuple[int, ...], list[_Row]] = {}
    seen: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    dup: dict[int, int] = {}
    for i, (ctx, cont) in enumerate(reqs):
        key = tuple(ctx)
        pair = (key, tuple(cont))
        if pair in seen:
            dup[i] = seen[pair]
            continue
        seen[pair] = i
        rows = groups.setdefault(key, [])
        if not rows or len(rows[-1]) + len(cont) - 1 > max_length:
            rows.append(_Row(ctx))  # a packed row stays within the model's length
        rows[-1].branches.append((i, cont))
    for rows in groups.values():
        for r in rows:
            r.branches.sort(key=lambda b: b[1])
    return [r for rows in groups.values() for r in rows], dup


def _row_key(row: _Row) -> tuple:
    return (-len(row), row.ctx, [c for _, c in row.branches])


def _padded_batches(rows: list[_Row], token_budget: int, max_rows: int | None) -> list[list[_Row]]:
    """For row-padded peers: longest rows first; a batch holds rows while rows x longest
    length <= token_budget (and at most ``max_rows`` rows).

    Rows (and branches within a row) are put in a canonical order that depends on their tokens
    only, so the same set of requests gives the same batches, and the same rounding, in any
    input order (parity.py and lm-eval's call order differ).
    """
    rows = sorted(rows, key=_row_key)
    out: list[list[_Row]] = []
    cur: list[_Row] = []
    for row in rows:
        width = len(cur[0]) if cur else len(row)
        full = (len(cur) + 1) * width > token_budget or (
            max_rows is not None and len(cur) >= max_rows
        )
        if cur and full:
            out.append(cur)
            cur = []
        cur.append(row)
    if cur:
        out.append(cur)
    return out


def _packed_batches(rows: list[_Row], token_budget: int, max_rows: int | None) -> list[list[_Row]]:
    """For the packed engine: rows go into batches of at most ``token_budget`` tokens (no padding
    between rows) and ``max_rows`` rows, best fit decreasing: each row, longest first, joins the
    batch with the least room that still fits it, so batches come out nearly full and their
    token counts (the forward's only shape) nearly equal. A row longer than the budget gets a
    batch of its own. Canonical row order, as in :func:`_padded_batches`.
    """
    rows = sorted(rows, key=_row_key)
    batches: list[list[_Row]] = []
    sizes: list[int] = []
    room: list[tuple[int, int]] = []  # sorted (free tokens, batch id) of batches still open
    for row in rows:
        n = row.stream_len
        at = bisect.bisect_left(room, (n, -1))
        if at < len(room):
            free, b = room.pop(at)
        else:
            b = len(batches)
            batches.append([])
            sizes.append(0)
            free = max(token_budget, n)
        batches[b].append(row)
        sizes[b] += n
        free -= n
        if free > 0 and (max_rows is None or len(batches[b]) < max_rows):
            bisect.insort(room, (free, b))
    return batches


@dataclass
class _Packed:
    """Host-side tensors of one packed batch (built before the device work starts)."""

    tokens: torch.Tensor  # [T] long: every row's tokens back to back, then padding
    positions: torch.Tensor  # [T] long
    seq_start: torch.Tensor  # [T] int32: first token of each token's row
    branch: torch.Tensor  # [T] int32: 0 context, k > 0 branch k
    flat_index: torch.Tensor  # [N] long: scored token indices
    src: torch.Tensor  # [S] long: row of the [N, V] logits that predicts each target
    target: torch.Tensor  # [S] long: target token ids
    req: torch.Tensor  # [S] long: request index of each target
    n_real: int  # tokens before the padding
    token_entry: torch.Tensor | None = None  # [T] int32: prefix-cache entry (-1 none)


PAD_MULTIPLE = 128  # token counts are rounded up to this: few distinct forward shapes


def _pack(
    batch: list[_Row], pin: bool = False, entries: dict[tuple[int, ...], int] | None = None
) -> _Packed:
    """Lay out a batch as one token stream: each row is its context, then every branch's
    tokens but the last (the last token of a continuation is a target, never an input), with
    positions restarting at ``len(ctx)`` for every branch. Scored positions: the last context
    token (predicts every branch's first target), then every branch token.

    A row with a cached prefix puts only ``ctx[prefix:]`` in the stream (positions from
    ``prefix`` on) and attends to the prefix's cached K/V; ``entries`` maps each prefix to its
    page-table row. Rows of one prefix form a segment that starts on a ``PREFIX_ALIGN``
    boundary (pad tokens before it), so a query block of the kernel sees one prefix.

    The stream is padded to a multiple of ``PAD_MULTIPLE``; a pad token is a sequence of its
    own (it attends to itself only) and is never scored.

    ``pin``: page-locked host tensors, so their copies to the GPU are truly asynchronous (a
    copy from pageable memory waits for the stream to drain and would idle the GPU while the
    host packs the next batch).
    """
    toks: list[int] = []
    pos: list[int] = []
    start: list[int] = []
    branch: list[int] = []
    entry: list[int] = []
    flat: list[int] = []
    src: list[int] = []
    target: list[int] = []
    req: list[int] = []

    def pad(to: int, e: int) -> None:
        n = -len(toks) % to
        start.extend(range(len(toks), len(toks) + n))
        toks.extend([0] * n)
        pos.extend([0] * n)
        branch.extend([0] * n)
        entry.extend([e] * n)

    current = -1
    for row in batch:
        e = entries[tuple(row.ctx[: row.prefix])] if row.prefix else -1
        if entries is not None and e != current:  # a new prefix segment
            pad(PREFIX_ALIGN, current)
            current = e
        s0 = len(toks)
        c, p = len(row.ctx), row.prefix
        toks += row.ctx[p:]
        pos += range(p, c)
        branch += [0] * (c - p)
        first_scored = len(flat)
        flat.append(s0 + c - p - 1)  # predicts the first token of every branch
        for k, (i, cont) in enumerate(row.branches, start=1):
            m = len(cont)
            b0 = len(toks)
            toks += cont[:-1]
            pos += range(c, c + m - 1)
            branch += [k] * (m - 1)
            src.append(first_scored)
            src += range(len(flat), len(flat) + m - 1)
            flat += range(b0, b0 + m - 1)
            target += cont
            req += [i] * m
        start += [s0] * (len(toks) - s0)
        entry += [e] * (len(toks) - s0)
    n_real = len(toks)
    pad(PREFIX_ALIGN if entries is not None else PAD_MULTIPLE, current)
    out = _Packed(
        tokens=torch.tensor(toks, dtype=torch.long),
        positions=torch.tensor(pos, dtype=torch.long),
        seq_start=torch.tensor(start, dtype=torch.int32),
        branch=torch.tensor(branch, dtype=torch.int32),
        flat_index=torch.tensor(flat, dtype=torch.long),
        src=torch.tensor(src, dtype=torch.long),
        target=torch.tensor(target, dtype=torch.long),
        req=torch.tensor(req, dtype=torch.long),
        n_real=n_real,
        token_entry=torch.tensor(entry, dtype=torch.int32) if entries is not None else None,
    )
    if pin:
        for name in ("tokens", "positions", "seq_start", "branch", "flat_index", "src"):
            setattr(out, name, getattr(out, name).pin_memory())
        out.target, out.req = out.target.pin_memory(), out.req.pin_memory()
        if out.token_entry is not None:
            out.token_entry = out.token_entry.pin_memory()
    return out


def _prefix_batches(
    rows: list[_Row], token_budget: int, max_rows: int | None, pool_pages: int, page_size: int
) -> list[list[_Row]]:
    """Rows with cached prefixes, one prefix after another (longest rows first within one),
    into batches of at most ``token_budget`` stream tokens counting each segment's alignment
    padding, ``max_rows`` rows, and prefixes that fit the pool together."""
    rows = sorted(rows, key=lambda r: (r.ctx[: r.prefix], *_row_key(r)))
    batches: list[list[_Row]] = []
    cur: list[_Row] = []
    used = pages = 0
    key = None
    for row in rows:
        k = tuple(row.ctx[: row.prefix])
        new_seg = k != key
        need = row.stream_len + ((-used % PREFIX_ALIGN) if new_seg and cur else 0)
        row_pages = -(-row.prefix // page_size) if new_seg else 0
        full = cur and (
            used + need > token_budget
            or (max_rows is not None and len(cur) >= max_rows)
            or pages + row_pages > pool_pages
        )
        if full:
            batches.append(cur)
            cur, used, pages, new_seg = [], 0, 0, True
            need, row_pages = row.stream_len, -(-row.prefix // page_size)
        cur.append(row)
        used += need
        pages += row_pages
        key = k
    if cur:
        batches.append(cur)
    return batches


@dataclass
class _Batch:
    """Host-side tensors of one row-padded batch (the plain scorer's layout)."""

    tokens: torch.Tensor  # [B, L] long
    flat_index: torch.Tensor  # [N] long: scored positions, flattened b * L + t
    src: torch.Tensor  # [T] long: row of the [N, V] logits that predicts each target
    target: torch.Tensor  # [T] long: target token ids
    req: torch.Tensor  # [T] long: request index of each target


def _pad_rows(batch: list[_Row], pin: bool = False) -> _Batch:
    """Right-padded ``[B, L]`` rows of single-branch rows (``ctx + cont[:-1]``) for peers whose
    forward takes a token matrix; scored positions as in :func:`_pack`."""
    width = max(len(r) for r in batch)
    tokens = torch.zeros(len(batch), width, dtype=torch.long)
    flat, src, target, req = [], [], [], []
    for b, row in enumerate(batch):
        ((i, cont),) = row.branches
        toks = row.ctx + cont[:-1]
        tokens[b, : len(toks)] = torch.tensor(toks)
        c = len(row.ctx)
        src += range(len(flat), len(flat) + len(cont))
        flat += range(b * width + c - 1, b * width + len(toks))
        target += cont
        req += [i] * len(cont)
    out = _Batch(
        tokens=tokens,
        flat_index=torch.tensor(flat, dtype=torch.long),
        src=torch.tensor(src, dtype=torch.long),
        target=torch.tensor(target, dtype=torch.long),
        req=torch.tensor(req, dtype=torch.long),
    )
    if pin:
        for name in ("tokens", "flat_index", "src", "target", "req"):
            setattr(out, name, getattr(out, name).pin_memory())
    return out


def _accumulate(
    logits: torch.Tensor, batch: _Packed | _Batch, sums: torch.Tensor, misses: torch.Tensor
) -> None:
    """Add this batch's per-token log-probs into ``sums`` and count non-argmax tokens, on device.

    ``logits`` may be in the model's dtype: the log-softmax runs in fp32 either way (one fused
    pass on CUDA, ``kernels/logprobs.py``)."""
    device = logits.device
    src = batch.src.to(device, non_blocking=True)
    target = batch.target.to(device, non_blocking=True)
    req = batch.req.to(device, non_blocking=True)
    lp, is_max = target_logprobs(logits, src, target, use_kernel=logits.is_cuda)
    sums.index_add_(0, req, lp.double())
    misses.index_add_(0, req, (~is_max).to(misses.dtype))


def _finish(
    sums: torch.Tensor, misses: torch.Tensor, n: int, dup: dict[int, int]
) -> list[tuple[float, bool]]:
    s = sums.cpu().tolist()
    m = misses.cpu().tolist()
    out = [(float(s[i]), m[i] == 0) for i in range(n)]
    for i, j in dup.items():
        out[i] = out[j]
    return out


def _progress(total: int, enabled: bool, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, desc=desc, unit="tok", unit_scale=True)


# --------------------------------------------------------------------------- public API


def _model_attr(model: object, names: Sequence[str]) -> int | None:
    """A positive int attribute of the model's config (``args``/``params``) or of the model.

    The config comes first: Nakta's ``model.max_seq_len`` is the KV-cache length (0 when none).
    """
    for holder in (getattr(model, "args", None), getattr(model, "params", None), model):
        if holder is None:
            continue
        for name in names:
            v = getattr(holder, name, None)
            if isinstance(v, int) and v > 0:
                return v
    return None


def _model_device(model: object) -> torch.device:
    try:
        return next(model.parameters()).device  # type: ignore[attr-defined]
    except (AttributeError, StopIteration):
        return torch.device("cpu")


@dataclass
class ScoreStats:
    """Token counts of one :func:`score` call: what lm-eval asks for, what was computed."""

    request_tokens: int = 0  # sum of len(context + continuation) - 1: a plain scorer's work
    unique_tokens: int = 0  # distinct prefixes of all (context + continuation)[:-1] sequences
    computed_tokens: int = 0  # tokens through the model: stream tokens + prefixes computed
    prefix_tokens: int = 0  # of which prefixes (each computed once while cached)
    prefixes: int = 0  # distinct shared prefixes found


def unique_tokens(reqs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> int:
    """Tokens of the trie of every ``(context + continuation)[:-1]``: what no engine can skip."""
    seqs = sorted({tuple(c) + tuple(x[:-1]) for c, x in reqs})
    total, prev = 0, ()
    for q in seqs:
        n = min(len(prev), len(q))
        i = 0
        while i < n and prev[i] == q[i]:
            i += 1
        total += len(q) - i
        prev = q
    return total


def default_prefix_budget(model) -> int:
    """Pool tokens for a temporary prefix cache: 8,192, or less where memory is short (at most
    a quarter of the free device memory)."""
    args = getattr(model, "args", None)
    if args is None:
        return 8192
    tp = model.parallel.tp_size
    per_token = 2 * args.n_layers * (args.n_kv_heads // tp) * args.head_dim
    per_token *= torch.empty((), dtype=model.dtype).element_size()
    if model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        return max(256, min(8192, int(free * 0.25) // per_token))
    return 8192


def score(
    model,
    requests: Sequence[Request],
    *,
    use_cache: bool = True,
    token_budget: int = DEFAULT_TOKEN_BUDGET,
    max_length: int | None = None,
    max_rows: int | None = None,
    progress: bool = False,
    prefix_cache=None,
    stats: ScoreStats | None = None,
) -> list[tuple[float, bool]]:
    """lm-eval ``loglikelihood`` over token requests with a Nakta model.

    ``model`` needs ``forward_packed(tokens, positions, seq_start, branch, logits_index)``
    (fp32 logits at ``logits_index`` only; see ``Transformer.forward_packed``). ``max_length``
    defaults to the model's ``max_seq_len``; ``use_cache`` packs the continuations of a shared
    context behind one copy of it, and computes a prefix shared by different contexts (a
    few-shot prompt) once: ``prefix_cache`` is a :class:`~nakta_model.prefix_cache.PrefixCache`
    to keep such prefixes across calls, ``None`` for one for this call when shared prefixes
    exist (the model's KV cache is its pool; freed afterwards), ``False`` for none. Results
    equal ``use_cache=False`` up to the model dtype's rounding. ``token_budget`` (tokens per
    forward) bounds memory; ``max_rows`` optionally caps the rows (contexts with their
    continuations) per forward. ``stats`` (a :class:`ScoreStats`) receives token counts.
    """
    if not hasattr(model, "forward_packed"):
        raise TypeError(
            "model must have forward_packed(tokens, positions, seq_start, branch, logits_index)"
        )
    if max_length is None:
        max_length = _model_attr(model, ("max_seq_len", "max_length"))
        if max_length is None:
            raise ValueError("max_length is required: the model exposes no max_seq_len")
    _check_budget(token_budget, max_rows)
    vocab = _model_attr(model, ("vocab_size",))
    reqs = _check_requests(requests, vocab, max_length)
    rows, dup = _build_rows(reqs, use_cache, max_length)
    cache, own_cache = _prefix_cache_for(model, rows, use_cache, prefix_cache)
    plain = [r for r in rows if not r.prefix]
    batches = [(b, False) for b in _packed_batches(plain, token_budget, max_rows)]
    if cache is not None:
        shared = [r for r in rows if r.prefix]
        pb = _prefix_batches(shared, token_budget, max_rows, cache.n_pages, cache.page_size)
        batches += [(b, True) for b in pb]
    device = _model_device(model)
    sums = torch.zeros(len(reqs), dtype=torch.float64, device=device)
    misses = torch.zeros(len(reqs), dtype=torch.int32, device=device)
    total = sum(r.stream_len for r in rows)
    pin = device.type == "cuda"
    computed_before = cache.computed_tokens if cache is not None else 0

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    try:
        with torch.inference_mode(), _progress(total, progress, "scoring") as bar:
            for rows_b, with_prefix in batches:
                kw = {"upcast": False}
                entries = None
                if with_prefix:
                    keys = list(dict.fromkeys(tuple(r.ctx[: r.prefix]) for r in rows_b))
                    table, lengths = cache.page_table(cache.acquire(keys))
                    entries = {k: i for i, k in enumerate(keys)}
                b = _pack(rows_b, pin=pin, entries=entries)
                if with_prefix:
                    from nakta_model.model import PrefixPages

                    kw["prefix"] = PrefixPages(table, lengths, put(b.token_entry), cache.page_size)
                index = put(b.flat_index)
                logits = model.forward_packed(
                    put(b.tokens), put(b.positions), put(b.seq_start), put(b.branch), index, **kw
                )
                if logits.shape[0] != index.shape[0]:
                    raise RuntimeError(
                        f"forward_packed returned {tuple(logits.shape)} logits for "
                        f"{index.shape[0]} scored positions"
                    )
                _accumulate(logits, b, sums, misses)
                bar.update(b.n_real)
    finally:
        if own_cache:
            model.clear_cache()
    if stats is not None:
        stats.request_tokens += sum(len(c) + len(x) - 1 for c, x in reqs)
        stats.unique_tokens += unique_tokens(reqs)
        prefix_computed = (cache.computed_tokens - computed_before) if cache is not None else 0
        stats.prefix_tokens += prefix_computed
        stats.computed_tokens += total + prefix_computed
        stats.prefixes += len({tuple(r.ctx[: r.prefix]) for r in rows if r.prefix})
    return _finish(sums, misses, len(reqs), dup)


def _prefix_cache_for(model, rows: list[_Row], use_cache: bool, prefix_cache):
    """``(PrefixCache or None, whether this call made it)``; marks the rows' ``prefix``."""
    if not use_cache or prefix_cache is False or not hasattr(model, "forward_prefill"):
        return None, False
    from nakta_model.prefix_cache import PrefixCache, shared_prefixes

    lengths = shared_prefixes([r.ctx for r in rows])
    if not any(lengths):
        return None, False
    own = prefix_cache is None or prefix_cache is True
    cache = PrefixCache(model, default_prefix_budget(model)) if own else prefix_cache
    if not isinstance(cache, PrefixCache):
        raise TypeError(
            f"prefix_cache must be a PrefixCache, None or False, got {type(prefix_cache).__name__}"
        )
    for r, n in zip(rows, lengths):
        if n and cache.fits(n):
            r.prefix = n
    return cache, own


def warm_up(model, *, use_cache: bool = True) -> float:
    """Score one tiny batch so the first real batch pays no kernel compilation; returns seconds.

    Every Triton kernel the scorer launches is compiled once per process (or loaded from
    Triton's on-disk cache) and none of them specialises on the token count, so one small batch
    (a context with two branches and a plain row) compiles exactly what every later batch runs.
    Call it right after loading (the lm-eval adapter does) to keep compilation out of scoring.
    """
    import time

    vocab = _model_attr(model, ("vocab_size",)) or 2
    tok = [(7 * i + 3) % vocab for i in range(12)]
    reqs = [(tok[:6], tok[6:9]), (tok[:6], tok[9:12]), (tok[3:5], tok[5:8])]
    t0 = time.perf_counter()
    score(model, reqs, use_cache=use_cache, max_rows=None)  # ends with a host sync
    return time.perf_counter() - t0


def score_with_forward(
    forward_fn: Callable[[torch.Tensor], torch.Tensor],
    requests: Sequence[Request],
    *,
    max_length: int,
    batch_size: int | None = None,
    token_budget: int = DEFAULT_TOKEN_BUDGET,
    vocab_size: int | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> list[tuple[float, bool]]:
    """The plain scorer for any ``forward_fn(tokens [b, s]) -> logits [b, s, V]``.

    One right-padded row per request (``(ctx + cont)[:-1]`` after left truncation), batches of
    at most ``batch_size`` rows and ``token_budget`` padded tokens; log-softmax only at the
    positions that predict continuation tokens. Same contract and results as :func:`score`.
    ``device`` is where the token batches go (default: the CPU).
    """
    _check_budget(token_budget, batch_size)
    reqs = _check_requests(requests, vocab_size, max_length)
    rows, _ = _build_rows(reqs, False, max_length)
    batches = _padded_batches(rows, token_budget, batch_size)
    device = torch.device(device or "cpu")
    sums = misses = None
    total = sum(len(r) for r in rows)
    with torch.inference_mode(), _progress(total, progress, "scoring") as bar:
        for rows_b in batches:
            b = _pad_rows(rows_b, pin=device.type == "cuda")
            logits = forward_fn(b.tokens.to(device, non_blocking=True))
            if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(b.tokens.shape):
                raise RuntimeError(
                    f"forward_fn returned {tuple(logits.shape)}; expected "
                    f"[{b.tokens.shape[0]}, {b.tokens.shape[1]}, vocab]"
                )
            bad = b.target.max().item() if b.target.numel() else 0
            if bad >= logits.shape[-1]:
                raise ValueError(
                    f"token id {bad} outside the model's vocabulary of {logits.shape[-1]}"
                )
            if sums is None:  # accumulate where the logits live: one sync at the end
                sums = torch.zeros(len(reqs), dtype=torch.float64, device=logits.device)
                misses = torch.zeros(len(reqs), dtype=torch.int32, device=logits.device)
            scored = logits.reshape(-1, logits.shape[-1])[
                b.flat_index.to(logits.device, non_blocking=True)
            ]
            _accumulate(scored, b, sums, misses)
            bar.update(sum(len(r) for r in rows_b))
    if sums is None:
        return []
    return _finish(sums, misses, len(reqs), {})
