#!/usr/bin/env bash
# Reproduces the accuracy catalogue (accuracy_test/results/<device>/): Nakta against Meta's code
# (llama_org) on the same checkpoint, against the fp32 truth, every flipped prediction listed.
#   OUT=/tmp/out bash scripts/reproduce_parity.sh [parity] [lm_eval_check] [tp2]
# parity: stories260K on all 10,042 HellaSwag tasks in bf16 and fp32, the 7B shape (random
# weights, the LLaMA tokenizer) on 1,000; with QUANT=fp8 the bf16 / FP8 pair on stories260K,
# aidreams260K (all tasks) and the 7B shape (1,000). lm_eval_check: lm-eval through both
# adapters gives parity.py's numbers (needs lm-eval in .whl/). tp2: 2 GPUs, nakta tp=2 (NCCL)
# against llama_org MP=2 on Meta's real 2-shard checkpoint, fp32 (results/<device>-x2/).
# Settings (environment): QUANT (bf16 | fp8), SIZE (the random shape, default 7B), LIMIT (tasks
# per run, for a quick look). Writes into the catalogue folders, then $OUT/parity.tar.gz.
set -uo pipefail
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
begin parity
QUANT=${QUANT:-bf16} SIZE=${SIZE:-7B}
A=accuracy_test/results/$SLUG
LIM=()
[ -n "${LIMIT:-}" ] && LIM=(--limit "$LIMIT")
P=(python3 -m accuracy_test.parity --device cuda --no-progress "${LIM[@]}")
for job in "${@:-parity}"; do
  case $job in
    parity)
      if [ "$QUANT" = fp8 ]; then
        for ck in stories260K aidreams260K; do
          step "${ck}_fp8" 300 "${P[@]}" --checkpoint "$DATA/$ck" --data "$HS_FULL" \
            --dtype bf16 --quant fp8 --out "$A/${ck}_bf16_fp8_cuda.json"
        done
        step "${SIZE}_fp8" 300 "${P[@]}" --preset "$SIZE" --random --tokenizer "$TOK" \
          --data "$HS_SUB" --dtype bf16 --quant fp8 --out "$A/$SIZE-random_bf16_fp8_cuda.json"
      else
        step stories260K_bf16 300 "${P[@]}" --checkpoint "$DATA/stories260K" --data "$HS_FULL" \
          --dtype bf16 --out "$A/stories260K_bf16_cuda.json"
        step stories260K_fp32 300 "${P[@]}" --checkpoint "$DATA/stories260K" --data "$HS_FULL" \
          --dtype fp32 --out "$A/stories260K_fp32_cuda.json"
        step "${SIZE}_bf16" 300 "${P[@]}" --preset "$SIZE" --random --seed 0 --tokenizer "$TOK" \
          --data "$HS_SUB" --dtype bf16 --out "$A/$SIZE-random_bf16_cuda.json"
      fi
      ;;
    lm_eval_check)
      step lm_eval_check 300 python3 -m accuracy_test.lm_eval_check --checkpoint "$DATA/stories260K" \
        --tokenizer "$DATA/stories260K/tokenizer.model" --data "$HS_SUB" --dtype bf16 \
        --device cuda --no-progress "${LIM[@]}" --out "$A/lm_eval_check_stories260K_bf16_cuda.json"
      ;;
    tp2)
      step parity_tp2 300 python3 -m torch.distributed.run --standalone --nproc_per_node 2 \
        -m accuracy_test.parity --tp 2 --checkpoint "$DATA/stories260K_mp2" \
        --tokenizer "$DATA/stories260K/tokenizer.model" --data "$HS_FULL" --limit 2000 \
        --dtype fp32 --no-progress --out "accuracy_test/results/${SLUG}-x2/stories260K_mp2_tp2_fp32_cuda.json"
      ;;
    *) echo "unknown job $job" | tee -a "$LOG"; status=2 ;;
  esac
done
finish
