"""``nakta-serve`` at tensor parallel 2: ``torch.distributed.run`` starts two CPU ranks (gloo) on
the real stories260K converted at tp=2; rank 0 serves HTTP on loopback, rank 1 follows its
engine in lockstep (``nakta_model/serve/lockstep.py``). Greedy text, streamed chat, echo +
logprobs and a cancelled stream against one process's model (tp=1: the offline ``Generator`` and
``sequence_logprobs``); SIGTERM to rank 0 drains the request in flight and ends both ranks with
status 0. One server pair for the module; torchrun runs in its own session, killed whole if a
test leaves it running."""

from __future__ import annotations

import concurrent.futures
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

REPO = Path(__file__).resolve().parents[1]
NAME = "stories260K-tp2"
PROMPTS = ["Once upon a time", "Lily and Tom went to the park", "The little dog", "One day, a bird"]


def _pythonpath() -> str:
    """The repo first, then whatever the caller's path held (the GPU image's carried wheels)."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


START_S = 240.0

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class TorchrunServer:
    """``torch.distributed.run --nproc_per_node 2 -m nakta_model.serve`` on a free loopback
    port, in a session of its own; ``url`` and rank 0's ``pid`` once it listens."""

    def __init__(self, checkpoint: Path, *args: str, device: str = "cpu"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc_per_node", "2", "--monitor-interval", "0.2", "-m", "nakta_model.serve"]
        cmd += ["--checkpoint", str(checkpoint), "--port", "0", "--device", device]
        cmd += ["--dtype", "fp32", "--no-access-log", "--model-name", NAME, *args]
        env = {**os.environ, "PYTHONPATH": _pythonpath(), "OMP_NUM_THREADS": "1"}
        if device == "cpu":
            env["TRITON_INTERPRET"] = "1"
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=self._drain, daemon=True).start()
        self.url: str | None = None
        self.pid: int | None = None
        deadline = time.monotonic() + START_S
        while self.url is None:
            try:
                line = self._q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                raise RuntimeError("server did not start:\n" + self.log()) from None
            if line is None:
                raise RuntimeError("server exited:\n" + self.log())
            if m := re.search(r"rank 0 \(pid (\d+)\) serves", line):
                self.pid = int(m.group(1))
            if "listening on " in line:
                self.url = line.split("listening on ")[1].strip()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self._q.put(line)
        self._q.put(None)

    def log(self, n: int = 60) -> str:
        return "".join(self.lines[-n:])

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # torchrun and both ranks: our session
        self.proc.wait()

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, value = line.split()
                out[name] = float(value)
        return out

    def client(self):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def stories() -> Path:
    from conftest import SHARED_DATA

    if not (SHARED_DATA / "stories260K").is_dir():
        pytest.skip(f"stories260K not found in {SHARED_DATA}")
    return SHARED_DATA / "stories260K"


@pytest.fixture(scope="module")
def tp2_checkpoint(stories, tmp_path_factory) -> Path:
    import convert

    return convert.convert(stories, tmp_path_factory.mktemp("serve_tp") / "st2", tp=2, quiet=True)


@pytest.fixture(scope="module")
def server(tp2_checkpoint):
    s = TorchrunServer(tp2_checkpoint, "--max-batch", "8")
    yield s
    s.kill()  # a test that failed before the SIGTERM test leaves nothing running


@pytest.fixture(scope="module")
def offline(stories):
    """One process's model (tp=1, the Meta folder itself), tokenizer and Generator."""
    import nakta_model
    from nakta_model.generation.engine import Generator
    from nakta_model.tokenizer import Tokenizer

    model = nakta_model.load(stories, "cpu", torch.float32)
    tok = Tokenizer(stories / "tokenizer.model")
    return model, tok, Generator(model, max_batch=8, chunk=16)


def offline_texts(offline, prompts: list[list[int]], max_tokens: int, stop=()) -> list[str]:
    from nakta_model.generation.sampling import SamplingParams
    from nakta_model.generation.streaming import TextStream

    _, tok, gen = offline
    streams = [TextStream(tok, p, stop) for p in prompts]
    reqs = [s.request(max_tokens, SamplingParams(), (tok.eos_id,)) for s in streams]
    return [r.text for r in gen.generate(reqs)]


def _wait_idle(server: TorchrunServer, within_s: float) -> dict[str, float]:
    t0 = time.monotonic()
    while True:
        m = server.metrics()
        if m["nakta_running_rows"] == 0 and m["nakta_kv_pages_used"] == 0:
            return m
        assert time.monotonic() - t0 < within_s, m
        time.sleep(0.05)


