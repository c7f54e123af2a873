#!/usr/bin/env bash
# Issues 27 and 28, the session's last call on a 4-GPU host (nvidia-h100-x4 or its H200 twin), one
# lane per GPU pinned to its quarter of the cores (gpu_env.sh `lane`):
#   lane 0: lm-eval gsm8k_shaped_full_local through the CLI on all 1,319 docs: nakta as the
#       machine's first run (the scorer's warm-up no longer runs for generation-only runs), then
#       hf --batch_size 128 (hf's best in the previous call)
#   lane 1: decode, 7B, nakta and nakta_fp8 at batch 1 and 32 (prompt 64, 128 new) under the
#       decode-attention split rules in NAKTA_DECODE_ATTENTION_TUNE (default, then 64- and
#       128-key splits): a batch-1 row of 192 keys reads them with 32 programs in one split
#   lane 2: throughput, nakta at 256 rows, 1,000 prompts 128/128, under the decode-attention
#       tile variants (default BLOCK_S=64 / 4 warps / 3 stages, then BLOCK_S=32, 8 warps, 4 stages)
#   lane 3: every GPU test (pytest -m gpu) of the merged tree
# Run from the repo root with .data/ and .whl/ carried: bash scripts/gpu_session_final.sh
# Everything comes back in $OUT/final.tar.gz plus the lane logs. On a 2-GPU host lanes 2 and 3
# wait for lanes 0 and 1 (run_lanes; a longer call).
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
D=.data
R=$OUT/final
mkdir -p "$R"
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv | tee "$OUT/gpus.txt"

lane0() {
  lane 0
  step gsm8k 420 python3 speed_bench/lm_eval_gsm8k.py --preset 7B \
    --tokenizer "$D/llama_tokenizer.model" --hf-batch-sizes 128 --run-timeout-s 90 \
    --hf-timeout-s 300 --out "$R/lm_eval_gsm8k_full" --work /tmp/gsm8k_work
  echo "lane0 status=$status" >>"$LOG"
}

lane1() {
  lane 1
  local i=0 v
  for v in "" "MIN_SPLIT_KEYS=64" "MIN_SPLIT_KEYS=128" "MIN_SPLIT_KEYS=64,BLOCK_S=32"; do
    echo "variant $i: NAKTA_DECODE_ATTENTION_TUNE='$v'" >>"$LOG"
    NAKTA_DECODE_ATTENTION_TUNE=$v step "decode_$i" 60 python3 -m speed_bench.decode_speed \
      --preset 7B --engines nakta,nakta_fp8 --batches 1,32 --lengths 64:128 --no-budget \
      --out "$R/decode_attn_$i"
    echo "decode_attn_$i: NAKTA_DECODE_ATTENTION_TUNE='$v'" >>"$R/variants.txt"
    i=$((i + 1))
  done
  echo "lane1 status=$status" >>"$LOG"
}

lane2() {
  lane 2
  local i=0 v
  for v in "" "BLOCK_S=32" "num_warps=8" "num_stages=4"; do
    echo "variant $i: NAKTA_DECODE_ATTENTION_TUNE='$v'" >>"$LOG"
    NAKTA_DECODE_ATTENTION_TUNE=$v step "throughput_$i" 75 python3 -m speed_bench.throughput \
      --preset 7B --prompts 1000 --input-len 128 --output-len 128 --engines nakta \
      --max-batch 256 --out "$R/throughput_attn_$i"
    echo "throughput_attn_$i: NAKTA_DECODE_ATTENTION_TUNE='$v'" >>"$R/variants.txt"
    i=$((i + 1))
  done
  echo "lane2 status=$status" >>"$LOG"
}

lane3() {
  lane 3
  step gpu_tests 380 python3 -m pytest -v -m gpu -p no:cacheprovider -rs tests/
  echo "lane3 status=$status" >>"$LOG"
}

status=0
run_lanes lane0 lane1 lane2 lane3
for f in lane0 lane1 lane2 lane3; do
  echo "##### $f"
  grep -v -E "it/s\]|s/it\]|%\|" "$OUT/$f.txt" 2>/dev/null | grep -E "^\[|^===|variant|passed|FAILED|rror|wall|tok/s" | cut -c1-220 | tail -40
done
cat "$R/lm_eval_gsm8k_full/lm_eval_summary.md" 2>/dev/null | cut -c1-250
tar czf "$OUT/final.tar.gz" -C "$OUT" final && rm -rf "$R"
grep -h "status=" "$OUT"/lane*.txt
