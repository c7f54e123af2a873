"""Where a batch-1 decode step's time goes: each launch of one Nakta layer, and the LM head,
timed alone in a CUDA graph against the bytes it must read (``decode_speed.py``'s ``budget``).

Kept apart from ``decode_speed.py`` (engines, runs, report) so each reads in one sitting.
"""

from __future__ import annotations

import time

import torch

__all__ = ["layer_budget"]


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
