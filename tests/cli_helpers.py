"""Running the repo's command-line scripts as a user does: in a subprocess, with a hard timeout.

:func:`run_script` starts ``python -S`` with site-packages on ``PYTHONPATH``: third-party
packages import, but no ``.pth`` file runs, so an editable install (of this or another
checkout) cannot supply ``nakta_model`` / ``speed_bench``. A script run by path then finds the
repo only through its own bootstrap, ``python -m`` only through its working directory: a test
that passes here passes on a machine where nothing is installed in editable mode.

:func:`torchrun` runs a command under ``torchrun --standalone --nproc_per_node 2`` (gloo on the
CPU) in its own process session, killed as a whole when the timeout expires, so a hanging rank
fails the test instead of hanging it. Neither sets ``TRITON_INTERPRET``: a user's CPU run has
no interpreter unless asked for.
"""

from __future__ import annotations

import os
import signal
import site
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT_TIMEOUT_S = 120
TORCHRUN_TIMEOUT_S = 180


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def run_script(
    args: list[str], cwd: Path, timeout: float = SCRIPT_TIMEOUT_S, **env: str
) -> subprocess.CompletedProcess:
    """``python -S ARGS`` in ``cwd`` (see the module docstring); stdout and stderr as text."""
    packages = [*site.getsitepackages(), site.getusersitepackages()]
    return subprocess.run(
        [sys.executable, "-S", *args],
        cwd=cwd,
        env=_env(PYTHONPATH=os.pathsep.join(packages), **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def torchrun(
    args: list[str], cwd: Path, timeout: float = TORCHRUN_TIMEOUT_S, env: dict | None = None
) -> tuple[int, str]:
    """``torchrun --standalone --nproc_per_node 2 ARGS`` in ``cwd``: (exit status, output);
    ``env``: variables added to the ranks' environment.

    The ranks see the repo the way the command says: a script by path through its bootstrap,
    ``-m`` through ``cwd``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["--monitor-interval", "0.2", *args]
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=_env(**(env or {})), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True, text=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks: our own session only
        output, _ = proc.communicate()
        pytest.fail(f"torchrun hung for {timeout}s:\n{output[-3000:]}")
    return proc.returncode, output


def error_lines(text: str) -> list[str]:
    """The ``error: ...`` lines of a command's output."""
    return [line for line in text.splitlines() if line.startswith("error: ")]
