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




import sw_pipe as SP
section = sys.argv[1] if len(sys.argv) > 1 else "all"
SMS = torch.cuda.get_device_properties(0).multi_processor_count
if section in ("all", "swiglu"):
    T, F = 16384, 11008
    gu = torch.randn(T, 2 * F, device=dev, dtype=torch.bfloat16)
    g, u = gu[:, :F], gu[:, F:]
    out = torch.empty(T, F, device=dev, dtype=torch.bfloat16)
    ref = torch.nn.functional.silu(g) * u
    nb = 3 * T * F * 2
    var = {}
    for mode in (0, 1, 2):
        for bm, bn, nw in [(1, 1024, 4), (1, 2048, 8), (1, 512, 2)]:
            for st in (2, 3):
                for k in (8, 16):
                    name = f"pipe_m{mode}_{bm}x{bn}w{nw}_s{st}_p{k}"
                    try:
                        SP.launch(g, u, out, bm, bn, nw, mode, st, SMS * k)
                        if mode != 2 and not torch.equal(out, ref):
                            print(name, "NOT EXACT", int((out != ref).sum()))
                    except Exception as e:
                        print(name, "failed", str(e)[:100]); continue
                    var[name] = [functools.partial(SP.launch, g, u, out, bm, bn, nw, mode, st, SMS * k)]
    var["exact_1x512w1"] = [functools.partial(S.silu_mul_forward, g, u, exact=True)]
    var["fast_1x512w1"] = [functools.partial(S.silu_mul_forward, g, u, exact=False)]
    var["liger_fused"] = [functools.partial(LigerFusedGateUpSiLUMulFunction.apply, gu)]
    with torch.no_grad():
        compare(f"swiglu_fwd_{F}", var, nb, rounds=9)
    del gu, g, u, out, ref
    torch.cuda.empty_cache()

if section in ("all", "rms"):
    T = 16384
    for N in (4096, 8192):
        x = torch.randn(T, N, device=dev, dtype=torch.bfloat16)
        w = torch.randn(N, device=dev, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        ref = RN.rms_norm_forward(x, w, 1e-6)[0]
        var = {}
        for bm, nw in [(1, 4), (1, 8), (2, 8), (1, 16), (2, 16)]:
            for st in (2, 3, 4):
                for k in (2, 4, 8):
                    name = f"pipe_{bm}w{nw}_s{st}_p{k}"
                    try:
                        SP.rms_launch(x, w, y, bm, nw, st, SMS * k)
                        if not torch.equal(y, ref):
                            print(name, "differs", int((y != ref).sum()))
                    except Exception as e:
                        print(name, "failed", str(e)[:100]); continue
                    var[name] = [functools.partial(SP.rms_launch, x, w, y, bm, nw, st, SMS * k)]
        var["default"] = [functools.partial(RN.rms_norm_forward, x, w, 1e-6)]
        var["liger"] = [functools.partial(LigerRMSNormFunction.apply, x, w, 1e-6, 0.0, "llama", False)]
        with torch.no_grad():
            compare(f"rms_fwd_{N}", var, 2 * T * N * 2, rounds=9)
        del x, y
        torch.cuda.empty_cache()

os.makedirs(OUT, exist_ok=True)
with open(os.path.join(OUT, f"tune4_{section}.json"), "w") as f:
    json.dump(dict(copy_gbps=COPY, device=torch.cuda.get_device_name(), results=results), f, indent=1)
