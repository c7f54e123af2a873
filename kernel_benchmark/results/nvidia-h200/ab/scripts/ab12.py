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
mods = {"cur": RN, "mulrn_all": importlib.import_module("rms_mulrn_all"), "mulrn_one": importlib.import_module("rms_mulrn_one")}
from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
T = 16384
for N in (4096, 5120, 6656, 8192):
    w = (1 + 0.1 * torch.randn(N, device=dev)).to(torch.bfloat16)
    x = torch.randn(T, N, device=dev, dtype=torch.bfloat16)
    ref = mods["cur"].rms_norm(x, w, 1e-6)
    var = {}
    for k, m in mods.items():
        checks.append(dict(N=N, mod=k, equal=bool(torch.equal(m.rms_norm(x, w, 1e-6), ref))))
        var[k] = [functools.partial(m.rms_norm, x, w, 1e-6)]
    var["liger"] = [functools.partial(LigerRMSNormFunction.apply, x, w, 1e-6, 0.0, "llama", False)]
    print(checks[-3:], flush=True)
    with torch.no_grad():
        for rep in range(3 if N == 4096 else 2):
            compare(f"rms_fwd_{N}_r{rep}", var, 2 * T * N * 2, rounds=15)
    if N == 4096:
        r = torch.randn_like(x)
        var = {k: [functools.partial(m.rms_norm, x, w, 1e-6, residual=r)] for k, m in mods.items()}
        var["liger"] = [functools.partial(LigerFusedAddRMSNormFunction.apply, x.clone(), r.clone(), w, 1e-6, 0.0, "llama", False)]
        with torch.no_grad():
            compare(f"rms_fwd_res_{N}", var, 4 * T * N * 2, rounds=15)
    del x
SM = importlib.import_module("swiglu_mulrn")
for F in (11008, 13824):
    gu = torch.randn(T, 2 * F, device=dev, dtype=torch.bfloat16) * 2
    g, u = gu[:, :F], gu[:, F:]
    ref = S.silu_mul_forward(g, u, exact=False)
    checks.append(dict(F=F, sw_mulrn_equal=bool(torch.equal(SM.silu_mul_forward(g, u, exact=False), ref)), fast_equal_exact=bool(torch.equal(S.silu_mul_forward(g, u), ref))))
    print(checks[-1], flush=True)
    var = {"fast": [functools.partial(S.silu_mul_forward, g, u, exact=False)],
           "fast_mulrn": [functools.partial(SM.silu_mul_forward, g, u, exact=False)],
           "exact": [functools.partial(S.silu_mul_forward, g, u, exact=True)],
           "exact_mulrn": [functools.partial(SM.silu_mul_forward, g, u, exact=True)],
           "liger_fused": [functools.partial(LigerFusedGateUpSiLUMulFunction.apply, gu)]}
    with torch.no_grad():
        for rep in range(2):
            compare(f"swiglu_fwd_{F}_r{rep}", var, 3 * T * F * 2, rounds=15)
    del gu, g, u
with open(os.path.join(OUT, "ab12.json"), "w") as f:
    json.dump(dict(copy_gbps=COPY, device=torch.cuda.get_device_name(), checks=checks, results=results), f, indent=1)
