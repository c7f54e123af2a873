"""Session-2 exploration: SwiGLU branch-free division, RMSNorm weight-early, RoPE small shapes.
Interleaved rounds of CUDA-graph replays, median per variant, peers in the same process."""
import json, os, statistics, sys, time, functools
import torch
from nakta_model.bench.ceilings import copy_bandwidth_gbps
from nakta_model.kernels import swiglu as S, rmsnorm as RN, rope as RP
from nakta_model.kernels.rope import RotaryPositionEmbedding, apply_rotary_pos_emb, apply_rope_qkv_, build_rope_cache
from importlib import import_module
sys.path.insert(0, os.getcwd())
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

section = sys.argv[1] if len(sys.argv) > 1 else "all"
# ---------------------------------------------------------------- exactness of the new division
if section in ("all", "swiglu"):
    for dt in (torch.bfloat16, torch.float16):
        g = torch.arange(-(2**15), 2**15, device=dev, dtype=torch.int32).to(torch.int16).view(dt)
        u = torch.ones_like(g)
        a, b = S.silu_mul(g, u), torch.nn.functional.silu(g) * u
        ok = ((a == b) & (torch.signbit(a) == torch.signbit(b))) | (torch.isnan(a) & torch.isnan(b))
        print("exhaustive", dt, "mismatches", int((~ok).sum()), flush=True)
    bad = 0
    for k in range(16):
        x = (torch.arange(k * 2**28, (k + 1) * 2**28, device=dev, dtype=torch.int64) - 2**31).to(torch.int32).view(torch.float32)
        one = torch.ones(1, device=dev).expand_as(x)
        a = S.silu_mul_forward(x.view(1, -1), torch.ones_like(x).view(1, -1))
        b = torch.nn.functional.silu(x).view(1, -1)
        ok = ((a == b) & (torch.signbit(a) == torch.signbit(b))) | (torch.isnan(a) & torch.isnan(b))
        bad += int((~ok).sum())
        del x, a, b, ok
    print("exhaustive fp32 silu (all 2^32 gates) mismatches", bad, flush=True)
    results.append(dict(tag="exhaustive_fp32_silu", variant="mismatches", us=bad, pct_copy_bw=0, spread=0))
    torch.cuda.empty_cache()

    T = 16384
    for F in (11008, 22016):
        gu = torch.randn(T, 2 * F, device=dev, dtype=torch.bfloat16)
        g, u = gu[:, :F], gu[:, F:]
        gc, uc = g.contiguous(), u.contiguous()
        nb = 3 * T * F * 2
        var = {}
        for bm, bn, nw in [(2, 1024, 4), (1, 1024, 4), (1, 2048, 4), (4, 1024, 8), (2, 2048, 8), (1, 4096, 8), (1, 4096, 4), (2, 512, 2), (4, 512, 4), (1, 16384, 16), (8, 256, 4)]:
            var[f"new_fused_{bm}x{bn}w{nw}"] = [functools.partial(S.silu_mul_forward, g, u, block_m=bm, block_n=bn, num_warps=nw)]
        var["old_fused_2x1024w4"] = [functools.partial(OS.silu_mul_forward, g, u)]
        var["new_split_2x1024w4"] = [functools.partial(S.silu_mul_forward, gc, uc)]
        var["liger_fused"] = [functools.partial(LigerFusedGateUpSiLUMulFunction.apply, gu)]
        var["liger_split"] = [functools.partial(LigerSiLUMulFunction.apply, gc, uc)]
        with torch.no_grad():
            compare(f"swiglu_fwd_{F}", var, nb)
        dout = torch.randn(T, F, device=dev, dtype=torch.bfloat16)
        dgu = torch.empty_like(gu)
        var = {}
        for bm, bn, nw in [(1, 1024, 4), (2, 1024, 4), (1, 2048, 4), (1, 2048, 8), (2, 512, 4), (4, 512, 8)]:
            var[f"new_bwd_{bm}x{bn}w{nw}"] = [functools.partial(S.silu_mul_backward, dout, g, u, dgu[:, :F], dgu[:, F:], block_m=bm, block_n=bn, num_warps=nw)]
        var["old_bwd_1x1024w4"] = [functools.partial(OS.silu_mul_backward, dout, g, u, dgu[:, :F], dgu[:, F:])]
        compare(f"swiglu_bwd_{F}", var, 5 * T * F * 2)
        del gu, g, u, gc, uc, dout, dgu
        torch.cuda.empty_cache()

