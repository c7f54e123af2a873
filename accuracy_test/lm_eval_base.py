"""The lm-eval adapters' shared half: tokenization as lm-eval's ``TemplateLM`` does it (each
distinct string encoded once), rolling windows, and Meta-style batched generation; the
subclasses in ``lm_eval_adapter`` supply the model calls (``_score``, ``_generate``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from tqdm.auto import tqdm

from accuracy_test import models
from accuracy_test.lm_eval_args import (
    ModelArgsError,
    _positive_int,
    generation_settings,
    merged_model_args,
)
from accuracy_test.lm_eval_requests import tokenize_requests
from nakta_model import scoring

__all__ = ["ScoringLM"]


class ScoringLM(TemplateLM):
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
        from nakta_model.tokenizer import load_tokenizer

        try:
            self._device = models.resolve_device(device, fallback=True)
        except RuntimeError:  # torch.device("gpu"): a list of every device type torch knows
            raise ModelArgsError(f"device {device!r}: expected cpu, cuda or cuda:N") from None
        except ValueError as e:
            raise ModelArgsError(f"device {device!r}: {e}") from None
        try:
            self.dtype = models.parse_dtype(
                dtype or ("bf16" if self.device.type == "cuda" else "fp32")
            )
            self.token_budget = _positive_int("token_budget", token_budget)
            self.max_gen_toks = _positive_int("max_gen_toks", max_gen_toks)
        except ValueError as e:
            raise ModelArgsError(str(e)) from e
        try:  # a missing file, or one that is no SentencePiece model (RuntimeError)
            self.tok = load_tokenizer(tokenizer)
        except (OSError, RuntimeError, ValueError) as e:
            raise ModelArgsError(f"tokenizer {tokenizer}: cannot read it ({e})") from e
        # BOS as text, what a rendered chat prompt starts with (SentencePiece: none)
        self._bos_text = self.tok.decode([self.tok.bos_id]) if self.tok.bos_id >= 0 else ""

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """lm-eval's constructor call, but a key given both in ``--model_args`` and by lm-eval
        (``batch_size``, ``device``) is passed once: the model_args value wins
        (:func:`merged_model_args`), never a ``TypeError`` for a duplicate keyword."""
        args = lm_utils.simple_parse_args_string(arg_string)
        return cls(**merged_model_args(args, additional_config))

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """As :meth:`create_from_arg_string`, from a dict of model args."""
        return cls(**merged_model_args(dict(arg_dict), additional_config))

    # ---------------------------------------------------------------- tokenizer
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_id  # LLaMA conditions an empty context on BOS

    def _chat_prompt(self, string: str) -> bool:
        """A string that starts with BOS's text is a rendered chat prompt (``apply_chat_template``
        wrote it): its special tokens' text is read as those tokens and no second BOS goes
        first, as lm-eval's ``hf`` encodes one."""
        return bool(self._bos_text) and string.startswith(self._bos_text)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kw) -> list[int]:
        if add_special_tokens is None and self._chat_prompt(string):
            return self.tok.encode_special(string)
        return self.tok.encode(string, bos=add_special_tokens is not False, eos=False)

    def tok_decode(self, tokens: Sequence[int], **kw) -> str:
        return self.tok.decode(list(tokens))

    def _encode_many(self, strings: list[str], bos: bool) -> list[list[int]]:
        """``tok_encode`` of many strings (BOS when ``bos``) in one multi-threaded call."""
        chat = [i for i, s in enumerate(strings) if bos and self._chat_prompt(s)]
        if not chat:
            return self.tok.encode_many(strings, bos=bos, eos=False)
        out = self.tok.encode_many(strings, bos=bos, eos=False)
        for i in chat:
            out[i] = self.tok.encode_special(strings[i])
        return out

    # ---------------------------------------------------------------- chat (lm-eval's API)
    @property
    def tokenizer_name(self) -> str:
        """The tokenizer file, as lm-eval's request cache names it (``/`` -> ``__``)."""
        return self.tok.path.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The chat format lm-eval records (``--apply_chat_template``): the HF template's text,
        or Meta's Llama-3 dialog format by name; a tokenizer with none is refused up front."""
        from nakta_model.chat import chat_format

        if not chat_template:
            return None
        fmt = chat_format(self.tok)
        if fmt is None:
            raise ModelArgsError(
                f"--apply_chat_template: tokenizer {self.tok.path} has no chat format (a Meta "
                "Llama-3 tokenizer.model, or a HF folder with a chat_template)"
            )
        return self.tok.chat_template if fmt == "template" else "llama3 (Meta's dialog format)"

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The dialog as the checkpoint's chat format writes it (``nakta_model.chat``), the
        final message left open when ``add_generation_prompt`` is False, as ``hf`` does."""
        from nakta_model.chat import render_chat

        try:
            return render_chat(self.tok, chat_history, add_generation_prompt)
        except (TypeError, ValueError) as e:
            # hf retries without system messages (templates that refuse them), so does this
            rest = [m for m in chat_history if m.get("role") != "system"]
            if len(rest) < len(chat_history):
                try:
                    return render_chat(self.tok, rest, add_generation_prompt)
                except (TypeError, ValueError):
                    pass
            raise ModelArgsError(f"apply_chat_template: {e}") from e

    # ---------------------------------------------------------------- scoring
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``TemplateLM.loglikelihood``'s token pairs, but each distinct string encoded once in
        batched calls: lm-eval encodes two strings per request one at a time (3 s of a 15 s
        MMLU-shaped 5-shot run on an H200, where 4 choices share each context)."""
        args = [tuple(req.args) for req in requests]
        pairs = self._tokenize_pairs(args, progress=not disable_tqdm)
        t1 = time.perf_counter()
        out = self._loglikelihood_tokens(
            [(a, ctx, cont) for a, (ctx, cont) in zip(args, pairs)], disable_tqdm=disable_tqdm
        )
        self._add_request_time("score_s", time.perf_counter() - t1)  # tokens -> results
        return out

    def _add_request_time(self, key: str, seconds: float) -> None:
        """``request_timings``: where ``loglikelihood``'s seconds went (the CLI's timing hook
        writes them out)."""
        timings = self.__dict__.setdefault("request_timings", {"tokenize_s": 0.0, "score_s": 0.0})
        timings[key] = timings.get(key, 0.0) + seconds

    def _request_time(self, key: str) -> float:
        return self.__dict__.get("request_timings", {}).get(key, 0.0)

    def _tokenize_pairs(
        self, args: list[tuple[str, str]], progress: bool
    ) -> list[tuple[list[int], list[int]]]:
        """lm-eval's strings -> token pairs (``tokenize_requests``), timed as ``tokenize_s``."""
        t0 = time.perf_counter()
        pairs = tokenize_requests(args, self._encode_many, self.prefix_token_id, progress=progress)
        self._add_request_time("tokenize_s", time.perf_counter() - t0)
        return pairs

    def _score(self, reqs: list[tuple[list[int], list[int]]], progress: bool) -> list:
        raise NotImplementedError

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw):
        reqs = [(list(ctx), list(cont)) for _, ctx, cont in requests]
        return self._score(reqs, progress=not disable_tqdm)

    def _rolling_sums(self, strings: list[str], score, progress: bool) -> list[float]:
        """log P(text | BOS) of each string: its rolling windows (lm-eval's) through
        ``score(token_pairs, progress)``, summed per string."""
        flat: list[tuple[list[int], list[int]]] = []
        owner: list[int] = []
        for i, string in enumerate(strings):
            windows = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string, add_special_tokens=False),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for ctx, cont in map(lm_utils.make_disjoint_window, windows):
                flat.append((ctx, cont))
                owner.append(i)
        sums = [0.0] * len(strings)
        for i, (ll, _) in zip(owner, score(flat, progress)):
            sums[i] += ll
        return sums

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        strings = [req.args[0] for req in requests]
        sums = self._rolling_sums(strings, self._score, progress=not disable_tqdm)
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
