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



section = sys.argv[1] if len(sys.argv) > 1 else "all"
if section in ("all", "swiglu"):
    T = 16384
    for F in (11008, 22016):
        gu = torch.randn(T, 2 * F, device=dev, dtype=torch.bfloat16)
        g, u = gu[:, :F], gu[:, F:]
        nb = 3 * T * F * 2
        var = {}
        for ex in (True, False):
            for bm, bn, nw in [(2, 1024, 4), (2, 512, 2), (2, 256, 1), (1, 1024, 2), (1, 512, 1), (4, 256, 2), (1, 2048, 4)]:
                var[f"{'exact' if ex else 'fast'}_{bm}x{bn}w{nw}"] = [functools.partial(S.silu_mul_forward, g, u, exact=ex, block_m=bm, block_n=bn, num_warps=nw)]
        var["liger_fused"] = [functools.partial(LigerFusedGateUpSiLUMulFunction.apply, gu)]
        with torch.no_grad():
            compare(f"swiglu_fwd_{F}", var, nb, rounds=11)
        del gu, g, u
        torch.cuda.empty_cache()

if section in ("all", "rope"):
    shapes = {"default": {}, "seq512": dict(s=512), "batch2": dict(b=2), "batch8": dict(b=8), "heads8": dict(h=8), "rotary0.5": dict(rp=0.5), "seq1024": dict(s=1024)}
    confs = {"auto": {}, "off": dict(PREFETCH=False), "on_T2048": dict(PREFETCH=True, TARGET=2048)}
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
            compare(f"rope_te_{sn}", var, 2 * t0.numel() * 2, rounds=11)
        RP._TE_TUNE.clear()
        del sets, t0
    for nm, nh in (("13B", 40), ("7B", 32), ("65B", 64)):
        N = 16384
        qkv = torch.randn(N, 3 * nh * 128, device=dev, dtype=torch.bfloat16)
        cos, sin = build_rope_cache(8192, 128, device=dev)
        pos = torch.randint(0, 8192, (N,), device=dev)
        qconfs = {"hf": {}, "tf": dict(HEADS_FASTEST=False), "hf_H32": dict(BLOCK_H=32), "tf_H32": dict(BLOCK_H=32, HEADS_FASTEST=False), "hf_w8": dict(num_warps=8), "hf_T4096": dict(TARGET=4096)}
        def mq(conf):
            def f():
                RP._QKV_TUNE.clear(); RP._QKV_TUNE.update(conf)
                return apply_rope_qkv_(qkv, pos, cos, sin, nh, nh, 128, interleaved=False)
            return f
        var = {n: [mq(c)] for n, c in qconfs.items()}
        with torch.no_grad():
            compare(f"rope_qkv_{nm}", var, 2 * 2 * N * nh * 128 * 2, rounds=11)
        RP._QKV_TUNE.clear()

os.makedirs(OUT, exist_ok=True)
with open(os.path.join(OUT, f"tune3_{section}.json"), "w") as f:
    json.dump(dict(copy_gbps=COPY, device=torch.cuda.get_device_name(), results=results), f, indent=1)
