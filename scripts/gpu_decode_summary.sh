#!/usr/bin/env bash
# Issue 27's decoding rows on this tree, one GPU: decode_speed 7B bf16 + FP8 at batch 1 / 8 / 32
# (prompt 64, 128 new) in one process (the summary's source), three more fresh batch-1
# processes (the spread), the decode timelines (FP8, bf16), then the GPU tests of the decode
# kernels and the generation engine. <= 590 s.
# $OUT receives decode_summary.tar.gz (log.txt, decode_7B/, b1_N/, timeline_fp8/, timeline_bf16/).
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
stage decode_summary
D="python3 -m speed_bench.decode_speed --preset 7B --engines nakta,nakta_fp8 --lengths 64:128 --no-budget"
step decode_7B 150 $D --batches 1,8,32 --out "$STAGE/decode_7B"
for i in 1 2 3; do
  step "b1_$i" 60 $D --batches 1 --out "$STAGE/b1_$i"
done
T="python3 -m model_profile.decode_timeline --preset 7B --prompt 64 --gen 64"
step timeline_fp8 60 $T --quant fp8 --out "$STAGE/timeline_fp8"
step timeline_bf16 60 $T --out "$STAGE/timeline_bf16"
step gpu_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_greedy_advance.py tests/test_step_inputs.py tests/test_decode_attention.py \
  tests/test_decode_linear.py tests/test_decode_linear_fp8.py tests/test_generation_engine.py \
  tests/test_generation_pipeline.py tests/test_generation_paged.py \
  tests/test_generation_overlap.py tests/test_decode_step_gemm.py
decode_runs "$STAGE" decode_7B b1_1 b1_2 b1_3 2>&1 | tee -a "$LOG"
grep -E "^===|passed|failed|Step " "$LOG" | tail -30
echo "decode_summary status=$status" | tee -a "$LOG"
tar czf "$OUT/decode_summary.tar.gz" -C "$(dirname "$STAGE")" decode_summary
exit $status
