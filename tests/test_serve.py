"""nakta-serve over real HTTP on 127.0.0.1 (stories260K, fp32, CPU): OpenAI's client against the
offline Generator, echo / logprobs against the scorer, every bad input an OpenAI-shaped 4xx,
a full queue a 429, SIGTERM a clean exit 0. Every server started here is stopped here."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

REPO = Path(__file__).resolve().parents[1]
KEY = "sk-test-key"
NAME = "stories260K"
PROMPTS = ["Once upon a time", "Lily and Tom went to the park", "The little dog", "One day, a bird"]


class ServerProcess:
    """``python -m nakta_model.serve`` on a free loopback port; ``url`` once it listens."""

    def __init__(self, checkpoint: Path, *args: str, start_s: float = 180.0):
        cmd = [sys.executable, "-m", "nakta_model.serve", "--checkpoint", str(checkpoint)]
        cmd += ["--port", "0", "--device", "cpu", "--dtype", "fp32", "--no-access-log", *args]
        env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1"}
        env["OMP_NUM_THREADS"] = "1"
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
        )
        self.lines: list[str] = []
        self._q: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + start_s
        self.url = None
        while self.url is None:
            try:
                line = self._q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.stop(signal.SIGKILL)
                raise RuntimeError("server did not start:\n" + "".join(self.lines)) from None
            if line is None:
                raise RuntimeError("server exited:\n" + "".join(self.lines))
            if "listening on " in line:
                self.url = line.split("listening on ")[1].strip()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            self._q.put(line)
        self._q.put(None)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, value = line.split()
                out[name] = float(value)
        return out


@pytest.fixture(scope="module")
def stories(shared_data_module) -> Path:
    return shared_data_module / "stories260K"


@pytest.fixture(scope="module")
def shared_data_module() -> Path:
    from conftest import SHARED_DATA

    if not (SHARED_DATA / "stories260K").is_dir():
        pytest.skip(f"stories260K not found in {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="module")
def server(stories):
    s = ServerProcess(stories, "--api-key", KEY, "--max-batch", "8", "--max-body-bytes", "65536")
    yield s
    assert s.stop() == 0, "".join(s.lines[-20:])


@pytest.fixture(scope="module")
def offline(stories):
    """The model, tokenizer and an offline Generator in this process (the reference)."""
    import nakta_model
    from nakta_model.generation.engine import Generator
    from nakta_model.tokenizer import Tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = nakta_model.load(stories, "cpu", torch.float32)
    tok = Tokenizer(stories / "tokenizer.model")
    yield model, tok, Generator(model, max_batch=8, chunk=16)
    torch.set_num_threads(threads)


def offline_texts(offline, prompts: list[list[int]], max_tokens: int) -> list[str]:
    from nakta_model.generation.sampling import SamplingParams
    from nakta_model.generation.streaming import TextStream

    _, tok, gen = offline
    streams = [TextStream(tok, p) for p in prompts]
    reqs = [s.request(max_tokens, SamplingParams(), (tok.eos_id,)) for s in streams]
    return [r.text for r in gen.generate(reqs)]


def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def post(server, path: str, body, key: str | None = KEY, timeout: float = 120) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, (bytes, str)):
        return httpx.post(f"{server.url}{path}", content=body, headers=headers, timeout=timeout)
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=timeout)


# ------------------------------------------------------------------------- the openai client
def test_completions_greedy_text_equals_the_offline_generator(server, offline):
    _, tok, _ = offline
    ids = [tok.encode(p, bos=True, eos=False) for p in PROMPTS]
    want = offline_texts(offline, ids, 24)
    c = client(server)
    r = c.completions.create(model=NAME, prompt=PROMPTS, max_tokens=24, temperature=0)
    got = [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]
    assert got == want
    assert r.usage.prompt_tokens == sum(map(len, ids))
    # the same prompts as token ids, one request each, all at once (they share the batch)
    with ThreadPoolExecutor(len(ids)) as pool:
        outs = list(
            pool.map(
                lambda p: c.completions.create(model=NAME, prompt=p, max_tokens=24, temperature=0),
                ids,
            )
        )
    assert [o.choices[0].text for o in outs] == want
    assert all(o.choices[0].finish_reason in ("stop", "length") for o in outs)


def test_streaming_pieces_join_to_the_whole_text(server, offline):
    _, tok, _ = offline
    want = offline_texts(offline, [tok.encode(PROMPTS[1], bos=True, eos=False)], 40)[0]
    c = client(server)
    events = list(
        c.completions.create(
            model=NAME, prompt=PROMPTS[1], max_tokens=40, temperature=0, stream=True
        )
    )
    assert "".join(e.choices[0].text for e in events) == want
    assert events[-1].choices[0].finish_reason in ("stop", "length")


def test_chat_plain_and_streamed_equal_the_offline_generator(server, offline):
    from nakta_model.serve.chat import chat_prompt

    _, tok, _ = offline
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    want = offline_texts(offline, [chat_prompt(tok, messages)], 20)[0]
    c = client(server)
    r = c.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    stream = c.chat.completions.create(
        model=NAME, messages=messages, max_tokens=20, temperature=0, stream=True
    )
    assert "".join(e.choices[0].delta.content or "" for e in stream) == want


def test_sampling_runs_and_stop_strings_cut(server):
    c = client(server)
    r = c.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=30, temperature=0.8, top_p=0.9, n=2, seed=3
    )
    assert len(r.choices) == 2 and all(ch.finish_reason for ch in r.choices)
    full = c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=30, temperature=0)
    text = full.choices[0].text
    cut = text.split(" ")[3]  # a word in the middle ends it
    stopped = c.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=30, temperature=0, stop=[cut]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(cut)]


# --------------------------------------------------------------------------- logprobs
def test_echo_logprobs_equal_the_scorer(server, offline):
    """lm-eval's loglikelihood request: token-id prompt, echo, logprobs 1, max_tokens 1."""
    from nakta_model import scoring

    model, tok, _ = offline
    pairs = []
    for p in PROMPTS:
        ctx = tok.encode(p, bos=True, eos=False)
        cont = tok.encode(p + " and the sun was warm", bos=True, eos=False)[len(ctx) :]
        pairs.append((ctx, cont))
    want = scoring.score(model, pairs)
    c = client(server)
    for (ctx, cont), (ll, greedy) in zip(pairs, want):
        r = c.completions.create(
            model=NAME, prompt=ctx + cont, max_tokens=1, temperature=0, logprobs=1, echo=True
        )
        lp = r.choices[0].logprobs
        assert len(lp.token_logprobs) == len(ctx) + len(cont) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        got = sum(lp.token_logprobs[len(ctx) : -1])
        assert got == pytest.approx(ll, rel=1e-6, abs=1e-5)  # fp32: packing changes rounding
        tops = lp.top_logprobs[len(ctx) : -1]
        got_greedy = all(
            t == max(top.values()) for t, top in zip(lp.token_logprobs[len(ctx) : -1], tops)
        )
        assert got_greedy == greedy


