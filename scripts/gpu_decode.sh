#!/usr/bin/env bash
# GPU job for the generation engine (issue 14): GPU tests of the engine and its kernels, the
# decode_linear launch-config sweep (7B shapes), decode_speed (nakta vs llama_org vs HF
# generate at batch 1/8/32, prompts 64 and 512, 128 new tokens) with the tuned configs, and the
# packed-attention config sweep incl. long (10-shot) rows. Run from the repo root with `.whl/`
# carried (fairscale, liger-kernel). Writes to $OUT: decode_results.tar.gz (everything),
# decode_summary.json, decode.md, decode_budget.md, decode_linear_tune_best.json, log.txt.
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
export PYTHONUNBUFFERED=1
LOG=$OUT/log.txt
: >"$LOG"
status=0
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv 2>&1 | tee -a "$LOG"
R=$OUT/res
mkdir -p "$R"
step gpu_tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider -x \
  tests/test_generation_engine.py tests/test_decode_linear.py tests/test_decode_attention.py \
  tests/test_safetensors_read.py tests/test_packed_attention.py tests/test_logprobs.py
step tune_decode_linear 170 python3 -m kernel_benchmark.bench_decode --tune --models 7B \
  --batches 1,8,32 --tune-budget 140 --out "$R"
BEST=$(ls "$R"/*_linear_tune_best.json 2>/dev/null | head -1)
CFG=()
[ -n "$BEST" ] && CFG=(--decode-configs "$BEST") && cp "$BEST" "$OUT/decode_linear_tune_best.json"
step decode_speed 260 python3 speed_bench/decode_speed.py --preset 7B --batches 1,8,32 \
  --lengths 64:128,512:128 "${CFG[@]}" --out "$R"
step tune_attention 100 python3 -m kernel_benchmark.bench_attention --quick --tune --no-prefill \
  --out "$R/attn"
cp "$R"/decode_summary.json "$R"/decode.md "$R"/decode_budget.md "$OUT/" 2>/dev/null
tar czf "$OUT/decode_results.tar.gz" -C "$OUT" res && rm -rf "$R"
grep -v -E "it/s\]|s/it\]" "$LOG" | cut -c1-220 | tail -70
exit $status
