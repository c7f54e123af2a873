#!/usr/bin/env bash
# Reproduces the scoring catalogue rows: HellaSwag through every engine in one process
# (speed_bench/results/<device>/speed.md; fp8/scoring_7B/ with QUANT=fp8), the 10-shot-shaped
# engine row, a new process's first pass, the multi-GPU scaling table (2 GPUs), the checkpoint
# read rates, and the scoring profiles (model_profile/results/<device>/). < 10 min a job.
#   OUT=/tmp/out bash scripts/reproduce_scoring.sh [speed] [engine10] [first_pass] [profile]
#       [profile10] [profile_mmlu] [compile] [read_bench] [scaling]
# Settings (environment): SIZE (preset, default 7B; SIZE=30B QUANT=fp8 LIMIT=300 is the 30B
# on one 80 GB GPU); QUANT (bf16 | fp8: nakta_cache and nakta_cache_fp8 in one process on the
# 1,000-task subset); LIMIT (tasks, default 1000); ENGINES (the speed job's engines, default
# nakta_cache,hf). Writes into the catalogue folders of this GPU, then $OUT/scoring.tar.gz and
# $OUT/scoring_log.txt.
set -uo pipefail
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
begin scoring
SIZE=${SIZE:-7B} QUANT=${QUANT:-bf16} LIMIT=${LIMIT:-1000}
S=speed_bench/results/$SLUG P=model_profile/results/$SLUG
REAL=(--data "$HS_FULL" --tokenizer "$TOK")
for job in "${@:-speed}"; do
  case $job in
    speed)
      if [ "$QUANT" = fp8 ]; then
        dir=$S/fp8/scoring_$SIZE engines=nakta_cache,nakta_cache_fp8
        [ "$SIZE" = 30B ] && dir=$S/fp8/capacity_30B/scoring_fp8_1gpu engines=nakta_cache_fp8
        step speed_fp8 540 python3 -m speed_bench.run_all --preset "$SIZE" --engines "$engines" \
          --data "$HS_SUB" --tokenizer "$TOK" --limit "$LIMIT" --no-progress --out "$dir"
      else
        step speed 540 python3 -m speed_bench.run_all --preset "$SIZE" "${REAL[@]}" \
          --limit "$LIMIT" --select spread --engines "${ENGINES:-nakta_cache,hf}" --no-progress \
          --out "$S"
      fi
      ;;
    engine10)  # 300 embedded 10-shot-shaped tasks (~1,100-token rows)
      step engine10 300 python3 -m speed_bench.run_all --preset "$SIZE" --shots 10 --limit 300 \
        --engines nakta_cache --no-progress --out "$S/engine_10shot"
      ;;
    first_pass)  # no warm-up, two timed passes in one process
      step first_pass 300 python3 -m speed_bench.run_all --preset "$SIZE" "${REAL[@]}" \
        --limit 3000 --engines nakta_cache --warmup 0 --passes 2 --no-progress \
        --out "$S/first_pass"
      ;;
    profile)
      step profile 300 python3 -m model_profile.profile --workload hellaswag --tasks "$LIMIT" \
        --engines nakta_cache --out "$P/hellaswag_0shot_1000"
      ;;
    profile10)
      step profile10 300 python3 -m model_profile.profile --workload hellaswag --shots 10 \
        --tasks 300 --engines nakta_cache --out "$P/hellaswag_10shot_300"
      ;;
    profile_mmlu)
      step profile_mmlu 300 python3 -m model_profile.profile --workload mmlu --tasks 230 \
        --engines nakta_cache,nakta_ctx --out "$P/mmlu"
      ;;
    compile)  # what a new process compiles on an empty Triton cache
      TRITON_CACHE_DIR=$(mktemp -d) step compile 400 python3 -m model_profile.compile_profile \
        --out "$P/compile"
      ;;
    read_bench)  # the 7B shard onto the GPU, alone and beside a busy Python thread
      ckpt=$(mktemp -d)/random-$SIZE
      step make_checkpoint 300 bash -c 'random_checkpoint "$0" "$1"' "$ckpt" "$SIZE"
      step read_bench 300 python3 -m speed_bench.read_bench --repeats 1 \
        --file "$ckpt/model.tp00-of-01.safetensors" --out "$S"
      ;;
    scaling)  # 2 GPUs: tp and dp against one GPU, 7B / 13B / 30B (speed_bench/results/<host>/)
      work=$(mktemp -d)
      TR=(python3 -m torch.distributed.run --standalone --nproc_per_node 2)
      C=(--engines nakta_cache --no-progress "${REAL[@]}" --select spread)
      step 7B_tp1 150 python3 -m speed_bench.run_all --preset 7B --limit 2000 "${C[@]}" \
        --out "$work/random-7B-tp1-dp1"
      step 7B_dp2 150 "${TR[@]}" -m speed_bench.run_all --preset 7B --dp 2 --limit 2000 "${C[@]}" \
        --out "$work/random-7B-tp1-dp2"
      step 13B_tp1 150 python3 -m speed_bench.run_all --preset 13B --limit 1000 "${C[@]}" \
        --out "$work/random-13B-tp1-dp1"
      step 13B_tp2 150 "${TR[@]}" -m speed_bench.run_all --preset 13B --tp 2 --limit 1000 \
        "${C[@]}" --out "$work/random-13B-tp2-dp1"
      step 30B_tp2 180 "${TR[@]}" -m speed_bench.run_all --preset 30B --tp 2 --limit 1000 \
        "${C[@]}" --out "$work/random-30B-tp2-dp1"
      step 30B_tp1 150 python3 -m speed_bench.run_all --preset 30B --limit 1000 "${C[@]}" \
        --out "$work/random-30B-tp1-dp1"
      # shellcheck disable=SC2046
      step scaling 60 python3 -m speed_bench.scaling $(ls "$work"/random-*/summary.json) \
        --out "speed_bench/results/${SLUG}-x2/scaling"
      ;;
    *) echo "unknown job $job" | tee -a "$LOG"; status=2 ;;
  esac
done
finish