def test_generated_logprobs_are_the_greedy_tokens(server):
    c = client(server)
    r = c.completions.create(
        model=NAME, prompt=PROMPTS[2], max_tokens=12, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) in (n, n + 1)  # + the stop token when it ended on one
    for t, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and t == max(top.values()) and t <= 0
    assert "".join(lp.tokens[:n]).startswith(r.choices[0].text[:1])


# ------------------------------------------------------------------------ other routes
def test_models_health_tokenize_metrics(server, offline):
    _, tok, _ = offline
    h = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    m = httpx.get(f"{server.url}/v1/models", headers=h).json()
    assert m["data"][0]["id"] == NAME and m["data"][0]["max_model_len"] == 512
    r = post(server, "/tokenize", {"prompt": "Once upon a time"}).json()
    assert r["tokens"] == tok.encode("Once upon a time", bos=True, eos=False)
    r = post(server, "/tokenize", {"prompt": "<s>Hi</s>", "add_special_tokens": False}).json()
    assert r["tokens"] == [tok.bos_id, *tok.encode("Hi", bos=False, eos=False), tok.eos_id]
    r = post(server, "/detokenize", {"tokens": tok.encode("a cat", bos=True, eos=False)}).json()
    assert r["prompt"] == "a cat"
    info = httpx.get(f"{server.url}/tokenizer_info", headers=h).json()
    assert info["eos_token"] == "</s>" and info["bos_token"] == "<s>"
    assert post(server, "/v1/completions", {"model": NAME, "prompt": "A"}).status_code == 200
    metrics = server.metrics()
    for name in (
        "nakta_prompt_tokens_total", "nakta_generation_tokens_total", "nakta_queue_depth",
        "nakta_running_rows", "nakta_kv_pages_used", "nakta_kv_pages_total",
        "nakta_time_to_first_token_seconds_count", "nakta_inter_token_seconds_count",
        "nakta_ttft_queue_seconds_count", "nakta_ttft_engine_seconds_count",
        "nakta_stream_events_total", "nakta_loop_cpu_seconds_total",
    ):  # fmt: skip
        assert name in metrics, name
    assert metrics["nakta_generation_tokens_total"] > 0
    # the engine's own counters: it decoded, and its thread was busy meanwhile
    assert metrics["nakta_engine_decode_steps_total"] > 0
    assert metrics["nakta_engine_prefilled_tokens_total"] > 0
    assert metrics["nakta_engine_busy_seconds_total"] > 0
    assert metrics["nakta_ttft_engine_seconds_count"] >= 1


