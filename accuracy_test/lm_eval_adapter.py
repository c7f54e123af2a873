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
``tokenizer`` (sentencepiece file; its size must equal the checkpoint's vocab_size; default:
the checkpoint folder's own ``tokenizer.model``, which ``convert.py`` writes), ``dtype``
(fp32|bf16|fp16 in any case; default bf16 on CUDA, fp32 on CPU), ``token_budget`` (padded
tokens per forward: what bounds memory), ``max_length`` (default and upper limit: the
checkpoint's max_seq_len), ``use_cache`` (nakta: shared-context packing, default true),
``prefix_cache`` (nakta: a prefix shared by different contexts -- a few-shot prompt -- computed
once and kept for the whole run, default true) and ``prefix_budget`` (its K/V pool in tokens,
default 8192 or a quarter of free GPU memory), ``max_gen_toks`` (default 256),
``kernels``/``tp``/``dp`` (nakta), ``background_load`` (nakta, default false; see Loading).

Loading (``nakta``). The constructor reads the checkpoint's params and checks the tokenizer and
``max_length`` against them at once, then loads the weights. The scorer's kernels are compiled
(``scoring.warm_up``) by the first scoring call, before its first batch, not at load (through
``lm_eval_cli``: on a thread from the moment lm-eval starts building a scoring task's requests,
``start_warm_up``; the first request waits for what is left): a run that only generates (GSM8K)
never compiles them (on an empty Triton cache they took 5.8 s on an
H200, ``model_profile/results/nvidia-h200/compile``, and 11.9 s of one first GSM8K run's load).
Through ``lm_eval_cli`` the
weights of a single-GPU Nakta checkpoint are already on their way: their read started when
lm-eval's command line was parsed (``lm_eval_preload``) and overlapped lm-eval's start-up, and
the load takes them. ``background_load=true`` does the load on a worker thread instead, the
first request waiting for what is left (and raising a failed load's error); it is off by
default because under the GIL that thread only takes turns with lm-eval's own Python work: on
the H200 host it made no run faster (``speed_bench/results/nvidia-h200/lm_eval_load_matrix``).
Any ``torchrun`` grid loads in the constructor (its loads go through collectives).
``load_timings`` holds ``read_s``, ``prefetched`` (whether the load took a prefetched shard),
``warm_up_s`` (once a scoring call has compiled the scorer), ``wait_s`` (background only: what
the first request still waited), ``init_parallel_s`` (under a grid: the process group's
rendezvous, which waits for the slowest rank) and the wall-clock moments ``build_start_unix``,
``read_end_unix``, ``ready_unix``, ``warm_up_start_unix``, ``warm_up_end_unix`` (the timing hook
of ``lm_eval_cli`` turns them into events).

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
(``python -m torch.distributed.run ... -m accuracy_test.lm_eval_cli ...``), or the entry alone
with ``dp``/``tp`` (it starts its ranks itself). The adapter splits the model over ``tp`` GPUs
and reports each replica's ``dp`` rank and size to lm-eval, whose own data parallelism then
builds, tokenizes and scores on each replica only its documents (``rank::dp``; a document's
requests stay together), pads the replicas' request counts even, and gathers the per-document
metrics to replica 0 (``all_gather``, ``gather_object``, ``barrier`` over the replica's dp
group). Only the process that is replica 0 and ``LOCAL_RANK`` 0 writes results; a ``cuda:N``
device means "this rank's GPU" there. Each rank's read of its shard starts while lm-eval starts
up (``lm_eval_preload``), and torch's CPU threads are split among a host's ranks. A checkpoint
that cannot be loaded (missing, truncated, corrupted) is a ``ModelArgsError``: one ``error:``
line from rank 0, exit status 2. ``llama_org`` runs Meta's model parallel: one process per shard.

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

import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Iterator

import lm_eval.models  # noqa: F401  (lm-eval's built-ins first: see lm_eval_cli)
from lm_eval.api.registry import register_model

from accuracy_test import models
from accuracy_test.lm_eval_args import (
    ModelArgsError,
    _as_bool,
    _check_vocab,
    _max_length,
    _meta_dir,
    _parallel_device,
    _positive_int,
    _refuse_unknown_args,
    _rows,
    default_tokenizer,
    generation_settings,
    require_checkpoint_arg,
)
from accuracy_test.lm_eval_base import ScoringLM
from nakta_model import scoring

__all__ = ["LlamaOrgLM", "ModelArgsError", "NaktaLM"]

LLAMA_ORG_ROWS = 32  # llama_org's rows (and KV-cache batch) when no row count was given
# generate_until's rows in flight when no row count was given: 256 is what GSM8K-full was
# measured at (docs/lm-eval.md); the engine takes up to max_rows() when asked
GENERATE_ROWS = 256


@register_model("nakta")
class NaktaLM(ScoringLM):
    """Nakta: shared-context scoring engine, fused Triton kernels on CUDA."""

    def __init__(
        self,
        checkpoint: str | None = None,
        tokenizer: str | None = None,
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
        quant: str | None = None,
        kv_cache: str | None = None,
        **unknown,
    ):
        from nakta_model.fp8 import Precision, check_kv_cache
        from nakta_model.loading import CheckpointDir
        from nakta_model.model import KERNEL_MODES
        from nakta_model.parallel import ParallelConfigError, ParallelContext, init_parallel

        _refuse_unknown_args("nakta", NaktaLM, unknown)
        checkpoint = require_checkpoint_arg("nakta", checkpoint)
        _require_format(checkpoint)
        tokenizer = default_tokenizer(tokenizer, checkpoint, "nakta")
        if kernels not in (None, "") and kernels not in KERNEL_MODES:
            raise ModelArgsError(
                f"kernels must be one of {', '.join(KERNEL_MODES)}, got {kernels!r}"
            )
        self.rows = _rows(batch_size, max_batch_size)
        self.use_cache = _as_bool(use_cache, "use_cache")
        self.use_prefix_cache = self.use_cache and _as_bool(prefix_cache, "prefix_cache")
        self.prefix_budget = (
            None if prefix_budget in (None, "") else _positive_int("prefix_budget", prefix_budget)
        )
        background = _as_bool(background_load, "background_load")
        try:  # kv_cache=fp8: e4m3 KV pages (nakta_model/fp8.py); opt-in; checked first, so
            check_kv_cache(kv_cache)  # that a bad value is named as that argument
        except (TypeError, ValueError) as e:
            raise ModelArgsError(f"nakta kv_cache: {e}") from None
        try:  # quant=fp8: e4m3 block matrices (nakta_model/fp8.py); opt-in; parsed once here
            self.precision = Precision.parse(quant, kv_cache)
        except (TypeError, ValueError) as e:
            raise ModelArgsError(f"nakta quant: {e}") from None
        self._prefixes = self._gen = self._model = self._pending = self._failed = None
        self._warming = None  # the scorer's warm-up on a worker thread (start_warm_up)
        self.load_timings: dict[str, float] = {}
        self.score_stats = scoring.ScoreStats()
        self.generation_stats: dict[str, float] = {}  # the engine's counters, summed over calls
        self.parallel = ParallelContext()
        tp, dp = _positive_int("tp", tp), _positive_int("dp", dp)
        if tp * dp > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
            t0 = time.perf_counter()
            try:  # a grid this launch cannot run (ParallelConfigError) is the user's input
                self.parallel = init_parallel(tp, dp, device=_parallel_device(device))
            except ParallelConfigError as e:
                raise ModelArgsError(f"nakta tp={tp}, dp={dp}: {e}") from None
            # the process group's rendezvous: waits for the slowest rank to get here
            self.load_timings["init_parallel_s"] = time.perf_counter() - t0
            device = str(self.parallel.device)
            _share_host_threads()
        super().__init__(tokenizer, device, dtype, token_budget, max_gen_toks)
        try:  # the device's verdict on the precision, before any weight is read
            self.precision.check_device(self.device)
        except ValueError as e:
            arg = "kv_cache" if "kv_cache" in str(e) else "quant"
            raise ModelArgsError(f"nakta {arg}={getattr(self.precision, arg)}: {e}") from None
        with _load_errors(checkpoint):  # settings only (read once): a bad tokenizer fails first
            opened = CheckpointDir.open(checkpoint)
        args = opened.args
        _check_vocab(self.tok, tokenizer, args.vocab_size, checkpoint)
        self._max_length = _max_length(max_length, args.max_seq_len, checkpoint)
        build = functools.partial(self._build, opened, kernels)
        if background and self.parallel.world_size == 1:
            self._pending = _start_in_background(build, self.device)
        else:
            self._model = build()

    def _build(self, checkpoint, kernels: str | None):
        """Read the weights of the opened ``checkpoint`` (a ``CheckpointDir``: its settings are
        not read again), or take the ones ``lm_eval_preload`` prefetched. The ``*_unix``
        timings are wall-clock moments (the CLI's timing hook turns them into events)."""
        from nakta_model import prefetch
        from nakta_model.loading import load

        t = self.load_timings
        t["build_start_unix"] = time.time()
        t0, taken = time.perf_counter(), prefetch.handed_out
        with _load_errors(checkpoint):
            model = load(
                checkpoint, self.device, self.dtype, self.parallel, kernels=kernels,
                quant=self.precision,
            )  # fmt: skip
        t["read_s"] = time.perf_counter() - t0
        t["prefetched"] = prefetch.handed_out > taken
        t["read_end_unix"] = time.time()
        t["ready_unix"] = time.time()
        return model

    def _scorer_ready(self) -> None:
        """Compile the scorer's kernels once, before the first scoring batch (``warm_up``):
        here rather than at load, so that a run which only generates never compiles them. A
        warm-up :meth:`start_warm_up` started is waited for (its error raised) instead."""
        self._await_warm_up()
        if "warm_up_s" not in self.load_timings:
            self._warm_up(self.model)  # a background load finishes first: not the warm-up

    def _warm_up(self, model) -> None:
        t = self.load_timings
        t["warm_up_start_unix"] = time.time()
        t["warm_up_s"] = scoring.warm_up(model, use_cache=self.use_cache)
        t["warm_up_end_unix"] = time.time()

    def start_warm_up(self) -> None:
        """Start the scorer's warm-up on a worker thread; the first use of the model for a
        request (scoring or generation) waits for it.

        ``lm_eval_cli`` calls this when lm-eval's ``evaluate`` starts on a task that scores:
        lm-eval then builds every request on the main thread (Python, the same on every rank of
        a grid) before the first one reaches the model, and the warm-up's GPU work, Triton's
        cache loads and cuBLAS's start-up go on beside it instead of after it."""
        if "warm_up_s" in self.load_timings or self._warming is not None:
            return
        self._warming = _start_in_background(
            functools.partial(self._warm_up, self.model), self.device
        )

    def _await_warm_up(self) -> None:
        """The warm-up :meth:`start_warm_up` started, finished (its error raised here); the
        seconds the caller still waited are ``warm_up_wait_s``."""
        if self._warming is None:
            return
        warming, self._warming = self._warming, None
        t0 = time.perf_counter()
        try:
            warming.result()
        finally:
            self.load_timings["warm_up_wait_s"] = time.perf_counter() - t0

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
        if self._warming is not None:
            self._warming.exception()  # and a warm-up
        self._model = self._prefixes = self._gen = self._pending = self._warming = None

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

    def _score_local(self, reqs, progress):
        """This replica's token requests through the shared-context engine."""
        self._scorer_ready()
        return scoring.score(
            self.model,
            reqs,
            use_cache=self.use_cache,
            token_budget=self.token_budget,
            max_length=self.max_length,
            max_rows=self.rows,
            progress=progress and self.parallel.is_leader,
            prefix_cache=self._prefix_cache(),
            stats=self.score_stats,
        )

    def _score(self, reqs, progress):
        return self._score_local(reqs, progress)

    # lm-eval's data-parallel contract: under dp > 1 it builds each replica's requests only (its
    # documents ``rank::world_size``), hands them to this replica, and gathers the per-document
    # metrics to replica 0 through these methods. A replica's tp ranks report the same rank and
    # gather within their own dp group (one per tp rank): each tp position sees whole results.
    @property
    def rank(self) -> int:
        return self.parallel.dp_rank

    @property
    def world_size(self) -> int:
        return self.parallel.dp_size

    def all_gather(self, tensor):
        """Every replica's ``tensor`` (a 0-d count included), concatenated in replica order."""
        if self.parallel.dp_size == 1:
            return tensor
        import torch
        import torch.distributed as dist

        flat = tensor.reshape(-1)
        parts = [torch.empty_like(flat) for _ in range(self.parallel.dp_size)]
        dist.all_gather(parts, flat, group=self.parallel.dp_group)
        return torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        """Every replica's ``obj`` in replica order on replica ``dst``, None on the others."""
        if self.parallel.dp_size == 1:
            return [obj]
        import torch.distributed as dist

        on_dst = self.parallel.dp_rank == dst
        out = [None] * self.parallel.dp_size if on_dst else None
        dst_global = dst * self.parallel.tp_size + self.parallel.tp_rank  # dst's rank in WORLD
        dist.gather_object(obj, out, dst=dst_global, group=self.parallel.dp_group)
        return out

    def barrier(self) -> None:
        if self.parallel.dp_size > 1:
            import torch.distributed as dist

            dist.barrier(group=self.parallel.dp_group)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """This replica's requests (lm-eval sharded the documents); progress on rank 0 only."""
        self._add_request_time("items", len(requests))
        return super().loglikelihood(requests, disable_tqdm or not self.parallel.is_leader)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        return super().loglikelihood_rolling(requests, disable_tqdm or not self.parallel.is_leader)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """This replica's requests (lm-eval sharded them) through one ``Generator``."""
        self._await_warm_up()  # its pages come from the model's KV pool too
        return self._generate_until_local(
            list(requests), disable_tqdm or not self.parallel.is_leader
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
                    stop_token_ids=tuple(self.tok.stop_ids),  # Llama-3: eot, eom, end_of_text
                    stop=StopStrings(gen.until, self.tok_decode),
                )
            )
        if not reqs:
            return []
        gen = self._generator(reqs)
        results = gen.generate(reqs, progress=not disable_tqdm)
        for key, value in dataclasses.asdict(gen.stats).items():
            if isinstance(value, (int, float)):  # counters add up; per-request lists do not
                self.generation_stats[key] = self.generation_stats.get(key, 0) + value
        self.generation_stats["max_batch"] = max(
            gen.max_batch, self.generation_stats.get("max_batch", 0)
        )
        out = []
        for req, res in zip(requests, results):
            if res.finish == "error":  # a request the KV pool can never hold
                raise ModelArgsError(f"generate_until: {res.error}")
            out.append(res.text)
            self.cache_hook.add_partial("generate_until", req.args, res.text)
        return out

    def _generator(self, reqs):
        """The generation engine (pages from the model's KV pool), built on first use and again
        when requests need longer rows: rows as long as the longest prompt + budget asks
        (rounded up to 256, at most ``max_length``), :data:`GENERATE_ROWS` of them in flight
        (or the ``--batch_size`` cap, up to the decode step's ``max_rows()``). Not fewer to fit full-length rows in
        memory: a row takes only the pages its own prompt and budget need (a shared few-shot
        prefix's pages by reference), and one the pool cannot hold yet waits for pages. (Sizing
        rows for full 1,280-position rows held GSM8K-full to 158 rows on an H200.)"""
        from nakta_model.generation import Generator
        from nakta_model.generation.engine import max_rows

        need = max(len(r.prompt) + r.max_new_tokens for r in reqs)
        gen = getattr(self, "_gen", None)
        if gen is None or gen.max_seq_len < need:
            row_len = min(self.max_length, -(-need // 256) * 256)
            self._gen = None  # the model's KV pool is kept (scorer's pages too); it grows if needed
            rows = min(self.rows or GENERATE_ROWS, max_rows())
            self._gen = Generator(self.model, max_batch=rows, max_seq_len=row_len)
        return self._gen


def _require_format(checkpoint: str) -> None:
    """A folder in one of the formats ``nakta_model.load`` reads (files looked at, none read)."""
    from nakta_model.cli import InputError, require_checkpoint

    try:
        require_checkpoint(checkpoint, "nakta checkpoint")
    except InputError as e:
        raise ModelArgsError(str(e)) from None


@contextlib.contextmanager
def _load_errors(checkpoint: object, model: str = "nakta") -> Iterator[None]:
    """A checkpoint that cannot be read (missing, truncated or corrupted files: the manifest's
    checks, a failed read on some rank, a ``.pth`` torch cannot unpickle) becomes one line for
    the user: a ``ModelArgsError``."""
    from nakta_model.cli import LOAD_ERRORS

    try:
        yield
    except ModelArgsError:
        raise
    except LOAD_ERRORS as e:  # CheckpointError, ParallelConfigError are ValueErrors
        raise ModelArgsError(f"{model} checkpoint {checkpoint}: cannot load it: {e}") from e


def _share_host_threads() -> None:
    """Under torchrun, this rank's share of the host's cores for torch's CPU threads (unless
    ``OMP_NUM_THREADS`` says otherwise): N ranks each using every core only slow each other
    during the load and tokenization."""
    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        return
    ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_here))


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


@register_model("llama_org")
class LlamaOrgLM(ScoringLM):
    """Meta's reference LLaMA (``llama_org``), plain scoring over its all-position forward."""

    def __init__(
        self,
        checkpoint: str | None = None,
        tokenizer: str | None = None,
        batch_size: int | str | None = None,
        max_batch_size: int | str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        token_budget: int | str = scoring.DEFAULT_TOKEN_BUDGET,
        max_length: int | str | None = None,
        max_gen_toks: int | str = 256,
        **unknown,
    ):
        from nakta_model.checkpoint import read_json_object

        _refuse_unknown_args("llama_org", LlamaOrgLM, unknown)
        checkpoint = require_checkpoint_arg("llama_org", checkpoint)
        meta = _meta_dir(checkpoint)
        tokenizer = default_tokenizer(tokenizer, checkpoint, "llama_org")
        self.rows = _rows(batch_size, max_batch_size) or LLAMA_ORG_ROWS
        with _load_errors(checkpoint, "llama_org"):
            params = read_json_object(meta / "params.json")
            # Meta's params.json usually has no max_seq_len (Llama.build takes one): then 2048
            limit = int(params.get("max_seq_len", 2048))
        self._max_length = _max_length(max_length, limit, checkpoint)
        super().__init__(tokenizer, device, dtype, token_budget, max_gen_toks)
        with _load_errors(checkpoint, "llama_org"):
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
