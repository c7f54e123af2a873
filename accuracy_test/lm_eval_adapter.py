"""lm-eval model adapters ``nakta`` and ``llama_org`` (registered on import).

    python -m accuracy_test.lm_eval_cli --model nakta \\
        --model_args checkpoint=../shared/data/stories260K,tokenizer=../shared/data/stories260K/tokenizer.model,dtype=fp32 \\
        --include_path accuracy_test/tasks --tasks hellaswag_local --device cpu

Both subclass lm-eval's ``TemplateLM``, and the string -> token requests follow its rules
(``_encode_pair``: trailing context space moved to the continuation, continuation tokens =
``encode(ctx + cont)[len(encode(ctx)):]``; BOS prepended as LLaMA's tokenizer does; empty
contexts conditioned on BOS), with each distinct string encoded once, in batched calls
(``lm_eval_requests``: the same pairs, tested against lm-eval's method). Token requests go to
Nakta's scoring engine: ``nakta`` through the shared-context cache (``scoring.score``),
``llama_org`` through the plain scorer over Meta's forward (``scoring.score_with_forward``), so
an lm-eval run reproduces ``parity.py`` exactly.

Model args (anything else is refused, naming the known ones): ``checkpoint`` (Nakta dir, or
Meta dir: read in memory by ``nakta_model.load``, no converted copy; llama_org needs a Meta dir),
``tokenizer`` (sentencepiece file; its size must equal the checkpoint's vocab_size), ``dtype``
(fp32|bf16|fp16 in any case; default bf16 on CUDA, fp32 on CPU), ``token_budget`` (padded
tokens per forward: what bounds memory), ``max_length`` (default and upper limit: the
checkpoint's max_seq_len), ``use_cache`` (nakta: shared-context packing, default true),
``prefix_cache`` (nakta: a prefix shared by different contexts -- a few-shot prompt -- computed
once and kept for the whole run, default true) and ``prefix_budget`` (its K/V pool in tokens,
default 8192 or a quarter of free GPU memory), ``max_gen_toks`` (default 256),
``kernels``/``tp``/``dp`` (nakta), ``background_load`` (nakta, default false; see Loading).

Loading (``nakta``). The constructor reads the checkpoint's params and checks the tokenizer and
``max_length`` against them at once, then loads the weights and compiles the scorer's kernels
(``scoring.warm_up``), so the first batch pays no compilation. Through ``lm_eval_cli`` the
weights of a single-GPU Nakta checkpoint are already on their way: their read started when
lm-eval's command line was parsed (``lm_eval_preload``) and overlapped lm-eval's start-up, and
the load takes them. ``background_load=true`` does the load on a worker thread instead, the
first request waiting for what is left (and raising a failed load's error); it is off by
default because under the GIL that thread only takes turns with lm-eval's own Python work: on
the H200 host it made no run faster (``speed_bench/results/nvidia-h200/lm_eval_load_matrix``).
Any ``torchrun`` grid loads in the constructor (its loads go through collectives).
``load_timings`` holds ``read_s``, ``warm_up_s``, ``prefetched`` (whether the load took a
prefetched shard), ``wait_s`` (background only: what the first request still waited) and the
wall-clock moments ``build_start_unix``, ``read_end_unix``, ``ready_unix`` (the timing hook of
``lm_eval_cli`` turns them into events).

Batch size. Nakta packs rows (a row = one context with its continuations) until
``token_budget`` padded tokens, so memory is bounded by the token budget, never by a row count:

- no ``--batch_size`` (the CLI then passes 1, ``simple_evaluate`` None), ``1``, ``auto`` and
  ``auto:N``: the token budget alone. 1 counts as "not given" because lm-eval cannot tell the
  two apart, and one row per forward is never what a packing engine should do (it made a
  3000-task HellaSwag run 5x slower);
- ``N > 1``: at most N rows per forward (as well as the budget); ``--max_batch_size N > 1``
  caps the same way (the smaller cap wins).

``llama_org`` keeps Meta's rule: its KV cache is allocated for ``rows x max_length`` up front,
so it always needs a row count: ``N > 1`` rows, else 32 (no flag, 1, ``auto``). Generation
batches ``N`` prompts; nakta's engine decodes up to 64 at once when uncapped (as many as its
KV cache fits in 80% of the free GPU memory, rows as long as the requests need).

Device: lm-eval's CLI passes ``--device cuda:0`` when none was given; on a machine without that
GPU the adapters fall back to the automatic choice with a warning line, as lm-eval's ``hf`` does.

Multi-GPU (``nakta``): ``tp`` and ``dp`` model args under ``torchrun --nproc_per_node tp*dp``
(``python -m torch.distributed.run ... -m accuracy_test.lm_eval_cli ...``). Every rank sees all of
lm-eval's requests (the adapter reports rank 0 of 1, lm-eval's TP convention: only
``LOCAL_RANK`` 0 writes results); the adapter splits the model over ``tp`` GPUs and shards the
requests over the ``dp`` replicas itself (a context's continuations stay together), gathering
the answers back in order; a ``cuda:N`` device means "this rank's GPU" there. ``llama_org``
runs Meta's model parallel: one process per shard.

``loglikelihood_rolling`` follows lm-eval's rolling windows (``get_rolling_token_windows``,
prefix BOS) over the text encoded *without* BOS: the sum is log P(text | BOS). lm-eval's ``hf``
with its default ``add_bos_token`` encodes the text *with* the LLaMA tokenizer's BOS and still
uses BOS as the prefix, so its sum also holds log P(BOS | BOS) and conditions the text on
``BOS BOS``; ``hf`` with ``add_bos_token=False`` gives Nakta's number (``loglikelihood``
requests, which is what multiple-choice tasks use, agree with ``hf``'s default).

``generate_until`` decodes greedily (or samples when ``do_sample`` and ``temperature > 0``,
with ``top_p``) with the model's KV cache and cuts at the stop strings. Other generation
settings (``num_beams``, ``top_k``, ``repetition_penalty``, ``max_new_tokens``, ...) are not
implemented and are refused, unless they hold their no-op value (``num_beams=1``,
``top_k=0``, ``repetition_penalty=1.0``).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import lm_eval.models  # noqa: F401  (lm-eval's built-ins first: see lm_eval_cli)
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from accuracy_test import models
from accuracy_test.lm_eval_requests import tokenize_requests
from nakta_model import scoring
from nakta_model.sources import is_meta_checkpoint

__all__ = ["LlamaOrgLM", "NaktaLM"]

LLAMA_ORG_ROWS = 32  # llama_org's rows (and KV-cache batch) when no row count was given
IMPLEMENTED_GEN_KWARGS = ("until", "max_gen_toks", "temperature", "do_sample", "top_p", "top_k")
# settings the engine does not implement, accepted only at the value that changes nothing
NOOP_GEN_KWARGS = {
    "num_beams": (1,),
    "num_return_sequences": (1,),
    "repetition_penalty": (1, 1.0),
}


class ModelArgsError(ValueError):
    """model_args or generation settings that cannot work: ``lm_eval_cli`` prints one
    ``error:`` line and exits 2 instead of lm-eval's traceback."""


