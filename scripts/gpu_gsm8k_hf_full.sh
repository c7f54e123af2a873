#!/usr/bin/env bash
# Issues 28 (GSM8K measured on every doc) and 27 (FP8 decode rows tuned for this GPU) in ONE call
# of a 2-GPU machine (nvidia-h100-x2 or its H200 twin), one lane per GPU (gpu_env.sh `lane`):
#   lane 0: scripts/gpu_fp8_tune.sh (FP8 decode GPU tests, the tuner writing this GPU family's
#       rows into nakta_model/kernels/_decode_linear_fp8_tuned.json, bench_fp8 decode at batch 1
#       and 32), then decode_speed 7B nakta / nakta_fp8 at batch 1 and 32 (prompt 64, 128 new) in
#       a fresh process with the tuned rows.
#   lane 1: lm-eval gsm8k_shaped_full_local through the CLI on all 1,319 docs, --model nakta then
#       --model hf --batch_size 64 (lm-eval's auto cap), both in fresh processes (~8 min).
# Run from the repo root with .data/ and .whl/ carried: bash scripts/gpu_gsm8k_hf_full.sh
# $OUT receives lane logs, the tuned JSON, fp8_tune.tar.gz and gsm8k_hf_full.tar.gz.
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
D=.data
R=$OUT/gsm8k_hf_full
mkdir -p "$R"
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv | tee "$OUT/gpus.txt"

lane0() {
  lane 0
  step fp8_tune 480 bash scripts/gpu_fp8_tune.sh
  LOG=$OUT/lane0.txt
  step decode 75 python3 -m speed_bench.decode_speed --preset 7B --engines nakta,nakta_fp8 \
    --batches 1,32 --lengths 64:128 --no-budget --out "$R/decode"
  echo "lane0 status=$status" >>"$LOG"
}

lane1() {
  lane 1
  step lm_eval_gsm8k 580 python3 speed_bench/lm_eval_gsm8k.py --preset 7B \
    --tokenizer "$D/llama_tokenizer.model" --hf-batch-sizes 64 --run-timeout-s 120 \
    --hf-timeout-s 410 --deadline-s 570 --out "$R/lm_eval_gsm8k_full" --work /tmp/gsm8k_work
  echo "lane1 status=$status" >>"$LOG"
}

status=0
lane0 &
lane1 &
wait
for f in lane0 lane1 fp8_tune_log; do
  grep -v -E "it/s\]|s/it\]|%\|" "$OUT/$f.txt" | cut -c1-220 | tail -25
done
cat "$R"/decode/decode.md "$R/lm_eval_gsm8k_full/lm_eval_summary.md" 2>/dev/null | cut -c1-250
tar czf "$OUT/gsm8k_hf_full.tar.gz" -C "$OUT" gsm8k_hf_full && rm -rf "$R"
grep -h "status=" "$OUT"/lane*.txt
