#!/usr/bin/env bash
# Reproduces the decoding catalogue rows on one GPU: greedy decoding against the memory-bandwidth
# floor (speed_bench/results/<device>/decode/, fp8_decode/ with QUANT=fp8), the cascade over a
# shared prefix (decode_shared_prefix/shared/) and the decode step's launch timeline
# (model_profile/results/<device>/decode_b<N>[_fp8]/). Random weights of SIZE, < 10 min a job.
#   OUT=/tmp/out bash scripts/reproduce_decode.sh [decode] [shared_prefix] [timeline] [families]
#     [fp8_kv]
# Settings (environment): SIZE (preset, default 7B); QUANT (bf16 | fp8: nakta and nakta_fp8 in
# one process, batch 1 / 8 / 32, prompt 64); BATCHES (the timeline's batches, default "1 8 32").
# fp8_kv (issue 42's summary, ~6-7 min on an H100): the step's % of its byte floor, bf16 and FP8
# weights, at 1 / 8 / 32 rows; the batch-1 generate() call from outside (64-token prompt, 128
# new, bf16 and FP8 in one process); FP8 alone with its prompt's GEMMs on fp8_decode_gemm vs
# cuBLASLt, alternated (into the log); then `fp8_report kv` writes speed_bench/results/<device>/
# fp8_kv/ from them and the committed throughput_fp8 / fp8_kv_long / KV-accuracy results
# (FP8_KV_THROUGHPUT=1 reruns the 1,000 x 128/128 rows first: ~9 more minutes; FP8_KV_ROWS: their rows,
# default 384, e.g. 768 past the old 512-row step limit, where the e4m3 pool holds them).
# Writes into the catalogue folders of this GPU, then $OUT/decode.tar.gz and $OUT/decode_log.txt.
set -uo pipefail
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
begin decode
SIZE=${SIZE:-7B} QUANT=${QUANT:-bf16}
S=speed_bench/results/$SLUG P=model_profile/results/$SLUG
for job in "${@:-decode}"; do
  case $job in
    decode)
      if [ "$QUANT" = fp8 ]; then
        step fp8_decode 300 python3 -m speed_bench.decode_speed --preset "$SIZE" \
          --engines nakta,nakta_fp8 --batches 1,8,32 --lengths 64:128 --no-budget \
          --out "$S/fp8_decode"
      else  # with one layer's launches at batch 1 against their byte floors (decode_budget.md)
        step decode 540 python3 -m speed_bench.decode_speed --preset "$SIZE" --batches 1,8,32 \
          --lengths 64:128,512:128 --engines nakta,llama_org --out "$S/decode"
      fi
      ;;
    shared_prefix)  # 896-token prompts sharing 768: the cascade vs the row-by-row read
      step shared_prefix 300 python3 -m speed_bench.decode_speed --preset "$SIZE" \
        --batches 32,64 --lengths 896:128 --engines nakta,nakta_rowwise --no-budget \
        --shared-prefix 768 --out "$S/decode_shared_prefix/shared"
      ;;
    timeline)
      q=() suffix=
      [ "$QUANT" = fp8 ] && q=(--quant fp8) suffix=_fp8
      for b in ${BATCHES:-1 8 32}; do
        step "timeline_b$b$suffix" 150 python3 -m model_profile.decode_timeline --preset "$SIZE" \
          --prompt 64 --gen 64 --batch "$b" "${q[@]}" --out "$P/decode_b$b$suffix"
      done
      ;;
    families)  # batch 1 beside HF at each FAMILIES preset (speed_bench/families_report.py)
      for preset in ${FAMILIES:-llama3-8B llama3.2-1B}; do
        step "families_decode_$preset" 240 python3 -m speed_bench.decode_speed --preset "$preset" \
          --batches 1 --lengths 64:128 --engines nakta,hf --no-budget \
          --out "$S/families/$preset/decode"
      done
      ;;
    fp8_kv)
      K=$S/fp8_kv
      step fp8_kv_decode 300 python3 -m speed_bench.decode_speed --preset "$SIZE" \
        --engines nakta,nakta_fp8 --batches 1,8,32 --lengths 64:128 --no-budget \
        --out "$K/decode_lean"
      step fp8_kv_b1 180 python3 -m speed_bench.throughput --preset "$SIZE" \
        --engines nakta,nakta_fp8 --prompts 1 --input-len 64 --output-len 128 --max-batch 1 \
        --out "$K/b1_outside"
      # the batch-1 call's prefill GEMMs (64 rows) on fp8_decode_gemm vs cuBLASLt, alternated in
      # one process (model.FP8_SMALL_GEMM_ROWS 64 / 0): whole generate() calls, into the log
      step fp8_kv_b1_prefill_ab 240 python3 - "$SIZE" <<'PY'
import statistics, sys, time
import torch
import nakta_model.model as nm
from nakta_model.config import preset
from nakta_model.generation import GenerationRequest, Generator
from nakta_model.loading import random_model

model = random_model(preset(sys.argv[1]), "cuda", torch.bfloat16, seed=0, quant="fp8")
gen = Generator(model, max_batch=1)
g = torch.Generator().manual_seed(0)
prompt = [1] + torch.randint(3, model.args.vocab_size, (63,), generator=g).tolist()
times = {64: [], 0: []}  # (wall s, prefill s) of each timed call
for trial in range(7):
    for rows in (64, 0):
        nm.FP8_SMALL_GEMM_ROWS = rows
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gen.generate([GenerationRequest(prompt, 128)])
        torch.cuda.synchronize()
        if trial:  # the first round warms both
            times[rows].append((time.perf_counter() - t0, gen.stats.prefill_s))
for rows, ts in times.items():
    wall = statistics.median(t for t, _ in ts)
    pre = statistics.median(p for _, p in ts)
    name = "fp8_decode_gemm" if rows else "cuBLASLt"
    print(f"b1 prefill GEMMs on {name}: {128 / wall:.1f} tok/s, prefill {pre * 1e3:.2f} ms "
          f"(medians of {len(ts)} calls)")
print(f"fp8_decode_gemm / cuBLASLt speed: {statistics.median(t for t, _ in times[0]) / statistics.median(t for t, _ in times[64]):.3f}")
PY
      if [ "${FP8_KV_THROUGHPUT:-0}" = 1 ]; then
        step fp8_kv_throughput 540 python3 -m speed_bench.throughput --preset "$SIZE" \
          --engines nakta,nakta_fp8 --kv-cache fp8 --prompts 1000 --input-len 128 \
          --output-len 128 --max-batch "${FP8_KV_ROWS:-384}" --out "$S/throughput_fp8"
      fi
      step fp8_kv_report 60 python3 -m speed_bench.fp8_report kv \
        --throughput "$S/throughput_fp8/throughput_summary.json" \
        --long "$S/fp8_kv_long/decode_summary.json" --decode "$K/decode_lean/decode_summary.json" \
        --b1 "$K/b1_outside/throughput_summary.json" \
        --accuracy accuracy_test/results/kv_cache_accuracy.json --out "$K"
      ;;
    *) echo "unknown job $job (decode, shared_prefix, timeline, families, fp8_kv)" | tee -a "$LOG"; status=2 ;;
  esac
done
finish