# ---------------------------------------------------------------- rmsnorm forward
if section in ("all", "rms"):
    T = 16384
    for N in (4096, 8192, 5120):
        x = torch.randn(T, N, device=dev, dtype=torch.bfloat16)
        w = torch.randn(N, device=dev, dtype=torch.bfloat16)
        var = {}
        for bm, nw in [(1, 4), (1, 8), (2, 4), (2, 8), (2, 16), (4, 8), (4, 16), (1, 16)]:
            var[f"new_{bm}w{nw}"] = [functools.partial(RN.rms_norm_forward, x, w, 1e-6, block_m=bm, num_warps=nw)]
        var["old_default"] = [functools.partial(ORN.rms_norm_forward, x, w, 1e-6)]
        var["new_default"] = [functools.partial(RN.rms_norm_forward, x, w, 1e-6)]
        var["liger"] = [functools.partial(LigerRMSNormFunction.apply, x, w, 1e-6, 0.0, "llama", False)]
        with torch.no_grad():
            compare(f"rms_fwd_{N}", var, 2 * T * N * 2)
        del x
        torch.cuda.empty_cache()

# ---------------------------------------------------------------- rope seq512 and qkv 13B
if section in ("all", "rope"):
    s, b, h, d = 512, 16, 32, 128
    sets = [torch.randn(s, b, h, d, device=dev, dtype=torch.bfloat16) for _ in range(3)]
    emb = RotaryPositionEmbedding(d, 1.0, device=dev)(s)
    nb = 2 * sets[0].numel() * 2
    base = dict(RP._TE_DEFAULTS)
    confs = {
        "split1024(old)": dict(MIN_SPLIT=1024),
        "split512(new)": {},
        "split512_T2048": dict(TARGET=2048),
        "split512_T8192": dict(TARGET=8192),
        "split512_pref_T2048": dict(TARGET=2048, PREFETCH=True),
        "split512_pref": dict(PREFETCH=True),
        "split512_w8": dict(num_warps=8),
        "split512_T8192_w8": dict(TARGET=8192, num_warps=8),
        "split256": dict(MIN_SPLIT=256, MIN_PROGRAMS=256),
        "split512_joint": dict(JOINT=True),
        "B8_split512": dict(BLOCK_B=8),
    }
    def mk(conf, t):
        def f():
            RP._TE_TUNE.clear(); RP._TE_TUNE.update(conf)
            return apply_rotary_pos_emb(t, emb)
        return f
    # graph capture snapshots the launch config at capture time
    var = {n: [mk(c, t) for t in sets] for n, c in confs.items()}
    var["copy_same_size"] = [functools.partial(torch.clone, t) for t in sets]
    with torch.no_grad():
        compare("rope_te_seq512", var, nb)
    RP._TE_TUNE.clear()
    for nm, nh in (("13B", 40), ("7B", 32), ("65B", 64)):
        N = 16384
        qkv = torch.randn(N, 3 * nh * 128, device=dev, dtype=torch.bfloat16)
        cos, sin = build_rope_cache(8192, 128, device=dev)
        pos = torch.randint(0, 8192, (N,), device=dev)
        qconfs = {"default": {}, "w8": dict(num_warps=8), "H8": dict(BLOCK_H=8), "H8_w8": dict(BLOCK_H=8, num_warps=8),
                  "T4096_w8": dict(TARGET=4096, num_warps=8), "H8_T1024": dict(BLOCK_H=8, TARGET=1024), "T1024": dict(TARGET=1024), "T1024_w2": dict(TARGET=1024, num_warps=2)}
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
with open(os.path.join(OUT, f"tune_{section}.json"), "w") as f:
    json.dump(dict(copy_gbps=COPY, device=torch.cuda.get_device_name(), results=results), f, indent=1)
