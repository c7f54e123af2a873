#!/usr/bin/env bash
# fp8_decode_gemm job (issue 27: FP8 decode at 32 rows >= 1.4x bf16), one H100/H200, one call
# of < 10 min: <= 7 min by the step limits (150 + 100 + 100 + 55 s), ~4 min expected.
#   1. the tuner (kernel_benchmark/tune_fp8_decode_gemm.py, budget 120 s: grid precompiled in
#      worker processes, then timed beside cuBLASLt at the 7B linears, rows 32, 64, 16, 8); it
#      writes the winners into nakta_model/kernels/_fp8_decode_gemm_tuned.json under this GPU's
#      family, which every later step (fresh processes) loads;
#   2. the GPU tests of the kernel (tests/test_fp8_decode_gemm.py -m gpu: 7B shapes vs the exact
#      reference and cuBLASLt, forced splits, CUDA-graph replay, a captured 32-row FP8 step);
#      after the tuner, so most of their kernels are already in Triton's cache;
#   3. bench_decode_gemm's blocks at fp8, rows 1, 8, 32, 64, all paths (decode_linear, gemm =
#      cuBLASLt, triton_fp8 = fp8_decode_gemm), into $OUT (not the results catalogue);
#   4. end to end: speed_bench.decode_speed, 7B, nakta (bf16) vs nakta_fp8 at batch 8 and 32,
#      prompt 64, 128 new: the command behind the 6,240 / 6,550 tok/s of the H200 README.
# Run from the repo root (no carried data needed): bash scripts/gpu_fp8_decode_gemm.sh
# Under a lane (gpu_env.sh: `lane N` sets CUDA_VISIBLE_DEVICES): nothing here names a GPU index.
# Results come back through $OUT:
#   _fp8_decode_gemm_tuned.json   the tuned rows: copy to nakta_model/kernels/ and commit
#   fp8_decode_gemm_tune.tar.gz   kernel_benchmark/results/<device>/fp8_decode_gemm_tune.{csv,md,json}
#   decode_gemm_fp8/              decode_gemm_blocks{,_layer}.{csv,md}, decode_gemm.png,
#                                 decode_gemm_crossover.json
#   fp8_decode/                   decode_summary.json, decode.md, decode.png
#   fp8_decode_gemm_log.txt       the full log
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
LOG=${LOG:-$OUT/fp8_decode_gemm_log.txt}
: >"$LOG"
status=0
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv 2>&1 | tee -a "$LOG"
SLUG=$(python3 -c "from bench_common.ceilings import device_slug; print(device_slug())")
K=kernel_benchmark/results/$SLUG
TUNED=nakta_model/kernels/_fp8_decode_gemm_tuned.json
step tune_fp8_decode_gemm 150 python3 -m kernel_benchmark.tune_fp8_decode_gemm --budget 120
grep -E "^\[|precompile|budget|tuned configs|done in|points," "$LOG" | cut -c1-230 | tail -24
step fp8_decode_gemm_gpu_tests 100 python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
  tests/test_fp8_decode_gemm.py
step decode_gemm_blocks_fp8 100 python3 -m kernel_benchmark.bench_decode_gemm --models 7B \
  --quants fp8 --rows 1,8,32,64 --sections blocks --out "$OUT/decode_gemm_fp8"
step decode_e2e 75 python3 -m speed_bench.decode_speed --preset 7B --engines nakta,nakta_fp8 \
  --batches 1,8,32 --lengths 64:128 --no-budget --out "$OUT/fp8_decode"
grep -v -E "it/s\]|%\|" "$LOG" | cut -c1-220 | tail -40
cut -c1-200 "$OUT/decode_gemm_fp8/decode_gemm_blocks_layer.md" "$OUT/fp8_decode/decode.md" \
  2>/dev/null
[ -f "$TUNED" ] && cp "$TUNED" "$OUT/"
files=$(ls "$K"/fp8_decode_gemm_tune* 2>/dev/null)
# shellcheck disable=SC2086
[ -n "$files" ] && tar czf "$OUT/fp8_decode_gemm_tune.tar.gz" $files
exit $status
