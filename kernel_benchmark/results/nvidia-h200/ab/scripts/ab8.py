"""Does the sweep's sequential order bias RMSNorm fwd nakta vs liger? Time both with the bench's
graph_ms in the order nakta, liger, nakta, liger, ... and interleaved, in one process."""
import json, os, torch
from kernel_benchmark import bench_rmsnorm as B
from nakta_model.bench.timing import graph_ms, interleaved_ms
from nakta_model.bench.ceilings import copy_bandwidth_gbps
dev = torch.device("cuda")
out = {}
with torch.cuda.stream(torch.cuda.Stream()):
    copy = copy_bandwidth_gbps()
    plain, _ = B.paths(dev)
    t = B.make_inputs(16384, 4096, torch.bfloat16, dev, 1)
    nb = B.min_bytes("fwd", 16384, 4096, 2)
    pct = lambda us: round(100 * nb / us / 1e3 / copy, 2)
    seq = []
    for i in range(4):
        for p in ("nakta", "liger"):
            us = graph_ms([B.make_call("fwd", plain[p], t)], torch.cuda.current_stream()) * 1e3
            seq.append((p, round(us, 2), pct(us)))
    for p in ("liger", "nakta"):
        for i in range(3):
            us = graph_ms([B.make_call("fwd", plain[p], t)], torch.cuda.current_stream()) * 1e3
            seq.append((p + "_block", round(us, 2), pct(us)))
    h = interleaved_ms({p: [B.make_call("fwd", plain[p], t)] for p in ("nakta", "liger")}, dev, rounds=21)
    out = dict(copy_gbps=copy, sequential=seq, interleaved={p: (round(ms * 1e3, 2), pct(ms * 1e3), round(sp, 4)) for p, (ms, sp) in h.items()})
print(json.dumps(out, indent=1))
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "order.json"), "w"), indent=1)
