#!/usr/bin/env bash
# FP8 kernel GPU job (one H100/H200, one call of < 10 min, ~5 min expected): the FP8 GPU tests
# (quantizing kernels, FP8-weight decode GEMVs at 7B shapes + graph replay, _scaled_mm vs the
# exact reference) and kernel_benchmark/bench_fp8.py (< 3 min). Run from the repo root (no
# carried data needed); results come back through $OUT:
#   fp8_kernels.tar.gz     kernel_benchmark/results/<device>/fp8_* and fp8.png
#   fp8_kernels_log.txt    the full log
# Usage on the device: bash scripts/gpu_fp8_kernels.sh
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
export PYTHONUNBUFFERED=1
LOG=$OUT/fp8_kernels_log.txt
: >"$LOG"
status=0
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv 2>&1 | tee -a "$LOG"
SLUG=$(python3 -c "from bench_common.ceilings import device_slug; print(device_slug())")
K=kernel_benchmark/results/$SLUG
step fp8_gpu_tests 360 python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
  tests/test_fp8_kernels.py tests/test_decode_linear_fp8.py tests/test_fp8_gpu.py \
  tests/test_decode_linear.py tests/test_generation_engine.py
step bench_fp8 240 python3 -m kernel_benchmark.bench_fp8
grep -v -E "it/s\]|%\|" "$LOG" | cut -c1-200 | tail -100
files=$(ls $K/fp8* 2>/dev/null)
# shellcheck disable=SC2086
[ -n "$files" ] && tar czf "$OUT/fp8_kernels.tar.gz" $files
exit $status
