"""``nakta-serve``: load a model once and serve it over OpenAI's HTTP API.

    nakta-serve --checkpoint CKPT                        # http://127.0.0.1:8000/v1
    nakta-serve --checkpoint CKPT --api-key KEY --port 8080 --quant fp8
    python -m nakta_model.serve --random 7B --tokenizer llama_tokenizer.model   # speed runs
    torchrun --nproc_per_node 2 -m nakta_model.serve --checkpoint CKPT_TP2 --tp 2  # 2 GPUs

Binds 127.0.0.1 unless ``--host`` says otherwise; ``--port 0`` takes a free port. Once it
serves it prints ``nakta-serve: listening on http://HOST:PORT`` on stderr. SIGTERM or Ctrl-C:
no new connections, the running requests finish (at most ``--drain-s`` seconds, then they are
cancelled), exit status 0. Prompts are not logged unless ``--log-prompts``. Every bad argument is
one ``error:`` line, exit 2.

Under ``torchrun`` (tp = the number of processes; ``--tp`` may say it again) every rank loads
its shard and runs the same engine in lockstep; rank 0 alone serves HTTP and decides what every
rank's engine does next (``lockstep``). SIGTERM to rank 0 (or torchrun's to every rank: only
rank 0 acts on it) stops every rank, exit status 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

if not __package__:  # run by path: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from nakta_model.cli import (
    InputError,
    OneLineArgumentParser,
    checked_on_every_rank,
    checkpoint_errors,
    checkpoint_tokenizer_path,
    exit_on_input_error,
    require_checkpoint,
)

__all__ = ["ServeSettings", "main", "parse_args"]

_DTYPES = ("bf16", "fp16", "fp32")
# The engine thread and the event loop share the GIL. A thread that wants it waits until the
# holder blocks or this interval passes; the engine thread gives the GIL up at every torch op
# it launches (an eager prefill: hundreds), so at Python's 5 ms a busy event loop could hold
# each launch back by up to 5 ms. Shorter costs a forced switch now and then while both run.
SWITCH_INTERVAL_MS = 0.5
# Tensor parallel: a collective (the model's, or the ranks' control messages) that waits this
# long ends the rank. An idle server never does (rank 0 answers its followers every few
# seconds); a first kernel compile between two collectives may take a while on a cold cache.
DIST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ServeSettings:
    """Every setting of one server, parsed once from the command line."""

    checkpoint: str | None
    random: str | None
    tokenizer: str | None
    model_name: str
    host: str
    port: int
    api_key: str | None
    dtype: str | None
    device: str | None
    quant: str | None
    max_batch: int
    max_queue: int
    chunk: int
    min_chunk: int
    max_body_bytes: int
    drain_s: float
    warmup: bool | None
    log_prompts: bool
    access_log: bool
    seed: int
    switch_interval_s: float
    prefill_burst: int | None
    defer_rows: int
    pipeline_rows: int | None
    admit_gap_s: float
    tp: int = 1
    dist_timeout_s: float = DIST_TIMEOUT_S


def parse_args(argv: list[str] | None = None) -> ServeSettings:
    p = OneLineArgumentParser(prog="nakta-serve", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="Nakta, Meta or HF checkpoint folder")
    src.add_argument("--random", metavar="PRESET", help="random weights of a preset (7B, ...)")
    p.add_argument("--tokenizer", help="sentencepiece model (default: the checkpoint's own)")
    p.add_argument("--model-name", help="the model id clients send (default: folder name)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="0: a free port")
    p.add_argument("--api-key", help="require Authorization: Bearer KEY on /v1 routes")
    p.add_argument(
        "--tp", type=int, help="tensor-parallel size: the processes torchrun started (default: "
        "its WORLD_SIZE, else 1); each rank loads its shard, rank 0 serves HTTP"
    )  # fmt: skip
    p.add_argument(
        "--dist-timeout-s", type=float, default=DIST_TIMEOUT_S, help="tensor parallel: a "
        f"collective that waits this long ends the rank (default {DIST_TIMEOUT_S:.0f})"
    )  # fmt: skip
    p.add_argument("--dtype", choices=_DTYPES, help="default: bf16 on a GPU, fp32 on the CPU")
    p.add_argument("--device", help="cpu | cuda | cuda:N (default: cuda when present)")
    p.add_argument("--quant", choices=["fp8"], help="fp8 weights (opt-in; GPU cc >= 8.9)")
    p.add_argument("--max-batch", type=int, help="rows decoded at once (default 256 GPU, 8 CPU)")
    p.add_argument(
        "--max-queue", type=int, default=1024, help="requests waiting for a first token "
        "before new ones get 429 (default 1024)"
    )  # fmt: skip
    p.add_argument(
        "--chunk", type=int, default=16, help="tokens decoded between host checks with a full "
        "batch (default 16, the offline Generator's)"
    )  # fmt: skip
    p.add_argument(
        "--min-chunk", type=int, default=2, help="the chunk while few rows run (default 2: an "
        "arrival waits for at most the chunk in flight before its prefill); it grows with the "
        "batch's fill up to --chunk"
    )  # fmt: skip
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="request body cap")
    p.add_argument("--drain-s", type=float, default=30.0, help="SIGTERM: wait for rows (s)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="capture every batch bucket first (default: on a GPU)")  # fmt: skip
    p.add_argument("--log-prompts", action="store_true", help="log prompts (off by default)")
    p.add_argument("--no-access-log", action="store_true", help="no line per HTTP request")
    p.add_argument("--seed", type=int, default=0, help="sampling seed; random weights' seed")
    p.add_argument(
        "--switch-interval-ms", type=float, default=SWITCH_INTERVAL_MS, help="CPython's GIL "
        f"switch interval (default {SWITCH_INTERVAL_MS}; Python's own is 5): how long the engine "
        "thread may wait for the GIL while the HTTP side holds it"
    )  # fmt: skip
    p.add_argument(
        "--prefill-burst", type=int, help="prefill forwards that may run back to back before "
        "the running rows' next chunk (default: the Generator's)"
    )  # fmt: skip
    p.add_argument(
        "--defer-flush-rows", type=int, default=0, help="hold a step's tokens for at least "
        "this many rows while the GPU idles, hand them over beside its next chunk (0: off)"
    )  # fmt: skip
    p.add_argument(
        "--pipeline-rows", type=int, help="pipeline decode chunks (the next enqueued before "
        "this one is read) only while at least this many rows run (default: a quarter of "
        "--max-batch; 0: always): an arrival beside a light batch waits for one chunk, not two"
    )  # fmt: skip
    p.add_argument(
        "--admit-gap-ms", type=float, default=0.0, help="while the batch is light, gather "
        "arrivals that come less than this apart (at most 20 ms) and admit them together "
        "(0: off, the default)"
    )  # fmt: skip
    a = p.parse_args(argv)
    tp = _world_size() if a.tp is None else a.tp  # != the world: refused by parallel.launch
    if tp < 1:
        p.error(f"--tp must be >= 1, got {tp}")
    if tp > 1 and a.device and ":" in a.device:
        p.error(f"--device {a.device}: with --tp {tp} each rank takes GPU LOCAL_RANK; give cuda")
    if not a.dist_timeout_s > 0:
        p.error(f"--dist-timeout-s must be > 0, got {a.dist_timeout_s}")
    if not 0 <= a.port <= 65535:
        p.error(f"--port must be in [0, 65535], got {a.port}")
    for name in ("max_queue", "chunk", "min_chunk", "max_body_bytes"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    a.min_chunk = min(a.min_chunk, a.chunk)  # --chunk 4 alone: chunks of 2..4
    if a.max_batch is not None and a.max_batch < 1:
        p.error(f"--max-batch must be >= 1, got {a.max_batch}")
    if a.prefill_burst is not None and a.prefill_burst < 1:
        p.error(f"--prefill-burst must be >= 1, got {a.prefill_burst}")
    if a.pipeline_rows is not None and a.pipeline_rows < 0:
        p.error(f"--pipeline-rows must be >= 0, got {a.pipeline_rows}")
    if not 0 <= a.admit_gap_ms <= 20:
        p.error(f"--admit-gap-ms must be in [0, 20], got {a.admit_gap_ms}")
    if a.defer_flush_rows < 0:
        p.error(f"--defer-flush-rows must be >= 0, got {a.defer_flush_rows}")
    if not 0 < a.switch_interval_ms <= 1000:
        p.error(f"--switch-interval-ms must be in (0, 1000], got {a.switch_interval_ms}")
    if a.drain_s < 0:
        p.error(f"--drain-s must be >= 0, got {a.drain_s}")
    if a.api_key is not None and not a.api_key.strip():
        p.error("--api-key must not be empty")
    if a.random and not a.tokenizer:
        p.error("--random needs --tokenizer (random weights come with no tokenizer)")
    name = a.model_name or (Path(a.checkpoint).resolve().name if a.checkpoint else a.random)
    return ServeSettings(
        a.checkpoint, a.random, a.tokenizer, name, a.host, a.port, a.api_key, a.dtype,
        a.device, a.quant, a.max_batch or 0, a.max_queue, a.chunk, a.min_chunk, a.max_body_bytes,
        a.drain_s, a.warmup, a.log_prompts, not a.no_access_log, a.seed,
        a.switch_interval_ms / 1e3, a.prefill_burst, a.defer_flush_rows, a.pipeline_rows,
        a.admit_gap_ms / 1e3, tp, a.dist_timeout_s,
    )  # fmt: skip


def _world_size() -> int:
    """The processes torchrun started (``WORLD_SIZE``), else 1."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


