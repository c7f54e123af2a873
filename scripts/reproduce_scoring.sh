#!/usr/bin/env bash
# Reproduces the scoring catalogue rows: HellaSwag through every engine in one process
# (speed_bench/results/<device>/speed.md; fp8/scoring_7B/ with QUANT=fp8), the 10-shot-shaped
# engine row, a new process's first pass, the multi-GPU scaling table (2 GPUs), the 4-GPU
# catalogue (x4_*), the checkpoint read rates, and the scoring profiles
# (model_profile/results/<device>/). < 10 min a job.
#   OUT=/tmp/out bash scripts/reproduce_scoring.sh [speed] [engine10] [first_pass] [profile]
#       [profile10] [profile_mmlu] [compile] [read_bench] [scaling] [x4_seed] [x4_big]
#       [x4_scaling]
# The x4_* jobs (a 4-GPU host) add their rows to speed_bench/results/<device>-x4/scaling_x4/
# (speed_bench.scaling_x4 merges them into the summary already there: run `x4_seed x4_scaling`
# in one call and `x4_big` in the next, each ~7.5 min, with the first call's archive unpacked
# in the tree between them). X4_DEADLINE (seconds from the script's start, default 510) cuts or
# skips the runs that would go past it, so one slow step cannot take the call (the report that
# folds in what did run still gets its 45 s); LIMIT65 (x4_big's 65B tasks, default 1000);
# LM_EVAL_DP names an lm_eval_dp_summary.json for the lm-eval rows (default: the one in
# <device>-x4/lm_eval_dp/).
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
# the 4-GPU jobs: their summary folder, the lm-eval report they fold in, a call-wide deadline
X4=speed_bench/results/${SLUG}-x4/scaling_x4
LM_EVAL_DP=${LM_EVAL_DP:-speed_bench/results/${SLUG}-x4/lm_eval_dp/lm_eval_dp_summary.json}
X4_LM=()
[ -f "$LM_EVAL_DP" ] && X4_LM=(--lm-eval "$LM_EVAL_DP")
X4_DEADLINE=${X4_DEADLINE:-510}
TR4=(python3 -m torch.distributed.run --standalone --nproc_per_node 4)
need_gpus() {  # need_gpus N: false (and status 1, logged) on a host with fewer GPUs
  local have
  have=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  [ "$have" -ge "$1" ] && return 0
  echo "=== $job: SKIPPED (needs $1 GPUs, this host has $have) ===" | tee -a "$LOG"
  status=1
  return 1
}
x4_report() {  # x4_report NAME DIR: fold DIR's finished runs into the 4-GPU summary (45 s,
  # past X4_DEADLINE too: what did run is kept)
  local runs
  runs=$(ls "$2"/random-*/summary.json 2>/dev/null)
  if [ -z "$runs" ]; then
    echo "=== $1: no run finished, nothing to report ===" | tee -a "$LOG"
    return 0
  fi
  # shellcheck disable=SC2086
  step "$1" 45 python3 -m speed_bench.scaling_x4 $runs "${X4_LM[@]}" --out "$X4" --index
}
xstep() {  # xstep NAME SECONDS CMD...: step, its limit cut to what is left before X4_DEADLINE
  local name=$1 limit=$2 left=$((X4_DEADLINE - SECONDS))
  shift 2
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then
    echo "=== $name: SKIPPED (${left}s left of X4_DEADLINE=${X4_DEADLINE}s) ===" | tee -a "$LOG"
    status=1
    return 0
  fi
  step "$name" "$limit" "$@"
}
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
    x4_seed)  # the seed's command as written: exit status and wall clock (its results, in
      # results/<device>/nakta/, leave the tree: its default embedded workload is not a row)
      need_gpus 4 || continue
      work=$(mktemp -d)
      # shellcheck disable=SC2016
      xstep seed_command 170 bash -c 't0=$(date +%s%N); (cd speed_bench &&
        timeout 160 torchrun --nproc_per_node 4 nakta_speed.py); rc=$?
        echo "$rc $(( ($(date +%s%N) - t0) / 1000000 ))" >"$0"; exit $rc' "$work/rc_ms"
      for d in speed_bench/results/"$SLUG"/nakta/*-tp4-dp1; do
        [ -d "$d" ] && [ -z "$(git ls-files -- "$d" 2>/dev/null)" ] && mv "$d" "$work/"
      done
      rmdir "speed_bench/results/$SLUG/nakta" 2>/dev/null
      if [ -s "$work/rc_ms" ]; then
        read -r rc ms <"$work/rc_ms"
        step x4_report_seed 45 python3 -m speed_bench.scaling_x4 \
          --seed-command "$rc" "$(printf '%d.%03d' $((ms / 1000)) $((ms % 1000)))" \
          "${X4_LM[@]}" --out "$X4" --index
      fi
      ;;
    x4_big)  # 30B and 65B at tp=4, fp16 and bf16: nakta, nakta_cache vs llama_org at MP=4
      need_gpus 4 || continue
      work=$(mktemp -d)
      B=(--engines "nakta,nakta_cache,llama_org" --no-progress "${REAL[@]}" --select spread)
      for run in "30B fp16 1000 150" "30B bf16 1000 150" "65B fp16 ${LIMIT65:-1000} 210" \
        "65B bf16 ${LIMIT65:-1000} 210"; do
        read -r m dt n lim <<<"$run"
        xstep "${m}_tp4_$dt" "$lim" "${TR4[@]}" -m speed_bench.run_all --preset "$m" \
          --dtype "$dt" --limit "$n" "${B[@]}" --out "$work/random-$m-$dt-tp4-dp1"
      done
      x4_report x4_report_big "$work"
      ;;
    x4_scaling)  # 7B / 13B / 30B on 1, 2 and 4 GPUs; tp x dp = 4x1, 2x2, 1x4 (nakta_cache, bf16)
      need_gpus 4 || continue
      work=$(mktemp -d)
      C=(--engines nakta_cache --no-progress "${REAL[@]}" --select spread)
      # MODEL TASKS then per grid TPxDP:LIMIT_S (1 GPU first: the others compare with it; the
      # 2-GPU grid as the 2-GPU catalogue ran it)
      for plan in "7B 2000 1x1:70 1x2:60 4x1:60 2x2:60 1x4:60" \
        "13B 1000 1x1:60 2x1:60 4x1:60 2x2:60 1x4:60" \
        "30B 1000 1x1:80 2x1:70 4x1:60 2x2:70 1x4:100"; do
        read -r m n grids <<<"$plan"
        for g in $grids; do
          tp=${g%%x*} dp=${g#*x} dp=${dp%%:*} lim=${g#*:}
          dir=$work/random-$m-tp$tp-dp$dp
          if [ $((tp * dp)) -eq 1 ]; then
            xstep "${m}_tp1" "$lim" python3 -m speed_bench.run_all --preset "$m" --limit "$n" \
              "${C[@]}" --out "$dir"
          else
            xstep "${m}_tp${tp}_dp$dp" "$lim" python3 -m torch.distributed.run --standalone \
              --nproc_per_node $((tp * dp)) -m speed_bench.run_all --preset "$m" --tp "$tp" \
              --dp "$dp" --limit "$n" "${C[@]}" --out "$dir"
          fi
        done
      done
      x4_report x4_report_scaling "$work"
      ;;
    *) echo "unknown job $job" | tee -a "$LOG"; status=2 ;;
  esac
done
finish
