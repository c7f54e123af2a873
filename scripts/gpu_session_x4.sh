#!/usr/bin/env bash
# Issues 27 and 28 in ONE call of a 4-GPU host (nvidia-h100-x4 or its H200 twin), one lane per
# GPU, each pinned to its quarter of the cores (gpu_env.sh `lane`):
#   lane 0: scripts/gpu_fp8_decode_gemm.sh (the FP8 decode GEMM at 8..64 rows: tuner, GPU tests,
#       blocks bench against cuBLASLt and decode_linear, decode bf16 vs FP8 at 1, 8 and 32 rows),
#       then scripts/gpu_one_pool.sh (a mixed lm-eval suite in one call on the one KV pool)
#   lane 1: the throughput benchmark, 1,000 prompts 128/128: nakta at 64/128/256 rows, HF's
#       static cache at 128/64, llama_org (Meta's loop) at 64/128/256
#   lane 2: lm-eval gsm8k_shaped_full_local through the CLI on all 1,319 docs: nakta (the
#       machine's first run: Triton's cache empty), hf --batch_size 64 (lm-eval's auto cap),
#       then nakta again (warm)
#   lane 3: the same task, hf --batch_size 128 on all docs (hf's best batch in the throughput
#       benchmark), weights made in its own folder
# Run from the repo root with .data/ and .whl/ carried: bash scripts/gpu_session_x4.sh
# Everything comes back in $OUT/x4.tar.gz (one file) plus the lane logs. On a 2-GPU host lanes
# 2 and 3 wait for lanes 0 and 1 (a longer call).
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
D=.data
R=$OUT/x4
mkdir -p "$R"
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv | tee "$OUT/gpus.txt"

lane0() {
  lane 0
  mkdir -p "$R/l0" && OUT=$R/l0 step fp8_decode_gemm 300 bash scripts/gpu_fp8_decode_gemm.sh
  mkdir -p "$R/l0_pool" && OUT=$R/l0_pool step one_pool 250 bash scripts/gpu_one_pool.sh
  echo "lane0 status=$status" >>"$LOG"
}

lane1() {
  lane 1
  step throughput 520 python3 -m speed_bench.throughput --preset 7B --prompts 1000 \
    --input-len 128 --output-len 128 --engines nakta,hf,llama_org --max-batch 64,128,256 \
    --hf-batches 128,64 --out "$R/throughput"
  echo "lane1 status=$status" >>"$LOG"
}

lane2() {
  lane 2
  step gsm8k 460 python3 speed_bench/lm_eval_gsm8k.py --preset 7B \
    --tokenizer "$D/llama_tokenizer.model" --hf-batch-sizes 64 --run-timeout-s 100 \
    --hf-timeout-s 340 --out "$R/lm_eval_gsm8k_full" --work /tmp/gsm8k_work
  step gsm8k_warm 85 python3 speed_bench/lm_eval_gsm8k.py --checkpoint /tmp/gsm8k_work/nakta \
    --tokenizer "$D/llama_tokenizer.model" --models nakta --run-timeout-s 80 \
    --out "$R/lm_eval_gsm8k_full_warm" --work /tmp/gsm8k_work_warm
  echo "lane2 status=$status" >>"$LOG"
}

lane3() {
  lane 3
  step gsm8k_hf128 460 python3 speed_bench/lm_eval_gsm8k.py --preset 7B \
    --tokenizer "$D/llama_tokenizer.model" --models hf --hf-batch-sizes 128 \
    --hf-timeout-s 370 --out "$R/lm_eval_gsm8k_full_hf128" --work /tmp/gsm8k_work_hf128
  echo "lane3 status=$status" >>"$LOG"
}

status=0
run_lanes lane0 lane1 lane2 lane3
for f in lane0 lane1 lane2 lane3; do
  echo "##### $f"
  grep -v -E "it/s\]|s/it\]|%\|" "$OUT/$f.txt" | cut -c1-220 | tail -30
done
cat "$R/lm_eval_gsm8k_full/lm_eval_summary.md" "$R/lm_eval_gsm8k_full_warm/lm_eval_summary.md" \
  "$R/lm_eval_gsm8k_full_hf128/lm_eval_summary.md" "$R/throughput/throughput.md" \
  2>/dev/null | cut -c1-250
cp nakta_model/kernels/_fp8_decode_gemm_tuned.json "$R/" 2>/dev/null
tar czf "$OUT/x4.tar.gz" -C "$OUT" x4 && rm -rf "$R"
grep -h "status=" "$OUT"/lane*.txt