# ------------------------------------------------------ the control messages, in one process
class _Tok:
    def decode(self, ids):
        return " ".join(str(i) for i in ids)


class _Sent:
    """A Lockstep stand-in on rank 0: what the bridge sends, in order."""

    heartbeat_s = 0.05

    def __init__(self):
        self.messages: list[tuple] = []

    def send(self, message):
        self.messages.append(message)


def _scaled(model, x, k):  # a model call: travels by name
    return (model, x * k)


def test_rank_0_broadcasts_every_answer_and_an_idle_heartbeat():
    import asyncio
    import pickle
    from types import SimpleNamespace

    from nakta_model.generation.requests import GenerationRequest, GenerationStats
    from nakta_model.generation.sampling import SamplingParams
    from nakta_model.generation.streaming import TextStream
    from nakta_model.serve.bridge import EngineBridge, Handle
    from nakta_model.serve.lockstep import request_from_wire
    from nakta_model.serve.metrics import Metrics

    gen = SimpleNamespace(
        pool=SimpleNamespace(capacity=8, used_pages=0), stats=GenerationStats(), model="M"
    )
    sent = _Sent()
    b = EngineBridge(gen, Metrics(), 4, lockstep=sent)
    loop = asyncio.new_event_loop()
    try:
        cut = TextStream(_Tok(), [1, 2], ["9 9"]).request(6, SamplingParams(0.5, 3, 0.9), (2,))
        for key, req in enumerate([GenerationRequest([1, 5], 4), cut]):
            h = Handle(key, req, loop, time.perf_counter())
            b._live[key], b._waiting = h, b._waiting + 1
            b._new.append(h)
        b._cancel.append(7)
        fut = concurrent.futures.Future()
        b._calls.append(((_scaled, (3, 2)), fut))
        assert b.pending() and sent.messages[-1] == ("pending", True)
        new, cancel = b.poll(idle=False)
        assert [k for k, _ in new] == [0, 1] and cancel == [7] and fut.result() == ("M", 6)
        kind, wire, wire_cancel, calls = pickle.loads(pickle.dumps(sent.messages[-1]))
        assert kind == "poll" and wire_cancel == [7] and calls == [(_scaled, (3, 2))]
        plain, stopped = (request_from_wire(w, _Tok()) for _, w in wire)
        assert plain.prompt == [1, 5] and plain.max_new_tokens == 4 and plain.stop is None
        assert stopped.sampling == cut.sampling and tuple(stopped.stop_token_ids) == (2,)
        assert stopped.stop.cut([8, 9, 9]) == cut.stop.cut([8, 9, 9]) == (" 8 ", True)
        with ThreadPoolExecutor(1) as pool:  # nothing came: an empty answer, not a wait
            idle = pool.submit(b.poll, True)
            try:
                assert idle.result(timeout=5) == ([], [])
            finally:
                with b._cv:  # a bridge that kept waiting: released
                    b._stop = True
                    b._cv.notify()
        assert sent.messages[-1] == ("poll", [], [], [])
        assert b.poll(idle=True) is None and sent.messages[-1] == ("stop",)
    finally:
        loop.close()


def test_a_follower_returns_rank_0s_answers_and_refuses_one_out_of_step(monkeypatch):
    from nakta_model.generation.sampling import SamplingParams
    from nakta_model.serve import lockstep as ls

    inbox = [
        ("pending", False),
        ("poll", [(4, ([1, 2], 5, SamplingParams(), (2,), ["x"]))], [3], [(_scaled, (2, 5))]),
        ("stop",),
        ("poll", [], [], []),
    ]

    def broadcast(box, src, group):
        box[0] = inbox.pop(0)

    monkeypatch.setattr(ls.dist, "broadcast_object_list", broadcast)
    chan = object.__new__(ls.Lockstep)
    chan.group, chan.rank = None, 1
    feed = ls.FollowerFeed(chan, "M", _Tok())
    assert feed.pending() is False
    new, cancel = feed.poll(idle=False)
    assert cancel == [3] and [k for k, _ in new] == [4] and new[0][1].stop.stops == ["x"]
    assert feed.poll(idle=True) is None
    with pytest.raises(ls.LockstepError, match="expected a pending message"):
        feed.pending()


