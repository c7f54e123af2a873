#!/usr/bin/env bash
# Issue 28's throughput levers, one GPU, fresh processes: 1,000 random prompts of 128 tokens,
# 128 new each, nakta bf16 (random 7B), as scripts/gpu_throughput.sh measures it. First the
# generation GPU tests (the two-stream overlap, buckets past 256, the deferred residual adds,
# splitk_gemm in a CUDA graph); then one throughput process per run, named ROWS_SETTING[_N]:
#   off     nothing new but the deferred residual adds (today's default)
#   sep     NAKTA_DEFER_RESIDUAL=0: the wo / w2 residual adds as launches of their own
#   equal   NAKTA_PREFILL_OVERLAP=equal;  first: NAKTA_PREFILL_OVERLAP=decode_first
#   splitk  NAKTA_SPLITK_GEMM=1: wo / w2 on kernels/splitk_gemm instead of cuBLAS
#   burst   NAKTA_PREFILL_BURST=8: up to 8 prefill forwards back to back before a decode chunk
#           (the default since; the other settings keep NAKTA_PREFILL_BURST=1 for the A/B)
#   nopipe  NAKTA_DECODE_PIPELINE=0 with bursts: one decode chunk enqueued at a time
#   pipe    NAKTA_DECODE_PIPELINE=1 with bursts (the default)
#   fp8, fp8splitk  the FP8 engine (nakta_fp8), without / with NAKTA_SPLITK_GEMM=1 (not in the
#           default list: name them, e.g. 256_fp8 256_fp8splitk)
# ROWS is max_batch ("big": 384 on an 80 GB GPU, 512 on a larger one). Repeats interleave, so
# their spread is the noise. Default runs, most wanted first: big_nopipe_1 big_pipe_1
# big_nopipe_2 big_pipe_2 256_nopipe 256_pipe (bursts won; equal, first, splitk and sep lost on
# an H100: speed_bench/results/nvidia-h100-80gb-hbm3/throughput_ab/), or run names as
# arguments; a run that would start after DEADLINE seconds (default 420) is skipped
# and named in the log. Last, with time left: bench_decode_gemm's blocks at 256 and the big
# rows (cuBLAS against splitk_gemm, block by block).
# $OUT receives throughput_ab.tar.gz (a folder per run; log.txt ends with the table).
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
stage throughput_ab
step gpu_tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider -x \
  tests/test_generation_overlap.py tests/test_generation_paged.py tests/test_generation_engine.py \
  tests/test_decode_step_gemm.py tests/test_splitk_gemm.py tests/test_generation_pipeline.py
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
big=384
[ "${mib:-0}" -gt 100000 ] && big=512
T="python3 -m speed_bench.throughput --preset 7B --prompts 1000 --input-len 128 --output-len 128"
runs=("$@")
[ ${#runs[@]} -eq 0 ] && runs=(big_nopipe_1 big_pipe_1 big_nopipe_2 big_pipe_2 256_nopipe
  256_pipe)
limit=120  # the first run compiles what the tests did not
for name in "${runs[@]}"; do
  if [ "$SECONDS" -gt "${DEADLINE:-420}" ]; then
    echo "=== $name: skipped at ${SECONDS}s (DEADLINE) ===" | tee -a "$LOG"
    continue
  fi
  IFS=_ read -r rows setting _ <<<"$name"
  [ "$rows" = big ] && rows=$big
  overlap=off defer=1 splitk=0 burst=1 pipe=0 engine=nakta
  case $setting in
    burst) burst=8 ;;
    nopipe) burst=8 ;;
    pipe) burst=8 pipe=1 ;;
    sep) defer=0 ;;
    splitk) splitk=1 ;;
    fp8) engine=nakta_fp8 ;;
    fp8splitk) engine=nakta_fp8 splitk=1 ;;
    equal) overlap=equal ;;
    first) overlap=decode_first ;;
    off) ;;
    *) echo "unknown setting in run $name" | tee -a "$LOG"; status=1; continue ;;
  esac
  step "$name" "$limit" env NAKTA_PREFILL_OVERLAP=$overlap NAKTA_DEFER_RESIDUAL=$defer \
    NAKTA_SPLITK_GEMM=$splitk NAKTA_PREFILL_BURST=$burst NAKTA_DECODE_PIPELINE=$pipe \
    $T --engines "$engine" --max-batch "$rows" --out "$STAGE/$name"
  limit=70
done
python3 -m speed_bench.throughput_ab "$STAGE" 2>&1 | tee -a "$LOG"
# the step's linears block by block at its row counts: cuBLAS (wo / w2 ran at 55 / 69% of the
# matmul rate at 256 rows on an H200) against splitk_gemm, if time is left
if [ "$SECONDS" -le "${DEADLINE:-420}" ]; then
  step gemm_blocks 120 python3 -m kernel_benchmark.bench_decode_gemm --models 7B --quants bf16 \
    --rows "256,$big" --sections blocks --out "$STAGE/gemm_blocks"
fi
grep -E "^===|passed|failed" "$LOG" | tail -14
echo "throughput_ab status=$status" | tee -a "$LOG"
tar czf "$OUT/throughput_ab.tar.gz" -C "$(dirname "$STAGE")" throughput_ab
exit $status
