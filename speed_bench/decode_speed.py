"""Decoding speed: Nakta's generation engine vs llama_org (Meta's loop) vs HF generate.

Every engine greedily decodes the same random prompts from the same weights; the time per
decode step is ``(t(gen) - t(1)) / (gen - 1)`` for each engine (a run of ``gen`` new tokens
minus a run of one: prefill and set-up cancel out), so ``tok_s = batch / step time``. The floor
is the bytes a step must read (every weight once, plus each row's K/V cache at its mean length)
over the device's copy bandwidth measured in this run: ``floor_tok_s = batch / (bytes / BW)``.

* ``nakta``: ``nakta_model.generation.Generator``: fused decode kernels, the step captured in a
  CUDA graph per batch bucket, chunked host checks (what lm-eval's ``generate_until`` runs);
* ``nakta_compile`` (on request only: ``--engines nakta,nakta_compile``): the same engine and
  step math, the step run through ``torch.compile(mode="reduce-overhead")`` (inductor + CUDA
  graph trees, graph breaks at the kernel launchers' host checks) instead of the manual capture;
* ``nakta_rowwise`` (on request only): the same engine with a shared prompt prefix
  (``--shared-prefix``) read row by row through L2 instead of by the attention's cascade;
* ``llama_org``: Meta's LLaMA-1 loop (one Python iteration per token, eager kernels);
* ``hf``: ``transformers``' ``generate`` with its static KV cache (``cache_implementation=
  "static"``), greedy.

At batch 1 it also times the five launches of one Nakta layer and the LM head, each alone in
a CUDA graph, against the bytes each must read (``budget`` rows): where the step's time goes.

    python speed_bench/decode_speed.py                       # 7B on a GPU, tiny on the CPU
    python speed_bench/decode_speed.py --batches 1,8,32 --lengths 64:128,512:128

Writes ``decode_summary.json`` (``{"runs": [{"engine", "batch", "prompt", "gen", "tok_s",
"floor_tok_s", "ms_per_token", ...}], "budget": [...], ...}``), ``decode.md`` and ``decode.png``
to ``--out`` (default ``speed_bench/results/<device>/``).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run by path: import from the repo root, not from this script's folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import gc
import json
import random
import time
from collections.abc import Callable, Sequence

import pandas as pd
import torch

from bench_common.ceilings import copy_bandwidth_gbps, device_slug
from bench_common.report import results_dir, save_figure, write_json, write_table
from nakta_model.cli import exit_on_input_error

ENGINES = ("nakta", "llama_org", "hf")  # the default --engines
OPT_IN = ("nakta_compile", "nakta_rowwise", "nakta_fp8", "nakta_kv8", "nakta_fp8_kv8")  # named
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help="random weights of this shape (default 7B on a GPU, tiny)")
    src.add_argument("--checkpoint", type=Path, help="Nakta, Meta or HF checkpoint folder")
    p.add_argument(
        "--batches", default=None, help="comma-separated, up to 1024 (default 1,8,32; CPU 1,2)"
    )
    p.add_argument(
        "--lengths", default=None, help="prompt:gen pairs (default 64:128,512:128; CPU 8:5)"
    )
    p.add_argument(
        "--engines",
        default=",".join(ENGINES),
        help="nakta,llama_org,hf (also: nakta_compile, nakta_rowwise, nakta_fp8, nakta_kv8, "
        "nakta_fp8_kv8)",
    )
    p.add_argument(
        "--kv-cache", choices=["bf16", "fp8"], default="bf16",
        help="fp8: each nakta / nakta_fp8 engine also runs with an e4m3 KV cache (named "
        "nakta_kv8 / nakta_fp8_kv8) beside the bf16-KV one, in the same run",
    )  # fmt: skip
    p.add_argument(
        "--quant", choices=["fp8"],
        help="fp8: the nakta engine on the FP8 model (e4m3 weights), named nakta_fp8; "
        "bf16 beside it in the same run: --engines nakta,nakta_fp8",
    )  # fmt: skip
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="default bf16 on GPU, fp32 on CPU")
    p.add_argument("--device", help="default cuda when present")
    p.add_argument("--decode-configs", type=Path, help="JSON of decode_linear shape configs")
    p.add_argument("--no-budget", action="store_true", help="skip the per-layer time budget")
    p.add_argument(
        "--shared-prefix", type=int, default=0,
        help="the prompts of a batch share their first N tokens (a few-shot prompt); the floor "
        "then counts that prefix's K/V once",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="results folder (default results/<device>/)")
    a = p.parse_args(argv)
    a.engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    if a.quant:
        a.engines = list(dict.fromkeys("nakta_fp8" if e == "nakta" else e for e in a.engines))
    if a.kv_cache == "fp8":
        kv8 = {"nakta": ["nakta", "nakta_kv8"], "nakta_fp8": ["nakta_fp8", "nakta_fp8_kv8"]}
        a.engines = list(dict.fromkeys(x for e in a.engines for x in kv8.get(e, [e])))
    for e in a.engines:
        if e not in ENGINES + OPT_IN:
            p.error(f"--engines: unknown engine {e!r}; choose from {ENGINES + OPT_IN}")
    return a


def _ints(text: str, name: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: {name} must be comma-separated ints, got {text!r}") from None
    if not out or min(out) < 1:
        raise SystemExit(f"error: {name} needs positive ints, got {text!r}")
    return out


def _lengths(text: str) -> list[tuple[int, int]]:
    pairs = []
    for part in text.split(","):
        try:
            prompt, gen = (int(x) for x in part.split(":"))
        except ValueError:
            raise SystemExit(f"error: --lengths takes prompt:gen pairs, got {part!r}") from None
        if prompt < 1 or gen < 2:
            raise SystemExit(f"error: --lengths needs prompt >= 1 and gen >= 2, got {part!r}")
        pairs.append((prompt, gen))
    return pairs


# ----------------------------------------------------------------------------- bytes and floor
def step_bytes(
    args,
    batch: int,
    context: float,
    elem: int,
    shared: int = 0,
    quant: str | None = None,
    kv_cache: str | None = None,
) -> float:
    """Bytes one decode step must read: every block weight and the LM head once, plus each
    row's K and V at ``context`` positions, the first ``shared`` of them (a prefix every row
    has) once for all rows (activations are noise next to these). ``quant="fp8"``: the block
    weights are one byte each plus an fp32 scale per output channel. ``kv_cache="fp8"``: K/V
    one byte an element plus an fp32 scale per position and KV head."""
    from speed_bench.weights import matmul_params

    blocks, head = matmul_params(args)
    positions = (context - shared) * batch + shared
    kv = 2 * args.n_layers * args.n_kv_heads * args.head_dim * positions
    kv_bytes = kv * elem
    if kv_cache == "fp8":
        kv_bytes = kv + 4 * kv / args.head_dim
    if quant == "fp8":
        channels = args.n_layers * (args.qkv_dim + args.dim + 2 * args.hidden_dim + args.dim)
        return blocks + 4 * channels + head * elem + kv_bytes
    return (blocks + head) * elem + kv_bytes


# ----------------------------------------------------------------------------- engines
class _Engine:
    name = "engine"

    def run(self, prompts: list[list[int]], gen: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class NaktaDecode(_Engine):
    name = "nakta"
    graph_mode: str | None = None  # the Generator's default: CUDA graphs on a GPU
    cascade = True
    quant: str | None = None
    kv_cache: str | None = None  # None: the model's dtype

    def __init__(self, weights, device, dtype, max_seq: int, max_batch: int):
        from nakta_model.generation import Generator
        from nakta_model.loading import load

        self.model = load(weights.source(device, dtype), device, dtype, quant=self.quant)
        self.gen = Generator(
            self.model, max_batch=max_batch, max_seq_len=max_seq, graph_mode=self.graph_mode,
            cascade=self.cascade, kv_cache=self.kv_cache,
        )  # fmt: skip

    def run(self, prompts, gen):
        from nakta_model.generation import greedy_requests

        self.gen.generate(greedy_requests(prompts, gen, eos_id=None))

    def close(self):
        self.model.clear_cache()
        self.gen = self.model = None


class NaktaFp8Decode(NaktaDecode):
    """The Nakta engine on the FP8 model: e4m3 block weights streamed by the decode GEMVs."""

    name = "nakta_fp8"
    quant = "fp8"


class NaktaKv8Decode(NaktaDecode):
    """The Nakta engine with an e4m3 KV cache (``kv_cache="fp8"``): half the cache bytes a step
    reads."""

    name = "nakta_kv8"
    kv_cache = "fp8"


class NaktaFp8Kv8Decode(NaktaFp8Decode):
    """FP8 weights and an e4m3 KV cache."""

    name = "nakta_fp8_kv8"
    kv_cache = "fp8"


class NaktaRowwiseDecode(NaktaDecode):
    """The Nakta engine with a shared prefix read row by row (through L2) instead of by the
    attention's cascade: the two compared with ``--shared-prefix``."""

    name = "nakta_rowwise"
    cascade = False


