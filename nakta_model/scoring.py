"""Loglikelihood engine: lm-eval's ``loglikelihood`` contract, computed with little waste.

A request is ``(context_tokens, continuation_tokens)``; its result is ``(sum of the
continuation's log-probs, whether greedy decoding would produce it)``, exactly what lm-eval's
HF backend computes (same left truncation, same per-token log-softmax in fp32).

Why an engine and not a loop over requests: multiple-choice benchmarks score several
continuations of ONE context (HellaSwag: 4 endings of ~17 tokens after a ~34-token context).
With ``use_cache=True`` the requests sharing a context are packed into one row

    [ctx..., cont1[:-1]..., cont2[:-1]..., ...]

whose positions restart at ``len(ctx)`` for every continuation, under a tree mask (each
continuation sees the whole context and its own causal prefix). The context is computed once,
with no K/V copies, and the first token of every continuation is predicted from the one shared
last-context position. That halves the tokens of a HellaSwag run. Only the scored positions go
through the LM head and the log-softmax (``forward_scored``'s ``logits_index``), never
``[rows, len, vocab]``.

Batches are filled up to a token budget (rows x padded length), longest rows first, so padding
stays small. ``score_with_forward`` is the plain (no-cache) scorer for any model callable
``tokens [b, s] -> logits [b, s, V]`` (llama_org, HF peers): same requests, same truncation,
same batching limits, same log-prob gather, so speed and parity comparisons are like for like.

Truncation (as lm-eval's HF causal LM): a request longer than ``max_length + 1`` tokens keeps
``(ctx + cont)[-(max_length + 1):][:-1]`` as model input, i.e. the context loses tokens on the
LEFT; a continuation longer than ``max_length`` cannot be scored (ValueError).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

Request = tuple[Sequence[int], Sequence[int]]
DEFAULT_TOKEN_BUDGET = 16384


@dataclass
class _Row:
    """One model input row: a context followed by one or more continuation branches."""

    ctx: list[int]
    branches: list[tuple[int, list[int]]] = field(default_factory=list)  # (request idx, cont)

    def __len__(self) -> int:
        return len(self.ctx) + sum(len(c) - 1 for _, c in self.branches)


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


def _batches(rows: list[_Row], token_budget: int, max_rows: int | None) -> list[list[_Row]]:
    """Longest rows first; a batch holds rows while rows x longest length <= token_budget.

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


@dataclass
class _Batch:
    """Host-side tensors of one batch (built before the device work starts)."""

    tokens: torch.Tensor  # [B, L] long
    positions: torch.Tensor  # [B, L] long
    segments: torch.Tensor | None  # [B, L] long: 0 context, k>0 branch k, -1 padding
    flat_index: torch.Tensor  # [N] long: scored positions, flattened b * L + t
    src: torch.Tensor  # [T] long: row of the [N, V] logits that predicts each target
    target: torch.Tensor  # [T] long: target token ids
    req: torch.Tensor  # [T] long: request index of each target
    n_tokens: int


def _pack(batch: list[_Row], tree: bool, pin: bool = False) -> _Batch:
    """Lay out a batch: tokens, positions, tree segments and the scored-position gather maps.

    ``pin``: page-locked host tensors, so their copies to the GPU are truly asynchronous. A copy
    from pageable memory first waits for the stream to drain, which would leave the GPU idle
    while the host packs the next batch.
    """
    width = max(len(r) for r in batch)
    n = len(batch)
    tokens = torch.zeros(n, width, dtype=torch.long)
    positions = torch.zeros(n, width, dtype=torch.long)
    segments = torch.full((n, width), -1, dtype=torch.long) if tree else None
    flat, src, target, req = [], [], [], []
    n_scored = 0
    for b, row in enumerate(batch):
        c = len(row.ctx)
        toks = list(row.ctx)
        pos = list(range(c))
        seg = [0] * c
        for k, (_, cont) in enumerate(row.branches, start=1):
            toks += cont[:-1]
            pos += range(c, c + len(cont) - 1)
            seg += [k] * (len(cont) - 1)
        length = len(toks)
        tokens[b, :length] = torch.tensor(toks)
        positions[b, :length] = torch.tensor(pos)
        if segments is not None:
            segments[b, :length] = torch.tensor(seg)
        # Scored positions of this row: the last context token, then every branch token.
        flat.append(torch.arange(b * width + c - 1, b * width + length))
        off = c  # row offset of the current branch's first token
        for i, cont in row.branches:
            m = len(cont)
            # target j is predicted from row position c-1 (j=0) or off+j-1 (j>0)
            row_pos = [c - 1] + list(range(off, off + m - 1))
            src += [n_scored + p - (c - 1) for p in row_pos]
            target += cont
            req += [i] * m
            off += m - 1
        n_scored += length - c + 1
    out = _Batch(
        tokens=tokens,
        positions=positions,
        segments=segments,
        flat_index=torch.cat(flat),
        src=torch.tensor(src, dtype=torch.long),
        target=torch.tensor(target, dtype=torch.long),
        req=torch.tensor(req, dtype=torch.long),
        n_tokens=n * width,
    )
    if pin:
        for name in ("tokens", "positions", "segments", "flat_index", "src", "target", "req"):
            t = getattr(out, name)
            if t is not None:
                setattr(out, name, t.pin_memory())
    return out


