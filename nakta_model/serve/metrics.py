"""The server's Prometheus metrics (``/metrics``), in a registry of its own (so several servers
in one process, as in the tests, never collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["Metrics"]

_LATENCY = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
_GAP = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class Metrics:
    """Counters, gauges and histograms the routes and the engine bridge update."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "nakta_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.prompt_tokens = Counter("nakta_prompt_tokens", "prompt tokens taken", registry=r)
        self.generation_tokens = Counter(
            "nakta_generation_tokens", "tokens generated and sent", registry=r
        )
        self.queue_depth = Gauge(
            "nakta_queue_depth", "requests waiting for their first token", registry=r
        )
        self.running = Gauge("nakta_running_rows", "requests decoding", registry=r)
        self.kv_used = Gauge("nakta_kv_pages_used", "KV pages in use", registry=r)
        self.kv_total = Gauge("nakta_kv_pages_total", "KV pages in the pool", registry=r)
        self.kv_usage = Gauge("nakta_kv_usage_ratio", "KV pages in use / pool", registry=r)
        self.ttft = Histogram(
            "nakta_time_to_first_token_seconds",
            "request arrival -> its first token on the host",
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            "nakta_inter_token_seconds",
            "gap before each later token reached the host (tokens arrive a decode chunk at "
            "a time: the first of a chunk carries the gap, the rest 0)",
            buckets=_GAP,
            registry=r,
        )
        self.e2e = Histogram(
            "nakta_request_seconds", "request arrival -> finish", buckets=_LATENCY, registry=r
        )
        # where a first token's time goes, and the HTTP side's cost per streamed event
        # (serve_bench reads their sums and counts around each run)
        self.ttft_queue = Histogram(
            "nakta_ttft_queue_seconds",
            "arrival -> the engine takes the request (the step in flight ends)",
            buckets=_GAP,
            registry=r,
        )
        self.ttft_engine = Histogram(
            "nakta_ttft_engine_seconds",
            "the engine takes the request -> its first token on the host (prefill)",
            buckets=_GAP,
            registry=r,
        )
        self.ttft_write = Histogram(
            "nakta_ttft_write_seconds",
            "first token on the host -> its event written to the client's stream",
            buckets=_GAP,
            registry=r,
        )
        self.deliver_lag = Histogram(
            "nakta_deliver_lag_seconds",
            "the engine hands a step's tokens over -> the event loop takes them",
            buckets=_GAP,
            registry=r,
        )
        self.stream_events = Counter(
            "nakta_stream_events", "server-sent events written (one per wake-up)", registry=r
        )
        self.stream_seconds = Counter(
            "nakta_stream_seconds",
            "event-loop time turning tokens into server-sent events",
            registry=r,
        )
        self.rejected = Counter(
            "nakta_rejected", "requests refused because the queue was full", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