@dataclass
class _Prepared:
    """What :func:`_prepare` found before any weight is read."""

    args: object  # ModelArgs
    tokenizer: object
    sock: socket.socket | None  # rank 0's bound socket (not listening yet)


def _dtype(s: ServeSettings, device):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        s.dtype or ("bf16" if device.type == "cuda" else "fp32")
    ]


def _prepare(s: ServeSettings, device, leader: bool) -> _Prepared:
    """Every check that needs no weights (the model's shape, the tokenizer against it, the
    device's verdict on ``--quant``), and on the serving rank the socket bound: a bad argument
    or a taken port is refused before the weights are read."""
    from nakta_model.tokenizer import Tokenizer

    if s.quant:
        from nakta_model.fp8 import check_fp8_device

        try:
            check_fp8_device(device)
        except ValueError as e:
            raise InputError(f"--quant {s.quant}: {e}") from None
    if s.random:
        from nakta_model.config import preset

        try:
            args = preset(s.random)
        except ValueError as e:
            raise InputError(f"--random: {e}") from None
        tok_path = checkpoint_tokenizer_path(None, s.tokenizer)
    else:
        from nakta_model.loading import checkpoint_args

        require_checkpoint(s.checkpoint)
        with checkpoint_errors(s.checkpoint):
            args = checkpoint_args(s.checkpoint)
        tok_path = checkpoint_tokenizer_path(s.checkpoint, s.tokenizer, vocab_size=args.vocab_size)
    try:
        tok = Tokenizer(tok_path)
    except (OSError, RuntimeError, ValueError) as e:
        raise InputError(f"--tokenizer {tok_path}: not a SentencePiece model ({e})") from e
    if tok.n_words > args.vocab_size:
        raise InputError(
            f"--tokenizer {tok_path} has {tok.n_words} pieces, more than the model's "
            f"vocab_size {args.vocab_size}"
        )
    return _Prepared(args, tok, _bind(s) if leader else None)


