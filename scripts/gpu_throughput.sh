#!/usr/bin/env bash
# GPU job for the throughput benchmark (issue 28 item 4): 1,000 random prompts of 128 tokens,
# 128 new each, greedy with EOS ignored, random 7B bf16 weights. nakta (Generator, continuous
# batching over the paged KV pool) at max_batch 64, 128, 256 and 384 (a size the decode step does not
# take yet is skipped and named in the summary), then HF generate (static cache) at batch 64 and 32 (its
# best of the two is the peer). Run from the repo root, `.whl/` carried when the device lacks
# transformers. The benchmark rewrites its results after every run, so a step cut short by its
# time limit keeps the runs it finished. Writes to $OUT: throughput/throughput_summary.json,
# throughput/throughput.md, throughput/throughput.csv, throughput/throughput.png, log.txt
# (the lead commits throughput/ as speed_bench/results/<device>/throughput/).
# MAX_BATCH (default 64,128,256,384) sets nakta's rows; NAKTA_PREFILL_OVERLAP passes to the engine.
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
LOG=$OUT/log.txt
: >"$LOG"
status=0
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv 2>&1 | tee -a "$LOG"
step throughput 300 python3 -m speed_bench.throughput --preset 7B --prompts 1000 \
  --input-len 128 --output-len 128 --engines nakta,hf --max-batch "${MAX_BATCH:-64,128,256,384}" \
  --hf-batches 128,64 \
  --out "$OUT/throughput"
grep -v -E "it/s\]|s/it\]|run/s|s/run" "$LOG" | cut -c1-240 | tail -40
cat "$OUT/throughput/throughput.md" 2>/dev/null
exit $status
