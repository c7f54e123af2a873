"""Logs every Triton compile of any Python process started with this folder on PYTHONPATH and
``NAKTA_COMPILE_LOG=<csv path>`` set (model_profile.compile_profile's ``CompileLog``; phase
"run"): what a whole lm-eval run compiles, child processes included (each appends its rows).
Used by scripts/gpu_first_run.sh; nothing is imported when the variable is unset."""

import os

if os.environ.get("NAKTA_COMPILE_LOG"):
    import atexit
    import csv

    try:
        from model_profile.compile_profile import CompileLog

        _log = CompileLog()
        _log.phase = "run"

        def _dump(path=os.environ["NAKTA_COMPILE_LOG"]):
            new = not os.path.exists(path)
            with open(path, "a", newline="") as f:
                w = csv.DictWriter(f, ["pid", "phase", "kernel", "seconds", "specialization"])
                if new:
                    w.writeheader()
                for r in _log.records:
                    w.writerow({"pid": os.getpid(), **r})

        atexit.register(_dump)
    except ImportError:  # a process without the repository on its path
        pass
