#!/usr/bin/env bash
# Kernel GPU job (one H100/H200, three calls of < 10 min): every GPU test, and the kernel
# benchmarks against PyTorch, torch.compile, Liger-Kernel (and TE when importable). Run from the
# repo root with `.whl/` (fairscale, liger-kernel wheels) and `.data/` (copy of shared/data)
# carried; results come back through $OUT:
#   kernels_<part>.tar.gz  the files written under kernel_benchmark/results/<device>/
#   kernels_<part>_log.txt the full log
# Usage on the device: bash scripts/gpu_kernels.sh tests   (pytest -m gpu, all test files)
#                      bash scripts/gpu_kernels.sh rope    (RoPE benchmark)
#                      bash scripts/gpu_kernels.sh norm    (RMSNorm + SwiGLU benchmarks)
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
PART=${1:?usage: gpu_kernels.sh tests|rope|norm}
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
export PYTHONUNBUFFERED=1
LOG=$OUT/kernels_${PART}_log.txt
: >"$LOG"
status=0
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv 2>&1 | tee -a "$LOG"
SLUG=$(python3 -c "from bench_common.ceilings import device_slug; print(device_slug())")
K=kernel_benchmark/results/$SLUG
case $PART in
  tests)
    step gpu_tests 540 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests
    files=""
    ;;
  rope)
    step bench_rope 540 python3 -m kernel_benchmark.bench_rope
    files=$(ls $K/rope* 2>/dev/null)
    ;;
  norm)
    step bench_rmsnorm 200 python3 -m kernel_benchmark.bench_rmsnorm
    step bench_swiglu 340 python3 -m kernel_benchmark.bench_swiglu
    files=$(ls $K/rmsnorm* $K/swiglu* 2>/dev/null)
    ;;
  *) echo "unknown part $PART" && exit 2 ;;
esac
grep -v -E "it/s\]|%\|" "$LOG" | cut -c1-200 | tail -80
# shellcheck disable=SC2086
[ -n "$files" ] && tar czf "$OUT/kernels_${PART}.tar.gz" $files
exit $status
