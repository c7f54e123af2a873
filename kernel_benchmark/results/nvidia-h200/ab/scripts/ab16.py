"""Session 3: SwiGLU exact-by-exhaustion silu variants; RMSNorm 4096 Nakta vs Liger on shared buffers."""
import json, os, statistics, sys, time, functools
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), ".exp"))
from nakta_model.bench.ceilings import copy_bandwidth_gbps
from nakta_model.kernels import swiglu as S, rmsnorm as RN
import sw10
OUT = os.environ.get("OUT", "/tmp/out"); os.makedirs(OUT, exist_ok=True)
dev = torch.device("cuda")
results, checks = [], []

def graph_of(calls, reps):
    for c in calls: c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for c in calls: c()
    g.replay(); torch.cuda.synchronize()
    return g, reps * len(calls)

def compare(tag, variants, nbytes, rounds=15, reps=None):
    graphs = {}
    for name, calls in variants.items():
        try:
            calls[0](); torch.cuda.synchronize(); t0 = time.perf_counter(); calls[0](); torch.cuda.synchronize()
            est = time.perf_counter() - t0
            r = reps or max(2, min(50, int(0.004 / max(est, 1e-6) / len(calls))))
            graphs[name] = graph_of(calls, r)
        except Exception as e:
            print(f"{tag} {name}: FAILED {str(e).splitlines()[0][:300]}", flush=True)
    times = {n: [] for n in graphs}
    for _ in range(rounds):
        for n, (g, k) in graphs.items():
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); g.replay(); e.record(); e.synchronize()
            times[n].append(s.elapsed_time(e) * 1e3 / k)
    for n, ts in times.items():
        us = statistics.median(ts); pct = 100 * nbytes / (us * 1e-6) / 1e9 / COPY
        results.append(dict(tag=tag, variant=n, us=us, pct_copy_bw=pct, spread=(max(ts) - min(ts)) / us))
        print(f"{tag:24s} {n:34s} {us:9.2f} us {pct:6.1f}%  spread {100*(max(ts)-min(ts))/us:4.1f}%", flush=True)

COPY = copy_bandwidth_gbps()
print(f"copy {COPY:.0f} GB/s  {torch.cuda.get_device_name()}", flush=True)
from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction, LigerSiLUMulFunction
from liger_kernel.ops.rms_norm import LigerRMSNormFunction, _rms_norm_forward_kernel as LK


from kernel_benchmark import bench_rmsnorm as B
T, N = 16384, 4096
plain, _ = B.paths(dev)
sets = [B.make_inputs(T, N, torch.bfloat16, dev, 11 + 97 * i) for i in range(3)]
for i, t in enumerate(sets):
    print("set", i, hex(t["x"].data_ptr()), flush=True)
var = {}
for i, t in enumerate(sets):
    for p in ("nakta", "liger"):
        var[f"{p}_S{i}"] = [B.make_call("fwd", plain[p], t)]
for rep in range(3):
    compare(f"rms_fwd_4096_placement_r{rep}", var, 2 * T * N * 2, rounds=15)
    var = dict(reversed(list(var.items())))
with open(os.path.join(OUT, "ab16.json"), "w") as f:
    json.dump(dict(copy_gbps=COPY, device=torch.cuda.get_device_name(), x_ptrs=[hex(t["x"].data_ptr()) for t in sets], results=results), f, indent=1)
