#!/usr/bin/env bash
# FP8 batch-1 launch rows measured end to end (the tuner times each GEMV alone, without the
# dependent launches' overlap that EARLY_W and the attention trigger now give): for each
# candidate row of this GPU family, the tuned table is edited in this machine's copy and
# decode_speed 7B nakta_fp8 batch 1 runs in a fresh process. One GPU, <= 560 s.
# $OUT receives fp8_b1_sweep.tar.gz (log.txt, one decode folder per candidate, sweep.csv).
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
stage fp8_b1_sweep
FAM=$(python3 -c "from nakta_model.kernels._checks import device_family; import torch; print(device_family(torch.device('cuda')))" 2>/dev/null || echo h100)
T=nakta_model/kernels/_decode_linear_fp8_tuned.json
cp "$T" "$STAGE/table_orig.json"
# name kind_key BLOCK_N BLOCK_K warps PREFETCH
CANDS="base0 - 0 0 0 0
wo_bn4 residual/4096/4096 4 1024 4 0
wo_bk512 residual/4096/4096 8 512 4 0
wo_pf1 residual/4096/4096 8 1024 4 1
wo_pf1_bn16 residual/4096/4096 16 512 8 1
w2_pf1 residual/4096/11008 8 1024 4 1
w2_bn4 residual/4096/11008 4 1024 4 0
w13_pf1 swiglu/11008/4096 8 256 4 1
w13_bk1024 swiglu/11008/4096 4 1024 4 0
wqkv_pf0 rope/12288/4096 8 256 2 0
wqkv_bk512 rope/12288/4096 16 512 4 1
base1 - 0 0 0 0"
echo "$CANDS" | while read -r name key bn bk warps pf; do
  cp "$STAGE/table_orig.json" "$T"
  if [ "$key" != "-" ]; then
    python3 - "$T" "$FAM" "float8_e4m3fn/1/$key" "$bn" "$bk" "$warps" "$pf" <<'PY'
import json, sys
path, fam, key, bn, bk, w, pf = sys.argv[1:]
d = json.load(open(path))
e = d["devices"][fam]["entries"][key]
e.update(BLOCK_N=int(bn), BLOCK_K=int(bk), num_warps=int(w), PREFETCH=int(pf))
json.dump(d, open(path, "w"), indent=1)
PY
  fi
  step "$name" 60 python3 -m speed_bench.decode_speed --preset 7B --engines nakta_fp8 \
    --batches 1 --lengths 64:128 --no-budget --out "$STAGE/$name"
done
cp "$STAGE/table_orig.json" "$T"
python3 - "$STAGE" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys, pathlib
s = pathlib.Path(sys.argv[1])
rows = []
for d in sorted(p for p in s.iterdir() if p.is_dir()):
    try:
        r = json.loads((d / "decode_summary.json").read_text())["runs"][0]
        rows.append((d.name, r["tok_s"], r["pct_of_floor"]))
    except Exception as e:
        rows.append((d.name, float("nan"), float("nan")))
with open(s / "sweep.csv", "w") as f:
    f.write("candidate,tok_s,pct_of_floor\n")
    for n, t, p in rows:
        f.write(f"{n},{t:.2f},{p:.2f}\n")
        print(f"{n}: {t:.1f} tok/s, {p:.2f}% of floor")
PY
echo "fp8_b1_sweep status=$status" | tee -a "$LOG"
tar czf "$OUT/fp8_b1_sweep.tar.gz" -C "$(dirname "$STAGE")" fp8_b1_sweep
exit $status
