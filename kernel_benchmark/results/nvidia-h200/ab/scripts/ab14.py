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


from kernel_benchmark.bench_rmsnorm import meta_rms_norm
from kernel_benchmark.common import compiled
cm = compiled(meta_rms_norm)
T = 16384
cfgs = {
    6656: [dict(), dict(num_warps=8), dict(num_warps=2), dict(block_n=8192, num_warps=8), dict(block_n=8192, num_warps=16),
           dict(block_n=8192, num_warps=4), dict(block_n=8192, block_m=2, num_warps=16)],
    8192: [dict(), dict(block_m=1, num_warps=8), dict(block_m=1, num_warps=16), dict(block_m=2, num_warps=8), dict(block_m=1, num_warps=32)],
    5120: [dict(), dict(num_warps=8), dict(block_n=8192, num_warps=8), dict(block_n=8192, num_warps=16)],
}
for N, cs in cfgs.items():
    w = (1 + 0.1 * torch.randn(N, device=dev)).to(torch.bfloat16)
    x = torch.randn(T, N, device=dev, dtype=torch.bfloat16)
    ref = RN.rms_norm(x, w, 1e-6)
    var = {}
    for c in cs:
        name = "cfg_" + ("_".join(f"{k}{v}" for k, v in c.items()) or "default")
        y = RN.rms_norm_forward(x, w, 1e-6, **c)[0]
        checks.append(dict(N=N, cfg=name, equal=bool(torch.equal(y, ref))))
        var[name] = [functools.partial(RN.rms_norm_forward, x, w, 1e-6, **c)]
    var["compile_meta"] = [functools.partial(cm, x, w)]
    var["liger"] = [functools.partial(LigerRMSNormFunction.apply, x, w, 1e-6, 0.0, "llama", False)]
    print(checks[-len(cs):], flush=True)
    with torch.no_grad():
        cm(x, w)
        for rep in range(2):
            compare(f"rms_fwd_{N}_r{rep}", var, 2 * T * N * 2, rounds=15)
    del x
with open(os.path.join(OUT, "ab14.json"), "w") as f:
    json.dump(dict(copy_gbps=COPY, device=torch.cuda.get_device_name(), checks=checks, results=results), f, indent=1)