class NaktaCompileDecode(NaktaDecode):
    """The Nakta engine with its step under ``torch.compile`` (the first run compiles)."""

    name = "nakta_compile"
    graph_mode = "compile"

    def run(self, prompts, gen):
        """Graph breaks make dynamo compile each launcher's frame once per weight shape and
        batch bucket: past its recompile limit (8) a frame would silently run eager."""
        cfg = torch._dynamo.config
        key = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
        with cfg.patch(**{key: 64}):
            super().run(prompts, gen)

    def close(self):
        from torch._dynamo.utils import counters

        breaks = counters["graph_break"]
        top = "; ".join(f"{n}x {why[:90]}" for why, n in breaks.most_common(3))
        print(f"[nakta_compile] dynamo graph breaks: {sum(breaks.values())} ({top or 'none'})")
        super().close()
        torch._dynamo.reset()  # drop the compiled steps (and their graph pools)


class LlamaOrgDecode(_Engine):
    name = "llama_org"

    def __init__(self, weights, device, dtype, max_seq: int, max_batch: int):
        from llama_org import Llama

        self.llama = Llama.from_state_dict(
            weights.args.to_meta_params(), weights.state_dict(device, dtype), max_seq, max_batch,
            device=device, dtype=dtype,
        )  # fmt: skip

    def run(self, prompts, gen):
        self.llama.generate(prompts, max_gen_len=gen, temperature=0.0, eos_id=-1, pad_id=-1)

    def close(self):
        from llama_org.distributed import shutdown

        self.llama = None
        shutdown()


