"""OpenAI's request and error shapes: request bodies checked field by field into plain objects.

Every bad field is an :class:`APIError` naming the field (``param``) and what was expected, with
the HTTP status and OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``.
Fields this server does not act on are refused when they would change the answer (a non-zero
``presence_penalty``, ``best_of`` above 1) and ignored when they do not (``user``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = [
    "APIError",
    "ChatRequest",
    "CompletionRequest",
    "error_body",
    "parse_chat",
    "parse_completion",
]

MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's legacy API allows 5, vLLM 20)
MAX_STOPS = 16
MAX_N = 16


class APIError(Exception):
    """An OpenAI-shaped error: ``status`` (HTTP), ``message``, ``type``, ``param``, ``code``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )


def error_body(e: APIError) -> dict:
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


@dataclass
class Sampling:
    """What the engine needs of a request's decoding settings (shared by both endpoints)."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: list[str]
    seed: int | None
    n: int
    stream: bool
    include_usage: bool
    ignore_eos: bool = False  # vLLM's extension: EOS does not end the row (benchmarks)


@dataclass
class CompletionRequest:
    model: str
    prompts: list[str | list[int]]  # text or token ids, one per prompt
    sampling: Sampling
    echo: bool = False
    logprobs: int | None = None  # top alternatives per token; None: no logprobs


@dataclass
class ChatRequest:
    model: str
    messages: list[dict] = field(default_factory=list)  # {"role": str, "content": str}
    sampling: Sampling | None = None
    logprobs: int | None = None  # top_logprobs when logprobs is true


def _bad(param: str, expected: str, got: object) -> APIError:
    shown = repr(got)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return APIError(400, f"{param} must be {expected}, got {shown}", param=param)


def _int(body: dict, name: str, default, lo: int, hi: int) -> int | None:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _bad(name, f"an integer in [{lo}, {hi}]", v)
    return v


def _float(body: dict, name: str, default: float, lo: float, hi: float, lo_open=False) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(name, "a number", v)
    if v > hi or v < lo or (lo_open and v == lo):
        lo_side = "(" if lo_open else "["
        raise _bad(name, f"a number in {lo_side}{lo}, {hi}]", v)
    return float(v)


def _model(body: dict, served: str) -> str:
    m = body.get("model", served)
    if not isinstance(m, str):
        raise _bad("model", "a string", m)
    if m != served:
        raise APIError(
            404,
            f"The model {m!r} does not exist; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )
    return m


def _sampling(body: dict, max_context: int, default_max: int) -> Sampling:
    max_tokens = _int(body, "max_tokens", default_max, 0, max_context)
    if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
        max_tokens = _int(body, "max_completion_tokens", default_max, 0, max_context)
    temperature = _float(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", 0, -1, 1 << 30)
    top_k = 0 if top_k == -1 else top_k  # vLLM's "no cut"
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise _bad("stop", "a string or a list of strings", stop)
    if len(stop) > MAX_STOPS:
        raise _bad("stop", f"at most {MAX_STOPS} strings", f"{len(stop)} strings")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad("seed", "an integer", seed)
    n = _int(body, "n", 1, 1, MAX_N)
    best_of = body.get("best_of")
    if best_of not in (None, 1, n):
        raise _bad("best_of", "1 or n (no server-side ranking here)", best_of)
    for name in ("presence_penalty", "frequency_penalty"):
        v = _float(body, name, 0.0, -2.0, 2.0)
        if v != 0.0:
            raise APIError(400, f"{name} is not supported (only 0)", param=name)
    if body.get("logit_bias"):
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("stream", "a boolean", stream)
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise _bad("stream_options", "an object", opts)
    include_usage = opts.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise _bad("stream_options.include_usage", "a boolean", include_usage)
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise _bad("ignore_eos", "a boolean", ignore_eos)
    return Sampling(
        max_tokens, temperature, top_p, top_k, stop, seed, n, stream, include_usage, ignore_eos
    )


def _prompts(p: object, vocab: int) -> list[str | list[int]]:
    """OpenAI's ``prompt``: a string, a list of token ids, or a list of either."""

    def ids(x: list) -> list[int]:
        if not x:
            raise _bad("prompt", "a non-empty list of token ids", x)
        for t in x:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise _bad("prompt", f"token ids in [0, {vocab})", t)
        return list(x)

    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p:
        if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            return [ids(p)]
        out: list[str | list[int]] = []
        for x in p:
            if isinstance(x, str):
                out.append(x)
            elif isinstance(x, list):
                out.append(ids(x))
            else:
                raise _bad("prompt", "a string, token ids, or a list of either", x)
        return out
    raise _bad("prompt", "a string, token ids, or a non-empty list of either", p)


def _object(body: object) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", param=None)
    return body


def parse_completion(body: object, served: str, vocab: int, max_context: int) -> CompletionRequest:
    """``/v1/completions``'s body; ``max_context``: the model's positions per row."""
    body = _object(body)
    model = _model(body, served)
    if "prompt" not in body:
        raise APIError(400, "prompt is required", param="prompt")
    prompts = _prompts(body["prompt"], vocab)
    sampling = _sampling(body, max_context, 16)
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise _bad("echo", "a boolean", echo)
    logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    if sampling.max_tokens == 0 and not echo:
        raise _bad("max_tokens", "at least 1 (0 only with echo)", 0)
    if sampling.stream and (echo or logprobs is not None):
        raise APIError(400, "echo and logprobs are not supported with stream", param="stream")
    return CompletionRequest(model, prompts, sampling, echo, logprobs)


def parse_chat(body: object, served: str, max_context: int) -> ChatRequest:
    """``/v1/chat/completions``'s body."""
    body = _object(body)
    model = _model(body, served)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "a non-empty list of messages", msgs)
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}]", 'an object with a string "role"', m)
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"):
                    raise _bad(f"messages[{i}].content", "text parts only", part)
                if not isinstance(part.get("text"), str):
                    raise _bad(f"messages[{i}].content", "text parts with a string text", part)
                parts.append(part["text"])
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content", "a string or a list of text parts", content)
        out.append({"role": m["role"], "content": content})
    sampling = _sampling(body, max_context, max_context)
    if sampling.max_tokens == 0:
        raise _bad("max_tokens", "at least 1", 0)
    lp = body.get("logprobs", False)
    if lp is None:
        lp = False
    if not isinstance(lp, bool):
        raise _bad("logprobs", "a boolean", lp)
    top = _int(body, "top_logprobs", 0, 0, MAX_LOGPROBS)
    if top and not lp:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if lp and sampling.stream:
        raise APIError(400, "logprobs are not supported with stream", param="logprobs")
    return ChatRequest(model, out, sampling, top if lp else None)
