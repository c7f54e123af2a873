"""lm-eval model adapters ``nakta`` and ``llama_org`` (registered on import).

    python -m accuracy_test.lm_eval_cli --model nakta \\
        --model_args checkpoint=../shared/data/stories260K,tokenizer=../shared/data/stories260K/tokenizer.model,dtype=fp32 \\
        --include_path accuracy_test/tasks --tasks hellaswag_local --device cpu --batch_size 64

Both subclass lm-eval's ``TemplateLM``, so the string -> token requests are lm-eval's own code
(``_encode_pair``: trailing context space moved to the continuation, continuation tokens =
``encode(ctx + cont)[len(encode(ctx)):]``; BOS prepended as LLaMA's tokenizer does; empty
contexts conditioned on BOS). Token requests go to Nakta's scoring engine: ``nakta`` through
the shared-context cache (``scoring.score``), ``llama_org`` through the plain scorer over Meta's
forward (``scoring.score_with_forward``), so an lm-eval run reproduces ``parity.py`` exactly.

Model args: ``checkpoint`` (Nakta dir, or Meta dir: converted on the fly to a temp Nakta
checkpoint; llama_org needs a Meta dir), ``tokenizer`` (sentencepiece file), ``dtype``
(fp32|bf16|fp16; default bf16 on CUDA, fp32 on CPU), ``token_budget`` (padded tokens per batch),
``max_length`` (default: the model's max_seq_len), ``use_cache`` (nakta: shared-context
packing, default true), ``max_gen_toks`` (default 256). ``--batch_size N`` caps rows per batch
(``auto``: nakta is limited by the token budget only; llama_org uses 32, since Meta's KV cache
is allocated for ``batch x max_length`` up front).

Multi-GPU (``nakta``): ``tp`` and ``dp`` model args under ``torchrun --nproc_per_node tp*dp``
(``python -m torch.distributed.run ... -m accuracy_test.lm_eval_cli ...``). Every rank sees all of
lm-eval's requests (the adapter reports rank 0 of 1, lm-eval's TP convention: only
``LOCAL_RANK`` 0 writes results); the adapter splits the model over ``tp`` GPUs and shards the
requests over the ``dp`` replicas itself (a context's continuations stay together), gathering
the answers back in order. ``llama_org`` runs Meta's model parallel: one process per shard.

``loglikelihood_rolling`` follows lm-eval's rolling windows (``get_rolling_token_windows`` with
the BOS prefix, the text encoded without BOS). ``generate_until`` decodes greedily (or samples
when ``do_sample``/``temperature > 0``) with the model's KV cache and cuts at the stop strings.
"""

from __future__ import annotations

from collections.abc import Sequence

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from accuracy_test import models
from nakta_model import scoring

__all__ = ["LlamaOrgLM", "NaktaLM"]


def _as_bool(v: object) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false), got {v!r}")


def _rows(batch_size: object, auto: int | None) -> int | None:
    """lm-eval's ``--batch_size`` (int, "N", "auto", "auto:N") -> max rows per batch."""
    if batch_size is None:
        return auto
    s = str(batch_size)
    if s.startswith("auto"):
        return auto
    try:
        n = int(s)
    except ValueError as e:
        raise ValueError(f"batch_size must be an int or 'auto', got {batch_size!r}") from e
    if n < 1:
        raise ValueError(f"batch_size must be >= 1, got {n}")
    return n


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

        self._device = models.resolve_device(device)
        self.dtype = models.parse_dtype(dtype or ("bf16" if self.device.type == "cuda" else "fp32"))
        self.tok = nakta_model.Tokenizer(tokenizer)
        self.token_budget = int(token_budget)
        self.max_gen_toks = int(max_gen_toks)

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

    # ---------------------------------------------------------------- scoring
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
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="generate_until")
        for idx in groups.values():
            kwargs = dict(requests[idx[0]].args[1])
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            eos_text = self.tok_decode([self.eot_token_id])
            if eos_text and eos_text not in until:
                until.append(eos_text)
            max_gen = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.pop("temperature", 0.0))
            if not _as_bool(kwargs.pop("do_sample", False)) and temperature > 0:
                temperature = 0.0  # lm-eval: do_sample=False means greedy
            top_p = float(kwargs.pop("top_p", 1.0))
            if max_gen >= self.max_length:
                raise ValueError(f"max_gen_toks={max_gen} >= max_length={self.max_length}")
            keep = self.max_length - max_gen  # lm-eval left-truncates the context to this
            # longest prompts first: similar lengths share a batch
            idx = sorted(idx, key=lambda i: -len(requests[i].args[0]))
            rows = self._gen_rows()
            for start in range(0, len(idx), rows):
                chunk = idx[start : start + rows]
                prompts = [self.tok_encode(requests[i].args[0])[-keep:] for i in chunk]
                gens = self._generate(prompts, max_gen, temperature, top_p)
                for i, toks in zip(chunk, gens):
                    text = self.tok_decode(toks)
                    for stop in until:
                        if stop:
                            text = text.split(stop)[0]
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(chunk))
        bar.close()
        return out  # type: ignore[return-value]


