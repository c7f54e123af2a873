#!/usr/bin/env bash
# One call of a 2-GPU machine (nvidia-h100-x2), two jobs one after the other (~9 min):
#   1. issue 26: lm-eval hellaswag_local through the entry, 1 GPU vs dp=2 started by the entry
#      itself (--model_args ...,dp=2: nakta_model.spawn) and by torchrun, 10-shot 2,000 tasks and
#      0-shot all 10,042 (speed_bench/lm_eval_dp.py; the suite runs are gpu_dp.sh's job)
#   2. issue 27 on GPU 0: the FP8 decode tuner (rows into
#      nakta_model/kernels/_decode_linear_fp8_tuned.json), then in fresh processes decode_speed
#      7B nakta vs nakta_fp8 at batch 1 and 32, and bench_fp8 (quantizers, GEMMs, decode GEMVs)
# Run from the repo root with .data/ and .whl/ carried. $OUT receives dp.tar.gz, fp8_tune.tar.gz
# and the logs.
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
LOG=$OUT/log.txt
: >"$LOG"
status=0
nvidia-smi --query-gpu=index,name,memory.used --format=csv | tee -a "$LOG"
D=.data
step lm_eval_dp 365 python3 speed_bench/lm_eval_dp.py --preset 7B \
  --tokenizer "$D/llama_tokenizer.model" --data "$D/hellaswag_val_full.jsonl" \
  --runs 10:2000,0:all --gpus 2 --launchers nakta,torchrun --suite "" --warmup-limit 32 \
  --run-timeout-s 80 --deadline-s 360 --out "$OUT/lm_eval_dp" --work /tmp/lm_eval_dp_work
rm -rf "$OUT/lm_eval_dp/logs"
tar czf "$OUT/dp.tar.gz" -C "$OUT" lm_eval_dp && rm -rf "$OUT/lm_eval_dp"
export CUDA_VISIBLE_DEVICES=0
T=$OUT/fp8_tune
step tune_fp8_decode 125 python3 -m kernel_benchmark.tune_fp8_decode --budget 90 \
  --batches 1,32,8,64,16,4,2 --out "$T"
step decode_7B 60 python3 -m speed_bench.decode_speed --preset 7B --engines nakta,nakta_fp8 \
  --batches 1,32 --lengths 64:128 --no-budget --out "$T/decode_7B"
step bench_fp8 45 python3 -m kernel_benchmark.bench_fp8 --out "$T/bench"
cp nakta_model/kernels/_decode_linear_fp8_tuned.json "$T/" 2>/dev/null
tar czf "$OUT/fp8_tune.tar.gz" -C "$OUT" fp8_tune && rm -rf "$T"
grep -v -E "it/s\]|s/it\]|%\|" "$LOG" | cut -c1-220 | tail -70
exit $status
