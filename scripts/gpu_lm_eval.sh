#!/usr/bin/env bash
# GPU job for the lm-eval path (issue 13): GPU tests of the scoring and decode kernels, then
# lm-eval itself, --model hf vs --model nakta on one random LLaMA-7B (HF format, bf16), task
# hellaswag_local on the full validation jsonl: 0-shot on the first 3,000 tasks at nakta's
# default / 64 / auto batch sizes and hf at 64, 10-shot on 300 tasks likewise.
# Run from the repo root on the device with `.whl/` (lm-eval 0.4.13 and its deps, fairscale,
# liger-kernel) and `.data/` (hellaswag_val_full.jsonl, llama_tokenizer.model) carried.
# Writes to $OUT: lm_eval_summary.{json,md,png}, lm_eval_results.tar.gz (with the children's
# logs), gpu_tests.txt, log.txt.
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
export PYTHONUNBUFFERED=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
LOG=$OUT/log.txt
: >"$LOG"
status=0
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv 2>&1 | tee -a "$LOG"
python3 -c "import torch, triton, lm_eval, datasets, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'lm_eval', lm_eval.__version__, 'datasets', datasets.__version__, 'transformers', transformers.__version__)" 2>&1 | tee -a "$LOG"

step gpu_tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_packed_attention.py tests/test_logprobs.py tests/test_model.py \
  tests/test_decode_linear.py tests/test_decode_attention.py
grep -E "passed|failed|error" "$LOG" | tail -3 >"$OUT/gpu_tests.txt"

R=$OUT/lm_eval
step lm_eval_speed 420 python3 speed_bench/lm_eval_speed.py --preset 7B \
  --tokenizer .data/llama_tokenizer.model --data .data/hellaswag_val_full.jsonl \
  --fewshot 0,10 --batch-sizes default,64,auto --hf-batch-sizes 64 \
  --limit 3000 --fewshot-limit 300 --out "$R" --work /tmp/lm_eval_work
cp "$R"/lm_eval_summary.* "$OUT/" 2>/dev/null
tar czf "$OUT/lm_eval_results.tar.gz" -C "$OUT" lm_eval 2>/dev/null && rm -rf "$R"
grep -v -E "it/s\]|s/it\]" "$LOG" | cut -c1-200 | tail -60
exit $status
