#!/usr/bin/env bash
# The decode GEMVs' RMSNorm prologue in one or two loads (NAKTA_NORM_ELEMS_PER_THREAD=32, the
# default) against BLOCK_K-wide steps (=0), one GPU, fresh processes off/on/off/on:
# decode_speed 7B bf16 and FP8 at batch 1 and 32 (prompt 64, 128 new); then the decode GEMVs'
# GPU tests. <= 560 s by the step limits. $OUT receives norm_block_ab.tar.gz.
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
[ $# -ge 1 ] && lane "$1"
use_wheels
STAGE=$(mktemp -d /tmp/nb_ab.XXXXXX)/norm_block_ab
mkdir -p "$STAGE"
LOG=$STAGE/log.txt
: >"$LOG"
status=0
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv 2>&1 | tee -a "$LOG"
D="python3 -m speed_bench.decode_speed --preset 7B --engines nakta,nakta_fp8 --batches 1,32 --lengths 64:128 --no-budget"
for run in off1 on1 off2 on2; do
  v=0; [ "${run#on}" != "$run" ] && v=32
  step "decode_$run" 110 env NAKTA_NORM_ELEMS_PER_THREAD=$v $D --out "$STAGE/$run"
done
step gpu_tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider -x \
  tests/test_decode_linear.py tests/test_decode_linear_fp8.py tests/test_decode_linear_fp8_prefetch.py
python3 - "$STAGE" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys, pathlib
s = pathlib.Path(sys.argv[1])
for run in ("off1", "on1", "off2", "on2"):
    try:
        d = json.loads((s / run / "decode_summary.json").read_text())
    except Exception as e:
        print(run, "missing", e); continue
    for r in d["runs"]:
        print(f"{run} {r['engine']} b{r['batch']}: {r['tok_s']:.1f} tok/s, {r['pct_of_floor']:.1f}% of floor")
PY
grep -E "^===|passed|failed" "$LOG" | tail -14
echo "norm_block_ab status=$status" | tee -a "$LOG"
tar czf "$OUT/norm_block_ab.tar.gz" -C "$(dirname "$STAGE")" norm_block_ab
exit $status