def _as_bool(v: object, name: str = "value") -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ModelArgsError(f"{name} must be a boolean (true/false), got {v!r}")


def _rows_cap(value: object, name: str) -> int | None:
    """One lm-eval batch-size value (int, "N", "auto", "auto:N", None) -> a rows cap or None.

    None, 1 and auto mean "no cap": lm-eval's CLI passes 1 when the user gave nothing.
    """
    if value is None:
        return None
    s = str(value).strip().lower()
    if s == "auto" or s.startswith("auto:"):
        return None
    try:
        n = int(s)
    except ValueError as e:
        raise ModelArgsError(f"{name} must be an int, 'auto' or 'auto:N', got {value!r}") from e
    if n < 1:
        raise ModelArgsError(f"{name} must be >= 1, got {n}")
    return None if n == 1 else n


def _rows(batch_size: object, max_batch_size: object = None) -> int | None:
    """Max rows per forward from ``--batch_size`` / ``--max_batch_size`` (the smaller cap)."""
    caps = [
        c
        for c in (
            _rows_cap(batch_size, "batch_size"),
            _rows_cap(max_batch_size, "max_batch_size"),
        )
        if c is not None
    ]
    return min(caps, default=None)


def _positive_int(name: str, value: object) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ModelArgsError(f"{name} must be an int, got {value!r}") from None
    if n < 1:
        raise ModelArgsError(f"{name} must be >= 1, got {n}")
    return n


