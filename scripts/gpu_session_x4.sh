#!/usr/bin/env bash
# Issues 27 and 28 in ONE call of a 4-GPU host (nvidia-h100-x4 or its H200 twin), one lane per
# GPU, each pinned to its quarter of the cores (gpu_env.sh `lane`):
#   lane 0: scripts/gpu_fp8_decode_gemm.sh (the FP8 decode GEMM at 8..64 rows: tuner, GPU tests,
#       blocks bench against cuBLASLt and decode_linear, decode bf16 vs FP8 at 8 and 32 rows)
#   lane 1: scripts/gpu_fp8_cvt.sh (the batch-1 FP8 GEMV's integer e4m3 unpacking: GPU tests,
#       tuner at batch 1 with CVT in the grid, bench_fp8 decode, decode bf16 vs FP8 at batch 1)
#   lane 2: lm-eval gsm8k_shaped_full_local through the CLI on all 1,319 docs: nakta (the
#       machine's first run: Triton's cache empty), hf --batch_size 64, then nakta again (warm)
#   lane 3: scripts/gpu_one_pool.sh (a mixed lm-eval suite in one call on the one KV pool), then
#       the throughput benchmark (nakta, 1,000 prompts 128/128, 256 rows) and decode bf16 at
#       batch 1 (the paging's no-regression check)
# Run from the repo root with .data/ and .whl/ carried: bash scripts/gpu_session_x4.sh
# On a 2-GPU host lanes 2 and 3 wait for lanes 0 and 1 (a longer call).
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
D=.data
R=$OUT/x4
mkdir -p "$R"
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv | tee "$OUT/gpus.txt"
GPUS=$(nvidia-smi -L | grep -c '^GPU')

lane0() {
  lane 0
  mkdir -p "$OUT/l0" && OUT=$OUT/l0 step fp8_decode_gemm 420 bash scripts/gpu_fp8_decode_gemm.sh
  echo "lane0 status=$status" >>"$LOG"
}

lane1() {
  lane 1
  mkdir -p "$OUT/l1" && OUT=$OUT/l1 step fp8_cvt 330 bash scripts/gpu_fp8_cvt.sh
  echo "lane1 status=$status" >>"$LOG"
}

lane2() {
  lane $((2 % GPUS))
  LOG=$OUT/lane2.txt
  : >"$LOG"
  step gsm8k 460 python3 speed_bench/lm_eval_gsm8k.py --preset 7B \
    --tokenizer "$D/llama_tokenizer.model" --hf-batch-sizes 64 --run-timeout-s 100 \
    --hf-timeout-s 340 --out "$R/lm_eval_gsm8k_full" --work /tmp/gsm8k_work
  step gsm8k_warm 85 python3 speed_bench/lm_eval_gsm8k.py --checkpoint /tmp/gsm8k_work/nakta \
    --tokenizer "$D/llama_tokenizer.model" --models nakta --run-timeout-s 80 \
    --out "$R/lm_eval_gsm8k_full_warm" --work /tmp/gsm8k_work_warm
  echo "lane2 status=$status" >>"$LOG"
}

lane3() {
  lane $((3 % GPUS))
  LOG=$OUT/lane3.txt
  : >"$LOG"
  mkdir -p "$OUT/l3" && OUT=$OUT/l3 step one_pool 280 bash scripts/gpu_one_pool.sh
  step throughput 120 python3 -m speed_bench.throughput --preset 7B --prompts 1000 \
    --input-len 128 --output-len 128 --engines nakta --max-batch 256 --out "$R/throughput"
  step decode_b1 60 python3 -m speed_bench.decode_speed --preset 7B --engines nakta \
    --batches 1 --lengths 64:128 --no-budget --out "$R/decode_b1"
  echo "lane3 status=$status" >>"$LOG"
}

status=0
if [ "$GPUS" -ge 4 ]; then
  lane0 & lane1 & lane2 & lane3 &
  wait
else
  lane0 & lane1 &
  wait
  lane2 & lane3 &
  wait
fi
for f in lane0 lane1 lane2 lane3; do
  echo "##### $f"
  grep -v -E "it/s\]|s/it\]|%\|" "$OUT/$f.txt" | cut -c1-220 | tail -30
done
cat "$R/lm_eval_gsm8k_full/lm_eval_summary.md" "$R/lm_eval_gsm8k_full_warm/lm_eval_summary.md" \
  "$R/throughput/throughput.md" "$R/decode_b1/decode.md" 2>/dev/null | cut -c1-250
tar czf "$OUT/x4.tar.gz" -C "$OUT" x4 && rm -rf "$R"
grep -h "status=" "$OUT"/lane*.txt
