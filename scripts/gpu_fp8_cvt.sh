#!/usr/bin/env bash
# Issue 27, the e4m3 -> fp32 conversion of the batch-1 FP8 decode GEMVs (CVT=1: integer
# unpacking, _decode_linear_kernels._fma_loop) timed against CVT=0 on this GPU: <= 5 min by the
# step limits (~4 min expected), one GPU. Steps:
#   1. GPU tests: every e4m3 code through the compiled PTX, CVT=1 bit for bit CVT=0 at the 7B
#      shapes (batch 1, this GPU's table tiles), the FP8 GEMV under graph replay (CVT=0's
#      SASS is unchanged by the knob: checked on the CPU against main's, docs/experiments.md);
#   2. the tuner at batch 1 with CVT in its grid (budget 135 s, killed at 150 s): it writes this GPU family's
#      batch-1 rows into nakta_model/kernels/_decode_linear_fp8_tuned.json (other rows kept);
#      results under $OUT/fp8_cvt_tune, not the catalogue (whose file holds every batch);
#   3. bench_fp8's decode section at batch 1 and 4. decode_speed 7B nakta / nakta_fp8 at batch
#      1 (prompt 64, 128 new), each in a fresh process, so with the tuned rows.
# Usage (repo root; .whl/ carried when present, no data needed):
#   bash scripts/gpu_fp8_cvt.sh        one GPU (nvidia-h200 / nvidia-h100-x1)
#   bash scripts/gpu_fp8_cvt.sh N      as lane N of a 2-GPU host (gpu_env.sh `lane`: GPU N,
#                                      half the cores), beside another job in the other lane
# $OUT receives:
#   fp8_cvt_log.txt                 the full log (step limits, rc, every tuner line)
#   _decode_linear_fp8_tuned.json   the tuned rows with CVT: copy to nakta_model/kernels/, commit
#   fp8_cvt_tune/                   fp8_decode_tune.{csv,md,json}: every timing, best per shape
#   fp8_cvt/                        bench_fp8 decode (fp8_decode.{csv,md}, fp8_summary.json, fp8.png)
#   decode_cvt/                     decode_speed (decode.{csv,md,json}, plot)
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
[ $# -ge 1 ] && lane "$1"
use_wheels
export PYTHONUNBUFFERED=1
LOG=$OUT/fp8_cvt_log.txt
: >"$LOG"
status=0
JOBS=$(($(nproc) - 2))
[ "$JOBS" -gt 12 ] && JOBS=12
[ "$JOBS" -lt 1 ] && JOBS=1
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee -a "$LOG"
TUNED=nakta_model/kernels/_decode_linear_fp8_tuned.json
step fp8_cvt_gpu_tests 60 python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
  tests/test_decode_linear_fp8_cvt.py \
  tests/test_decode_linear_fp8.py::test_gpu_fp8_cuda_graph_replay_follows_new_inputs
step tune_fp8_decode_b1 150 python3 -m kernel_benchmark.tune_fp8_decode --batches 1 \
  --budget 135 --jobs "$JOBS" --out "$OUT/fp8_cvt_tune"
step bench_fp8_decode_b1 40 python3 -m kernel_benchmark.bench_fp8 --sections decode \
  --batches 1 --out "$OUT/fp8_cvt"
step decode_speed_b1 50 python3 -m speed_bench.decode_speed --preset 7B \
  --engines nakta,nakta_fp8 --batches 1 --lengths 64:128 --no-budget --out "$OUT/decode_cvt"
[ -f "$TUNED" ] && cp "$TUNED" "$OUT/"
grep -v -E "it/s\]|s/it\]|%\|" "$LOG" | grep -E "^===|^\[|precompile|budget|tuned configs|passed|failed|rror" |
  cut -c1-230 | tail -40
cat "$OUT/fp8_cvt/fp8_decode.md" "$OUT/decode_cvt/decode.md" 2>/dev/null | cut -c1-250 | tail -30
echo "fp8_cvt status=$status" | tee -a "$LOG"
exit $status
