"""nakta-serve's engine bridge and request shaping without HTTP: what goes to the engine for a
request with and without stop strings, the hand-over held back while the GPU idles
(``--defer-flush-rows``), the engine counters in /metrics, and the new command-line knobs."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from nakta_model.generation.requests import GenerationRequest, GenerationStats  # noqa: E402
from nakta_model.generation.sampling import SamplingParams  # noqa: E402
from nakta_model.generation.streaming import TextStream  # noqa: E402
from nakta_model.serve import bridge as bridge_mod  # noqa: E402
from nakta_model.serve.app import _engine_request  # noqa: E402
from nakta_model.serve.bridge import EngineBridge, Handle  # noqa: E402
from nakta_model.serve.cli import parse_args  # noqa: E402
from nakta_model.serve.metrics import Metrics  # noqa: E402


class _Tok:
    def decode(self, ids):
        return " ".join(str(i) for i in ids)


def test_stop_strings_reach_the_engine_only_when_there_are_some():
    plain = _engine_request(TextStream(_Tok(), [1, 2]), 5, SamplingParams(), (2,))
    assert plain.stop is None and plain.prompt == [1, 2] and plain.max_new_tokens == 5
    assert tuple(plain.stop_token_ids) == (2,)
    cut = _engine_request(TextStream(_Tok(), [1, 2], ["x"]), 5, SamplingParams(), ())
    assert cut.stop is not None and cut.stop.stops == ["x"]


class _Stream:
    """A CUDA stream stand-in: ``idle`` is what ``query()`` answers."""

    def __init__(self):
        self.idle = True

    def query(self):
        return self.idle


def _bridge(
    defer_rows: int = 0, pipeline_rows: int = 0, admit_gap_s: float = 0.0
) -> tuple[EngineBridge, Metrics]:
    gen = SimpleNamespace(pool=SimpleNamespace(capacity=8, used_pages=0), stats=GenerationStats())
    m = Metrics()
    return EngineBridge(gen, m, 4, defer_rows, pipeline_rows, admit_gap_s), m


def _handles(b: EngineBridge, loop, n: int) -> list[Handle]:
    hs = []
    for key in range(n):
        h = Handle(key, GenerationRequest([1], 4), loop, 0.0)
        b._live[key] = h
        b._waiting += 1
        hs.append(h)
    return hs


def test_deferred_hand_over_waits_for_a_busy_gpu_then_delivers_everything():
    loop = asyncio.new_event_loop()
    try:
        b, m = _bridge(defer_rows=2)
        b._stream = _Stream()
        hs = _handles(b, loop, 3)
        for h in hs:
            b._on_tokens(h.key, [7], None)
        b.flush()  # 3 rows >= 2 and the GPU idles: held back
        loop.run_until_complete(asyncio.sleep(0))
        assert [h.n for h in hs] == [0, 0, 0] and b.clock.deferred == 1
        b._on_tokens(0, [7, 8], "length")
        b._stream.idle = False
        b.flush()  # a chunk in flight: everything goes, the latest tokens of each row
        loop.run_until_complete(asyncio.sleep(0))
        assert [h.n for h in hs] == [2, 1, 1] and hs[0].finish == "length"
        assert all(h.event.is_set() for h in hs)
        assert b.live() == 2 and b._waiting == 0  # row 0 ended; all three left the queue
        # one row with news is under the threshold: it goes at once, GPU idle or not
        b._stream.idle = True
        b._on_tokens(1, [7, 9], None)
        b.flush()
        loop.run_until_complete(asyncio.sleep(0))
        assert hs[1].n == 2
        text = m.render().decode()
        assert "nakta_engine_deferred_flushes_total 1.0" in text
        assert "nakta_engine_flushes_total 2.0" in text
    finally:
        loop.close()


def test_a_deferred_hand_over_goes_after_max_defer_s(monkeypatch):
    loop = asyncio.new_event_loop()
    try:
        b, _ = _bridge(defer_rows=1)
        b._stream = _Stream()
        (h,) = _handles(b, loop, 1)
        b._on_tokens(0, [5], None)
        b.flush()
        assert b.clock.deferred == 1
        b._dirty_since -= bridge_mod.MAX_DEFER_S  # held back long enough
        b.flush()
        loop.run_until_complete(asyncio.sleep(0))
        assert h.n == 1 and b.clock.deferred == 1
    finally:
        loop.close()


def test_no_deferral_without_a_gpu_stream():
    loop = asyncio.new_event_loop()
    try:
        b, _ = _bridge(defer_rows=1)  # CPU: no stream to ask
        (h,) = _handles(b, loop, 1)
        b._on_tokens(0, [5], None)
        b.flush()
        loop.run_until_complete(asyncio.sleep(0))
        assert h.n == 1 and b.clock.deferred == 0
    finally:
        loop.close()


def test_light_batch_is_not_pipelined():
    """``pending()`` (the engine queues no chunk behind the running one while it is True):
    arrivals, or fewer running rows than ``pipeline_rows``."""
    loop = asyncio.new_event_loop()
    try:
        b, _ = _bridge(pipeline_rows=2)
        assert b.pending()  # nothing runs
        hs = _handles(b, loop, 2)
        assert b.pending()  # two submitted, neither has a token yet: none runs
        for h in hs:
            b._on_tokens(h.key, [3], None)
        b.flush()
        assert not b.pending()  # two run: pipelined
        b._on_tokens(0, [3, 4], "length")
        b.flush()
        assert b.pending()  # one left
        always, _ = _bridge(pipeline_rows=0)
        assert not always.pending()
        always._cancel.append(1)
        assert always.pending()  # a cancellation waits
    finally:
        loop.close()


def _arrive(b: EngineBridge, loop, key: int) -> None:
    """What ``submit`` does, from any thread (``submit`` itself needs a running loop)."""
    with b._cv:
        h = Handle(key, GenerationRequest([1], 4), loop, time.perf_counter())
        b._live[key] = h
        b._waiting += 1
        b._new.append(h)
        b._cv.notify()


@pytest.mark.parametrize("gap", [0.0, 0.3])
def test_a_burst_of_arrivals_is_gathered_while_the_batch_is_light(monkeypatch, gap):
    monkeypatch.setattr(bridge_mod, "MAX_GATHER_S", 5.0)
    loop = asyncio.new_event_loop()
    try:
        b, _ = _bridge(pipeline_rows=4, admit_gap_s=gap)
        _arrive(b, loop, 0)

        def more():
            for key in range(1, 6):
                time.sleep(0.01)
                _arrive(b, loop, key)

        t = threading.Thread(target=more)
        t.start()
        new, _ = b.poll(idle=False)
        t.join()
        if gap:
            assert [k for k, _ in new] == [0, 1, 2, 3, 4, 5]  # 10 ms apart: one group
        else:
            assert [k for k, _ in new][0] == 0 and len(new) < 6  # at once: what was there
        # a batch that is not light is never held
        b2, _ = _bridge(pipeline_rows=0, admit_gap_s=0.3)
        _arrive(b2, loop, 0)
        t0 = time.perf_counter()
        assert len(b2.poll(idle=False)[0]) == 1 and time.perf_counter() - t0 < 0.25
    finally:
        loop.close()


def test_engine_clock_counts_busy_spans_only():
    c = bridge_mod.EngineClock()
    c.stop()  # not started: nothing
    assert c.busy_s == 0
    c.start()
    sum(range(200_000))
    c.stop()
    assert c.busy_s > 0 and 0 < c.cpu_s <= c.busy_s * 1.5 + 1e-3


def test_new_knobs_parse_and_bad_values_are_one_error(capsys):
    s = parse_args(["--random", "7B", "--tokenizer", "t"])
    assert s.switch_interval_s == pytest.approx(0.0005)
    assert s.defer_rows == 0 and s.prefill_burst is None and s.pipeline_rows is None
    assert s.admit_gap_s == 0
    s = parse_args(["--random", "7B", "--tokenizer", "t", "--switch-interval-ms", "5",
                    "--defer-flush-rows", "64", "--prefill-burst", "2",
                    "--pipeline-rows", "0"])  # fmt: skip
    assert s.switch_interval_s == pytest.approx(0.005)
    assert s.defer_rows == 64 and s.prefill_burst == 2 and s.pipeline_rows == 0
    for flag, value in (("--switch-interval-ms", "0"), ("--defer-flush-rows", "-1"),
                        ("--prefill-burst", "0"), ("--pipeline-rows", "-1"),
                        ("--admit-gap-ms", "50")):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            parse_args(["--random", "7B", "--tokenizer", "t", flag, value])
        assert e.value.code == 2
        assert flag in capsys.readouterr().err
