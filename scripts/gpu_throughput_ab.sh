#!/usr/bin/env bash
# Issue 28's throughput levers, one GPU, fresh processes: 1,000 random prompts of 128 tokens,
# 128 new each, nakta bf16 (random 7B), as scripts/gpu_throughput.sh measures it. First the
# generation GPU tests (the two-stream overlap, buckets past 256); then max_batch 256 with
# NAKTA_PREFILL_OVERLAP off / equal / decode_first, off and equal twice (interleaved: the
# spread between repeats is the noise); then the rows past 256 (384 on an 80 GB GPU, 512 on a
# larger one), off and equal. ~7 min. $OUT receives throughput_ab.tar.gz (a folder per run,
# log.txt with the table at its end).
# Usage: bash scripts/gpu_throughput_ab.sh
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
stage throughput_ab
step gpu_tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider -x \
  tests/test_generation_overlap.py tests/test_generation_paged.py tests/test_generation_engine.py
T="python3 -m speed_bench.throughput --preset 7B --prompts 1000 --input-len 128 --output-len 128"
run() {  # run NAME MAX_BATCH OVERLAP
  step "$1" 70 env NAKTA_PREFILL_OVERLAP="$3" $T --engines nakta --max-batch "$2" \
    --out "$STAGE/$1"
}
run b256_off_1 256 off
run b256_equal_1 256 equal
run b256_first 256 decode_first
run b256_off_2 256 off
run b256_equal_2 256 equal
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
rows=384
[ "${mib:-0}" -gt 100000 ] && rows=512
run "b${rows}_off" "$rows" off
run "b${rows}_equal" "$rows" equal
python3 -m speed_bench.throughput_ab "$STAGE" 2>&1 | tee -a "$LOG"
grep -E "^===|passed|failed" "$LOG" | tail -12
echo "throughput_ab status=$status" | tee -a "$LOG"
tar czf "$OUT/throughput_ab.tar.gz" -C "$(dirname "$STAGE")" throughput_ab
exit $status
