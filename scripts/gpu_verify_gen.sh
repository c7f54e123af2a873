#!/usr/bin/env bash
# A short check after a change of the decode step's crossover (nvidia-h100-x2, ~2 min): lane 0:
# decode 7B nakta / nakta_fp8 at batch 1, 8 and 32 (prompt 64, 128 new); lane 1: the throughput
# benchmark's nakta runs at 128 and 256 rows (1,000 prompts 128/128). Each lane on its GPU and
# half the cores. Run from the repo root: bash scripts/gpu_verify_gen.sh
# $OUT receives verify.tar.gz (decode/, throughput/) and the lanes' logs.
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
R=$OUT/verify
mkdir -p "$R"
lane0() {
  lane 0
  step decode 90 python3 -m speed_bench.decode_speed --preset 7B --engines nakta,nakta_fp8 \
    --batches 1,8,32 --lengths 64:128 --no-budget --out "$R/decode"
}
lane1() {
  lane 1
  step throughput 120 python3 -m speed_bench.throughput --preset 7B --prompts 1000 \
    --input-len 128 --output-len 128 --engines nakta --max-batch 128,256 --out "$R/throughput"
}
status=0
lane0 &
lane1 &
wait
cat "$R/decode/decode.md" "$R/throughput/throughput.md" 2>/dev/null | cut -c1-250
tar czf "$OUT/verify.tar.gz" -C "$OUT" verify && rm -rf "$R"