class HFDecode(_Engine):
    name = "hf"

    def __init__(self, weights, device, dtype, max_seq: int, max_batch: int):
        from speed_bench.hf_engine import hf_model

        self.model = hf_model(weights, device, dtype, max_seq)
        self.device = device

    def run(self, prompts, gen):
        ids = torch.tensor(prompts, device=self.device)  # equal lengths: no padding
        with torch.inference_mode():
            self.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen,
                min_new_tokens=gen, do_sample=False, cache_implementation="static",
                pad_token_id=0,
            )  # fmt: skip

    def close(self):
        self.model = None


BUILDERS: dict[str, Callable] = {
    "nakta": NaktaDecode,
    "nakta_compile": NaktaCompileDecode,
    "nakta_rowwise": NaktaRowwiseDecode,
    "nakta_fp8": NaktaFp8Decode,
    "nakta_kv8": NaktaKv8Decode,
    "nakta_fp8_kv8": NaktaFp8Kv8Decode,
    "llama_org": LlamaOrgDecode,
    "hf": HFDecode,
}


# ----------------------------------------------------------------------------- timing
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(engine: _Engine, prompts, gen: int, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    engine.run(prompts, gen)
    _sync(device)
    return time.perf_counter() - t0


def measure(engine: _Engine, prompts, gen: int, device, repeats: int = 3) -> float:
    """Seconds per decode step: ``(min t(gen) - min t(1)) / (gen - 1)`` over ``repeats``
    alternating runs (the minimum of each is the least disturbed by anything else)."""
    engine.run(prompts, min(4, gen))  # warm-up: compilation, graph capture, allocator
    ones, fulls = [], []
    for _ in range(repeats):
        ones.append(_timed(engine, prompts, 1, device))
        fulls.append(_timed(engine, prompts, gen, device))
    step = (min(fulls) - min(ones)) / (gen - 1)
    if step <= 0:
        raise RuntimeError(f"decode time not measurable: t({gen}) <= t(1); use a longer --lengths")
    return step


def random_prompts(
    batch: int, length: int, vocab: int, seed: int, shared: int = 0
) -> list[list[int]]:
    """BOS + random tokens; with ``shared``, every prompt starts with the same ``shared``."""
    rng = random.Random(seed * 7919 + batch * 31 + length)
    prefix = [1] + [rng.randrange(3, vocab) for _ in range(max(shared, 1) - 1)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(length - len(prefix))]
            for _ in range(batch)]  # fmt: skip


