"""The ASGI app: OpenAI's routes over the engine bridge (a thin layer: no model code here).

``/v1/completions``, ``/v1/chat/completions`` (both streaming as server-sent events),
``/v1/models``, ``/health``, ``/metrics``, and vLLM's ``/tokenize``, ``/detokenize`` and
``/tokenizer_info`` (lm-eval's ``local-completions`` reads them for its ``remote`` tokenizer).
Every error, ours or the framework's (unknown route, wrong method), is OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nakta_model.generation.engine import GenerationRequest
from nakta_model.generation.sampling import SamplingParams
from nakta_model.generation.streaming import TextStream
from nakta_model.kv_pages import pages_for
from nakta_model.serve.bridge import EngineBridge, Handle, QueueFull, ShuttingDown
from nakta_model.serve.chat import chat_prompt
from nakta_model.serve.logprobs import SequenceLogprobs, sequence_logprobs
from nakta_model.serve.metrics import Metrics
from nakta_model.serve.protocol import (
    APIError,
    Sampling,
    error_body,
    parse_chat,
    parse_completion,
)

__all__ = ["ServerState", "create_app"]

log = logging.getLogger("nakta.serve")
RETRY_AFTER_S = 1  # what a 429 tells the client to wait
DISCONNECT_CHECK_S = 0.5  # how often a request with no news checks that its client is there
# A stream's own check is a backstop: Starlette's StreamingResponse listens for the client's
# disconnect beside the body (ASGI spec < 2.4, as uvicorn's) and cancels the body, whose
# ``finally`` cancels the rows. Checking every 0.5 s cost the event loop a poll per queued
# stream twice a second (hundreds of streams wait for a first token at an unbounded rate).
STREAM_CHECK_S = 5.0


@dataclass
class ServerState:
    """What the routes share: the bridge, the tokenizer and the settings they read."""

    bridge: EngineBridge
    tokenizer: object
    metrics: Metrics
    model_name: str
    max_context: int  # positions per row: prompt + max_tokens must fit
    vocab: int
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    log_prompts: bool = False


def create_app(state: ServerState) -> FastAPI:
    """The app over a started bridge (``nakta_model.serve.cli`` builds both)."""
    app = FastAPI(title="nakta-serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.nakta = state
    tok = state.tokenizer

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 429 else None
        _count(request, e.status)
        return JSONResponse(error_body(e), status_code=e.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        body = error_body(APIError(e.status_code, str(e.detail), type=kind))
        _count(request, e.status_code)
        return JSONResponse(body, status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("internal error on %s", request.url.path)
        _count(request, 500)
        body = error_body(APIError(500, "internal server error", type="server_error"))
        return JSONResponse(body, status_code=500)

    def _count(request: Request, status: int) -> None:
        state.metrics.requests.labels(request.url.path, str(status)).inc()

    def _auth(request: Request) -> None:
        if state.api_key is None:
            return
        got = request.headers.get("authorization", "").encode()
        want = f"Bearer {state.api_key}".encode()
        if not hmac.compare_digest(got, want):  # constant time in the key's content
            raise APIError(
                401,
                "missing or wrong API key (Authorization: Bearer KEY)",
                type="authentication_error",
                code="invalid_api_key",
            )

    async def _json(request: Request) -> object:
        """The body as JSON, refused past ``max_body_bytes`` before it is all read."""
        cap = state.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise APIError(413, f"request body of {declared} bytes is over the {cap}-byte cap")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                raise APIError(413, f"request body is over the {cap}-byte cap")
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON ({e})") from None

    def _ok(request: Request, body: dict) -> JSONResponse:
        _count(request, 200)
        return JSONResponse(body)

    # ------------------------------------------------------------------- plain routes
    @app.get("/health")
    async def health(request: Request):
        if not state.bridge.alive:
            raise APIError(503, "the engine is not running", type="server_error")
        return _ok(request, {"status": "ok"})

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        _auth(request)
        card = {
            "id": state.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "nakta",
            "max_model_len": state.max_context,
        }
        return _ok(request, {"object": "list", "data": [card]})

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        _auth(request)
        sp = getattr(tok, "sp_model", None)
        piece = (lambda i: sp.id_to_piece(i) if i >= 0 else None) if sp else (lambda i: None)
        return _ok(
            request,
            {
                "bos_token": piece(tok.bos_id),
                "eos_token": piece(tok.eos_id),
                "pad_token": piece(getattr(tok, "pad_id", -1)),
                "model_max_length": state.max_context,
                "tokenizer_class": type(tok).__name__,
            },
        )

    @app.post("/tokenize")
    async def tokenize(request: Request):
        _auth(request)
        body = await _json(request)
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise APIError(400, "add_special_tokens must be a boolean", param="add_special_tokens")
        if "messages" in body:
            ids = chat_prompt(tok, parse_chat(body, state.model_name, state.max_context).messages)
        else:
            text = body.get("prompt")
            if not isinstance(text, str):
                raise APIError(400, "prompt must be a string", param="prompt")
            ids = _encode_with_specials(tok, text, bos=special)
        return _ok(request, {"tokens": ids, "count": len(ids), "max_model_len": state.max_context})

    @app.post("/detokenize")
    async def detokenize(request: Request):
        _auth(request)
        body = await _json(request)
        ids = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < state.vocab for t in ids
        ):
            raise APIError(
                400, f"tokens must be a list of token ids in [0, {state.vocab})", param="tokens"
            )
        return _ok(request, {"prompt": tok.decode(ids)})

    # ------------------------------------------------------------------- completions
    @app.post("/v1/completions")
    async def completions(request: Request):
        _auth(request)
        req = parse_completion(
            await _json(request), state.model_name, state.vocab, state.max_context
        )
        prompts = [
            p if isinstance(p, list) else tok.encode(p, bos=True, eos=False) for p in req.prompts
        ]
        s = req.sampling
        for ids in prompts:
            _check_fits(state, len(ids), s.max_tokens)
        if state.log_prompts:
            log.info("completion prompts: %r", req.prompts)
        state.metrics.prompt_tokens.inc(sum(len(p) for p in prompts) * s.n)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": req.model}
        if s.stream:
            jobs = _submit(state, prompts, s)
            _count(request, 200)
            return _sse(request, state, jobs, s, head, chat=False)
        if req.echo and req.logprobs is not None and (s.max_tokens == 0 or _greedy_one(s)):
            choices = await _scored_choices(state, prompts, req.logprobs, s)
        else:
            jobs = _submit(state, prompts, s)
            await _wait_all(request, state, jobs)
            choices = [await _choice(state, j, req.echo, req.logprobs) for j in jobs]
        completion = sum(c.pop("_n") for c in choices)
        prompt_n = sum(len(p) for p in prompts) * s.n
        usage = _usage(prompt_n, completion)
        return _ok(request, {**head, "choices": choices, "usage": usage})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        _auth(request)
        req = parse_chat(await _json(request), state.model_name, state.max_context)
        ids = chat_prompt(tok, req.messages)
        s = req.sampling
        if s.max_tokens >= state.max_context:  # the default: all the context leaves
            s.max_tokens = max(1, state.max_context - len(ids))
        _check_fits(state, len(ids), s.max_tokens)
        if state.log_prompts:
            log.info("chat messages: %r", req.messages)
        state.metrics.prompt_tokens.inc(len(ids) * s.n)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "chat.completion", "created": created, "model": req.model}
        jobs = _submit(state, [ids], s)
        if s.stream:
            _count(request, 200)
            head["object"] = "chat.completion.chunk"
            return _sse(request, state, jobs, s, head, chat=True)
        await _wait_all(request, state, jobs)
        choices = []
        for j in jobs:
            c = await _choice(state, j, False, req.logprobs, chat=True)
            choices.append(c)
        completion = sum(c.pop("_n") for c in choices)
        return _ok(
            request, {**head, "choices": choices, "usage": _usage(len(ids) * s.n, completion)}
        )

    return app


# ---------------------------------------------------------------------------- helpers
@dataclass
class _Job:
    index: int  # the choice's index
    prompt: list[int]
    stream: TextStream
    handle: Handle | None = None
    sent: bool = False  # its first piece went out


def _encode_with_specials(tok, text: str, bos: bool) -> list[int]:
    """``/tokenize``: the text's ids, BOS first when ``bos``; the BOS / EOS pieces written in
    the text (``<s>``, ``</s>``) are those tokens, as HF tokenizers read them."""
    sp = getattr(tok, "sp_model", None)
    specials = {}
    if sp is not None:
        for i in (tok.bos_id, tok.eos_id):
            if i >= 0:
                specials[sp.id_to_piece(i)] = i
    ids = [tok.bos_id] if bos else []
    rest = text
    while rest:
        hits = [(rest.find(p), p) for p in specials if p and rest.find(p) >= 0]
        if not hits:
            ids += tok.encode(rest, bos=False, eos=False)
            break
        at, p = min(hits)
        if at:
            ids += tok.encode(rest[:at], bos=False, eos=False)
        ids.append(specials[p])
        rest = rest[at + len(p) :]
    return ids


def _check_fits(state: ServerState, n_prompt: int, max_tokens: int) -> None:
    """A prompt plus ``max_tokens`` must fit the context (and the KV pool): a 400 naming both."""
    total = n_prompt + max_tokens
    if total > state.max_context or n_prompt >= state.max_context:
        raise APIError(
            400,
            f"the prompt has {n_prompt} tokens and max_tokens is {max_tokens}: {total} "
            f"positions, past this model's context of {state.max_context}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    g = state.bridge.generator
    need = pages_for(max(1, total - 1))
    if need > g.pool.capacity - 1:
        raise APIError(
            400,
            f"the prompt has {n_prompt} tokens and max_tokens is {max_tokens}: {need} KV "
            f"pages, more than the server's pool holds ({g.pool.capacity - 1})",
            param="max_tokens",
            code="context_length_exceeded",
        )


def _greedy_one(s: Sampling) -> bool:
    return s.max_tokens == 1 and s.temperature == 0 and not s.stop


def _submit(state: ServerState, prompts: list[list[int]], s: Sampling) -> list[_Job]:
    """One engine request per prompt and choice (``n``), every one queued or none (429)."""
    tok = state.tokenizer
    sampling = SamplingParams(s.temperature, s.top_k, s.top_p)
    eos = (tok.eos_id,) if getattr(tok, "eos_id", -1) >= 0 and not s.ignore_eos else ()
    jobs: list[_Job] = []
    try:
        for p in prompts:
            for _ in range(s.n):
                stream = TextStream(tok, p, s.stop)
                j = _Job(len(jobs), p, stream)
                j.handle = state.bridge.submit(_engine_request(stream, s.max_tokens, sampling, eos))
                jobs.append(j)
    except QueueFull:
        for j in jobs:
            state.bridge.cancel(j.handle)
        state.metrics.rejected.inc()
        raise APIError(
            429,
            "the server's queue is full; retry later",
            type="rate_limit_exceeded",
            code="queue_full",
        ) from None
    except ShuttingDown:
        for j in jobs:
            state.bridge.cancel(j.handle)
        raise APIError(503, "the server is shutting down", type="server_error") from None
    if len(jobs) > 1:  # one event for all: a stream wakes when any of them moves
        shared = asyncio.Event()
        for j in jobs:
            j.handle.event = shared
            if j.handle.n or j.handle.finish:
                shared.set()
    return jobs


def _engine_request(stream: TextStream, max_tokens: int, sampling, eos) -> GenerationRequest:
    """The engine request of a stream. Stop strings go to the engine only when there are
    some: with a ``StopStrings`` the engine decodes the row's whole text at every chunk it
    reads (on its own thread, the GPU's critical path between chunks), which a request
    without stop strings never needs; the stream still cuts and holds back its own text."""
    if stream.stop.stops:
        return stream.request(max_tokens, sampling, eos)
    return GenerationRequest(stream.prompt, max_tokens, sampling, eos)


async def _wait_event(ev: asyncio.Event, timeout: float) -> None:
    """Until ``ev`` is set (then cleared), else TimeoutError after ``timeout`` seconds. Not
    ``asyncio.wait_for``: that wraps every wait in a task of its own, and a stream waits once
    per chunk it receives."""
    if not ev.is_set():
        async with asyncio.timeout(timeout):
            await ev.wait()
    ev.clear()


async def _wait_all(request: Request, state: ServerState, jobs: list[_Job]) -> None:
    """Until every job finished; a client that goes away cancels them (their pages return)."""
    checked = time.monotonic()
    try:
        while not all(j.handle.finish for j in jobs):
            ev = jobs[0].handle.event
            with contextlib.suppress(TimeoutError):
                await _wait_event(ev, DISCONNECT_CHECK_S)
            if time.monotonic() - checked >= DISCONNECT_CHECK_S:  # tokens or not
                checked = time.monotonic()
                if await request.is_disconnected():
                    raise asyncio.CancelledError()
    except BaseException:
        for j in jobs:
            state.bridge.cancel(j.handle)
        raise
    for j in jobs:
        if j.handle.finish == "error":
            raise APIError(500, "the engine could not run this request", type="server_error")
        if j.handle.finish == "cancelled":  # only the server cancels a live client's rows
            raise APIError(503, "cancelled: the server is shutting down", type="server_error")


def _piece(tok, i: int) -> str:
    sp = getattr(tok, "sp_model", None)
    if sp is None:
        return tok.decode([i])
    return sp.id_to_piece(i).replace("\u2581", " ")


def _legacy_logprobs(
    tok, lp: SequenceLogprobs, ids: list[int], start: int, top: int, offset0: int
) -> dict:
    """OpenAI's completions ``logprobs`` for ``ids[start:]`` (position 0 has none)."""
    tokens, token_lp, top_lp, offsets = [], [], [], []
    off = offset0
    for pos in range(start, len(ids)):
        s = _piece(tok, ids[pos])
        tokens.append(s)
        offsets.append(off)
        off += len(s)
        if pos == 0:
            token_lp.append(None)
            top_lp.append(None)
            continue
        token_lp.append(lp.logprobs[pos - 1])
        alts = {}
        for i, v in zip(lp.top_ids[pos - 1][:top], lp.top_logprobs[pos - 1][:top]):
            alts.setdefault(_piece(tok, i), v)
        top_lp.append(alts)
    return {
        "tokens": tokens,
        "token_logprobs": token_lp,
        "top_logprobs": top_lp,
        "text_offset": offsets,
    }


async def _scored_choices(state: ServerState, prompts, top: int, s: Sampling) -> list[dict]:
    """``echo`` + ``logprobs`` with at most one greedy token (lm-eval's loglikelihood
    request): one forward per prompt gives the prompt's logprobs and the next token."""
    tok = state.tokenizer
    choices = []
    for ids in prompts:
        lp = await _on_engine(state, sequence_logprobs, list(ids), top)
        seq, text, finish, n_out = list(ids), "", "length", 0
        if s.max_tokens:
            nxt = lp.next_ids[0]
            last = SequenceLogprobs(
                [lp.next_logprobs[0]], [lp.next_ids], [lp.next_logprobs], [], []
            )
            lp = SequenceLogprobs(
                lp.logprobs + last.logprobs,
                lp.top_ids + last.top_ids,
                lp.top_logprobs + last.top_logprobs,
                [],
                [],
            )
            seq.append(nxt)
            if nxt == tok.eos_id:
                finish = "stop"  # kept in logprobs (as vLLM does), not in the text
            else:
                text, n_out = TextStream(tok, ids).continuation([nxt]), 1
        prompt_text = tok.decode(ids)
        for _ in range(s.n):
            choices.append(
                {
                    "index": len(choices),
                    "text": prompt_text + text,
                    "logprobs": _legacy_logprobs(tok, lp, seq, 0, top, 0),
                    "finish_reason": finish,
                    "_n": n_out,
                }
            )
    return choices


async def _on_engine(state: ServerState, fn, *args):
    """``fn(model, *args)`` on the engine thread (on every rank under tensor parallelism)."""
    try:
        return await state.bridge.call(fn, *args)
    except ShuttingDown:
        raise APIError(503, "the server is shutting down", type="server_error") from None


async def _choice(state: ServerState, j: _Job, echo: bool, top: int | None, chat=False) -> dict:
    """A finished job as a choice (logprobs scored again over prompt + output)."""
    tok, h = state.tokenizer, j.handle
    out = h.text_tokens()
    text, hit = j.stream.stop.cut(out)
    finish = h.finish if h.finish in ("stop", "length") else "stop"
    lp_body = None
    if top is not None:
        seq = list(j.prompt) + out
        if finish == "stop" and not hit and tok.eos_id >= 0:
            seq.append(tok.eos_id)  # the stop token: in logprobs, not in the text
        lp = await _on_engine(state, sequence_logprobs, seq, max(top, 1))
        start = 0 if echo else len(j.prompt)
        if chat:
            lp_body = {"content": _chat_logprobs(tok, lp, seq, start, top)}
        else:
            off = 0 if echo else len(j.stream.prompt_text)
            lp_body = _legacy_logprobs(tok, lp, seq, start, top, off)
    if chat:
        msg = {"role": "assistant", "content": text}
        return {
            "index": j.index,
            "message": msg,
            "logprobs": lp_body,
            "finish_reason": finish,
            "_n": len(out),
        }
    if echo:
        text = j.stream.prompt_text + text
    return {
        "index": j.index,
        "text": text,
        "logprobs": lp_body,
        "finish_reason": finish,
        "_n": len(out),
    }


def _chat_logprobs(tok, lp: SequenceLogprobs, ids: list[int], start: int, top: int) -> list:
    out = []
    for pos in range(max(start, 1), len(ids)):
        s = _piece(tok, ids[pos])
        alts = [
            {"token": _piece(tok, i), "logprob": v, "bytes": list(_piece(tok, i).encode())}
            for i, v in zip(lp.top_ids[pos - 1][:top], lp.top_logprobs[pos - 1][:top])
        ]
        out.append(
            {
                "token": s,
                "logprob": lp.logprobs[pos - 1],
                "bytes": list(s.encode()),
                "top_logprobs": alts,
            }
        )
    return out


def _usage(prompt: int, completion: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _sse(request, state, jobs: list[_Job], s: Sampling, head: dict, chat: bool):
    """The jobs' text as server-sent events, piece by piece as tokens arrive: at each wake-up
    one write with an event per choice that moved (the head's JSON made once per stream)."""
    prefix = "data: " + json.dumps(head)[:-1] + ', "choices": ['
    metrics = state.metrics

    def event(choice: dict) -> str:
        return prefix + json.dumps(choice) + "]}\n\n"

    async def body() -> AsyncIterator[str]:
        ev = jobs[0].handle.event
        done: set[int] = set()
        clock = time.perf_counter
        try:
            if chat:
                out = []
                for j in jobs:
                    delta = {"role": "assistant", "content": ""}
                    out.append(event({"index": j.index, "delta": delta, "finish_reason": None}))
                yield "".join(out)
            while len(done) < len(jobs):
                try:
                    await _wait_event(ev, STREAM_CHECK_S)
                except TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                t0 = clock()
                out, first = [], None
                for j in jobs:
                    h = j.handle
                    if j.index in done or (not h.n and h.finish is None):
                        continue
                    if h.finish in ("error", "cancelled"):
                        why = (
                            "the server is shutting down"
                            if h.finish == "cancelled"
                            else ("the engine could not run this request")
                        )
                        err = APIError(
                            500 if h.finish == "error" else 503, why, type="server_error"
                        )
                        out.append(f"data: {json.dumps(error_body(err))}\n\n")
                        yield "".join(out)
                        return
                    piece = j.stream.update(h.text_tokens(), h.finish is not None)
                    finish = None
                    if h.finish is not None:
                        finish = h.finish if h.finish in ("stop", "length") else "stop"
                        done.add(j.index)
                    if piece or finish:
                        if chat:
                            delta = {"content": piece} if piece else {}
                            c = {"index": j.index, "delta": delta, "finish_reason": finish}
                        else:
                            c = {"index": j.index, "text": piece, "logprobs": None}
                            c["finish_reason"] = finish
                        out.append(event(c))
                        if not j.sent and h.first_token_at is not None:
                            j.sent = True
                            first = h.first_token_at
                if out:
                    now = clock()
                    metrics.stream_events.inc()
                    metrics.stream_seconds.inc(now - t0)
                    if first is not None:
                        metrics.ttft_write.observe(now - first)
                    yield "".join(out)
            tail = []
            if s.include_usage:
                completion = sum(j.handle.n for j in jobs)
                prompt = sum(len(j.prompt) for j in jobs)
                usage = {**head, "choices": [], "usage": _usage(prompt, completion)}
                tail.append(f"data: {json.dumps(usage)}\n\n")
            tail.append("data: [DONE]\n\n")
            yield "".join(tail)
        finally:
            for j in jobs:
                if j.handle.finish is None:
                    state.bridge.cancel(j.handle)

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