# ----------------------------------------------------------------------------------- tests
def test_tp_without_torchrun_is_one_error_line_exit_2(tp2_checkpoint):
    r = subprocess.run(
        [sys.executable, "-m", "nakta_model.serve", "--checkpoint", str(tp2_checkpoint),
         "--tp", "2", "--device", "cpu", "--port", "0"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": _pythonpath()}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and "torchrun --nproc_per_node 2" in lines[0]


def test_completions_greedy_text_equals_one_process(server, offline):
    _, tok, _ = offline
    ids = [tok.encode(p, bos=True, eos=False) for p in PROMPTS]
    want = offline_texts(offline, ids, 24)
    c = server.client()
    r = c.completions.create(model=NAME, prompt=PROMPTS, max_tokens=24, temperature=0)
    assert [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)] == want
    # one request each, all at once (they join one batch), and stop strings (they travel to
    # rank 1 as strings and are cut there by its own tokenizer: the rows must end alike)
    stop = [want[0].split(" ")[3]]
    want_cut = offline_texts(offline, ids, 24, stop)
    with ThreadPoolExecutor(len(ids)) as pool:
        outs = list(
            pool.map(
                lambda p: c.completions.create(
                    model=NAME, prompt=p, max_tokens=24, temperature=0, stop=stop
                ),
                ids,
            )
        )
    assert [o.choices[0].text for o in outs] == want_cut
    assert outs[0].choices[0].finish_reason == "stop"


def test_streamed_chat_equals_one_process(server, offline):
    from nakta_model.serve.chat import chat_prompt

    _, tok, _ = offline
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    want = offline_texts(offline, [chat_prompt(tok, messages)], 20)[0]
    stream = server.client().chat.completions.create(
        model=NAME, messages=messages, max_tokens=20, temperature=0, stream=True
    )
    pieces = [e.choices[0].delta.content or "" for e in stream]
    assert len([p for p in pieces if p]) > 1 and "".join(pieces) == want


def test_echo_logprobs_equal_one_process(server, offline):
    """lm-eval's loglikelihood request (token ids, echo, logprobs 1, max_tokens 1): its
    forward runs on both ranks between engine steps."""
    from nakta_model.serve.logprobs import sequence_logprobs

    model, tok, _ = offline
    ids = tok.encode(PROMPTS[1] + " and the sun was warm", bos=True, eos=False)
    want = sequence_logprobs(model, ids, 1)
    r = server.client().completions.create(
        model=NAME, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) + 1
    got = torch.tensor(lp.token_logprobs[1:])
    ref = torch.tensor(want.logprobs + [want.next_logprobs[0]])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)  # fp32: TP sums in pieces
    from nakta_model.generation.streaming import TextStream

    nxt = TextStream(tok, ids).continuation([want.next_ids[0]])  # the greedy token
    assert r.choices[0].text == tok.decode(ids) + nxt


