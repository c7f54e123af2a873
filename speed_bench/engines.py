"""The speed-bench engines: what every engine is, which exist, how to build one.

An engine is a scorer of token requests plus an honest token count. Engines are built one at a
time from a :class:`~speed_bench.weights.WeightSource` and freed before the next, so each one's
peak memory is its own. A multi-GPU engine (tensor / data parallel) fits the same shape: build
it from the same weights, score the same requests.

``nakta`` / ``nakta_cache`` / ``nakta_ctx`` (``nakta_engine.py``, one shared model built by
``nakta_model.load`` from the weights), ``llama_org`` (``llama_engine.py``) and ``hf``
(``hf_engine.py``); what an engine is lives in ``engine_api.py``. This module, ``weights.py``
and ``workload.py`` are speed_bench's public API: ``run_all`` and ``model_profile`` both build
and time engines through them. The speed scripts (``nakta_speed.py`` ...) sit above all of it.
"""

from __future__ import annotations

from nakta_model.parallel import ParallelContext
from speed_bench.engine_api import (
    ALL_ENGINES,
    DEFAULT_ENGINES,
    NAKTA_ENGINES,
    Engine,
    EngineConfig,
    EngineSpec,
    engine_spec,
)
from speed_bench.weights import WeightSource

__all__ = [
    "ALL_ENGINES",
    "DEFAULT_ENGINES",
    "NAKTA_ENGINES",
    "Engine",
    "EngineConfig",
    "EngineSpec",
    "engine_spec",
    "make_engine",
    "skip_reason",
]


# ----------------------------------------------------------------------------- building
def make_engine(
    spec: EngineSpec | str,
    weights: WeightSource,
    cfg: EngineConfig,
    shared: dict,
    parallel: ParallelContext | None = None,
) -> Engine:
    """Build the engine ``spec`` (an :class:`EngineSpec`, or a name read by ``engine_spec``);
    Nakta's engines of one precision share one model (kept in ``shared``): this rank's shard,
    built by ``nakta_model.load`` from the weights one Meta tensor at a time."""
    spec = engine_spec(spec)
    parallel = parallel or ParallelContext()
    if spec.is_nakta:
        from nakta_model.loading import load
        from speed_bench.nakta_engine import NaktaEngine

        key = ("nakta", spec.precision)  # bf16 and FP8 models side by side
        if key not in shared:
            source = weights.source(cfg.device, cfg.dtype)
            shared[key] = load(source, cfg.device, cfg.dtype, parallel, quant=spec.precision)
        engine = NaktaEngine(
            shared[key],
            cfg,
            use_cache=spec.kind != "nakta",
            parallel=parallel,
            prefix_cache=spec.kind != "nakta_ctx",
        )
        engine.name = spec.name
        return engine
    name = spec.kind
    reason = _grid_reason(name, parallel)
    if reason:
        raise ValueError(f"engine {name!r} cannot run on {parallel.describe()}: {reason}")
    if name == "llama_org":
        from speed_bench.llama_engine import LlamaOrgEngine

        return LlamaOrgEngine(weights, cfg)
    from speed_bench.hf_engine import HFEngine

    return HFEngine(weights, cfg)


def _grid_reason(name: str, parallel: ParallelContext) -> str | None:
    """Why engine kind ``name`` cannot run on this grid: llama_org splits over the whole world
    only (Meta's model parallel, MP = world size), hf runs in one process."""
    if parallel.world_size == 1 or name in NAKTA_ENGINES:
        return None
    if name == "hf":
        return "single-GPU engine: it runs only in a plain `python` process (world size 1)"
    if parallel.tp_size != parallel.world_size:
        return (
            f"llama_org runs Meta's model parallel over the whole world "
            f"(MP = {parallel.world_size}), not over dp {parallel.dp_size} replicas: time it "
            "with --dp 1"
        )
    return None


def skip_reason(spec: EngineSpec | str, parallel: ParallelContext | None = None) -> str | None:
    """Why engine ``spec`` is not timed here (this grid, or a package missing), or None."""
    name = engine_spec(spec).kind
    reason = _grid_reason(name, parallel or ParallelContext())
    if reason:
        return reason
    if name == "hf":
        from speed_bench.hf_engine import unavailable_reason

        return unavailable_reason()
    if name == "llama_org":
        try:
            import fairscale  # noqa: F401
        except ImportError:
            return "fairscale is not installed (llama_org needs it)"
    return None
