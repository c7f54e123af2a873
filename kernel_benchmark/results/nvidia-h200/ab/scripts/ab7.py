"""Session-2 exploration: SwiGLU branch-free division, RMSNorm weight-early, RoPE small shapes.
Interleaved rounds of CUDA-graph replays, median per variant, peers in the same process."""
import json, os, statistics, sys, time, functools
import torch
from nakta_model.bench.ceilings import copy_bandwidth_gbps
from nakta_model.kernels import swiglu as S, rmsnorm as RN, rope as RP
from nakta_model.kernels.rope import RotaryPositionEmbedding, apply_rotary_pos_emb, apply_rope_qkv_, build_rope_cache
from importlib import import_module
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), '.exp'))
import importlib.util
def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
OS = _load("old_swiglu", ".exp/old_swiglu.py")
ORN = _load("old_rmsnorm", ".exp/old_rmsnorm.py")
OUT = os.environ.get("OUT", "/tmp/out")
dev = torch.device("cuda")
results = []

def graph_of(calls, reps):
    for c in calls: c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for c in calls: c()
    g.replay(); torch.cuda.synchronize()
    return g, reps * len(calls)

def compare(tag, variants, nbytes, rounds=9, reps=None):
    """variants: name -> list of callables (input sets). Returns name -> (us, pct)."""
    graphs = {}
    for name, calls in variants.items():
        try:
            if reps is None:
                calls[0](); torch.cuda.synchronize(); t0 = time.perf_counter(); calls[0](); torch.cuda.synchronize()
                est = time.perf_counter() - t0
                r = max(2, min(50, int(0.004 / max(est, 1e-6) / len(calls))))
            else:
                r = reps
            graphs[name] = graph_of(calls, r)
        except Exception as e:
            print(f"{tag} {name}: FAILED {str(e).splitlines()[0][:200]}", flush=True)
    times = {n: [] for n in graphs}
    for _ in range(rounds):
        for n, (g, k) in graphs.items():
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); g.replay(); e.record(); e.synchronize()
            times[n].append(s.elapsed_time(e) * 1e3 / k)
    out = {}
    for n, ts in times.items():
        us = statistics.median(ts)
        pct = 100 * nbytes / (us * 1e-6) / 1e9 / COPY
        out[n] = (us, pct)
        results.append(dict(tag=tag, variant=n, us=us, pct_copy_bw=pct, spread=(max(ts) - min(ts)) / us))
        print(f"{tag:28s} {n:40s} {us:9.2f} us {pct:6.1f}%  spread {100*(max(ts)-min(ts))/us:4.1f}%", flush=True)
    del graphs
    return out

COPY = copy_bandwidth_gbps()
print(f"copy {COPY:.0f} GB/s", flush=True)
from liger_kernel.ops.swiglu import LigerSiLUMulFunction, LigerFusedGateUpSiLUMulFunction
from liger_kernel.ops.rms_norm import LigerRMSNormFunction






T = 16384
for N in (5120, 6656, 4096):
    x = torch.randn(T, N, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, device=dev, dtype=torch.bfloat16)
    r = torch.randn_like(x)
    var = {}
    var["new_default"] = [functools.partial(RN.rms_norm_forward, x, w, 1e-6)]
    var["old_default"] = [functools.partial(ORN.rms_norm_forward, x, w, 1e-6)]
    for bm, nw in [(1, 4), (1, 8), (2, 8)]:
        var[f"new_{bm}w{nw}"] = [functools.partial(RN.rms_norm_forward, x, w, 1e-6, block_m=bm, num_warps=nw)]
        var[f"old_{bm}w{nw}"] = [functools.partial(ORN.rms_norm_forward, x, w, 1e-6, block_m=bm, num_warps=nw)]
    var["new_res"] = [functools.partial(RN.rms_norm_forward, x, w, 1e-6, r)]
    var["old_res"] = [functools.partial(ORN.rms_norm_forward, x, w, 1e-6, r)]
    var["liger"] = [functools.partial(LigerRMSNormFunction.apply, x, w, 1e-6, 0.0, "llama", False)]
    with torch.no_grad():
        compare(f"rms_fwd_{N}", var, 2 * T * N * 2, rounds=11)
    del x, r
    torch.cuda.empty_cache()
os.makedirs(OUT, exist_ok=True)
with open(os.path.join(OUT, "tune7_rms_chunks.json"), "w") as f:
    json.dump(dict(copy_gbps=COPY, device=torch.cuda.get_device_name(), results=results), f, indent=1)