def _bind(s: ServeSettings) -> socket.socket:
    family = socket.AF_INET6 if ":" in s.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((s.host, s.port))
    except OSError as e:
        sock.close()
        raise InputError(f"--host {s.host} --port {s.port}: cannot bind ({e})") from None
    return sock


def _load_model(s: ServeSettings, args, device, parallel=None):
    """This rank's model (its shard under tensor parallelism)."""
    dtype = _dtype(s, device)
    if s.random:
        from nakta_model.loading import random_model

        return random_model(args, device, dtype, seed=s.seed, parallel=parallel, quant=s.quant)
    from nakta_model.loading import load

    with checkpoint_errors(s.checkpoint):
        return load(s.checkpoint, device, dtype, parallel, quant=s.quant)


def _generator(s: ServeSettings, model, tok):
    """The engine, built alike on every rank (and warmed up alike: the same collectives)."""
    from nakta_model.generation.engine import Generator, max_rows

    max_batch = s.max_batch or (256 if model.device.type == "cuda" else 8)
    if max_batch > max_rows():
        raise InputError(f"--max-batch {max_batch}: at most {max_rows()} rows decode at once")
    gen = Generator(
        model, max_batch=max_batch, chunk=s.chunk, min_chunk=s.min_chunk,
        prefill_burst=s.prefill_burst,
    )  # fmt: skip
    if s.warmup if s.warmup is not None else model.device.type == "cuda":
        _warm_up(gen, tok)
    return gen


