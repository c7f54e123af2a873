"""Timing primitives shared by the benchmarks: eager calls, CUDA-graph replays (``graph_ms``,
the one graph timer; ``rotated_ms`` / ``interleaved_ms`` for head-to-head paths), and how many
input copies defeat the L2 cache."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def eager_ms(
    fn: Callable[[], object], device: torch.device, warmup: int = 5, rep: int = 10
) -> float:
    """Median ms per call launched from Python (do_bench: events, L2 flushed between calls;
    ``warmup``/``rep`` in ms); wall clock, median of 3, on the CPU.

    Includes the host's launch overhead wherever it exceeds the GPU time."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[1]


def graph_ms(
    calls: Callable[[], object] | list[Callable[[], object]],
    stream: torch.cuda.Stream | None = None,
    budget_ms: float = 20.0,
) -> float:
    """GPU ms per call: calls cycled inside one CUDA graph, median of 3 replays.

    The one CUDA-graph timer of the benches. Graph replay removes host launch overhead.
    ``calls`` (one callable, or several with distinct input sets, together larger than L2: see
    ``input_sets``) then read their inputs from DRAM. ``stream``: where the graph is captured
    (default: the current stream, which must not be the legacy default stream)."""
    calls = [calls] if callable(calls) else list(calls)
    stream = stream if stream is not None else torch.cuda.current_stream()
    reps = _graph_reps(calls, budget_ms)
    graph = _capture(calls, reps, stream)
    torch.cuda.synchronize()
    times = [_replay_ms(graph) / (reps * len(calls)) for _ in range(3)]
    del graph
    return sorted(times)[1]


def rotated_ms(
    calls: dict[str, list[Callable[[], object]]], rounds: int = 3, budget_ms: float = 10.0
) -> tuple[dict[str, float], dict[str, str]]:
    """GPU ms per call of every path at one point of a sweep: ``(path -> median, path -> why
    it could not be timed)``.

    Each round captures each path's CUDA graph in turn (its calls cycled, repeated to
    ~``budget_ms``), replays it once warm, times one replay and frees it; the median over the
    rounds is kept. So drift (clocks, temperature) between paths averages out as in
    ``interleaved_ms``, while only one path's graph memory is held at a time, which the
    largest sweep shapes need. A path whose graph cannot be captured is reported, not timed.
    """
    times: dict[str, list[float]] = {n: [] for n in calls}
    reps: dict[str, int] = {}
    errors: dict[str, str] = {}
    stream = torch.cuda.current_stream()
    if stream == torch.cuda.default_stream():  # graphs are captured on a side stream
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
    for _ in range(rounds):
        for n, cs in calls.items():
            if n in errors:
                continue
            try:
                if n not in reps:
                    reps[n] = _graph_reps(cs, budget_ms)
                graph = _capture(cs, reps[n], stream)
                times[n].append(_replay_ms(graph) / (reps[n] * len(cs)))
                del graph
            except Exception as ex:  # e.g. a peer that syncs with the host inside its call
                errors[n] = str(ex).splitlines()[0][:60] if str(ex) else type(ex).__name__
    medians = {n: _median_spread(ts)[0] for n, ts in times.items() if ts and n not in errors}
    return medians, errors


def _graph_reps(calls: list[Callable[[], object]], budget_ms: float) -> int:
    """Passes over ``calls`` in one graph: ~``budget_ms`` of work by a warm host timing, at
    least one and at most ~24 calls."""
    est = _warm_ms(calls)
    return max(1, min(24 // len(calls) + 1, int(budget_ms / max(est, 1e-3) / len(calls))))


def _warm_ms(calls: list[Callable[[], object]]) -> float:
    """Run every call once (compilation, autotuning, allocator), then time one: host ms."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    calls[0]()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def _capture(calls: list[Callable[[], object]], reps: int, stream):
    """One CUDA graph of ``reps`` passes over ``calls``, replayed once (a warm replay)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(reps):
            for c in calls:
                c()
    graph.replay()
    return graph


def _replay_ms(graph) -> float:
    """GPU ms of one replay, between CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def input_sets(device: torch.device, bytes_per_call: int) -> int:
    """Copies of the inputs to cycle through so that one pass over them exceeds 3x L2."""
    if device.type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return max(1, min(8, -(-3 * l2 // bytes_per_call)))


def interleaved_ms(
    calls: dict[str, list[Callable[[], object]]],
    device: torch.device,
    rounds: int = 15,
    budget_ms: float = 4.0,
) -> dict[str, tuple[float, float]]:
    """Head-to-head GPU ms per call of several paths: ``name -> (median, spread)``.

    One CUDA graph per path (its calls cycled, repeated to ~``budget_ms``); each round replays
    every graph once, in turn, so clock and temperature drift hit every path alike. Sequential
    measurements of paths within ~1% of each other (RMSNorm, SwiGLU vs Liger on an H200) can
    come out in either order; alternating rounds settle which is faster. ``spread`` is
    (max - min) / median over the rounds. On the CPU, eager calls alternate the same way.
    Run it on a side stream on CUDA (graphs cannot be captured on the default stream).
    """
    if device.type != "cuda":
        times = {n: [] for n in calls}
        for _ in range(rounds):
            for n, cs in calls.items():
                t0 = time.perf_counter()
                for c in cs:
                    c()
                times[n].append((time.perf_counter() - t0) * 1e3 / len(cs))
        return {n: _median_spread(ts) for n, ts in times.items()}
    graphs = {}
    for n, cs in calls.items():
        reps = max(2, min(64, int(budget_ms / max(_warm_ms(cs), 1e-3) / len(cs))))
        graphs[n] = (_capture(cs, reps, torch.cuda.current_stream()), reps * len(cs))
    torch.cuda.synchronize()
    times = {n: [] for n in graphs}
    for _ in range(rounds):
        for n, (graph, k) in graphs.items():
            times[n].append(_replay_ms(graph) / k)
    del graphs
    return {n: _median_spread(ts) for n, ts in times.items()}


def _median_spread(ts: list[float]) -> tuple[float, float]:
    s = sorted(ts)
    med = s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])
    return med, (s[-1] - s[0]) / med if med > 0 else float("nan")
