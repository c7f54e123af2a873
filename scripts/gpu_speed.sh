#!/usr/bin/env bash
# H6 GPU job (H100, < 7 min): HellaSwag speed benchmark on the 7B preset with 1,000 real tasks
# (all engines), the attention benchmark, and the model profile. Run from the repo root with
# `.data/` (copy of shared/data) and `.whl/` carried; results come back through $OUT:
#   h6_results.tar.gz  everything written under */results/<device>/ (no Chrome traces)
#   speed_summary.json speed.md attention.md profile_categories.md   quick-look copies
#   h6_log.txt         the full log
# Usage on the device: bash scripts/gpu_speed.sh from the repo root
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
export PYTHONUNBUFFERED=1
LOG=$OUT/h6_log.txt
: >"$LOG"
status=0
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv 2>&1 | tee -a "$LOG"

SLUG=$(python3 -c "from bench_common.ceilings import device_slug; print(device_slug())")
echo "device slug: $SLUG" | tee -a "$LOG"
if [ "${H6_SMOKE:-0}" = 1 ]; then  # CPU smoke test of this script: tiny model, embedded tasks
  SPEED=(--preset tiny --limit 8) ATTN=(--quick) PROF=(--preset tiny --tasks 2)
else
  # 7B random bf16 weights (same for every engine), 1,000 tasks spread over the full validation
  # file (its ActivityNet/WikiHow length mix).
  SPEED=(--preset 7B --data .data/hellaswag_val_full.jsonl
    --tokenizer .data/llama_tokenizer.model --limit 1000 --select spread)
  ATTN=() PROF=(--preset 7B --tasks 64)
fi
# 1. Speed: all engines in one process.
step speed_bench 230 python3 -m speed_bench.run_all "${SPEED[@]}" \
  --engines nakta,nakta_cache,llama_org,hf --no-progress
# 2. Attention paths vs Meta's eager attention (HellaSwag shapes + 2K-8K prefill).
step bench_attention 100 python3 -m kernel_benchmark.bench_attention "${ATTN[@]}"
# 3. Profiles of llama_org / nakta / nakta_cache on the same tasks.
step profile 100 python3 -m model_profile.profile "${PROF[@]}"

# Results: the log (tables as the tools print them) to stdout; files to $OUT.
S=speed_bench/results/$SLUG K=kernel_benchmark/results/$SLUG P=model_profile/results/$SLUG
grep -v -E "it/s\]|USDT:|initializing (model parallel|ddp|pipeline)" "$LOG" | cut -c1-160 | tail -150
files=$(ls $S/{summary.json,speed.csv,speed.md,speed.png} $K/attention.{csv,md,png} \
  $P/{summary.json,categories.csv,categories.md,profile.png} $P/kernels_*.{csv,md} 2>/dev/null)
# shellcheck disable=SC2086
[ -n "$files" ] && tar czf "$OUT/h6_results.tar.gz" $files
cp $S/summary.json "$OUT/speed_summary.json" 2>/dev/null
cp $S/speed.md "$OUT/speed.md" 2>/dev/null
cp $K/attention.md "$OUT/attention.md" 2>/dev/null
cp $P/categories.md "$OUT/profile_categories.md" 2>/dev/null
ls -la "$OUT"
exit $status