# ----------------------------------------------------------------------------- budget
# Where a batch-1 decode step's time goes (unless ``--no-budget``): each launch of one Nakta layer
# and the LM head, timed alone in a CUDA graph against the bytes it must read.


def layer_budget(weights, device, dtype, context: int, bandwidth_gbps: float) -> list[dict]:
    """One Nakta decode layer at batch 1, launch by launch (each alone in a CUDA graph, median
    of replays), against the bytes it must read over the measured copy bandwidth."""
    from nakta_model.generation.step import DecodeStep
    from nakta_model.loading import load

    # the whole-step graph advances the position and the history column on every call: room
    # for _graph_us's 2 eager calls + 5 replays of 20 steps (history past its end would index
    # out of bounds on the device)
    calls = 256
    model = load(weights.source(device, dtype), device, dtype)
    model.setup_cache(2, context + calls)
    step = DecodeStep(model, 1, calls, sampling=False)
    step.buffers.positions.fill_(context - 1)
    from nakta_model.kernels import decode_attention as da
    from nakta_model.kernels import decode_linear as dl

    layer, m = model.layers[0], model
    a, f = layer.attention, layer.feed_forward
    args, elem = model.args, torch.empty((), dtype=dtype).element_size()
    hq, hkv, hd = args.n_heads, args.n_kv_heads, args.head_dim
    x = torch.randn(1, args.dim, device=device, dtype=dtype)
    o = torch.randn(1, hq * hd, device=device, dtype=dtype)
    g = torch.randn(1, args.hidden_dim, device=device, dtype=dtype)
    pos = torch.full((1,), context - 1, device=device, dtype=torch.int32)
    slots = pos.clone()
    rope = dl.RopeArgs(pos, step.cos, step.sin, hq, hkv, hd, a.k_cache, a.v_cache, slots)
    kc = a.k_cache.view(-1, model.max_seq_len, hkv, hd)
    vc = a.v_cache.view(-1, model.max_seq_len, hkv, hd)
    lens = pos + 1
    q = torch.randn(1, hq, hd, device=device, dtype=dtype)
    ops = {
        "norm+wqkv+rope": (
            lambda: dl.decode_linear(
                x,
                a.wqkv.weight,
                norm_weight=layer.attention_norm.weight,
                eps=args.norm_eps,
                rope=rope,
            ),  # fmt: skip
            a.wqkv.weight.numel() * elem,
        ),
        "attention": (
            lambda: da.decode_attention(
                q,
                kc,
                vc,
                lens,
                workspace=step.workspace,
                n_splits=step.splits,
                block_table=step.buffers.block_table,
            ),  # fmt: skip (the step's call: its rows' block tables, here one page a row)
            2 * context * hkv * hd * elem,
        ),
        "wo+residual": (
            lambda: dl.decode_linear(o, a.wo.weight, residual=x),
            a.wo.weight.numel() * elem,
        ),
        "norm+w13+swiglu": (
            lambda: dl.decode_linear(
                x, f.w13.weight, norm_weight=layer.ffn_norm.weight, eps=args.norm_eps, swiglu=True
            ),  # fmt: skip
            f.w13.weight.numel() * elem,
        ),
        "w2+residual": (
            lambda: dl.decode_linear(g, f.w2.weight, residual=x),
            f.w2.weight.numel() * elem,
        ),
        "lm_head (once per step)": (
            lambda: dl.decode_linear(
                x, m.output.weight, norm_weight=m.norm.weight, eps=args.norm_eps
            ),  # fmt: skip
            m.output.weight.numel() * elem,
        ),
    }
    rows = []
    for name, (fn, nbytes) in ops.items():
        us = _graph_us(fn, device)
        floor_us = nbytes / (bandwidth_gbps * 1e9) * 1e6
        per_step = 1 if name.startswith("lm_head") else args.n_layers
        rows.append(
            {
                "launch": name,
                "us": us,
                "floor_us": floor_us,
                "pct_of_floor": 100 * floor_us / us,
                "GB_s": nbytes / (us * 1e-6) / 1e9,
                "ms_per_step": us * per_step / 1e3,
                "floor_ms_per_step": floor_us * per_step / 1e3,
            }
        )
    step.buffers.block_table.fill_(1)  # the whole step writes into cache row 1
    rows.append(_whole_step_row(step, rows, device))
    model.clear_cache()
    return rows


