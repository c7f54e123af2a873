"""Start N ranks on this host the way ``torchrun --standalone --nproc_per_node N`` does, without
importing torch first.

    python -m nakta_model.spawn --nproc 2 -m accuracy_test.lm_eval_cli --model nakta \\
        --model_args checkpoint=DIR,dp=2 --tasks hellaswag_local ...
    python -m nakta_model.spawn --nproc 2 speed_bench/run_all.py --dp 2

Why: measured on two H100s (``speed_bench/lm_eval_dp.py``), torchrun's own
start-up (importing torch in the launcher, its elastic agent and rendezvous) put the ranks'
Python 4.0 s after the command started; a data-parallel lm-eval run of ~37 s paid that on top
of the single-GPU run's fixed part. This launcher imports only the standard library: it picks a
free port, sets what ``torch.distributed``'s ``env://`` rendezvous and Nakta read (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), starts
the ranks at once and waits. The first rank that fails ends the others (SIGTERM, then SIGKILL
after a grace period) and its exit status is the launcher's; SIGINT / SIGTERM are passed on.
One host only (``--standalone``); multi-node runs keep torchrun.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

__all__ = ["main", "rank_env", "spawn"]

GRACE_S = 5.0


def free_port() -> int:
    """A TCP port free on the loopback interface now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(base: dict[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    """The environment of rank ``rank`` of ``nproc`` on this host."""
    env = dict(base)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N ranks must not each use every core
    return env


def spawn(cmd: Sequence[str], nproc: int, poll_s: float = 0.05) -> int:
    """Run ``cmd`` (argv after ``python``) as ``nproc`` ranks; the first failure's status, else 0."""
    port = free_port()
    procs: list[subprocess.Popen] = []
    try:
        for r in range(nproc):
            env = rank_env(dict(os.environ), r, nproc, port)
            procs.append(subprocess.Popen([sys.executable, *cmd], env=env))
    except BaseException:  # a rank that could not start: none of the others is left running
        _stop(procs)
        raise

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                _stop(procs)
                return failed[0] if failed[0] > 0 else 128 - failed[0]
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll_s)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM the ranks still running, SIGKILL what is left after ``GRACE_S``."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


USAGE = "usage: python -m nakta_model.spawn --nproc N (-m MODULE | SCRIPT) [ARGS...]"


def parse(argv: Sequence[str]) -> tuple[int, list[str]]:
    """``--nproc N`` (or ``--nproc_per_node N``, ``=N``) first, then the command, untouched:
    its own options (``-m``, ``--model_args`` ...) are never read here."""
    args = list(argv)
    if not args or args[0] in ("-h", "--help"):
        raise SystemExit(USAGE)
    flag, _, value = args.pop(0).partition("=")
    if flag not in ("--nproc", "--nproc_per_node"):
        raise ValueError(f"the first argument must be --nproc N, got {flag!r}")
    if not value:
        if not args:
            raise ValueError("--nproc needs a number")
        value = args.pop(0)
    try:
        nproc = int(value)
    except ValueError:
        raise ValueError(f"--nproc must be an int, got {value!r}") from None
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if not args:
        raise ValueError("give what to run after --nproc N: -m MODULE ARGS... or SCRIPT ARGS...")
    return nproc, args


def main(argv: Sequence[str] | None = None) -> int:
    try:
        nproc, cmd = parse(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        print(f"spawn: error: {e}\n{USAGE}", file=sys.stderr)
        return 2
    return spawn(cmd, nproc)


if __name__ == "__main__":
    sys.exit(main())
