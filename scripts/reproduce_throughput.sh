#!/usr/bin/env bash
# Reproduces the generation-throughput catalogue rows (speed_bench/results/<device>/throughput/,
# throughput_fp8/ with QUANT=fp8) and their kernel profile (model_profile/results/<device>/
# throughput/): 1,000 random prompts of 128 tokens, 128 new each, greedy with EOS ignored,
# random weights of SIZE. One GPU, < 10 min a job.
#   OUT=/tmp/out bash scripts/reproduce_throughput.sh [throughput] [profile] [families] [serve]
# Settings (environment): SIZE (preset, default 7B); QUANT (bf16 | fp8: nakta and nakta_fp8 in
# one process at the FP8 rows); MAX_BATCH (nakta's rows, default 64,128,256,384; fp8 384);
# HF_BATCHES (the HF static-cache peer's batches, default 128,64; "" leaves HF out); PROMPTS.
# Writes into the catalogue folders of this GPU, then $OUT/throughput.tar.gz (those files) and
# $OUT/throughput_log.txt.
set -uo pipefail
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
begin throughput
SIZE=${SIZE:-7B} QUANT=${QUANT:-bf16} PROMPTS=${PROMPTS:-1000}
HF_BATCHES=${HF_BATCHES-128,64}
S=speed_bench/results/$SLUG P=model_profile/results/$SLUG
COMMON=(--preset "$SIZE" --prompts "$PROMPTS" --input-len 128 --output-len 128)
for job in "${@:-throughput}"; do
  case $job in
    throughput)
      if [ "$QUANT" = fp8 ]; then
        step throughput_fp8 540 python3 -m speed_bench.throughput "${COMMON[@]}" \
          --engines nakta,nakta_fp8 --max-batch "${MAX_BATCH:-384}" --out "$S/throughput_fp8"
      else
        engines=nakta hf=()
        [ -n "$HF_BATCHES" ] && engines=nakta,hf hf=(--hf-batches "$HF_BATCHES")
        step throughput 540 python3 -m speed_bench.throughput "${COMMON[@]}" \
          --engines "$engines" --max-batch "${MAX_BATCH:-64,128,256,384}" "${hf[@]}" \
          --out "$S/throughput"
      fi
      ;;
    profile)  # the decode graph's kernels by name at 256 rows
      q=()
      [ "$QUANT" = fp8 ] && q=(--quant fp8)
      step profile 300 python3 -m model_profile.throughput_profile --preset "$SIZE" \
        --prompts "$PROMPTS" --max-batch "${MAX_BATCH:-256}" "${q[@]}" --out "$P/throughput"
      ;;
    families)  # each FAMILIES preset: bf16 beside HF's static cache, then FP8 weights with the
      # bf16 and the e4m3 KV cache (TensorRT-LLM's FP8 checkpoints quantize the KV cache too)
      for preset in ${FAMILIES:-llama3-8B}; do
        F=$S/families/$preset COMMON[1]=$preset
        step "families_throughput_$preset" 420 python3 -m speed_bench.throughput "${COMMON[@]}" \
          --engines nakta,hf --max-batch "${MAX_BATCH:-512,1024}" --hf-batches "${HF_BATCHES:-128}" \
          --out "$F/throughput"
        step "families_throughput_fp8_$preset" 240 python3 -m speed_bench.throughput \
          "${COMMON[@]}" --engines nakta_fp8 --kv-cache fp8 --max-batch "${MAX_BATCH:-512,1024}" \
          --out "$F/throughput_fp8"
      done
      ;;
    serve)  # nakta-serve over HTTP (the same 128/128 prompts at request rates, then unbounded)
      # beside the offline Generator on the same prompts (speed_bench/results/<device>/serve/).
      # SERVE_VARIANTS='NAME=SERVER ARGS;...' adds a fresh server per variant at 10 req/s and
      # unbounded, and the run goes to serve_variants/ instead (SERVE_RATES: the main server's
      # rates, default all); every table has serve_diagnostics.md (where the time goes)
      dest=$S/serve va=()
      if [ -n "${SERVE_VARIANTS:-}" ]; then
        dest=$S/serve_variants
        IFS=';' read -ra vs <<<"$SERVE_VARIANTS"
        for v in "${vs[@]}"; do va+=(--variant "$v"); done
      fi
      step serve 580 python3 -m speed_bench.serve_bench --preset "$SIZE" --tokenizer "$TOK" \
        --rates "${SERVE_RATES:-2,5,10,20,40,inf}" "${va[@]}" --out "$dest"
      ;;
    *) echo "unknown job $job (throughput, profile, families, serve)" | tee -a "$LOG"; status=2 ;;
  esac
done
finish