def _whole_step_row(step, rows: list[dict], device) -> dict:
    us = _graph_us(step, device)
    floor_ms = sum(r["floor_ms_per_step"] for r in rows)
    return {
        "launch": "whole step (graph)",
        "us": us,
        "floor_us": floor_ms * 1e3,
        "pct_of_floor": 100 * floor_ms * 1e3 / us,
        "GB_s": float("nan"),
        "ms_per_step": us / 1e3,
        "floor_ms_per_step": floor_ms,
    }


def _graph_us(fn, device, reps: int = 20) -> float:
    """Median microseconds of ``fn`` replayed from a CUDA graph (eager wall clock on the CPU)."""
    if device.type != "cuda":
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    fn()  # compile
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[len(times) // 2]


# ----------------------------------------------------------------------------- main
def _weights(a: argparse.Namespace, on_gpu: bool):
    """The checkpoint's weights (any format) or a preset's random ones; a path or file that does
    not load is one ``error:`` line (``InputError``), before anything is built."""
    from nakta_model.cli import InputError, checkpoint_errors, require_checkpoint
    from speed_bench.weights import weight_source

    if a.checkpoint is None:
        name = a.preset or ("7B" if on_gpu else "tiny")
        try:
            return weight_source(name, None, a.seed)
        except ValueError as e:
            raise InputError(f"--preset {name}: {e}") from e
    require_checkpoint(a.checkpoint)
    with checkpoint_errors(a.checkpoint):
        return weight_source(None, a.checkpoint, a.seed)


def main(argv: Sequence[str] | None = None) -> dict:
    a = parse_args(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    dtype = _DTYPES[a.dtype or ("bf16" if on_gpu else "fp32")]
    batches = _ints(a.batches or ("1,8,32" if on_gpu else "1,2"), "--batches")
    from nakta_model.generation.step import MAX_ROWS

    if max(batches) > MAX_ROWS:  # the step's GEMM path above the crossover takes up to 1024
        raise SystemExit(f"error: --batches must be <= {MAX_ROWS} (the decode step's rows)")
    lengths = _lengths(a.lengths or ("64:128,512:128" if on_gpu else "8:5"))
    if a.decode_configs is not None:
        from nakta_model.kernels import decode_linear as dl

        dl._SHAPES.update(_load_configs(a.decode_configs))
    weights = exit_on_input_error(_weights, a, on_gpu)
    args = weights.args
    elem = torch.empty((), dtype=dtype).element_size()
    bw = copy_bandwidth_gbps(device="cuda") if on_gpu else float("nan")
    max_seq = max(p + g for p, g in lengths) + 8
    print(f"{weights.name} {str(dtype)[6:]} on {device_slug(device)}, copy {bw:.0f} GB/s")
    runs: list[dict] = []
    skipped: dict[str, str] = {}
    out = a.out or results_dir(__file__, device_slug(device))
    out.mkdir(parents=True, exist_ok=True)
    for name in a.engines:
        reason = _skip(name, device)
        if reason:
            print(f"[{name}] skipped: {reason}")
            skipped[name] = reason
            continue
        engine = BUILDERS[name](weights, device, dtype, max_seq, max(batches))
        for batch in batches:
            for prompt, gen in lengths:
                if a.shared_prefix >= prompt:
                    raise SystemExit(f"error: --shared-prefix must be < every prompt ({prompt})")
                shared = a.shared_prefix
                prompts = random_prompts(batch, prompt, args.vocab_size, a.seed, shared)
                try:
                    s = measure(engine, prompts, gen, device)
                except (RuntimeError, ValueError, TypeError) as e:  # a peer that cannot run it
                    skipped[f"{name} b{batch} p{prompt} g{gen}"] = f"{type(e).__name__}: {e}"
                    print(f"[{name}] batch {batch} prompt {prompt} gen {gen} failed: {e}")
                    continue
                quant = getattr(engine, "quant", None)
                kv = getattr(engine, "kv_cache", None)
                nbytes = step_bytes(args, batch, prompt + gen / 2, elem, shared, quant, kv)
                floor_s = nbytes / (bw * 1e9)
                row = {
                    "engine": name,
                    "batch": batch,
                    "prompt": prompt,
                    "gen": gen,
                    "shared_prefix": shared,
                    "tok_s": batch / s,
                    "floor_tok_s": batch / floor_s if on_gpu else float("nan"),
                    "ms_per_token": s * 1e3,
                }
                row["pct_of_floor"] = 100 * row["tok_s"] / row["floor_tok_s"]
                runs.append(row)
                print(
                    f"[{name}] batch {batch} prompt {prompt} gen {gen}: {row['tok_s']:.1f} tok/s"
                    f" ({row['ms_per_token']:.2f} ms/step, {row['pct_of_floor']:.1f}% of floor)"
                )
        engine.close()
        del engine
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
        _write(out, _summary(weights, device, dtype, bw, runs, [], skipped), quiet=True)
    budget = []
    if on_gpu and not a.no_budget and "nakta" in a.engines:
        budget = layer_budget(weights, device, dtype, lengths[0][0] + lengths[0][1] // 2, bw)
    summary = _summary(weights, device, dtype, bw, runs, budget, skipped)
    _write(out, summary)
    return summary


def _summary(weights, device, dtype, bw, runs, budget, skipped) -> dict:
    return {
        "device": device_slug(device),
        "model": weights.name,
        "dtype": str(dtype).removeprefix("torch."),
        "copy_gbps": bw,
        "runs": runs,
        "budget": budget,
        "ratios": _ratios(runs),
        "skipped": skipped,
    }


def _skip(name: str, device: torch.device) -> str | None:
    if name == "nakta_compile":
        return _compile_unavailable(device)
    if name == "hf":
        from speed_bench.hf_engine import unavailable_reason

        return unavailable_reason()
    if name == "llama_org":
        try:
            import fairscale  # noqa: F401
        except ImportError:
            return "fairscale is not installed"
    return None


def _compile_unavailable(device: torch.device) -> str | None:
    """Why ``torch.compile`` cannot run here (None: it can): inductor builds CPU kernels with
    a C++ compiler, and dynamo supports only some Python versions."""
    import os
    import shutil

    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile (dynamo) is not supported on this Python / torch build"
    compilers = (os.environ.get("CXX"), "g++", "c++", "clang++")
    if device.type == "cpu" and not any(c and shutil.which(c) for c in compilers):
        return "torch.compile on the CPU needs a C++ compiler (inductor); none found"
    return None


def _load_configs(path: Path) -> dict:
    """``decode_linear`` per-shape configs: the ``shapes`` of ``bench_decode.py --tune``'s
    ``*_tune_best.json`` (keys are tuple literals)."""
    import ast

    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("shapes"), dict):
        raise SystemExit(f"error: --decode-configs {path}: expected a --tune JSON with 'shapes'")
    return {tuple(ast.literal_eval(k)): dict(v) for k, v in data["shapes"].items()}


def _ratios(runs: list[dict]) -> dict:
    by = {(r["engine"], r["batch"], r["prompt"], r["gen"]): r["tok_s"] for r in runs}
    out = {}
    for (e, b, p, g), v in by.items():
        if e != "nakta":
            continue
        for peer in ("nakta_compile", "nakta_rowwise", "llama_org", "hf"):
            if (peer, b, p, g) in by:
                out[f"nakta_vs_{peer}_b{b}_p{p}_g{g}"] = v / by[(peer, b, p, g)]
    return out


def _write(out: Path, summary: dict, quiet: bool = False) -> None:
    write_json(summary, out / "decode_summary.json")
    df = pd.DataFrame(summary["runs"])
    notes = (
        f"{summary['model']}, {summary['dtype']}, {summary['device']}; copy bandwidth "
        f"{summary['copy_gbps']:.0f} GB/s measured in this run. tok_s = batch / seconds per "
        "decode step, the step time being (t(gen) - t(1)) / (gen - 1) for every engine; "
        "floor_tok_s = batch / (weights + K/V at the mean context) / copy bandwidth. "
        "Ratios: " + ", ".join(f"{k} {v:.2f}x" for k, v in summary["ratios"].items())
    )
    write_table(df, out, "decode", "Decoding speed vs the memory-bandwidth floor", notes)
    if summary["budget"]:
        write_table(
            pd.DataFrame(summary["budget"]), out, "decode_budget",
            "One Nakta decode layer at batch 1, launch by launch, vs its byte floor", notes,
        )  # fmt: skip
    if len(df):
        save_figure(_plot(df, summary), out / "decode.png")
    if not quiet:
        print(df.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
        print(f"results -> {out}")


def _plot(df: pd.DataFrame, summary: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(b, p, g) for b, p, g in zip(df["batch"], df["prompt"], df["gen"])})
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cases)), 4))
    width = 0.8 / (len(set(df["engine"])) + 1)
    for i, engine in enumerate(sorted(set(df["engine"]))):
        sub = df[df["engine"] == engine].set_index(["batch", "prompt", "gen"])
        ys = [sub.loc[c, "tok_s"] if c in sub.index else 0 for c in cases]
        ax.bar([j + i * width for j in range(len(cases))], ys, width, label=engine)
    floor = df.groupby(["batch", "prompt", "gen"])["floor_tok_s"].first()
    ax.bar([j + len(set(df["engine"])) * width for j in range(len(cases))],
           [floor.get(c, 0) for c in cases], width, label="floor", color="lightgray")  # fmt: skip
    ax.set_xticks([j + 0.4 for j in range(len(cases))], [f"b{b} p{p} g{g}" for b, p, g in cases])
    ax.set_yscale("log")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"Decoding, {summary['model']} {summary['dtype']} on {summary['device']}")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    return fig


if __name__ == "__main__":
    main()
