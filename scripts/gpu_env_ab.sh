#!/usr/bin/env bash
# A/B of one decode knob read from the environment at import, one GPU, fresh processes
# off/on/off/on: decode_speed 7B bf16 and FP8 at batch 1 and 32 (prompt 64, 128 new); then the
# decode GEMVs' GPU tests. <= 560 s by the step limits. $OUT receives env_ab.tar.gz.
# Usage: bash scripts/gpu_env_ab.sh VAR OFF_VALUE ON_VALUE [LANE]
#   e.g. NAKTA_NORM_ELEMS_PER_THREAD 0 32 (the RMSNorm prologue in one or two loads),
#        NAKTA_EARLY_WEIGHT 0 1 (the first weight tile loaded before the PDL wait)
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
VAR=$1 OFF=$2 ON=$3
[ $# -ge 4 ] && lane "$4"
use_wheels
stage env_ab
D="python3 -m speed_bench.decode_speed --preset 7B --engines nakta,nakta_fp8 --batches 1,32 --lengths 64:128 --no-budget"
for run in off1 on1 off2 on2; do
  v=$OFF; [ "${run#on}" != "$run" ] && v=$ON
  step "decode_$run" 110 env "$VAR=$v" $D --out "$STAGE/$run"
done
step gpu_tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider -x \
  tests/test_decode_linear.py tests/test_decode_linear_fp8.py tests/test_decode_linear_fp8_prefetch.py
decode_runs "$STAGE" off1 on1 off2 on2 2>&1 | tee -a "$LOG"
grep -E "^===|passed|failed" "$LOG" | tail -14
echo "env_ab $VAR $OFF/$ON status=$status" | tee -a "$LOG"
tar czf "$OUT/env_ab.tar.gz" -C "$(dirname "$STAGE")" env_ab
exit $status
