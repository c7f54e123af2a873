"""Scoring speed of HF transformers' ``LlamaForCausalLM`` (SDPA), measured as ``run_all`` does.

The command: ``run_all`` with this engine only (same options, results in their own folder);
the engine itself is ``hf_engine.py``. One process only.

    python speed_bench/hf_speed.py [run_all options]              # results/<device>/hf/
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run by path: import from the repo root, not from this script's folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

# the engine's names, where lm_eval_speed.py and older callers import them from
from speed_bench.hf_engine import (  # noqa: F401
    HFEngine,
    default_dtype,
    hf_config,
    meta_to_hf,
    unavailable_reason,
)
from speed_bench.run_all import EngineSet
from speed_bench.run_all import main as run_all_main

ENGINES = ("hf",)
DESCRIPTION = (
    "HellaSwag scoring speed of HF transformers' LlamaForCausalLM (SDPA), measured as "
    "speed_bench.run_all measures it (same options). One process only."
)


def main(argv: list[str] | None = None) -> dict | None:
    """``run_all`` with the HF engine only."""
    return run_all_main(argv, EngineSet(ENGINES, "hf", DESCRIPTION))


if __name__ == "__main__":
    main()
