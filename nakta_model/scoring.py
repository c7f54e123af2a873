"""Loglikelihood engine: lm-eval's ``loglikelihood`` contract, computed with little waste.

A request is ``(context_tokens, continuation_tokens)``; its result is ``(sum of the
continuation's log-probs, whether greedy decoding would produce it)``, exactly what lm-eval's
HF backend computes (same left truncation, same per-token log-softmax in fp32).

Why an engine and not a loop over requests: multiple-choice benchmarks score several
continuations of ONE context (HellaSwag: 4 endings of ~17 tokens after a ~34-token context).
With ``use_cache=True`` the requests sharing a context become one row

    [ctx..., trie of cont1[:-1], cont2[:-1], ... in depth-first order]

a token tree under a tree mask (each continuation sees the whole context and its own causal
prefix; continuations that begin alike share those tokens, positions count depth), and rows
whose contexts begin alike merge into one tree (``score_batches.merge_rows``). The context is
computed once, with no K/V copies, and the first token of every continuation is predicted from
the one shared last-context position. That halves the tokens of a HellaSwag run, and the
shared beginnings take another 11.8% (3,000 tasks: 242,101 tokens, 240,241 unique). Only the
scored positions go through the LM head and the log-softmax (``forward_packed``'s
``logits_index``), never ``[rows, len, vocab]``.

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from nakta_model.kernels.logprobs import target_logprobs
from nakta_model.kv_pages import SCORING_FRACTION, kv_bytes_available
from nakta_model.score_batches import (
    MERGE_MAX_TOKENS,
    Packed,
    PaddedBatch,
    Row,
    build_rows,
    check_budget,
    merge_rows,
    pack,
    packed_batches,
    pad_rows,
    padded_batches,
    prefix_batches,
)

Request = tuple[Sequence[int], Sequence[int]]
DEFAULT_TOKEN_BUDGET = 16384


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


def _accumulate(
    logits: torch.Tensor, batch: Packed | PaddedBatch, sums: torch.Tensor, misses: torch.Tensor
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
    # unique_tokens sorts every request (tens of ms per 1,000 tasks, on the host): a caller that
    # knows them already (speed_bench's workload) turns it off to keep it out of a timed pass
    count_unique: bool = True


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
    ``kv_pages.SCORING_FRACTION``, a quarter, of the memory a KV pool could take: the free
    memory and what the model's current pool holds, which scoring trims)."""
    args = getattr(model, "args", None)
    if args is None:
        return 8192
    tp = model.parallel.tp_size
    per_token = 2 * args.n_layers * args.local_kv_heads(tp) * args.head_dim
    per_token *= torch.empty((), dtype=model.dtype).element_size()
    if model.device.type == "cuda":
        free = kv_bytes_available(model)
        return max(256, min(8192, int(free * SCORING_FRACTION) // per_token))
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

    ``model`` needs ``forward_packed(tokens, positions, seq_start, span_end, logits_index)``
    (fp32 logits at ``logits_index`` only; see ``Transformer.forward_packed``). ``max_length``
    defaults to the model's ``max_seq_len``; ``use_cache`` packs the continuations of a shared
    context behind one copy of it, and computes a prefix shared by different contexts (a
    few-shot prompt) once: ``prefix_cache`` is a :class:`~nakta_model.prefix_cache.PrefixCache`
    to keep such prefixes across calls, ``None`` for one for this call when shared prefixes
    exist (its pages come from the model's KV pool, ``kv_pages``, and go back afterwards; the
    pool's memory too when this call made it), ``False`` for none. Results
    equal ``use_cache=False`` up to the model dtype's rounding. ``token_budget`` (tokens per
    forward) bounds memory; ``max_rows`` optionally caps the rows (contexts with their
    continuations) per forward. ``stats`` (a :class:`ScoreStats`) receives token counts.
    """
    if not hasattr(model, "forward_packed"):
        raise TypeError(
            "model must have forward_packed(tokens, positions, seq_start, span_end, logits_index)"
        )
    if max_length is None:
        max_length = _model_attr(model, ("max_seq_len", "max_length"))
        if max_length is None:
            raise ValueError("max_length is required: the model exposes no max_seq_len")
    check_budget(token_budget, max_rows)
    vocab = _model_attr(model, ("vocab_size",))
    reqs = _check_requests(requests, vocab, max_length)
    rows, dup = build_rows(reqs, use_cache, max_length)
    pool = getattr(model, "kv_pool", None)
    if pool is not None:  # a pool grown past its cap for generation: freed for the forwards
        pool.trim_for_scoring()
    had_pool = getattr(pool, "n_pages", 0) > 0
    cache, own_cache = _prefix_cache_for(model, rows, use_cache, prefix_cache)
    plain = [r for r in rows if not r.prefix]
    if use_cache:  # contexts that begin alike: one tree, their shared tokens computed once
        plain = merge_rows(plain, min(MERGE_MAX_TOKENS, max_length), max_contexts=max_rows)
    batches = [(b, False) for b in packed_batches(plain, token_budget, max_rows)]
    if cache is not None:
        shared = [r for r in rows if r.prefix]
        pb = prefix_batches(shared, token_budget, max_rows, cache.limit, cache.page_size)
        batches += [(b, True) for b in pb]
    device = _model_device(model)
    sums = torch.zeros(len(reqs), dtype=torch.float64, device=device)
    misses = torch.zeros(len(reqs), dtype=torch.int32, device=device)
    total = sum(r.stream_len for b, _ in batches for r in b)
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
                b = pack(rows_b, pin=pin, entries=entries)
                if with_prefix:
                    from nakta_model.model import PrefixPages

                    kw["prefix"] = PrefixPages(table, lengths, put(b.token_entry), cache.page_size)
                index = put(b.flat_index)
                logits = model.forward_packed(
                    put(b.tokens), put(b.positions), put(b.seq_start), put(b.span_end), index, **kw
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
            _drop_own(cache, had_pool)
    if stats is not None:
        stats.request_tokens += sum(len(c) + len(x) - 1 for c, x in reqs)
        if stats.count_unique:
            stats.unique_tokens += unique_tokens(reqs)
        prefix_computed = (cache.computed_tokens - computed_before) if cache is not None else 0
        stats.prefix_tokens += prefix_computed
        stats.computed_tokens += total + prefix_computed
        stats.prefixes += len({tuple(r.ctx[: r.prefix]) for r in rows if r.prefix})
    return _finish(sums, misses, len(reqs), dup)


def _drop_own(cache, had_pool: bool) -> None:
    """A call's own prefix cache gives its pages back to the model's KV pool; the pool's memory
    goes too when the call made it (another user's pool stays as it is)."""
    cache.clear()
    if not had_pool:
        cache.pool.release()


def _prefix_cache_for(model, rows: list[Row], use_cache: bool, prefix_cache):
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
    cache.prepare()  # the pool's cap while scoring: a pool grown for generation is trimmed
    for r, n in zip(rows, lengths):
        if n and cache.fits(n):
            r.prefix = n
    return cache, own


def warm_up(model, *, use_cache: bool = True, prefix: bool | None = None) -> float:
    """Score tiny batches so the first real batch pays no kernel compilation; returns seconds.

    Every Triton kernel the scorer launches is compiled once per process (or loaded from
    Triton's on-disk cache) and none of them specialises on the token count, so one small batch
    (a context with two branches and a plain row) compiles exactly what every later batch runs.
    ``prefix`` (default: with ``use_cache``, when the model can prefill) also runs two contexts
    that share a few-shot-length prefix through a small temporary prefix cache, which compiles
    the prefill and prefix-reading kernels that a few-shot task's first batch would. Call it
    right after loading (the lm-eval adapter does) to keep compilation out of scoring.
    """
    import time

    vocab = _model_attr(model, ("vocab_size",)) or 2
    tok = [(7 * i + 3) % vocab for i in range(12)]
    reqs = [(tok[:6], tok[6:9]), (tok[:6], tok[9:12]), (tok[3:5], tok[5:8])]
    t0 = time.perf_counter()
    score(model, reqs, use_cache=use_cache, max_rows=None)  # ends with a host sync
    if prefix is None:
        prefix = use_cache and hasattr(model, "forward_prefill")
    if prefix:
        from nakta_model.prefix_cache import MIN_PREFIX_TOKENS, PrefixCache

        shared = [(5 * i + 1) % vocab for i in range(MIN_PREFIX_TOKENS + 2)]
        few_shot = [(shared + [tok[0]], tok[1:3]), (shared + [tok[4]], tok[5:7])]
        had_pool = getattr(getattr(model, "kv_pool", None), "n_pages", 0) > 0
        cache = PrefixCache(model, budget_tokens=2 * len(shared))
        try:
            score(model, few_shot, use_cache=True, max_rows=None, prefix_cache=cache)
        finally:
            _drop_own(cache, had_pool)
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
    check_budget(token_budget, batch_size)
    reqs = _check_requests(requests, vocab_size, max_length)
    rows, _ = build_rows(reqs, False, max_length)
    batches = padded_batches(rows, token_budget, batch_size)
    device = torch.device(device or "cpu")
    sums = misses = None
    total = sum(len(r) for r in rows)
    with torch.inference_mode(), _progress(total, progress, "scoring") as bar:
        for rows_b in batches:
            b = pad_rows(rows_b, pin=device.type == "cuda")
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
