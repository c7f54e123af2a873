"""Is the sweep's first point (16K x 4096, nakta fwd, first job of the process) slowed by clock ramp?"""
import json, os, sys, time, torch
sys.path.insert(0, os.getcwd())
from nakta_model.bench.ceilings import copy_bandwidth_gbps
from nakta_model.bench.timing import _capture, _replay_ms, _warm_ms
from kernel_benchmark import bench_rmsnorm as B
OUT = os.environ.get("OUT", "/tmp/out"); os.makedirs(OUT, exist_ok=True)
dev = torch.device("cuda")
rec = {}
copy = copy_bandwidth_gbps(); print("copy", copy, flush=True); rec["copy"] = copy
plain, _ = B.paths(dev)
t = B.make_inputs(16384, 4096, torch.bfloat16, dev, 1)
nb = B.min_bytes("fwd", 16384, 4096, 2)
def replays(name, n=12):
    call = B.make_call("fwd", plain[name], t)
    est = _warm_ms([call]); reps = max(1, int(20 / max(est, 1e-3)))
    g = _capture([call], reps, torch.cuda.current_stream())
    ts = [100 * nb / (_replay_ms(g) / reps * 1e-3) / 1e9 / copy for _ in range(n)]
    print(name, " ".join(f"{v:.1f}" for v in ts), flush=True); return ts
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    for k in range(2):
        rec[f"nakta_{k}"] = replays("nakta"); rec[f"liger_{k}"] = replays("liger")
    time.sleep(3)
    rec["after_idle_nakta"] = replays("nakta"); rec["after_idle_liger"] = replays("liger")
    for k in range(2):
        rows = B.bench_shape(16384, 4096, torch.bfloat16, dev, copy)
        sel = {r["path"]: round(r["pct_copy_bw"], 1) for r in rows if r["mode"] == "fwd" and r["path"] in ("nakta", "liger")}
        print("bench_shape", k, sel, flush=True); rec[f"bench_shape_{k}"] = sel
json.dump(rec, open(os.path.join(OUT, "ab13.json"), "w"), indent=1)
