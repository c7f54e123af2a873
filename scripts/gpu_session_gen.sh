#!/usr/bin/env bash
# Issues 28 (and 27) in ONE call of a 2-GPU machine (nvidia-h100-x2), one lane per GPU, each lane
# pinned to its half of the host's cores (a lane making weights on every core delayed the other
# lane's decode-graph launches by ~1.5 ms a token in an earlier call):
#   lane 0 (GPU 0): the decode GPU tests (GEMM step, paged attention, GEMVs, engine); the
#       throughput benchmark (1,000 prompts 128/128, nakta at 64/128/256 rows over the paged
#       pool, HF static cache at 128/64); decode 7B nakta / nakta_fp8 at batch 1 and 32, prompt
#       64 / 128 new; the decode GEMM-path crossover bench (7B blocks, fp8 then bf16).
#   lane 1 (GPU 1): lm-eval gsm8k_shaped_full_local through the CLI, nakta on all 1,319 docs vs
#       hf (batch 64) on the first 256 and nakta on the same 256 (scripts/gpu_gsm8k.sh's run).
# Run from the repo root with .data/ and .whl/ carried: bash scripts/gpu_session_gen.sh
# $OUT receives gen_session.tar.gz (every result folder, lm-eval logs included) and the logs.
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
D=.data
R=$OUT/gen_session
mkdir -p "$R"
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv | tee "$OUT/gpus.txt"

lane0() {
  lane 0
  step gpu_tests 110 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_decode_step_gemm.py tests/test_decode_attention.py tests/test_decode_linear.py \
    tests/test_generation_engine.py
  step throughput 280 python3 -m speed_bench.throughput --preset 7B --prompts 1000 \
    --input-len 128 --output-len 128 --engines nakta,hf --max-batch 64,128,256 \
    --hf-batches 128,64 --out "$R/throughput"
  step decode 60 python3 -m speed_bench.decode_speed --preset 7B --engines nakta,nakta_fp8 \
    --batches 1,32 --lengths 64:128 --no-budget --out "$R/decode"
  step bench_gemm_blocks 60 python3 -m kernel_benchmark.bench_decode_gemm --models 7B \
    --quants fp8,bf16 --rows 1,8,32,64,128,256 --sections blocks --out "$R/decode_gemm"
  echo "lane0 status=$status" >>"$LOG"
}

lane1() {
  lane 1
  step lm_eval_gsm8k 400 python3 speed_bench/lm_eval_gsm8k.py --preset 7B \
    --tokenizer "$D/llama_tokenizer.model" --hf-batch-sizes 64 --hf-limit 256 \
    --nakta-on-hf-docs --run-timeout-s 180 --hf-timeout-s 180 --subset-timeout-s 75 \
    --deadline-s 390 --out "$R/lm_eval_gsm8k_full" --work /tmp/gsm8k_work
  echo "lane1 status=$status" >>"$LOG"
}

status=0
lane0 &
lane1 &
wait
for f in lane0 lane1; do
  grep -v -E "it/s\]|s/it\]|%\|" "$OUT/$f.txt" | cut -c1-220 | tail -30
done
cat "$R/throughput/throughput.md" "$R"/decode/decode.md \
  "$R/lm_eval_gsm8k_full/lm_eval_summary.md" 2>/dev/null | cut -c1-250
tar czf "$OUT/gen_session.tar.gz" -C "$OUT" gen_session && rm -rf "$R"
grep -h "status=" "$OUT"/lane*.txt