def test_a_stream_cancelled_mid_way_frees_its_row_on_every_rank(server, offline):
    """The client leaves after one event: the row ends long before its budget and its pages
    go back; the next request's greedy text is still one process's (rank 1 dropped the same
    row, so both ranks still run the same batch)."""
    before = server.metrics()["nakta_generation_tokens_total"]
    body = {"model": NAME, "prompt": [1] + [300] * 8, "max_tokens": 500, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    m = _wait_idle(server, 10)
    assert m["nakta_generation_tokens_total"] - before < 500
    _, tok, _ = offline
    ids = tok.encode(PROMPTS[2], bos=True, eos=False)
    r = server.client().completions.create(model=NAME, prompt=ids, max_tokens=16, temperature=0)
    assert r.choices[0].text == offline_texts(offline, [ids], 16)[0]


def test_sigterm_to_rank_0_drains_and_every_rank_exits_0(server, offline):
    """Last in the module: a request in flight finishes, then both ranks end, status 0."""
    _, tok, _ = offline
    ids = tok.encode(PROMPTS[3], bos=True, eos=False)
    want = offline_texts(offline, [ids], 80)[0]
    c = server.client()
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(
            c.completions.create, model=NAME, prompt=ids, max_tokens=80, temperature=0
        )
        t0 = time.monotonic()
        while server.metrics()["nakta_running_rows"] == 0 and not fut.done():
            assert time.monotonic() - t0 < 30
            time.sleep(0.02)
        assert server.pid is not None
        os.kill(server.pid, signal.SIGTERM)
        assert fut.result(timeout=120).choices[0].text == want
    try:
        code = server.proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("the ranks did not stop:\n" + server.log())
    log = server.log(200)
    assert code == 0, log
    assert "nakta-serve: stopped" in log and "nakta-serve: rank 1 stopped" in log, log


# ------------------------------------------------------------------- slower: one start each
def _torchrun_fails(checkpoint: Path, *args: str) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    cmd += ["2", "--monitor-interval", "0.2", "-m", "nakta_model.serve", "--checkpoint"]
    cmd += [str(checkpoint), "--device", "cpu", "--dtype", "fp32", *args]
    env = {
        **os.environ,
        "PYTHONPATH": _pythonpath(),
        "TRITON_INTERPRET": "1",
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=START_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail("torchrun hung:\n" + out[-3000:])
    return proc.returncode, out


@pytest.mark.slow
def test_under_torchrun_bad_tp_and_a_taken_port_are_one_error_line(tp2_checkpoint):
    code, out = _torchrun_fails(tp2_checkpoint, "--tp", "1", "--port", "0")
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert code != 0 and len(errors) == 1, out[-3000:]
    assert "world size 2 != tp 1" in errors[0]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code, out = _torchrun_fails(tp2_checkpoint, "--port", str(port))
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert code != 0 and len(errors) == 1, out[-3000:]
    assert f"--port {port}: cannot bind" in errors[0]
    assert re.search(r"exitcode\s*:\s*2", out), out[-3000:]  # status 2 on the ranks


@pytest.mark.slow
def test_idle_past_the_group_timeout_then_torchruns_sigterm_stops_every_rank(
    tp2_checkpoint, offline
):
    """Rank 0 answers its idle followers every few seconds, so an idle spell longer than the
    collectives' timeout ends no rank; torchrun's SIGTERM reaches every rank, rank 0 alone
    acts on it and stops the others."""
    s = TorchrunServer(tp2_checkpoint, "--max-batch", "4", "--dist-timeout-s", "12")
    try:
        time.sleep(15)
        _, tok, _ = offline
        ids = tok.encode(PROMPTS[0], bos=True, eos=False)
        r = s.client().completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0)
        assert r.choices[0].text == offline_texts(offline, [ids], 12)[0], s.log()
        s.proc.send_signal(signal.SIGTERM)  # torchrun: it signals both ranks
        s.proc.wait(timeout=90)
        log = s.log(200)
        assert "nakta-serve: stopped" in log and "nakta-serve: rank 1 stopped" in log, log
        # the ranks' own output (torchrun then raises its SignalException: its traceback)
        ranks = log[: max(log.index("nakta-serve: stopped"), log.index("rank 1 stopped"))]
        assert "Traceback" not in ranks, log
    finally:
        s.kill()


@pytest.mark.gpu
def test_two_gpus_greedy_text_and_logprobs_equal_one_process(tp2_checkpoint, offline):
    """The same server on two GPUs (NCCL for the model, gloo for the ranks' control
    messages; CUDA graphs captured on both ranks at warm-up), fp32, against one CPU process."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from nakta_model.serve.logprobs import sequence_logprobs

    model, tok, _ = offline
    s = TorchrunServer(tp2_checkpoint, "--max-batch", "8", device="cuda")
    try:
        ids = [tok.encode(p, bos=True, eos=False) for p in PROMPTS]
        c = s.client()
        r = c.completions.create(model=NAME, prompt=PROMPTS, max_tokens=24, temperature=0)
        got = [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]
        assert got == offline_texts(offline, ids, 24)
        r = c.completions.create(
            model=NAME, prompt=ids[1], max_tokens=1, temperature=0, logprobs=1, echo=True
        )
        want = sequence_logprobs(model, ids[1], 1)
        torch.testing.assert_close(
            torch.tensor(r.choices[0].logprobs.token_logprobs[1:]),
            torch.tensor(want.logprobs + [want.next_logprobs[0]]),
            rtol=1e-4, atol=1e-4,
        )  # fmt: skip
        os.kill(s.pid, signal.SIGTERM)
        assert s.proc.wait(timeout=120) == 0, s.log()
    finally:
        s.kill()


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


@pytest.mark.slow
def test_a_dead_follower_ends_every_rank_instead_of_a_hang(tp2_checkpoint):
    """Rank 1 killed outright: rank 0's next collective fails at once (its engine stops the
    server) or torchrun ends it; either way the job ends, well before any timeout."""
    if not Path("/proc/self/task").is_dir():
        pytest.skip("needs /proc")
    s = TorchrunServer(tp2_checkpoint, "--max-batch", "4")
    try:
        follower = [k for k in _children(s.proc.pid) if k != s.pid]
        assert len(follower) == 1, (follower, s.pid)
        os.kill(follower[0], signal.SIGKILL)
        t0 = time.monotonic()
        code = s.proc.wait(timeout=60)
        assert code != 0 and time.monotonic() - t0 < 60, s.log()
    finally:
        s.kill()
