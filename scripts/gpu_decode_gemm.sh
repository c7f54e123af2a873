#!/usr/bin/env bash
# GPU job for the decode step's GEMM path (issues 27 and 28): one H100, at most 240 s of steps.
# 0. the GPU tests of the GEMM step (CUDA-graph capture = eager, bf16 and fp8).
# 1. kernel_benchmark/bench_decode_gemm at the 7B shapes, rows 1..256, fp8 and bf16: each of the
#    step's linears on decode_linear's GEMVs vs the GEMM path (cuBLAS / cuBLASLt W8A8), and the
#    whole DecodeStep on a random 7B both ways: the crossover step_gemm.CROSSOVER should hold.
# 2. speed_bench/decode_speed, random 7B, engines nakta and nakta_fp8 at batch 1, 32, 64, 128,
#    256 (prompt 64, 32 new tokens) with the default crossover: issue 27's batch-32 fp8/bf16
#    ratio and issue 28's rows in flight, against the byte floor.
# Run from the repo root. Writes to $OUT: decode_gemm/ (decode_gemm_blocks.{csv,md},
# decode_gemm_blocks_layer.{csv,md}, decode_gemm.png, decode_gemm_crossover.json),
# decode_gemm/step/ (decode_gemm_step.{csv,md}, decode_gemm.png): the lead commits both as
# kernel_benchmark/results/<device>/; decode_speed/ (decode_summary.json, decode.{csv,md},
# decode.png: speed_bench/results/<device>/decode_gemm/); log.txt.
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
LOG=$OUT/log.txt
: >"$LOG"
status=0
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv 2>&1 | tee -a "$LOG"
step gpu_tests 25 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_step_gemm.py
# fp8 first (issue 27); rows 2 and 4 left out for time (decode_linear's territory; each bucket
# compiles five decode_linear kernels per quant); tables rewritten after every block shape
step bench_blocks 110 python3 -m kernel_benchmark.bench_decode_gemm --models 7B \
  --quants fp8,bf16 --rows 1,8,16,32,64,128,256 --sections blocks --out "$OUT/decode_gemm"
step bench_step 45 python3 -m kernel_benchmark.bench_decode_gemm --quants fp8,bf16 \
  --sections step --rows 1,8,32,64,128,256 --out "$OUT/decode_gemm/step"
step decode_speed 60 python3 -m speed_bench.decode_speed --preset 7B --engines nakta,nakta_fp8 \
  --batches 1,32,64,128,256 --lengths 64:32 --no-budget --out "$OUT/decode_speed"
grep -v -E "it/s\]|s/it\]" "$LOG" | cut -c1-240 | tail -60
cat "$OUT/decode_gemm/decode_gemm_crossover.json" 2>/dev/null
exit $status