def build(s: ServeSettings, model, tok, lockstep=None):
    """(app, bridge): the engine thread started over ``model``, the app over it."""
    from nakta_model.serve.app import ServerState, create_app
    from nakta_model.serve.bridge import EngineBridge
    from nakta_model.serve.metrics import Metrics

    gen = _generator(s, model, tok)
    metrics = Metrics()
    pipeline_rows = gen.max_batch // 4 if s.pipeline_rows is None else s.pipeline_rows
    bridge = EngineBridge(
        gen, metrics, s.max_queue, s.defer_rows, pipeline_rows, s.admit_gap_s, lockstep
    )  # fmt: skip
    bridge.start()
    state = ServerState(
        bridge, tok, metrics, s.model_name, gen.max_seq_len, model.args.vocab_size,
        s.api_key, s.max_body_bytes, s.log_prompts,
    )  # fmt: skip
    return create_app(state), bridge


def _warm_up(gen, tok) -> None:
    """One short batch per bucket: kernels compiled and decode graphs captured before the
    first client waits for them."""
    import torch

    from nakta_model.generation.engine import GenerationRequest

    prompt = [max(tok.bos_id, 0)] + [min(100, gen.model.args.vocab_size - 1)] * 8
    with torch.inference_mode():
        for b in gen.buckets:
            gen.generate([GenerationRequest(prompt, gen.chunk + 1) for _ in range(b)])


def serve(s: ServeSettings) -> int:
    """One process: load, serve until SIGTERM / Ctrl-C."""
    import torch

    from nakta_model.generate import _device

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    device = _device(s.device)
    prep = _prepare(s, device, leader=True)
    try:
        torch.manual_seed(s.seed)
        model = _load_model(s, prep.args, device)
        return _run_http(s, model, prep)
    finally:
        prep.sock.close()