# ---------------------------------------------------------------------------- bad input
BAD = [
    # (body or raw bytes, key, status, param)
    (b"{not json", KEY, 400, None),
    (b"[1, 2]", KEY, 400, None),
    ({"model": NAME, "prompt": "x"}, None, 401, None),
    ({"model": NAME, "prompt": "x"}, "sk-wrong", 401, None),
    ({"model": "gpt-9", "prompt": "x"}, KEY, 404, "model"),
    ({"model": NAME}, KEY, 400, "prompt"),
    ({"model": NAME, "prompt": 12}, KEY, 400, "prompt"),
    ({"model": NAME, "prompt": []}, KEY, 400, "prompt"),
    ({"model": NAME, "prompt": [1, 99999]}, KEY, 400, "prompt"),
    ({"model": NAME, "prompt": [1, -3]}, KEY, 400, "prompt"),
    ({"model": NAME, "prompt": "x", "max_tokens": -1}, KEY, 400, "max_tokens"),
    ({"model": NAME, "prompt": "x", "max_tokens": "8"}, KEY, 400, "max_tokens"),
    ({"model": NAME, "prompt": "x", "max_tokens": 10**12}, KEY, 400, "max_tokens"),
    ({"model": NAME, "prompt": "x", "max_tokens": 510}, KEY, 400, "max_tokens"),
    ({"model": NAME, "prompt": "x", "temperature": -1}, KEY, 400, "temperature"),
    ({"model": NAME, "prompt": "x", "temperature": "hot"}, KEY, 400, "temperature"),
    ({"model": NAME, "prompt": "x", "top_p": 0}, KEY, 400, "top_p"),
    ({"model": NAME, "prompt": "x", "top_k": -5}, KEY, 400, "top_k"),
    ({"model": NAME, "prompt": "x", "n": 1000}, KEY, 400, "n"),
    ({"model": NAME, "prompt": "x", "logprobs": 100}, KEY, 400, "logprobs"),
    ({"model": NAME, "prompt": "x", "stop": 7}, KEY, 400, "stop"),
    ({"model": NAME, "prompt": "x", "stream": "yes"}, KEY, 400, "stream"),
    ({"model": NAME, "prompt": "x", "seed": 1.5}, KEY, 400, "seed"),
    ({"model": NAME, "prompt": "x", "presence_penalty": 1}, KEY, 400, "presence_penalty"),
    (
        {"model": NAME, "prompt": "x", "echo": True, "logprobs": 1, "stream": True},
        KEY,
        400,
        "stream",
    ),  # fmt: skip
    ({"model": NAME, "prompt": "x" * 70000}, KEY, 413, None),
]


