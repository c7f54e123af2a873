"""Scoring speed of Meta's LLaMA code (``llama_org``), measured as ``run_all`` measures it.

The command: ``run_all`` with this engine only (same options, results in their own folder);
the engine itself is ``llama_engine.py``. Under ``torchrun``: fairscale model parallel over
the whole world (MP = world size).

    python speed_bench/llama_speed.py [run_all options]          # results/<device>/llama_org/
    torchrun --nproc_per_node 4 speed_bench/llama_speed.py ...    # MP = 4
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run by path: import from the repo root, not from this script's folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from speed_bench.llama_engine import LlamaOrgEngine  # noqa: F401 -- where callers find it
from speed_bench.run_all import EngineSet
from speed_bench.run_all import main as run_all_main

ENGINES = ("llama_org",)
DESCRIPTION = (
    "HellaSwag scoring speed of Meta's LLaMA code (llama_org), measured as speed_bench.run_all "
    "measures it (same options). Under torchrun: fairscale model parallel over the whole world "
    "(MP = world size)."
)


def main(argv: list[str] | None = None) -> dict | None:
    """``run_all`` with llama_org only (MP = world size under torchrun)."""
    return run_all_main(argv, EngineSet(ENGINES, "llama_org", DESCRIPTION))


if __name__ == "__main__":
    main()