def _run_http(s: ServeSettings, model, prep: _Prepared, lockstep=None) -> int:
    """Rank 0 (or the one process): the engine thread and uvicorn over ``prep.sock``. Under
    tensor parallelism a failed engine stops the server (the other ranks cannot go on
    without it): exit status 1."""
    import uvicorn

    sys.setswitchinterval(s.switch_interval_s)
    app, bridge = build(s, model, prep.tokenizer, lockstep)
    sock = prep.sock
    sock.listen(4096)  # connections queue from now on, before uvicorn accepts them
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app,
        log_level="info",
        access_log=s.access_log,
        timeout_graceful_shutdown=max(1, int(s.drain_s)),
        backlog=4096,
    )
    server = _Server(config)
    if lockstep is not None:
        server.stop_when = lambda: bridge.error is not None
    print(f"nakta-serve: listening on http://{host}:{port}", file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        bridge.stop(drain_s=min(s.drain_s, 5.0))
    if lockstep is not None and bridge.error is not None:
        print(f"nakta-serve: the engine failed ({bridge.error}); every rank stops", file=sys.stderr)
        return 1
    print("nakta-serve: stopped", file=sys.stderr, flush=True)
    return 0


def _serve_rank(s: ServeSettings, parallel) -> int:
    """One rank of a tensor-parallel server (under ``parallel.launch``): rank 0 serves HTTP, the
    others follow its engine (``lockstep``). Bad input found on any rank is the same ``error:``
    line on rank 0 and exit status 2 on every rank."""
    import torch

    from nakta_model.parallel import ParallelConfigError
    from nakta_model.serve.lockstep import Lockstep

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    lockstep = Lockstep(s.dist_timeout_s)
    prep = checked_on_every_rank(_prepare, s, parallel.device, parallel.is_leader)
    try:
        torch.manual_seed(s.seed)  # the same sampling draws on every rank
        try:
            model = _load_model(s, prep.args, parallel.device, parallel)
            if parallel.is_leader:
                n = parallel.tp_size
                others = "rank 1 follows" if n == 2 else f"ranks 1-{n - 1} follow"
                print(
                    f"nakta-serve: tp={n}: rank 0 (pid {os.getpid()}) serves, {others} its engine",
                    file=sys.stderr,
                    flush=True,
                )
                return _run_http(s, model, prep, lockstep)
            return _follow(s, model, prep.tokenizer, lockstep, parallel)
        except InputError as e:  # every rank meets the same (a bad --max-batch, a load error)
            raise ParallelConfigError(str(e)) from e
    finally:
        if prep.sock is not None:
            prep.sock.close()


def _follow(s: ServeSettings, model, tok, lockstep, parallel) -> int:
    """A rank other than 0: run the engine on rank 0's answers until rank 0 says stop. SIGTERM
    and SIGINT (torchrun's, a terminal's Ctrl-C) are left to rank 0, which drains the rows
    and then stops every rank; a rank 0 that died ends this rank's next collective at once."""
    import torch

    from nakta_model.serve.lockstep import FollowerFeed

    gen = _generator(s, model, tok)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _left_to_rank_0)
    feed = FollowerFeed(lockstep, model, tok)
    with torch.inference_mode():
        gen.generate([], feed=feed)
    print(f"nakta-serve: rank {parallel.rank} stopped", file=sys.stderr, flush=True)
    return 0


def _left_to_rank_0(sig, frame) -> None:
    log = logging.getLogger("nakta.serve")
    log.info("signal %d: rank 0 stops every rank once its rows drain", sig)


def _server_class():
    import contextlib
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, but SIGTERM / SIGINT only start the graceful shutdown: uvicorn
        re-raises the signal once it is done, which would end the process with -15 instead of
        the exit status 0 a supervisor expects from a clean stop."""

        stop_when = None  # a callable: True ends the server as a signal would

        async def on_tick(self, counter: int) -> bool:
            if self.stop_when is not None and self.stop_when():
                self.should_exit = True
            return await super().on_tick(counter)

        @contextlib.contextmanager
        def capture_signals(self):
            def handle(sig, frame):
                self.should_exit = True  # a second one does not force: the rows drain

            old = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    return Server


def _Server(config):
    return _server_class()(config)


def main(argv: list[str] | None = None) -> None:
    s = parse_args(argv)
    if s.tp == 1 and _world_size() == 1:
        raise SystemExit(exit_on_input_error(serve, s))
    from nakta_model.parallel import launch

    code = launch(
        lambda parallel: _end_rank(_serve_rank(s, parallel)), s.tp, 1, device=s.device,
        timeout_s=s.dist_timeout_s,
    )  # fmt: skip
    raise SystemExit(code)


def _end_rank(code: int) -> NoReturn:
    """A rank that served ends here, without destroying the process group: the decode graphs
    each rank captured used NCCL's communicator, and the server's objects keep them alive
    until the interpreter's teardown; destroying the communicator under them is the suspect of
    a 2-GPU shutdown that hung (not yet re-run on GPUs). Every rank has left the lockstep by
    now; the operating system releases the rest."""
    from nakta_model.process_exit import exit_without_teardown

    exit_without_teardown(code)


if __name__ == "__main__":
    main()
