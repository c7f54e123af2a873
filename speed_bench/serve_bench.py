"""Serving benchmark: N prompts replayed against nakta-serve over HTTP at request rates, with the
offline ``Generator`` on the same prompts as the reference.

    python -m speed_bench.serve_bench --tokenizer ../shared/data/llama_tokenizer.model   # 7B, GPU
    python -m speed_bench.serve_bench --lengths hellaswag --rates 10,inf
    python -m speed_bench.serve_bench --url http://127.0.0.1:8000 --model NAME ...     # a running one

Workload: ``--prompts`` requests of BOS + seeded random token ids; prompt lengths fixed
(``--input-len``) or drawn from the committed HellaSwag length histogram (``--lengths hellaswag``,
``speed_bench/hellaswag_lengths.json``); every request asks ``--output-len`` new tokens, greedy,
EOS ignored (vLLM's ``ignore_eos``), so every request gets exactly that many.

Steps: (1) the offline reference: the same model (random weights of ``--preset``, or
``--checkpoint``) in this process, one warmed-up ``Generator(max_batch=--max-batch)`` call over
all prompts, output tok/s; the model is freed before (2): nakta-serve started as a subprocess on
the same weights (``--random PRESET --seed``), then for each rate of ``--rates`` the prompts
sent as streaming ``/v1/completions`` requests with Poisson arrivals at that rate (``inf``: all
at once), each rate on a fresh replay after the previous drained. Finite rates replay the first
``--rate-prompts`` prompts (a 2 req/s run of 1,000 would take 8 minutes). ``--chunk`` and
``--min-chunk`` set the server's decode chunk with a full and a light batch: fewer tokens between
host checks let an arrival start sooner (TTFT) at some host cost per token.

Per run: ``output_tok_s`` (tokens received / wall from the first send to the last token),
``requests_s``, TTFT (send -> first streamed event), TPOT ((last - first event) / (tokens - 1)
per request) and ITL (the gap between consecutive streamed events; tokens come a decode chunk
at a time) at p50 and p99. Writes ``serve_summary.json`` (``{"device_name", "offline_tok_s",
"runs": [{"rate", "output_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "itl_p99_s", ...}]}``,
rate null = unbounded), ``serve.md`` / ``serve.csv`` and ``serve.png`` (latency against rate) to
``--out`` (default ``speed_bench/results/<device>/serve/``).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run by path: import from the repo root, not from this script's folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import asyncio
import gc
import json
import math
import os
import queue
import random
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Sequence

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from nakta_model.cli import OneLineArgumentParser

    p = OneLineArgumentParser(prog="serve_bench", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None, help="random weights of this shape (default 7B)")
    src.add_argument("--checkpoint", help="a checkpoint folder instead of random weights")
    p.add_argument("--tokenizer", help="sentencepiece model (needed with random weights)")
    p.add_argument("--url", help="an already running server (no offline reference then)")
    p.add_argument("--model", help="the model name a --url server serves")
    p.add_argument("--prompts", type=int, default=1000)
    p.add_argument("--rate-prompts", type=int, default=100, help="prompts at finite rates")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--lengths", choices=["fixed", "hellaswag"], default="fixed")
    p.add_argument("--rates", default="2,5,10,20,40,inf", help="req/s, comma-separated")
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--chunk", type=int, help="the server's --chunk (default: its own)")
    p.add_argument("--min-chunk", type=int, help="the server's --min-chunk (default: its own)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--device", help="cpu | cuda (default: cuda when present)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-offline", action="store_true", help="skip the offline reference")
    p.add_argument(
        "--variant", action="append", default=[], metavar="NAME=ARGS", help="a server variant: "
        "NAME, then the extra nakta-serve arguments (e.g. 'gil5ms=--switch-interval-ms 5'); "
        "repeatable, each a fresh server after the main one, at --variant-rates"
    )  # fmt: skip
    p.add_argument("--variant-rates", default="10,inf", help="the variants' rates (req/s)")
    p.add_argument("--out", help="results folder (default speed_bench/results/<device>/serve)")
    a = p.parse_args(argv)
    a.rate_list = _rates(p, "--rates", a.rates)
    a.variant_rate_list = _rates(p, "--variant-rates", a.variant_rates)
    a.variants = []
    for v in a.variant:
        name, sep, extra = v.partition("=")
        if not sep or not name.strip() or name.strip() == "main" or any(c in name for c in " ,|"):
            p.error(f"--variant must be NAME=ARGS (a name without spaces, not main), got {v!r}")
        a.variants.append((name.strip(), shlex.split(extra)))
    if a.variants and a.url:
        p.error("--variant starts servers of its own: not with --url")
    for name in ("prompts", "rate_prompts", "input_len", "output_len", "max_batch"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.url is None and a.checkpoint is None and a.tokenizer is None:
        p.error("--tokenizer is needed with random weights (the server decodes text)")
    if a.url and not a.model:
        p.error("--url needs --model (the name the server serves)")
    a.preset = a.preset or ("7B" if a.checkpoint is None else None)
    return a


def _rates(p, flag: str, text: str) -> list[float | None]:
    try:
        rates = [None if r.strip() == "inf" else float(r) for r in text.split(",")]
    except ValueError:
        p.error(f"{flag} must be numbers or inf, got {text!r}")
    if any(r is not None and r <= 0 for r in rates):
        p.error(f"{flag} must be > 0")
    return rates


def make_prompts(a, vocab: int, bos: int, limit: int) -> list[list[int]]:
    """BOS + seeded random ids; lengths fixed or drawn from the HellaSwag histogram, each
    leaving room for ``--output-len`` in ``limit`` positions."""
    rng = random.Random(a.seed)
    if a.lengths == "hellaswag":
        from speed_bench.workload import _sampler, load_histogram

        draw = _sampler(load_histogram()["context_tokens_with_bos"], rng)
        lengths = [draw(limit - a.output_len) for _ in range(a.prompts)]
    else:
        if a.input_len + a.output_len > limit:
            raise SystemExit(f"error: --input-len + --output-len past the context of {limit}")
        lengths = [a.input_len] * a.prompts
    hi = min(vocab, 32000) - 1
    return [[bos] + [rng.randint(3, hi) for _ in range(n - 1)] for n in lengths]


def percentile(values: Sequence[float], q: float) -> float:
    v = sorted(x for x in values if not math.isnan(x))
    if not v:
        return float("nan")
    i = min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))
    return v[i]


# ---------------------------------------------------------------------------- offline
nan = float("nan")


def offline_reference(a, prompts: list[list[int]], device) -> tuple[float, list[dict]]:
    """Output tok/s of one warmed-up Generator call over every prompt (the model freed after),
    and rows in ``diagnose``'s terms: that call's own counters, and the same Generator run
    online without HTTP (its feed hands every prompt over at once, decode chunks sized as the
    server's): what the engine's online path gives before any HTTP or GIL cost."""
    import torch

    from nakta_model.generation.engine import GenerationRequest, Generator

    model = _model(a, device)
    # min_chunk: the server's (offline calls always run ``chunk``; the online run below uses it)
    gen = Generator(model, max_batch=a.max_batch, chunk=a.chunk or 16, min_chunk=a.min_chunk or 2)
    reqs = [GenerationRequest(p, a.output_len) for p in prompts]
    rows = []
    with torch.inference_mode():
        gen.generate(reqs[: min(len(reqs), 2 * a.max_batch)])  # compile, capture
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = gen.generate(reqs)
        wall = time.perf_counter() - t0
        tokens = sum(len(r.tokens) for r in out)
        rows.append({"server": "offline", **_engine_row(gen.stats, tokens, len(out), wall)})
        feed = _AllAtOnce(reqs)
        t0 = time.perf_counter()
        gen.generate([], on_tokens=feed.on_tokens, feed=feed)
        online = time.perf_counter() - t0
        rows.append(
            {"server": "engine_online", **_engine_row(gen.stats, feed.tokens, len(reqs), online)}
        )
    del gen, model, out
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return tokens / wall, rows


def _engine_row(st, tokens: int, requests: int, wall: float) -> dict:
    return {
        "rate": None,
        "output_tok_s": tokens / wall,
        "rows_per_step": (tokens - requests) / st.decode_steps if st.decode_steps else nan,
        "decode_steps": st.decode_steps,
        "prefill_forwards": st.prefill_chunks,
        "prefill_tokens_per_forward": st.prefilled_tokens / max(1, st.prefill_chunks),
        "engine_busy_s": wall,
        "engine_step_pct": 100 * (st.prefill_s + st.decode_s) / wall,
    }


class _AllAtOnce:
    """A ``Feed`` handing every request to the engine at its first poll, then stopping it
    once all have finished (the online engine path without HTTP)."""

    def __init__(self, requests):
        self.requests, self.given, self.finished, self.tokens = list(requests), False, 0, 0

    def poll(self, idle: bool):
        if self.finished == len(self.requests):
            return None
        if self.given:
            return [], []
        self.given = True
        return list(enumerate(self.requests)), []

    def pending(self) -> bool:
        return False

    def flush(self) -> None:
        pass

    def on_tokens(self, key: int, tokens: list[int], finish: str | None) -> None:
        if finish is not None:
            self.finished += 1
            self.tokens += len(tokens)


def _model(a, device):
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        a.dtype or ("bf16" if device.type == "cuda" else "fp32")
    ]
    if a.checkpoint:
        from nakta_model.loading import load

        return load(a.checkpoint, device, dtype)
    from nakta_model.config import preset
    from nakta_model.loading import random_model

    return random_model(preset(a.preset), device, dtype, seed=a.seed)


def _vocab_and_limit(a) -> tuple[int, int, int]:
    """(vocab, BOS id, positions per row) without building the model."""
    from nakta_model.tokenizer import Tokenizer

    if a.checkpoint:
        from nakta_model.loading import checkpoint_args

        args = checkpoint_args(a.checkpoint)
        tok = a.tokenizer or str(Path(a.checkpoint) / "tokenizer.model")
    else:
        from nakta_model.config import preset

        args, tok = preset(a.preset), a.tokenizer
    return args.vocab_size, Tokenizer(tok).bos_id, args.max_seq_len


# ----------------------------------------------------------------------------- server
class Server:
    """nakta-serve as a subprocess on a free loopback port (stopped with SIGTERM)."""

    def __init__(self, a, extra: Sequence[str] = ()):
        cmd = [sys.executable, "-m", "nakta_model.serve", "--port", "0", "--no-access-log"]
        if a.checkpoint:
            cmd += ["--checkpoint", a.checkpoint]
        else:
            cmd += ["--random", a.preset, "--seed", str(a.seed)]
        if a.tokenizer:
            cmd += ["--tokenizer", a.tokenizer]
        cmd += ["--max-batch", str(a.max_batch), "--max-queue", str(max(a.prompts, 1024))]
        flags = (("--dtype", a.dtype), ("--device", a.device), ("--chunk", a.chunk),
                 ("--min-chunk", a.min_chunk))  # fmt: skip
        for flag, v in flags:
            if v:
                cmd += [flag, str(v)]
        cmd += list(extra)
        # this checkout first, then whatever the caller's path holds (carried wheels, say)
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": path}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
        lines: queue.Queue = queue.Queue()

        def drain():
            for line in self.proc.stderr:
                sys.stderr.write("  [server] " + line)
                lines.put(line)
            lines.put(None)

        threading.Thread(target=drain, daemon=True).start()
        self.url = None
        while self.url is None:
            line = lines.get(timeout=900)
            if line is None:
                raise SystemExit("error: nakta-serve exited before it listened")
            if "listening on " in line:
                self.url = line.split("listening on ")[1].strip()
        self.model = _served_name(self.url)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=120)

    def metrics(self) -> dict[str, float]:
        return scrape(self.url)


def scrape(url: str) -> dict[str, float]:
    """The unlabelled samples of ``/metrics`` (counters, and histograms' sums and counts)."""
    import httpx

    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split()
            out[name] = float(value)
    return out


def diagnose(before: dict[str, float], after: dict[str, float], prompts: int) -> dict:
    """What the server's own counters say about one run (differences across it): decode
    rows per step, prefill forwards and their size, the engine thread's time (GPU work, GIL
    wait), where a first token's time went, the HTTP side's cost per streamed event."""

    def d(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    def mean(hist: str) -> float:
        n = d(f"{hist}_count")
        return d(f"{hist}_sum") / n if n else float("nan")

    steps, forwards, busy = (
        d("nakta_engine_decode_steps_total"),
        d("nakta_engine_prefill_forwards_total"),
        d("nakta_engine_busy_seconds_total"),
    )
    tokens = d("nakta_generation_tokens_total")
    events = d("nakta_stream_events_total")
    gpu = d("nakta_engine_prefill_seconds_total") + d("nakta_engine_decode_seconds_total")
    return {
        "rows_per_step": (tokens - prompts) / steps if steps else nan,
        "decode_steps": steps,
        "prefill_forwards": forwards,
        "prefill_tokens_per_forward": d("nakta_engine_prefilled_tokens_total") / forwards
        if forwards else nan,
        "engine_busy_s": busy,
        "engine_step_pct": 100 * gpu / busy if busy else nan,
        "engine_gil_wait_pct": 100 * (busy - d("nakta_engine_cpu_seconds_total")) / busy
        if busy else nan,
        "engine_flushes": d("nakta_engine_flushes_total"),
        "ttft_queue_ms": 1e3 * mean("nakta_ttft_queue_seconds"),
        "ttft_engine_ms": 1e3 * mean("nakta_ttft_engine_seconds"),
        "ttft_write_ms": 1e3 * mean("nakta_ttft_write_seconds"),
        "deliver_lag_ms": 1e3 * mean("nakta_deliver_lag_seconds"),
        "stream_us_per_event": 1e6 * d("nakta_stream_seconds_total") / events if events else nan,
        "loop_us_per_event": 1e6 * d("nakta_loop_cpu_seconds_total") / events if events else nan,
        "events_per_request": events / prompts if prompts else nan,
    }  # fmt: skip


def _served_name(url: str) -> str:
    import httpx

    return httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]


# ----------------------------------------------------------------------------- client
async def replay(url: str, model: str, prompts, output_len: int, rate: float | None, seed: int):
    """Send every prompt (Poisson arrivals at ``rate``, or all at once) as a streaming request;
    per request (send, event times, tokens).

    A plain HTTP/1.1 client on asyncio streams, a connection per request: the client's own
    cost per streamed event stays far below the server's (httpx's was not: with 1,000 streams
    its loop fell behind, read events late in bursts and measured its own lag)."""
    from urllib.parse import urlsplit

    rng = random.Random(seed)
    u = urlsplit(url)
    host, port = u.hostname, u.port or 80

    async def one(p, delay):
        await asyncio.sleep(delay)
        body = {"model": model, "prompt": p, "max_tokens": output_len, "temperature": 0,
                "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        data = json.dumps(body).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        sent = time.perf_counter()
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
        try:
            writer.write(head + data)
            return sent, *await _read_stream(reader)
        finally:
            writer.close()

    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        if rate is not None:
            t += rng.expovariate(rate)
    return await asyncio.gather(*(one(p, d) for p, d in zip(prompts, delays)))


async def _read_stream(reader) -> tuple[list[float], int]:
    """A streamed completion's response: (arrival time of each event with text, the usage's
    completion tokens). Chunked transfer or a body to the connection's end."""
    status = await reader.readline()
    chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if status.split(b" ")[1:2] != [b"200"]:
        raise RuntimeError(f"server answered {status.strip()!r}: {(await reader.read())[:500]!r}")
    events, tokens, buf = [], 0, b""
    while True:
        if chunked:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                break
            data = (await reader.readexactly(size + 2))[:-2]
        elif not (data := await reader.read(1 << 16)):
            break
        now = time.perf_counter()
        *lines, buf = (buf + data).split(b"\n")
        for line in lines:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            msg = json.loads(line[6:])
            if msg.get("usage"):
                tokens = msg["usage"]["completion_tokens"]
            elif msg.get("choices"):
                events.append(now)
            elif "error" in msg:
                raise RuntimeError(f"error event: {msg['error']}")
    return events, tokens


def _run(coro):
    """``asyncio.run`` on uvloop when it is installed (the client's own cost per event)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def summarize(rate: float | None, results) -> dict:
    start = min(s for s, _, _ in results)
    end = max(ev[-1] for _, ev, _ in results if ev)
    tokens = sum(n for _, _, n in results)
    ttft = [ev[0] - s for s, ev, _ in results if ev]
    tpot = [(ev[-1] - ev[0]) / (n - 1) for _, ev, n in results if ev and n > 1]
    itl = [b - a for _, ev, _ in results for a, b in zip(ev, ev[1:])]
    return {
        "rate": rate, "prompts": len(results), "output_tok_s": tokens / (end - start),
        "requests_s": len(results) / (end - start),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
        "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
        "wall_s": end - start,
    }  # fmt: skip


# ------------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> dict:
    a = parse_args(argv)
    import torch

    from bench_common.ceilings import device_slug

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if a.url:
        import httpx

        info = httpx.get(f"{a.url}/v1/models", timeout=60).json()["data"][0]
        vocab = 32000 if a.checkpoint is None else _vocab_and_limit(a)[0]
        bos, limit = 1, info["max_model_len"]
    else:
        vocab, bos, limit = _vocab_and_limit(a)
    prompts = make_prompts(a, vocab, bos, limit)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    offline, offline_rows = None, []
    if not (a.url or a.no_offline):
        offline, offline_rows = offline_reference(a, prompts, device)
        print(f"offline Generator: {offline:,.0f} output tok/s", file=sys.stderr, flush=True)
    runs, variants = [], []
    out = Path(a.out) if a.out else REPO / "speed_bench" / "results" / device_slug(device) / "serve"
    plan = [("main", [], a.rate_list)] + [(n, x, a.variant_rate_list) for n, x in a.variants]
    for name, extra, rates in plan:
        got = runs if name == "main" else []
        if name != "main":
            variants.append({"name": name, "server_args": " ".join(extra), "runs": got})
        server = None if a.url else Server(a, extra)
        url, model = (a.url, a.model) if a.url else (server.url, server.model)
        try:
            # the offline reference was warmed up on 2 x max_batch full prompts: the server gets
            # the same prompt shapes (prefill forwards of every size, every batch bucket)
            warm = prompts[: min(len(prompts), 2 * a.max_batch)]
            _run(replay(url, model, warm, min(16, a.output_len), None, a.seed))
            for rate in rates:
                work = prompts if rate is None else prompts[: a.rate_prompts]
                before = scrape(url)
                res = _run(replay(url, model, work, a.output_len, rate, a.seed))
                got.append({**summarize(rate, res), **diagnose(before, scrape(url), len(work))})
                r = got[-1]
                print(
                    f"{name} rate {rate or 'inf'}: {r['output_tok_s']:,.0f} tok/s, TTFT p50 "
                    f"{r['ttft_p50_s'] * 1e3:.1f} ms, TPOT p50 {r['tpot_p50_s'] * 1e3:.2f} ms",
                    file=sys.stderr,
                    flush=True,
                )
                write_results(out, device_name, offline, runs, variants, a, offline_rows)
        finally:
            if server is not None:
                code = server.stop()
                if code != 0:
                    print(f"warning: nakta-serve ({name}) exited {code}", file=sys.stderr)
    summary = write_results(out, device_name, offline, runs, variants, a, offline_rows)
    table = out / "serve_diagnostics.csv"
    if table.is_file():  # the small table in the log too
        import pandas as pd

        df = pd.read_csv(table)
        keep = ["server", "rate", "output_tok_s", "of_offline_pct", "ttft_p50_s", "tpot_p50_s",
                "rows_per_step", "prefill_forwards", "engine_step_pct", "engine_gil_wait_pct",
                "ttft_queue_ms", "ttft_engine_ms", "ttft_write_ms", "loop_us_per_event"]  # fmt: skip
        with pd.option_context("display.width", 250, "display.max_columns", 30):
            print(df[[c for c in keep if c in df.columns]].round(3).to_string(index=False),
                  file=sys.stderr)  # fmt: skip
    return summary


_BASE = ["rate", "prompts", "output_tok_s", "requests_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
         "tpot_p99_s", "itl_p50_s", "itl_p99_s", "wall_s"]  # fmt: skip
_DIAG = ["output_tok_s", "of_offline_pct", "ttft_p50_s", "tpot_p50_s", "rows_per_step",
         "prefill_forwards", "prefill_tokens_per_forward", "engine_step_pct",
         "engine_gil_wait_pct", "ttft_queue_ms", "ttft_engine_ms", "ttft_write_ms",
         "deliver_lag_ms", "stream_us_per_event", "loop_us_per_event",
         "events_per_request"]  # fmt: skip


def write_results(
    out: Path, device_name: str, offline, runs: list[dict], variants, a, offline_rows=()
) -> dict:
    """``serve_summary.json`` (the main server's runs; ``variants`` beside them), its table
    and plot, and ``serve_diagnostics.md``: every server and rate with the server's own
    counters (``diagnose``)."""

    from bench_common.report import write_json, write_table

    out.mkdir(parents=True, exist_ok=True)
    summary = {"device_name": device_name, "offline_tok_s": offline, "runs": runs}
    for r in offline_rows:
        if r["server"] == "engine_online":  # the same Generator online, no HTTP
            summary["engine_online_tok_s"] = r["output_tok_s"]
    if variants:
        summary["variants"] = variants
    write_json(summary, out / "serve_summary.json")
    src = a.checkpoint or f"random {a.preset}"
    notes = (
        f"{src}, {a.prompts} prompts ({a.lengths} lengths, {a.input_len} in) x {a.output_len} "
        f"out, greedy, EOS ignored; finite rates replay the first {a.rate_prompts}; "
        f"max_batch {a.max_batch}, server chunk {a.chunk or 'default'} (min "
        f"{a.min_chunk or 'default'}); offline Generator "
        + (f"{offline:,.0f} output tok/s" if offline else "not run")
    )
    if runs:
        write_table(_frame(runs, offline)[_BASE + (["of_offline_pct"] if offline else [])],
                    out, "serve", f"nakta-serve on {device_name}", notes)  # fmt: skip
        _plot(runs, device_name, out)
    rows = list(offline_rows)
    rows += [{"server": "main", **r} for r in runs]
    rows += [{"server": v["name"], **r} for v in variants for r in v["runs"]]
    if runs or variants:
        df = _frame(rows, offline)
        cols = ["server", "rate"] + [c for c in _DIAG if c in df.columns]
        args = "; ".join(f"{v['name']}: `{v['server_args']}`" for v in variants)
        notes += (
            ". Server counters over each run: rows_per_step (decoded tokens / steps), prefill "
            "forwards and prompt tokens per forward, engine_step_pct (prefill + decode wall / "
            "the engine thread's busy wall), engine_gil_wait_pct (busy wall not on the engine "
            "thread's CPU: waiting for the GIL or a core), TTFT parts (arrival -> taken by the "
            "engine -> first token on the host -> its event written), deliver lag (engine -> "
            "event loop), event-loop microseconds per streamed event"
            + (f". Variants: {args}" if args else "")
        )
        write_table(df[cols], out, "serve_diagnostics", f"nakta-serve on {device_name}: "
                    "where the time goes", notes)  # fmt: skip
    return summary


def _frame(rows: list[dict], offline):
    import pandas as pd

    df = pd.DataFrame(rows)
    df["of_offline_pct"] = 100 * df["output_tok_s"] / offline if offline else float("nan")
    df["rate"] = df["rate"].map(lambda r: "inf" if r is None or pd.isna(r) else r)
    return df


def _plot(runs: list[dict], device_name: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench_common.report import save_figure

    finite = [r for r in runs if r["rate"] is not None]
    if not finite:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    x = [r["rate"] for r in finite]
    for key, label in (("ttft_p50_s", "TTFT p50"), ("ttft_p99_s", "TTFT p99"),
                       ("tpot_p50_s", "TPOT p50"), ("itl_p99_s", "ITL p99")):  # fmt: skip
        ax.plot(x, [r[key] * 1e3 for r in finite], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("ms")
    ax.set_title(f"nakta-serve latency against rate ({device_name})")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    save_figure(fig, out / "serve.png")
    plt.close(fig)


if __name__ == "__main__":
    main()
