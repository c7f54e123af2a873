"""Ending a CLI process once its work is done, without the interpreter's teardown.

Why: a normal exit collects every module and then runs C++ static destructors. Two things go
wrong there under ``torchrun``:

- a process group that something still references cannot be torn down. ``fairscale`` (imported
  by the llama_org reference, and by a check that it is installed) evaluates
  ``group=dist.group.WORLD`` as a default argument when it is imported, so imported while the
  group is up it pins the group for the life of the process: ``destroy_process_group`` then
  cannot join gloo's threads (``gloo_tcp_loop``, ``pt_gloo_runloop``), and the C++ teardown at
  exit meets them still joinable: ``terminate called without an active exception``, SIGABRT,
  about one exit in two (it races the peer ranks' exits);
- torch's destructors free GPU blocks one by one (seconds at the end of a big run).

:func:`exit_without_teardown` joins this program's non-daemon threads, runs the ``atexit``
handlers, flushes logging and stdio, and ends the process with ``os._exit``: the operating
system releases sockets, threads and the GPU context as for any exiting process.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from typing import NoReturn

__all__ = ["exit_without_teardown"]


def exit_without_teardown(code: int = 0) -> NoReturn:
    """Join non-daemon threads, run ``atexit`` handlers, flush, then ``os._exit(code)``."""
    if not isinstance(code, int) or isinstance(code, bool):
        raise TypeError(f"code must be an int exit status, got {code!r}")
    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
