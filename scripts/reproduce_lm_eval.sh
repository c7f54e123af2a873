#!/usr/bin/env bash
# Reproduces the lm-eval catalogue rows: lm-eval itself, the project's entry in fresh processes,
# `--model nakta` against `--model hf` on the same random weights (speed_bench/results/<device>/
# lm_eval_*/); with QUANT=fp8 the bf16 / quant=fp8 pair on all 10,042 HellaSwag tasks
# (fp8/lm_eval/); the data-parallel rows (lm_eval_dp/): dp on one GPU (its 1-GPU rows, the fixed
# part of a run per phase), dp2 on a 2-GPU host, x4 and x4_30b on a 4-GPU host (into the
# <device>-x4 folder). < 10 min a job.
#   OUT=/tmp/out bash scripts/reproduce_lm_eval.sh [hellaswag0] [hellaswag10] [mmlu] [gen]
#       [gsm8k] [one_pool] [quant] [dp] [dp2] [x4] [x4_30b] [x4_30b_2x2] [families]
# Needs `.whl/` (lm-eval 0.4.13 and its deps: scripts/fetch_device_wheels.sh) and the real data
# (.data/ or ../shared/data). Settings (environment): SIZE (preset, default 7B); QUANT (the
# quant job's precision, default fp8). Writes into the catalogue folders of this GPU, then
# $OUT/lm_eval.tar.gz (children's logs and raw results stay out) and $OUT/lm_eval_log.txt.
set -uo pipefail
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
begin lm_eval
SIZE=${SIZE:-7B}
S=speed_bench/results/$SLUG
WORK=/tmp/nakta_lm_eval_work  # the random checkpoints (HF + Nakta), shared by the jobs
speed() {  # speed NAME LIMIT_S ARGS...: lm_eval_speed into $S/NAME, the checkpoints reused
  local name=$1 limit=$2 reuse=()
  shift 2
  [ -f "$WORK/nakta/params.json" ] && reuse=(--reuse-work)
  step "$name" "$limit" python3 speed_bench/lm_eval_speed.py --preset "$SIZE" --tokenizer "$TOK" \
    --data "$HS_FULL" --work "$WORK" "${reuse[@]}" --out "$S/$name" "$@"
  rm -rf "${S:?}/$name/logs" "${S:?}/$name/runs"  # raw per-child files: the summary keeps the figures
}
for job in "${@:-hellaswag0}"; do
  case $job in
    hellaswag0)
      speed lm_eval_hellaswag/0shot 540 --task hellaswag_local --fewshot 0 --warmup \
        --batch-sizes default --hf-batch-sizes 64 --limit 3000
      ;;
    hellaswag10)
      speed lm_eval_hellaswag/10shot 540 --task hellaswag_local --fewshot 10 --warmup \
        --batch-sizes default --hf-batch-sizes 64 --fewshot-limit 300
      ;;
    mmlu)
      speed lm_eval_mmlu 540 --task mmlu_shaped_local:5:20 --batch-sizes default --warmup \
        --hf-batch-sizes 64
      ;;
    gen)
      speed lm_eval_gen 540 --task gsm8k_shaped_local:8:128,bbh_shaped_local:3:128 \
        --batch-sizes default --warmup --hf-batch-sizes 64
      ;;
    gsm8k)  # all 1,319 docs: the machine's first run (Triton's cache empty), warm, hf at 128
      G=$S/lm_eval_gsm8k_full
      TRITON_CACHE_DIR=$(mktemp -d) step gsm8k_first 200 python3 speed_bench/lm_eval_gsm8k.py \
        --preset "$SIZE" --models nakta --tokenizer "$TOK" --run-timeout-s 180 \
        --out "$G/first" --work /tmp/gsm8k_work
      step gsm8k_warm 120 python3 speed_bench/lm_eval_gsm8k.py --checkpoint /tmp/gsm8k_work/nakta \
        --tokenizer "$TOK" --models nakta --run-timeout-s 100 --out "$G/warm" \
        --work /tmp/gsm8k_work_warm
      step gsm8k_hf128 360 python3 speed_bench/lm_eval_gsm8k.py --preset "$SIZE" --models hf \
        --tokenizer "$TOK" --hf-batch-sizes 128 --hf-timeout-s 330 --out "$G/hf128" \
        --work /tmp/gsm8k_work_hf128
      ;;
    one_pool)  # three tasks in ONE lm-eval call vs one call each: one KV pool for both engines
      step one_pool 300 python3 speed_bench/lm_eval_one_pool.py --preset "$SIZE" \
        --tokenizer "$TOK" --data "$HS_FULL" --limit 40 --run-timeout-s 80 \
        --work /tmp/one_pool_work --out "$S/lm_eval_one_pool"
      ;;
    quant)  # bf16 vs quant=$QUANT through the CLI, all 10,042 tasks, 0-shot
      ckpt=/tmp/nakta_quant_ckpt/random-$SIZE
      step make_checkpoint 300 bash -c 'random_checkpoint "$0" "$1"' "$ckpt" "$SIZE"
      step lm_eval_quant 300 python3 speed_bench/lm_eval_quant.py --checkpoint "$ckpt" \
        --data "$HS_FULL" --shots 0 --warmup-limit 0 --run-timeout-s 120 --deadline-s 280 \
        --out "$S/fp8/lm_eval"
      ;;
    dp)  # one GPU: the 1-GPU rows alone (0-shot all 10,042 tasks, 10-shot 2,000), each rank's
      # fixed time per phase (estimate: weights ~60 s, warm-up ~12 s, runs ~55 + ~57 s: ~3.5 min)
      step lm_eval_dp 400 python3 speed_bench/lm_eval_dp.py --preset "$SIZE" --tokenizer "$TOK" \
        --data "$HS_FULL" --runs 0:all,10:2000 --grids 1x1 --suite "" --warmup-limit 32 \
        --run-timeout-s 120 --deadline-s 380 --out "$S/lm_eval_dp_1gpu" --work /tmp/lm_eval_dp_work
      rm -rf /tmp/lm_eval_dp_work && mv "$S/lm_eval_dp_1gpu/logs" "$OUT/lm_eval_dp_1gpu_logs"
      ;;
    dp2)  # 2 GPUs: one GPU vs dp=2 started by the entry and under torchrun, and a 4-task suite
      step lm_eval_dp 575 python3 speed_bench/lm_eval_dp.py --preset "$SIZE" --tokenizer "$TOK" \
        --data "$HS_FULL" --runs 10:2000,0:all --gpus 2 --launchers nakta,torchrun \
        --suite-limit 20 --warmup-limit 32 --suite-hf --suite-hf-modes one_call \
        --hf-batch-size auto --run-timeout-s 150 --deadline-s 555 --out "$S/lm_eval_dp" \
        --work /tmp/lm_eval_dp_work
      rm -rf /tmp/lm_eval_dp_work
      ;;
    x4)  # 4 GPUs, random 7B: one GPU vs dp=4 (the entry's launcher), 0-shot all 10,042 tasks and
      # 10-shot 2,000, in one call (issue 43: dp=4 <= 0.35x / 0.33x the 1-GPU wall). Estimate from
      # the 2 x H100 rows: weights ~60 s, warm-up ~12 s, 1 GPU 55 + 57 s, dp=4 ~21 + ~22 s: ~4 min
      step lm_eval_dp_x4 540 python3 speed_bench/lm_eval_dp.py --preset "$SIZE" --tokenizer "$TOK" \
        --data "$HS_FULL" --runs 0:all,10:2000 --grids 1x1,1x4 --launchers nakta --suite "" \
        --warmup-limit 32 --run-timeout-s 120 --deadline-s 520 \
        --out "speed_bench/results/$SLUG-x4/lm_eval_dp" --work /tmp/lm_eval_dp_work
      rm -rf /tmp/lm_eval_dp_work  # the children's logs: beside the archive, not in the catalogue
      mv "speed_bench/results/$SLUG-x4/lm_eval_dp/logs" "$OUT/lm_eval_dp_x4_logs"
      ;;
    x4_30b)  # 4 GPUs, random 30B bf16, 0-shot 2,000 tasks: tp=4 with `--model hf` beside it
      # (parallelize=True: accelerate's split over the 4 GPUs, batch 64). Measured on 4 x H100:
      # the HF model made and saved (65 GB) 70-120 s, converted for tp=4 ~115 s, warm-up ~25 s,
      # nakta ~20 s, hf ~80 s: ~5.5 min. (--nakta-reads-hf skips the conversion; nakta then reads
      # the HF shards itself at tp=4, 17.5 s of its wall against 1.3 s for the converted copy)
      step lm_eval_dp_x4_30b 545 python3 speed_bench/lm_eval_dp.py --preset 30B \
        --tokenizer "$TOK" --data "$HS_FULL" --runs 0:2000 --grids 4x1 --hf-grids 4x1 \
        --launchers nakta --suite "" --warmup-limit 16 --hf-batch-size 64 --run-timeout-s 90 \
        --hf-timeout-s 200 --deadline-s 530 \
        --out "speed_bench/results/$SLUG-x4/lm_eval_dp_30b" --work /tmp/lm_eval_dp_30b_work
      rm -rf /tmp/lm_eval_dp_30b_work
      mv "speed_bench/results/$SLUG-x4/lm_eval_dp_30b/logs" "$OUT/lm_eval_dp_30b_logs"
      ;;
    x4_30b_2x2)  # the same 30B as two replicas of tp=2 (and tp=4 beside it): a 4-GPU user's way
      # to run a model that needs two GPUs; checkpoints converted per tp (~2 x 115 s)
      step lm_eval_dp_x4_30b_2x2 545 python3 speed_bench/lm_eval_dp.py --preset 30B \
        --tokenizer "$TOK" --data "$HS_FULL" --runs 0:2000 --grids 4x1,2x2 --launchers nakta \
        --suite "" --warmup-limit 16 --run-timeout-s 90 --deadline-s 530 \
        --out "speed_bench/results/$SLUG-x4/lm_eval_dp_30b_2x2" --work /tmp/lm_eval_dp_30b_work
      rm -rf /tmp/lm_eval_dp_30b_work
      mv "speed_bench/results/$SLUG-x4/lm_eval_dp_30b_2x2/logs" "$OUT/lm_eval_dp_30b_2x2_logs"
      ;;
    families)  # FAMILIES "preset:tokenizer:limit ...": HellaSwag 0-shot, nakta vs hf, fresh
      # processes on random weights of each family's shape; the report over every families job
      for spec in ${FAMILIES:-llama3-8B:$DATA/llama3_tokenizer.model:all}; do
        IFS=: read -r preset tok limit <<<"$spec"
        lim=() && [ "$limit" != all ] && lim=(--limit "$limit")
        step "families_lm_eval_$preset" 420 python3 speed_bench/lm_eval_speed.py \
          --preset "$preset" --tokenizer "$tok" --data "$HS_FULL" --work "/tmp/families_$preset" \
          --task hellaswag_local --fewshot 0 --batch-sizes default --hf-batch-sizes 64 "${lim[@]}" \
          --out "$S/families/$preset/lm_eval"
        rm -rf "${S:?}/families/$preset/lm_eval/logs" "${S:?}/families/$preset/lm_eval/runs"
      done
      step families_report 60 python3 -m speed_bench.families_report --root "$S/families"
      ;;
    *) echo "unknown job $job" | tee -a "$LOG"; status=2 ;;
  esac
done
finish
