#!/usr/bin/env bash
# Issues 27/28 in ONE call of a 2-GPU machine (nvidia-h100-x2), one lane per GPU:
#   lane 0 (GPU 0): the decode GPU tests (paged attention, GEMM step, PDL kernels, engine);
#       batch-1 decode, 7B, nakta and nakta_fp8, prompt 64 / 128 new, without and with the PDL
#       weight prefetch + attention PDL (two fresh processes: NAKTA_PDL_PREFETCH /
#       NAKTA_ATTENTION_PDL); the decode GEMM-path crossover bench (7B blocks, fp8 then bf16);
#       decode_speed nakta / nakta_fp8 at batch 1, 32, 64, 128, 256.
#   lane 1 (GPU 1): the throughput benchmark (1,000 prompts 128/128, nakta at 64/128/256 rows
#       over the paged pool, HF static cache at 64/32); then lm-eval gsm8k_shaped_full_local on
#       its first 64 docs, nakta vs hf (batch 64), to try the full-size driver on the GPU.
# Run from the repo root with .data/ and .whl/ carried: bash scripts/gpu_session_gen.sh
# $OUT receives gen_session.tar.gz (every result folder) and the lanes' logs.
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
  export CUDA_VISIBLE_DEVICES=0 LOG=$OUT/lane0.txt
  : >"$LOG"
  step gpu_tests 110 python3 -m pytest -q -m gpu -p no:cacheprovider -x \
    tests/test_decode_step_gemm.py tests/test_decode_attention.py tests/test_decode_linear.py \
    tests/test_decode_linear_fp8.py tests/test_generation_engine.py
  for pdl in 0 1; do
    NAKTA_PDL_PREFETCH=$pdl NAKTA_ATTENTION_PDL=$pdl step "decode_b1_pdl$pdl" 80 \
      python3 -m speed_bench.decode_speed --preset 7B --engines nakta,nakta_fp8 --batches 1 \
      --lengths 64:128 --no-budget --out "$R/decode_b1_pdl$pdl"
  done
  step bench_gemm_blocks 110 python3 -m kernel_benchmark.bench_decode_gemm --models 7B \
    --quants fp8,bf16 --rows 1,8,16,32,64,128,256 --sections blocks --out "$R/decode_gemm"
  step decode_rows 80 python3 -m speed_bench.decode_speed --preset 7B \
    --engines nakta,nakta_fp8 --batches 1,32,64,128,256 --lengths 64:32 --no-budget \
    --out "$R/decode_rows"
  echo "lane0 status=$status" >>"$LOG"
}

lane1() {
  export CUDA_VISIBLE_DEVICES=1 LOG=$OUT/lane1.txt
  : >"$LOG"
  step throughput 300 python3 -m speed_bench.throughput --preset 7B --prompts 1000 \
    --input-len 128 --output-len 128 --engines nakta,hf --max-batch 64,128,256 \
    --hf-batches 64,32 --out "$R/throughput"
  step gsm8k_64 230 python3 speed_bench/lm_eval_gsm8k.py --preset 7B \
    --tokenizer "$D/llama_tokenizer.model" --limit 64 --hf-batch-sizes 64 \
    --run-timeout-s 100 --hf-timeout-s 100 --deadline-s 225 --out "$R/gsm8k_64" \
    --work /tmp/gsm8k_work
  echo "lane1 status=$status" >>"$LOG"
}

status=0
lane0 &
lane1 &
wait
for f in lane0 lane1; do
  grep -v -E "it/s\]|s/it\]|%\|" "$OUT/$f.txt" | cut -c1-220 | tail -30
done
cat "$R"/decode_b1_pdl*/decode.md "$R/throughput/throughput.md" 2>/dev/null | cut -c1-250
rm -rf "$R/gsm8k_64/logs"
tar czf "$OUT/gen_session.tar.gz" -C "$OUT" gen_session && rm -rf "$R"
grep -h "status=" "$OUT"/lane*.txt
