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


import sw_exp_mod as SX
section = sys.argv[1] if len(sys.argv) > 1 else "all"
if section in ("all", "swiglu"):
    for dt in (torch.bfloat16, torch.float16):
        g = torch.arange(-(2**15), 2**15, device=dev, dtype=torch.int32).to(torch.int16).view(dt)
        u = torch.ones_like(g)
        a, b = S.silu_mul(g, u), torch.nn.functional.silu(g) * u
        ok = ((a == b) & (torch.signbit(a) == torch.signbit(b))) | (torch.isnan(a) & torch.isnan(b))
        print("exhaustive", dt, "mismatches", int((~ok).sum()), "at", g[~ok][:4].float().tolist(), flush=True)
    bad = 0
    for k in range(16):
        x = (torch.arange(k * 2**28, (k + 1) * 2**28, device=dev, dtype=torch.int64) - 2**31).to(torch.int32).view(torch.float32)
        a = S.silu_mul_forward(x.view(1, -1), torch.ones_like(x).view(1, -1))
        b = torch.nn.functional.silu(x).view(1, -1)
        ok = ((a == b) & (torch.signbit(a) == torch.signbit(b))) | (torch.isnan(a) & torch.isnan(b))
        bad += int((~ok).sum())
        del x, a, b, ok
    print("exhaustive fp32 silu (all 2^32 gates) mismatches", bad, flush=True)
    results.append(dict(tag="exhaustive_fp32_silu", variant="mismatches", us=bad, pct_copy_bw=0, spread=0))
    torch.cuda.empty_cache()
    T = 16384
    for F in (11008,):
        gu = torch.randn(T, 2 * F, device=dev, dtype=torch.bfloat16)
        g, u = gu[:, :F], gu[:, F:]
        out = torch.empty(T, F, device=dev, dtype=torch.bfloat16)
        nb = 3 * T * F * 2
        var = {}
        for mode in (0, 1, 2):
            for bm, bn, nw in [(2, 1024, 4), (2, 512, 2), (1, 512, 2), (4, 256, 2), (2, 256, 1), (1, 1024, 2), (4, 512, 4), (1, 256, 1), (8, 512, 8), (1, 16384, 16)]:
                var[f"m{mode}_{bm}x{bn}w{nw}"] = [functools.partial(SX.launch, g, u, out, bm, bn, nw, mode)]
        var["liger_fused"] = [functools.partial(LigerFusedGateUpSiLUMulFunction.apply, gu)]
        with torch.no_grad():
            compare(f"swiglu_fwd_{F}", var, nb)
        dout = torch.randn(T, F, device=dev, dtype=torch.bfloat16)
        dgu = torch.empty_like(gu)
        var = {}
        for bm, bn, nw in [(2, 512, 4), (2, 512, 2), (1, 512, 2), (4, 256, 2), (2, 256, 2), (1, 1024, 2)]:
            var[f"new_bwd_{bm}x{bn}w{nw}"] = [functools.partial(S.silu_mul_backward, dout, g, u, dgu[:, :F], dgu[:, F:], block_m=bm, block_n=bn, num_warps=nw)]
            var[f"old_bwd_{bm}x{bn}w{nw}"] = [functools.partial(OS.silu_mul_backward, dout, g, u, dgu[:, :F], dgu[:, F:], block_m=bm, block_n=bn, num_warps=nw)]
        var["old_bwd_1x1024w4"] = [functools.partial(OS.silu_mul_backward, dout, g, u, dgu[:, :F], dgu[:, F:])]
        var["liger_bwd"] = [functools.partial(__import__("liger_kernel.ops.swiglu", fromlist=["swiglu_backward"]).swiglu_backward, g.contiguous(), u.contiguous(), dout)]
        compare(f"swiglu_bwd_{F}", var, 5 * T * F * 2)
        del gu, g, u, dout, dgu
        torch.cuda.empty_cache()

if section in ("all", "rope"):
    shapes = {"default": {}, "seq512": dict(s=512), "batch2": dict(b=2), "batch4": dict(b=4), "batch8": dict(b=8), "heads8": dict(h=8), "rotary0.5": dict(rp=0.5), "seq1024": dict(s=1024), "d256": dict(d=256)}
    confs = {"new": {}, "split1024": dict(MIN_SPLIT=1024), "T2048": dict(TARGET=2048), "pref_T2048": dict(TARGET=2048, PREFETCH=True), "pref": dict(PREFETCH=True)}
    for sn, sh in shapes.items():
        s, b, h, d, rp = sh.get("s", 4096), sh.get("b", 16), sh.get("h", 32), sh.get("d", 128), sh.get("rp", 1.0)
        t0 = torch.randn(s, b, h, d, device=dev, dtype=torch.bfloat16)
        nsets = max(1, min(8, -(-3 * 60 * 2**20 // (t0.numel() * 2))))
        sets = [t0] + [torch.randn_like(t0) for _ in range(nsets - 1)]
        emb = RotaryPositionEmbedding(d, rp, device=dev)(s)
        def mk(conf, t):
            def f():
                RP._TE_TUNE.clear(); RP._TE_TUNE.update(conf)
                return apply_rotary_pos_emb(t, emb)
            return f
        var = {n: [mk(c, t) for t in sets] for n, c in confs.items()}
        with torch.no_grad():
            compare(f"rope_te_{sn}", var, 2 * t0.numel() * 2)
        RP._TE_TUNE.clear()
        del sets, t0
    for nm, nh in (("13B", 40), ("7B", 32), ("65B", 64)):
        N = 16384
        qkv = torch.randn(N, 3 * nh * 128, device=dev, dtype=torch.bfloat16)
        cos, sin = build_rope_cache(8192, 128, device=dev)
        pos = torch.randint(0, 8192, (N,), device=dev)
        qconfs = {"default": {}, "w8": dict(num_warps=8), "H32": dict(BLOCK_H=32), "H32_w8": dict(BLOCK_H=32, num_warps=8), "H16_T1": dict(BLOCK_H=16, BLOCK_T=1), "H16_T1_w2": dict(BLOCK_H=16, BLOCK_T=1, num_warps=2), "H64": dict(BLOCK_H=64, TARGET=4096), "T1024": dict(TARGET=1024)}
        def mq(conf):
            def f():
                RP._QKV_TUNE.clear(); RP._QKV_TUNE.update(conf)
                return apply_rope_qkv_(qkv, pos, cos, sin, nh, nh, 128, interleaved=False)
            return f
        var = {n: [mq(c)] for n, c in qconfs.items()}
        with torch.no_grad():
            compare(f"rope_qkv_{nm}", var, 2 * 2 * N * nh * 128 * 2)
        RP._QKV_TUNE.clear()

os.makedirs(OUT, exist_ok=True)
with open(os.path.join(OUT, f"tune2_{section}.json"), "w") as f:
    json.dump(dict(copy_gbps=COPY, device=torch.cuda.get_device_name(), results=results), f, indent=1)