def _float(name: str, value: object) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ModelArgsError(f"{name} must be a number, got {value!r}") from None


def _refuse_unknown_args(model: str, cls: type, extra: dict) -> None:
    """A typo (``dtyp=bf16``) must not run silently with the defaults."""
    if not extra:
        return
    known = [
        n
        for n, p in inspect.signature(cls.__init__).parameters.items()
        if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]
    raise ModelArgsError(
        f"{model}: unknown model_args {', '.join(sorted(extra))}; known: {', '.join(known)}"
    )


def _max_length(requested: object, limit: int, checkpoint: object) -> int:
    """``max_length`` model arg: default ``limit``; above the checkpoint's max_seq_len refused."""
    if requested in (None, ""):
        return limit
    n = _positive_int("max_length", requested)
    if n < 2:
        raise ModelArgsError(f"max_length must be >= 2, got {n}")
    if n > limit:
        raise ModelArgsError(
            f"max_length={n} exceeds max_seq_len={limit} of checkpoint {checkpoint} "
            "(the model was not built for longer sequences)"
        )
    return n


@dataclass(frozen=True)
class GenSettings:
    """One ``generate_until`` group's settings, as the engine implements them."""

    until: tuple[str, ...]
    max_gen: int
    temperature: float
    top_p: float
    top_k: int = 0


def generation_settings(kwargs: dict, default_max_gen: int, eos_text: str) -> GenSettings:
    """lm-eval generation kwargs -> what the engine does; unimplemented settings refused."""
    kwargs = dict(kwargs)
    until = kwargs.pop("until", None) or []
    until = [until] if isinstance(until, str) else list(until)
    if eos_text and eos_text not in until:
        until.append(eos_text)
    max_gen = _positive_int("max_gen_toks", kwargs.pop("max_gen_toks", default_max_gen))
    temperature = _float("temperature", kwargs.pop("temperature", 0.0) or 0.0)
    if not _as_bool(kwargs.pop("do_sample", False), "do_sample") and temperature > 0:
        temperature = 0.0  # lm-eval: do_sample=False means greedy
    top_p = _float("top_p", kwargs.pop("top_p", 1.0))
    top_k = kwargs.pop("top_k", None) or 0
    top_k = _positive_int("top_k", top_k) if top_k else 0
    unsupported = sorted(
        k for k, v in kwargs.items() if k not in NOOP_GEN_KWARGS or v not in NOOP_GEN_KWARGS[k]
    )
    if unsupported:
        raise ModelArgsError(
            "generation settings not implemented by this engine: "
            + ", ".join(f"{k}={kwargs[k]!r}" for k in unsupported)
            + f" (implemented: {', '.join(IMPLEMENTED_GEN_KWARGS)}; accepted as no-ops: "
            + ", ".join(f"{k}={v[-1]}" for k, v in NOOP_GEN_KWARGS.items())
            + ")"
        )
    return GenSettings(tuple(until), max_gen, temperature, top_p, top_k if temperature > 0 else 0)


