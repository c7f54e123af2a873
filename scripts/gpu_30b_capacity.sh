#!/usr/bin/env bash
# Issue 27's capacity figure (nvidia-h100-x2, ~3 min): the 30B preset scoring 300 real HellaSwag
# tasks in FP8 on ONE GPU beside bf16 at tp=2 over both (it does not fit one 80 GB GPU), in
# the same call. Run from the repo root with .data/ and .whl/ carried.
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
LOG=$OUT/log.txt
: >"$LOG"
status=0
D=.data
C=$OUT/capacity_30B
step bf16_tp2 130 python3 -m nakta_model.spawn --nproc 2 speed_bench/run_all.py --preset 30B \
  --engines nakta_cache --data $D/hellaswag_val_subset1000.jsonl \
  --tokenizer $D/llama_tokenizer.model --limit 300 --tp 2 --no-progress --out "$C/bf16_tp2"
step fp8_one_gpu 100 env CUDA_VISIBLE_DEVICES=0 python3 -m speed_bench.run_all --preset 30B \
  --engines nakta_cache_fp8 --data $D/hellaswag_val_subset1000.jsonl \
  --tokenizer $D/llama_tokenizer.model --limit 300 --no-progress --out "$C/fp8_1gpu"
tar czf "$OUT/capacity_30B.tar.gz" -C "$OUT" capacity_30B
grep -v -E "it/s\]|s/it\]|%\|" "$LOG" | cut -c1-220 | tail -30
exit $status
