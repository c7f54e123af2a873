#!/usr/bin/env bash
# FP8 decode tuning job (one H100/H200, one call of < 10 min: <= 7.7 min by the step limits,
# ~6 min expected): the FP8 decode
# GPU tests (tests/test_decode_linear_fp8.py -m gpu, both tl.dot operand conversions), the
# tuner (kernel_benchmark/tune_fp8_decode.py, <= 210 s: it writes the winners into
# nakta_model/kernels/_decode_linear_fp8_tuned.json under this GPU's family, which
# _decode_linear_configs.py loads), then bench_fp8's decode section at batches 1 and 32 in a
# fresh process, so with the tuned rows (bf16 beside fp8). Run from the repo root (no carried
# data needed); results come back through $OUT:
#   _decode_linear_fp8_tuned.json   the tuned rows: copy to nakta_model/kernels/ and commit
#   fp8_tune.tar.gz                 kernel_benchmark/results/<device>/fp8_decode_tune.{csv,md,json}
#   fp8_tuned/                      bench_fp8's decode section with the tuned rows (fp8_decode.*,
#                                   fp8_summary.json, fp8.png; kept out of the results catalogue,
#                                   whose fp8_summary.json holds every section)
#   fp8_tune_log.txt                the full log
# Usage on the device: bash scripts/gpu_fp8_tune.sh
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
export PYTHONUNBUFFERED=1
LOG=$OUT/fp8_tune_log.txt
: >"$LOG"
status=0
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv 2>&1 | tee -a "$LOG"
SLUG=$(python3 -c "from bench_common.ceilings import device_slug; print(device_slug())")
K=kernel_benchmark/results/$SLUG
TUNED=nakta_model/kernels/_decode_linear_fp8_tuned.json
step fp8_decode_gpu_tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
  tests/test_decode_linear_fp8.py
step tune_fp8_decode 250 python3 -m kernel_benchmark.tune_fp8_decode --budget 210
grep -E "^\[|precompile|budget|tuned configs|done in" "$LOG" | cut -c1-220 | tail -40
step bench_fp8_decode_tuned 90 python3 -m kernel_benchmark.bench_fp8 --sections decode \
  --batches 1,32 --out "$OUT/fp8_tuned"
grep -v -E "it/s\]|%\|" "$LOG" | cut -c1-200 | tail -30
[ -f "$TUNED" ] && cp "$TUNED" "$OUT/"
files=$(ls $K/fp8_decode_tune* 2>/dev/null)
# shellcheck disable=SC2086
[ -n "$files" ] && tar czf "$OUT/fp8_tune.tar.gz" $files
exit $status