@pytest.mark.parametrize("body,key,status,param", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_completion_input_is_an_openai_error(server, body, key, status, param):
    r = post(server, "/v1/completions", body, key=key)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


def test_bad_chat_input_and_routes_then_good_requests_still_served(server):
    for body in (
        {"model": NAME, "messages": []},
        {"model": NAME, "messages": "hi"},
        {"model": NAME, "messages": [{"content": "no role"}]},
        {"model": NAME, "messages": [{"role": "user", "content": 5}]},
        {"model": NAME, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
    ):
        r = post(server, "/v1/chat/completions", body)
        assert r.status_code == 400 and "error" in r.json(), (body, r.text)
    r = httpx.get(f"{server.url}/v1/nothing-here", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 405 and "error" in r.json()
    r = post(server, "/detokenize", {"tokens": [1, 10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    # the context check names both numbers
    r = post(server, "/v1/completions", {"model": NAME, "prompt": [1] * 500, "max_tokens": 20})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "500 tokens" in msg and "max_tokens is 20" in msg
    good = post(server, "/v1/completions", {"model": NAME, "prompt": "Once", "max_tokens": 4})
    assert good.status_code == 200 and good.json()["choices"][0]["text"]
    assert httpx.get(f"{server.url}/health").status_code == 200


# ------------------------------------------------------------------ overload and SIGTERM
def test_full_queue_is_429_and_sigterm_drains_then_exits_0(stories):
    s = ServerProcess(stories, "--max-batch", "1", "--max-queue", "2", "--drain-s", "60")
    try:
        body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 120, "temperature": 0}

        def one(_):
            return post(s, "/v1/completions", body, key=None)

        with ThreadPoolExecutor(8) as pool:
            rs = list(pool.map(one, range(8)))  # none hangs: post's timeout would raise
        codes = sorted(r.status_code for r in rs)
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, codes
        for r in rs:
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "queue_full"
        # a stream in flight when SIGTERM comes: it finishes, then the process exits 0
        with httpx.stream(
            "POST", f"{s.url}/v1/completions", json={**body, "stream": True}, timeout=120
        ) as r:
            lines = r.iter_lines()
            first = next(x for x in lines if x.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["text"] is not None
            s.proc.send_signal(signal.SIGTERM)
            rest = [x for x in lines if x.startswith("data: ")]
        events = [first, *rest]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")
        assert s.proc.wait(timeout=120) == 0, "".join(s.lines[-20:])
        s._reader.join(timeout=30)  # its last lines read
        assert any("nakta-serve: stopped" in line for line in s.lines)
    finally:
        if s.proc.poll() is None:
            s.stop(signal.SIGKILL)


# ------------------------------------------------------------------- the engine's feed API
def test_generator_feed_joins_running_batch_and_cancel_frees_pages(offline):
    """``Generator.generate(feed=...)`` with no HTTP: requests arrive while it runs and get
    the tokens an offline call gives; a cancelled row gives every page back."""
    from nakta_model.generation.engine import GenerationRequest

    _, tok, gen = offline
    ids = [tok.encode(p, bos=True, eos=False) for p in PROMPTS]
    eos = (tok.eos_id,)
    want = [
        r.tokens for r in gen.generate([GenerationRequest(p, 20, stop_token_ids=eos) for p in ids])
    ]

    class Feed:
        def __init__(self):
            self.new, self.cancel, self.polls, self.flushes = [], [], 0, 0

        def poll(self, idle):
            self.polls += 1
            if self.polls == 2:  # a long request arrives while the first ones decode
                self.new.append((99, GenerationRequest(ids[0], 300)))
            if idle and not self.new:
                return None  # everything done: stop
            new, self.new = self.new, []
            cancel, self.cancel = self.cancel, []
            return new, cancel

        def pending(self):
            return bool(self.new or self.cancel)

        def flush(self):  # the client goes away while its row decodes (as a server sees it)
            self.flushes += 1
            if self.flushes == 6:
                self.cancel.append(99)

    feed = Feed()
    feed.new = [(i, GenerationRequest(p, 20, stop_token_ids=eos)) for i, p in enumerate(ids)]
    got = {}
    gen.generate([], on_tokens=lambda i, t, f: f and got.__setitem__(i, (list(t), f)), feed=feed)
    assert [got[i][0] for i in range(len(ids))] == want
    assert got[99][1] == "cancelled" and 0 < len(got[99][0]) < 300
    assert gen.pool.used_pages == gen.held_pages == 0 and feed.flushes > 0


class _ListFeed:
    """A feed that hands over ``arrivals[k]`` at its k-th poll and stops once idle with nothing
    left; ``busy(n)``: what ``pending()`` says at its n-th call (a cut-short pipelined run)."""

    def __init__(self, arrivals: dict, busy=lambda n: False):
        self.arrivals, self.busy, self.polls, self.asked = dict(arrivals), busy, 0, 0

    def poll(self, idle):
        self.polls += 1
        new = self.arrivals.pop(self.polls, [])
        if idle and not new and not self.arrivals:
            return None
        return new, []

    def pending(self):
        self.asked += 1
        return self.busy(self.asked)

    def flush(self):
        pass


def test_adaptive_chunk_rule(offline):
    """Offline: always ``chunk``. Online: a power-of-two multiple of ``min_chunk`` covering
    ``chunk`` scaled by the batch's fill, at most ``chunk``."""
    from nakta_model.generation.engine import Generator

    model = offline[0]
    with pytest.raises(ValueError, match="min_chunk"):
        Generator(model, max_batch=8, chunk=4, min_chunk=5)
    with pytest.raises(ValueError, match="min_chunk"):
        Generator(model, max_batch=8, chunk=4, min_chunk=0)
    gen = Generator(model, max_batch=256, chunk=16, min_chunk=2, pages=64)
    assert [gen._chunk_for(n) for n in (1, 256)] == [16, 16]  # no feed: offline
    gen._feed = object()
    got = [gen._chunk_for(n) for n in (1, 10, 32, 33, 64, 100, 128, 200, 256)]
    assert got == [2, 2, 2, 4, 4, 8, 8, 16, 16]
    gen.min_chunk = 16  # min_chunk == chunk: no adaptation
    assert gen._chunk_for(1) == 16


@pytest.mark.parametrize("busy", [lambda n: False, lambda n: n % 2 == 0], ids=["free", "cut"])
def test_adaptive_and_cut_short_chunks_give_the_offline_tokens(offline, busy):
    """Online, a light batch decodes short chunks (tokens reach ``on_tokens`` a few at a time,
    not ``chunk`` at a time) and a feed with something pending ends a pipelined run at the next
    read; either way every request gets exactly the offline Generator's tokens."""
    from nakta_model.generation.engine import GenerationRequest, Generator

    model, tok, _ = offline
    ids = [tok.encode(p, bos=True, eos=False) for p in PROMPTS]
    reqs = [GenerationRequest(p, 24) for p in ids]
    want = [r.tokens for r in Generator(model, max_batch=8, chunk=8).generate(reqs)]
    gen = Generator(model, max_batch=8, chunk=8, min_chunk=1)
    got, steps = {}, {}

    def on_tokens(i, tokens, finish):
        steps.setdefault(i, []).append(len(tokens) - sum(steps.get(i, [])))
        if finish:
            got[i] = list(tokens)

    # one request at first, the rest arrive while it decodes
    feed = _ListFeed({1: [(0, reqs[0])], 3: [(i, r) for i, r in enumerate(reqs) if i]}, busy)
    gen.generate([], on_tokens=on_tokens, feed=feed)
    assert [got[i] for i in range(len(ids))] == want
    assert max(steps[0][1:4]) == 1  # one row of eight: a chunk of min_chunk = 1 step
    assert all(n <= 8 for s in steps.values() for n in s)
    assert gen.pool.used_pages == gen.held_pages == 0
    assert feed.asked > 0  # pipelined runs happened (and, with "cut", were cut short)


def test_bad_command_line_is_one_error_line_exit_2(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for argv, words in (
        (["--checkpoint", str(tmp_path / "nope")], "--checkpoint"),
        (["--checkpoint", str(tmp_path), "--port", "70000"], "--port"),
        (["--random", "7B"], "--tokenizer"),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "nakta_model.serve", *argv],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert lines[0].startswith("error: ") and words in lines[0]


def test_a_client_gone_before_its_answer_cancels_its_row(server):
    """A non-streaming client that stops waiting: its row is dropped (it stops generating
    long before its budget) and its pages go back."""
    before = server.metrics()["nakta_generation_tokens_total"]
    body = {"model": NAME, "prompt": [1] + [300] * 8, "max_tokens": 500, "temperature": 0}
    body["ignore_eos"] = True
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", body, timeout=0.3)
    deadline = time.monotonic() + 60
    while True:
        m = server.metrics()
        if m["nakta_running_rows"] == 0 and m["nakta_kv_pages_used"] == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
    assert m["nakta_generation_tokens_total"] - before < 500


def test_a_streaming_client_gone_mid_stream_cancels_its_row_at_once(server):
    """A streaming client that closes its connection after the first event: Starlette's
    disconnect listener cancels the stream, whose rows stop long before their budget and
    give their pages back well within the stream's own backstop check (5 s)."""
    from nakta_model.serve.app import STREAM_CHECK_S

    before = server.metrics()["nakta_generation_tokens_total"]
    body = {"model": NAME, "prompt": [1] + [300] * 8, "max_tokens": 500, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=60
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one event, then the connection closes
    gone = time.monotonic()
    while True:
        m = server.metrics()
        if m["nakta_running_rows"] == 0 and m["nakta_kv_pages_used"] == 0:
            break
        assert time.monotonic() - gone < STREAM_CHECK_S - 1, m
        time.sleep(0.05)
    assert m["nakta_generation_tokens_total"] - before < 500
