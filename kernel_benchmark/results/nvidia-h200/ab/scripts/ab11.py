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


import rms10
T, N = 16384, 4096
w = (1 + 0.1 * torch.randn(N, device=dev)).to(torch.bfloat16)
x = torch.randn(T, N, device=dev, dtype=torch.bfloat16)
y = torch.empty_like(x); r = torch.empty(T, device=dev, dtype=torch.float32)
def ours_raw():
    return RN._rms_norm_fwd_kernel[(T,)](x, x, w, y, y, y, T, N, x.stride(0), 0, 1, y.stride(0), y.stride(0), 1e-6, 1.0 / N,
        HAS_RESIDUAL=False, STORE_RSTD=False, CAST_META=True, BLOCK_M=1, C0=4096, C1=0, C2=0, SINGLE_BLOCK=True, ACCURATE=True, EMULATE_RNE=False, num_warps=8)
def liger_raw():
    return LK[(T,)](y, y.stride(0), x, x.stride(0), w, w.stride(0), r, r.stride(0), N, 1e-6, 0.0, casting_mode=0, elementwise_affine=True, BLOCK_SIZE=4096, num_warps=8)
ref = LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", False)
for name, fn in (("ours", ours_raw), ("liger", liger_raw)):
    k = fn(); open(os.path.join(OUT, f"{name}.cubin"), "wb").write(k.asm["cubin"])
var = {"nakta_raw": [ours_raw], "liger_raw": [liger_raw]}
combos = {"clone_liger": (1, 1, 1, 0), "clone_norstd": (0, 1, 1, 0), "clone_norstd_invn": (0, 0, 1, 0),
          "clone_ours": (0, 0, 0, 0), "clone_liger_hmul": (1, 1, 0, 0), "clone_norstd_hmul": (0, 1, 0, 0),
          "clone_liger_wlate": (1, 1, 1, 1), "clone_ours_wlate": (0, 0, 0, 1)}
for name, c in combos.items():
    k = rms10.launch(x, w, y, r, *c)
    checks.append(dict(variant=name, equal_liger=bool(torch.equal(y, ref))))
    open(os.path.join(OUT, f"{name}.cubin"), "wb").write(k.asm["cubin"])
    var[name] = [functools.partial(rms10.launch, x, w, y, r, *c)]
print(checks, flush=True)
with torch.no_grad():
    for rep in range(3):
        compare(f"rmsnorm_fwd_4096_r{rep}", var, 2 * T * N * 2, rounds=15)
del x, y
F = 11008
gu = torch.randn(T, 2 * F, device=dev, dtype=torch.bfloat16) * 2
g, u = gu[:, :F], gu[:, F:]
out = torch.empty(T, F, device=dev, dtype=torch.bfloat16)
var = {"mode4_1x512w1": [functools.partial(sw10.launch, g, u, out, 4)],
       "mode1_1x512w1": [functools.partial(sw10.launch, g, u, out, 1)],
       "nakta_exact": [functools.partial(S.silu_mul_forward, g, u, exact=True)],
       "nakta_fast": [functools.partial(S.silu_mul_forward, g, u, exact=False)],
       "liger_fused": [functools.partial(LigerFusedGateUpSiLUMulFunction.apply, gu)]}
with torch.no_grad():
    for rep in range(2):
        compare(f"swiglu_fwd_11008_r{rep}", var, 3 * T * F * 2, rounds=21)
with open(os.path.join(OUT, "ab11.json"), "w") as f:
    json.dump(dict(copy_gbps=COPY, device=torch.cuda.get_device_name(), checks=checks, results=results), f, indent=1)
