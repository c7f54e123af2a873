"""Scoring speed of Nakta's engines (``nakta``, ``nakta_cache``; ``nakta_ctx`` on request).

The command: ``run_all`` with these engines only (same options, results in their own folder);
the engines themselves are ``nakta_engine.py``. Under ``torchrun`` the model is split over the
whole world (tp = world size) unless ``--dp`` / ``--tp`` say otherwise.

    python speed_bench/nakta_speed.py [run_all options]           # results/<device>/nakta/
    cd speed_bench && torchrun --nproc_per_node 4 nakta_speed.py  # tp = 4 (the world size)
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run by path: import from the repo root, not from this script's folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from speed_bench.engine_api import NAKTA_ENGINES
from speed_bench.nakta_engine import NaktaEngine  # noqa: F401 -- where callers find it
from speed_bench.run_all import EngineSet
from speed_bench.run_all import main as run_all_main

ENGINES = NAKTA_ENGINES
DESCRIPTION = (
    "Scoring speed of Nakta's engines (nakta, nakta_cache; nakta_ctx on request), measured as "
    "speed_bench.run_all measures it (same options). Under torchrun the model is split over the "
    "whole world (tp = world size) unless --dp/--tp say otherwise."
)


def main(argv: list[str] | None = None) -> dict | None:
    """``run_all`` with the Nakta engines only."""
    return run_all_main(argv, EngineSet(ENGINES, "nakta", DESCRIPTION, ("nakta", "nakta_cache")))


if __name__ == "__main__":
    main()
