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


import importlib
from kernel_benchmark.bench_rmsnorm import meta_rms_norm
from kernel_benchmark.common import compiled
EV = importlib.import_module("rms_evict"); EVM = importlib.import_module("rms_evict_mulrn")
cm = compiled(meta_rms_norm)
T = 16384
for N in (6656, 8192, 5120, 4096):
    w = (1 + 0.1 * torch.randn(N, device=dev)).to(torch.bfloat16)
    x = torch.randn(T, N, device=dev, dtype=torch.bfloat16)
    var = {"default": [functools.partial(RN.rms_norm_forward, x, w, 1e-6)]}
    for bn in (1024, 2048, 4096):
        if bn >= N:
            continue
        for nw in (4, 8, 16):
            if bn // (32 * nw) < 4:
                continue
            for tag, mod in (("cur", RN), ("ev", EV), ("evm", EVM)):
                var[f"loop{bn}_w{nw}_{tag}"] = [functools.partial(mod.rms_norm_forward, x, w, 1e-6, block_n=bn, num_warps=nw)]
    var["compile_meta"] = [functools.partial(cm, x, w)]
    var["liger"] = [functools.partial(LigerRMSNormFunction.apply, x, w, 1e-6, 0.0, "llama", False)]
    ref = RN.rms_norm(x, w, 1e-6)
    for k, v in var.items():
        if k.startswith("loop"):
            y = v[0]()[0]
            checks.append(dict(N=N, v=k, max_ulp_diff=float(((y.float() - ref.float()).abs() / ref.float().abs().clamp_min(1e-30)).max())))
    with torch.no_grad():
        cm(x, w)
        compare(f"rms_fwd_{N}", var, 2 * T * N * 2, rounds=11)
    del x
with open(os.path.join(OUT, "ab15.json"), "w") as f:
    json.dump(dict(copy_gbps=COPY, device=torch.cuda.get_device_name(), checks=checks, results=results), f, indent=1)