def tree_mask(segments: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, L, L]`` (True = attend) from segment ids (0 context, k branch k, -1 pad).

    A query attends to keys at or before it that are context or in its own branch; a padding
    query attends to itself only (its output is never read, but its softmax must not be empty).
    """
    q = segments[:, :, None]
    k = segments[:, None, :]
    L = segments.shape[1]
    idx = torch.arange(L, device=segments.device)
    causal = idx[None, :, None] >= idx[None, None, :]
    allowed = causal & (q >= 0) & (k >= 0) & ((k == 0) | (k == q))
    return allowed | torch.eye(L, dtype=torch.bool, device=segments.device)[None]


def _accumulate(
    logits: torch.Tensor, batch: _Batch, sums: torch.Tensor, misses: torch.Tensor
) -> None:
    """Add this batch's per-token log-probs into ``sums`` and count non-argmax tokens, on device."""
    device = logits.device
    src = batch.src.to(device, non_blocking=True)
    target = batch.target.to(device, non_blocking=True)
    req = batch.req.to(device, non_blocking=True)
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    lp = logits[src, target] - lse[src]
    is_max = logits.argmax(dim=-1)[src] == target
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


def score(
    model,
    requests: Sequence[Request],
    *,
    use_cache: bool = True,
    token_budget: int = DEFAULT_TOKEN_BUDGET,
    max_length: int | None = None,
    max_rows: int | None = None,
    progress: bool = False,
) -> list[tuple[float, bool]]:
    """lm-eval ``loglikelihood`` over token requests with a Nakta model.

    ``model`` needs ``forward_scored(tokens, positions, attn_mask, logits_index)`` (fp32 logits
    at the flattened ``logits_index`` positions only). ``max_length`` defaults to the model's
    ``max_seq_len``; ``use_cache`` packs the continuations of a shared context into one row.
    Results equal ``use_cache=False`` up to the model dtype's rounding.
    """
    if not hasattr(model, "forward_scored"):
        raise TypeError("model must have forward_scored(tokens, positions, attn_mask, index)")
    max_length = max_length or _model_attr(model, ("max_seq_len", "max_length"))
    if max_length is None:
        raise ValueError("max_length is required: the model exposes no max_seq_len")
    _check_budget(token_budget, max_rows)
    vocab = _model_attr(model, ("vocab_size",))
    reqs = _check_requests(requests, vocab, max_length)
    rows, dup = _build_rows(reqs, use_cache, max_length)
    batches = _batches(rows, token_budget, max_rows)
    device = _model_device(model)
    sums = torch.zeros(len(reqs), dtype=torch.float64, device=device)
    misses = torch.zeros(len(reqs), dtype=torch.int32, device=device)
    total = sum(len(r) for r in rows)
    with torch.inference_mode(), _progress(total, progress, "scoring") as bar:
        for rows_b in batches:
            tree = use_cache and any(len(r.branches) > 1 for r in rows_b)
            b = _pack(rows_b, tree, pin=device.type == "cuda")
            tokens = b.tokens.to(device, non_blocking=True)
            positions = b.positions.to(device, non_blocking=True)
            segments = b.segments
            mask = tree_mask(segments.to(device, non_blocking=True)) if tree else None
            index = b.flat_index.to(device, non_blocking=True)
            logits = model.forward_scored(tokens, positions, mask, index)
            if logits.shape[0] != index.shape[0]:
                raise RuntimeError(
                    f"forward_scored returned {tuple(logits.shape)} logits for "
                    f"{index.shape[0]} scored positions"
                )
            _accumulate(logits, b, sums, misses)
            bar.update(sum(len(r) for r in rows_b))
    return _finish(sums, misses, len(reqs), dup)


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
    batches = _batches(rows, token_budget, batch_size)
    device = torch.device(device or "cpu")
    sums = misses = None
    total = sum(len(r) for r in rows)
    with torch.inference_mode(), _progress(total, progress, "scoring") as bar:
        for rows_b in batches:
            b = _pack(rows_b, tree=False, pin=device.type == "cuda")
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