@register_model("nakta")
class NaktaLM(_ScoringLM):
    """Nakta: shared-context scoring engine, fused Triton kernels on CUDA."""

    def __init__(
        self,
        checkpoint: str,
        tokenizer: str,
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,
        device: str | None = None,
        dtype: str | None = None,
        token_budget: int | str = scoring.DEFAULT_TOKEN_BUDGET,
        max_length: int | str | None = None,
        use_cache: bool | str = True,
        max_gen_toks: int | str = 256,
        kernels: str | None = None,
        tp: int | str = 1,
        dp: int | str = 1,
        **kw,
    ):
        import os

        from nakta_model.parallel import ParallelContext, init_parallel

        self.parallel = ParallelContext()
        if int(tp) * int(dp) > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
            self.parallel = init_parallel(int(tp), int(dp), device=device)
            device = str(self.parallel.device)
        super().__init__(tokenizer, device, dtype, token_budget, max_gen_toks)
        self.handle = models.load_nakta(
            checkpoint, self.device, self.dtype, kernels=kernels, parallel=self.parallel
        )
        self.model = self.handle.model
        self._max_length = int(max_length) if max_length else self.model.args.max_seq_len
        self.rows = _rows(batch_size, None)
        self.use_cache = _as_bool(use_cache)

    @property
    def max_length(self) -> int:
        return self._max_length

    def _score(self, reqs, progress):
        from nakta_model.parallel import data_parallel_map

        def local(part):
            return scoring.score(
                self.model,
                part,
                use_cache=self.use_cache,
                token_budget=self.token_budget,
                max_length=self.max_length,
                max_rows=self.rows,
                progress=progress and self.parallel.is_leader,
            )

        return data_parallel_map(
            local,
            reqs,
            self.parallel,
            costs=[len(c) + len(x) for c, x in reqs],
            keys=[tuple(c) for c, _ in reqs],
        )

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests sharded over the ``dp`` replicas (longer prompts weigh more), in order."""
        from nakta_model.parallel import data_parallel_map

        return data_parallel_map(
            lambda part: super(NaktaLM, self).generate_until(
                part, disable_tqdm or not self.parallel.is_leader
            ),
            list(requests),
            self.parallel,
            costs=[len(r.args[0]) + 1 for r in requests],
        )

    def _gen_rows(self) -> int:
        return self.rows or 16

    def _generate(self, prompts, max_gen, temperature, top_p):
        from nakta_model.generation import generate_tokens

        out = generate_tokens(
            self.model,
            prompts,
            max_gen,
            eos_id=self.tok.eos_id,
            pad_id=self.tok.pad_id,
            temperature=temperature,
            top_p=top_p,
            max_seq_len=self.max_length,
        )
        return [o[len(p) :] for o, p in zip(out, prompts)]


@register_model("llama_org")
class LlamaOrgLM(_ScoringLM):
    """Meta's reference LLaMA (``llama_org``), plain scoring over its all-position forward."""

    def __init__(
        self,
        checkpoint: str,
        tokenizer: str,
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,
        device: str | None = None,
        dtype: str | None = None,
        token_budget: int | str = scoring.DEFAULT_TOKEN_BUDGET,
        max_length: int | str | None = None,
        max_gen_toks: int | str = 256,
        **kw,
    ):
        super().__init__(tokenizer, device, dtype, token_budget, max_gen_toks)
        if not models.is_meta_checkpoint(checkpoint):
            raise ValueError(f"checkpoint {checkpoint} must be a Meta dir for llama_org")
        if max_length:
            self._max_length = int(max_length)
        else:
            import json
            from pathlib import Path

            params = json.loads((Path(checkpoint) / "params.json").read_text())
            self._max_length = int(params.get("max_seq_len", 2048))
        self.rows = _rows(batch_size, 32)
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