class _ScoringLM(TemplateLM):
    """Shared tokenization, rolling windows and generation; subclasses supply the model calls."""

    def __init__(
        self,
        tokenizer: str,
        device: str | None = None,
        dtype: str | None = None,
        token_budget: int | str = scoring.DEFAULT_TOKEN_BUDGET,
        max_gen_toks: int | str = 256,
    ):
        super().__init__()
        import nakta_model

        self._device = models.resolve_device(device, fallback=True)
        try:
            self.dtype = models.parse_dtype(
                dtype or ("bf16" if self.device.type == "cuda" else "fp32")
            )
            self.tok = nakta_model.Tokenizer(tokenizer)
            self.token_budget = _positive_int("token_budget", token_budget)
            self.max_gen_toks = _positive_int("max_gen_toks", max_gen_toks)
        except (ValueError, FileNotFoundError) as e:
            raise ModelArgsError(str(e)) from e

    # ---------------------------------------------------------------- tokenizer
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_id  # LLaMA conditions an empty context on BOS

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kw) -> list[int]:
        return self.tok.encode(string, bos=add_special_tokens is not False, eos=False)

    def tok_decode(self, tokens: Sequence[int], **kw) -> str:
        return self.tok.decode(list(tokens))

    def _encode_many(self, strings: list[str], bos: bool) -> list[list[int]]:
        """``tok_encode`` of many strings (BOS when ``bos``) in one multi-threaded call."""
        return self.tok.encode_many(strings, bos=bos, eos=False)

    # ---------------------------------------------------------------- scoring
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``TemplateLM.loglikelihood``'s token pairs, but each distinct string encoded once in
        batched calls: lm-eval encodes two strings per request one at a time (3 s of a 15 s
        MMLU-shaped 5-shot run on an H200, where 4 choices share each context)."""
        import time

        t0 = time.perf_counter()
        args = [tuple(req.args) for req in requests]
        pairs = tokenize_requests(
            args, self._encode_many, self.prefix_token_id, progress=not disable_tqdm
        )
        new_reqs = [(a, ctx, cont) for a, (ctx, cont) in zip(args, pairs)]
        t1 = time.perf_counter()
        out = self._loglikelihood_tokens(new_reqs, disable_tqdm=disable_tqdm)
        timings = self.__dict__.setdefault("request_timings", {"tokenize_s": 0.0, "score_s": 0.0})
        timings["tokenize_s"] += t1 - t0  # lm-eval's strings -> token pairs
        timings["score_s"] += time.perf_counter() - t1  # token pairs -> results (host synced)
        return out

    def _score(self, reqs: list[tuple[list[int], list[int]]], progress: bool) -> list:
        raise NotImplementedError

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw):
        reqs = [(list(ctx), list(cont)) for _, ctx, cont in requests]
        return self._score(reqs, progress=not disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        flat: list[tuple[list[int], list[int]]] = []
        owner: list[int] = []
        for i, (string,) in enumerate(req.args for req in requests):
            windows = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string, add_special_tokens=False),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for ctx, cont in map(lm_utils.make_disjoint_window, windows):
                flat.append((ctx, cont))
                owner.append(i)
        sums = [0.0] * len(requests)
        for i, (ll, _) in zip(owner, self._score(flat, progress=not disable_tqdm)):
            sums[i] += ll
        for req, s in zip(requests, sums):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, s)
        return sums

    # ---------------------------------------------------------------- generation
    def _generate(self, prompts: list[list[int]], max_gen: int, temperature: float, top_p: float):
        raise NotImplementedError

    def _gen_rows(self) -> int:
        raise NotImplementedError

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        eos_text = self.tok_decode([self.eot_token_id])
        settings = {
            key: generation_settings(requests[idx[0]].args[1], self.max_gen_toks, eos_text)
            for key, idx in groups.items()
        }  # every group checked before any generation runs
        for gen in settings.values():
            if gen.max_gen >= self.max_length:
                raise ModelArgsError(f"max_gen_toks={gen.max_gen} >= max_length={self.max_length}")
            if gen.top_k:
                raise ModelArgsError(
                    f"top_k={gen.top_k}: Meta's sampler (llama_org) has top_p only; use nakta"
                )
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="generate_until")
        for key, idx in groups.items():
            gen = settings[key]
            keep = self.max_length - gen.max_gen  # lm-eval left-truncates the context to this
            # longest prompts first: similar lengths share a batch
            idx = sorted(idx, key=lambda i: -len(requests[i].args[0]))
            rows = self._gen_rows()
            for start in range(0, len(idx), rows):
                chunk = idx[start : start + rows]
                prompts = [self.tok_encode(requests[i].args[0])[-keep:] for i in chunk]
                gens = self._generate(prompts, gen.max_gen, gen.temperature, gen.top_p)
                for i, toks in zip(chunk, gens):
                    text = self.tok_decode(toks)
                    for stop in gen.until:
                        if stop:
                            text = text.split(stop)[0]
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(chunk))
        bar.close()
        return out  # type: ignore[return-value]


def _parallel_device(device: str | None) -> str | None:
    """Under torchrun every rank takes its own GPU: ``cuda:N`` (lm-eval's default ``cuda:0``)
    would put all ranks on one; ``cuda`` lets ``init_parallel`` pick ``LOCAL_RANK``'s."""
    if device is None or not str(device).startswith("cuda"):
        return device
    if models.resolve_device(device, fallback=True).type != "cuda":
        return "cpu"  # no GPU here: the warning is out, the ranks share the CPU
    return "cuda"


@register_model("nakta")
class NaktaLM(_ScoringLM):
    """Nakta: shared-context scoring engine, fused Triton kernels on CUDA."""

    def __init__(
        self,
        checkpoint: str,
        tokenizer: str,
        batch_size: int | str | None = None,
        max_batch_size: int | str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        token_budget: int | str = scoring.DEFAULT_TOKEN_BUDGET,
        max_length: int | str | None = None,
        use_cache: bool | str = True,
        prefix_cache: bool | str = True,
        prefix_budget: int | str | None = None,
        max_gen_toks: int | str = 256,
        kernels: str | None = None,
        tp: int | str = 1,
        dp: int | str = 1,
        background_load: bool | str = False,
        **unknown,
    ):
        from nakta_model.loading import checkpoint_args
        from nakta_model.parallel import ParallelContext, init_parallel

        _refuse_unknown_args("nakta", NaktaLM, unknown)
        if not Path(checkpoint).is_dir():
            raise ModelArgsError(f"nakta checkpoint {checkpoint} is not a directory")
        self.rows = _rows(batch_size, max_batch_size)
        self.use_cache = _as_bool(use_cache, "use_cache")
        self.use_prefix_cache = self.use_cache and _as_bool(prefix_cache, "prefix_cache")
        self.prefix_budget = (
            None if prefix_budget in (None, "") else _positive_int("prefix_budget", prefix_budget)
        )
        background = _as_bool(background_load, "background_load")
        self._prefixes = self._gen = self._model = self._pending = self._failed = None
        self.load_timings: dict[str, float] = {}
        self.score_stats = scoring.ScoreStats()
        self.parallel = ParallelContext()
        if int(tp) * int(dp) > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
            self.parallel = init_parallel(int(tp), int(dp), device=_parallel_device(device))
            device = str(self.parallel.device)
        super().__init__(tokenizer, device, dtype, token_budget, max_gen_toks)
        args = checkpoint_args(checkpoint)  # params only: a bad tokenizer fails before the load
        _check_vocab(self.tok, tokenizer, args.vocab_size, checkpoint)
        self._max_length = _max_length(max_length, args.max_seq_len, checkpoint)
        build = functools.partial(self._build, checkpoint, kernels)
        if background and self.parallel.world_size == 1:
            self._pending = _start_in_background(build, self.device)
        else:
            self._model = build()

    def _build(self, checkpoint: str, kernels: str | None):
        """Read the weights (or take the ones ``lm_eval_preload`` prefetched), then compile the
        scorer's kernels: part of loading, not of the first batch. The ``*_unix`` timings are
        wall-clock moments (the CLI's timing hook turns them into events)."""
        from nakta_model import prefetch
        from nakta_model.loading import load

        t = self.load_timings
        t["build_start_unix"] = time.time()
        t0, taken = time.perf_counter(), prefetch.handed_out
        model = load(checkpoint, self.device, self.dtype, self.parallel, kernels=kernels)
        t["read_s"] = time.perf_counter() - t0
        t["prefetched"] = prefetch.handed_out > taken
        t["read_end_unix"] = time.time()
        t["warm_up_s"] = scoring.warm_up(model, use_cache=self.use_cache)
        t["ready_unix"] = time.time()
        return model

    @property
    def model(self):
        """The loaded model; the first use waits for a background load (and raises its error)."""
        if self._pending is not None:
            t0 = time.perf_counter()
            try:
                self._model = self._pending.result()
            finally:
                self.load_timings["wait_s"] = time.perf_counter() - t0
                self._failed = self._pending.exception()
                self._pending = None
        if self._model is None and self._failed is not None:
            raise self._failed
        return self._model

    def close(self) -> None:
        """Drop the model (its memory goes once nobody else holds it)."""
        if self._pending is not None:
            self._pending.exception()  # a load still running finishes first: threads can't stop
        self._model = self._prefixes = self._gen = self._pending = None

    def _prefix_cache(self):
        """One prefix cache for the whole run (a few-shot prefix computed once across tasks'
        calls), or False when the model args turned it off."""
        if not self.use_prefix_cache:
            return False
        if self._prefixes is None:
            from nakta_model.prefix_cache import PrefixCache

            budget = self.prefix_budget or scoring.default_prefix_budget(self.model)
            self._prefixes = PrefixCache(self.model, budget)
        return self._prefixes

    @property
    def max_length(self) -> int:
        return self._max_length

    def _score(self, reqs, progress):
        from nakta_model.data_parallel import map_requests

        def local(part):
            return scoring.score(
                self.model,
                part,
                use_cache=self.use_cache,
                token_budget=self.token_budget,
                max_length=self.max_length,
                max_rows=self.rows,
                progress=progress and self.parallel.is_leader,
                prefix_cache=self._prefix_cache(),
                stats=self.score_stats,
            )

        return map_requests(local, reqs, self.parallel)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests sharded over the ``dp`` replicas (longer prompts weigh more), in order."""
        from nakta_model.data_parallel import data_parallel_map

        return data_parallel_map(
            lambda part: self._generate_until_local(
                part, disable_tqdm or not self.parallel.is_leader
            ),
            list(requests),
            self.parallel,
            costs=[len(r.args[0]) + 1 for r in requests],
        )

    def _generate_until_local(self, requests, disable_tqdm: bool) -> list[str]:
        """Every request through one continuous-batching ``Generator``: per-request settings,
        decoding stops at EOS or as soon as an ``until`` string appears (lm-eval's cut)."""
        from nakta_model.generation import GenerationRequest, SamplingParams, StopStrings

        eos_text = self.tok_decode([self.eot_token_id])
        reqs = []
        for req in requests:  # every request checked before any generation runs
            gen = generation_settings(req.args[1], self.max_gen_toks, eos_text)
            if gen.max_gen >= self.max_length:
                raise ModelArgsError(f"max_gen_toks={gen.max_gen} >= max_length={self.max_length}")
            keep = self.max_length - gen.max_gen  # lm-eval left-truncates the context to this
            reqs.append(
                GenerationRequest(
                    self.tok_encode(req.args[0])[-keep:],
                    gen.max_gen,
                    SamplingParams(gen.temperature, gen.top_k, gen.top_p),
                    stop_token_ids=(self.eot_token_id,),
                    stop=StopStrings(gen.until, self.tok_decode),
                )
            )
        if not reqs:
            return []
        results = self._generator(reqs).generate(reqs, progress=not disable_tqdm)
        out = []
        for req, res in zip(requests, results):
            out.append(res.text)
            self.cache_hook.add_partial("generate_until", req.args, res.text)
        return out

    def _generator(self, reqs):
        """The generation engine (it owns the model's KV cache), built on first use and again
        when requests need longer rows: rows as long as the longest prompt + budget asks
        (rounded up to 256, at most ``max_length``), and as many as fit in memory (at most 64,
        or the ``--batch_size`` cap)."""
        from nakta_model.generation import Generator, fitting_batch

        need = max(len(r.prompt) + r.max_new_tokens for r in reqs)
        gen = getattr(self, "_gen", None)
        if gen is None or gen.max_seq_len < need:
            row_len = min(self.max_length, -(-need // 256) * 256)
            self._gen = None
            self.model.clear_cache()  # the old rows go before the new ones are sized
            cap = min(self.rows or 64, 64)
            rows = fitting_batch(self.model, row_len, cap=cap)
            self._gen = Generator(self.model, max_batch=rows, max_seq_len=row_len)
        return self._gen


def _start_in_background(fn, device):
    """``fn()`` on a worker thread, as a ``Future``. The thread takes the caller's CUDA device
    (the current device is per thread; ``cuda`` with no index means the caller's current one)
    and is joined at exit, never killed mid-copy."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    index = None
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()

    def run():
        if index is not None:
            torch.cuda.set_device(index)
        return fn()

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nakta-load")
    future = pool.submit(run)
    pool.shutdown(wait=False)  # the thread ends with its one job
    return future


def _check_vocab(tok, tokenizer: object, vocab_size: int, checkpoint: object) -> None:
    """A tokenizer of another model scores ids the checkpoint never learned (or has none of)."""
    if tok.n_words != vocab_size:
        raise ModelArgsError(
            f"tokenizer {tokenizer} has {tok.n_words} pieces but checkpoint {checkpoint} has "
            f"vocab_size {vocab_size}: use the tokenizer the checkpoint was trained with"
        )


def _meta_dir(checkpoint: str) -> Path:
    """llama_org's checkpoint: an existing Meta dir (params.json + consolidated.*.pth)."""
    path = Path(checkpoint)
    if not path.exists():
        raise ModelArgsError(f"llama_org checkpoint {checkpoint} does not exist")
    if not is_meta_checkpoint(path):
        raise ModelArgsError(
            f"llama_org checkpoint {checkpoint} must be a Meta dir "
            "(params.json + consolidated.*.pth), e.g. the one convert.py reads"
        )
    return path


@register_model("llama_org")
class LlamaOrgLM(_ScoringLM):
    """Meta's reference LLaMA (``llama_org``), plain scoring over its all-position forward."""

    def __init__(
        self,
        checkpoint: str,
        tokenizer: str,
        batch_size: int | str | None = None,
        max_batch_size: int | str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        token_budget: int | str = scoring.DEFAULT_TOKEN_BUDGET,
        max_length: int | str | None = None,
        max_gen_toks: int | str = 256,
        **unknown,
    ):
        _refuse_unknown_args("llama_org", LlamaOrgLM, unknown)
        meta = _meta_dir(checkpoint)
        self.rows = _rows(batch_size, max_batch_size) or LLAMA_ORG_ROWS
        params = json.loads((meta / "params.json").read_text())
        # Meta's params.json usually has no max_seq_len (Llama.build takes one): then 2048
        limit = int(params.get("max_seq_len", 2048))
        self._max_length = _max_length(max_length, limit, checkpoint)
        super().__init__(tokenizer, device, dtype, token_budget, max_gen_toks)
        self.llama = models.load_llama_org(
            checkpoint, tokenizer, self.device, self.dtype, self._max_length, self.rows
        )

    @property
    def max_length(self) -> int:
        return self._max_length

    def _score(self, reqs, progress):
        return scoring.score_with_forward(
            lambda t: self.llama.model(t, 0),
            reqs,
            max_length=self.max_length,
            batch_size=self.rows,
            token_budget=self.token_budget,
            vocab_size=self.llama.model.vocab_size,
            device=self.device,
            progress=progress,
        )

    def _gen_rows(self) -> int:
        return self.rows

    def _generate(self, prompts, max_gen, temperature, top_p):
        toks, _ = self.llama.generate(
            prompts, max_gen, temperature=temperature, top_p=top_p, eos_id=self.tok.eos_id
        )
        return toks
