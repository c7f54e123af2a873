#!/usr/bin/env bash
# One device call, any of the GPU jobs of issues 13/14/17, by name, in the order given:
#   bash scripts/gpu_session.sh tests profile_mmlu decode ...
# tests         every `-m gpu` test (-v), tests.txt
# failing       the GPU tests that failed in a full run, with tracebacks
# prefix_decode nakta at batch 32 and 64, 896-token prompts, 128 new: prompts sharing a
#               768-token prefix (the cascade; nakta_rowwise: read row by row through L2)
# plain_decode  the same with nothing shared (GSM8K-shaped decoding without the cascade)
# attn_bench    decode_attention alone (MHA and GQA, batch 1/32/64, contexts 128-2048): the
#               CUDA-core path, the tensor-core path and SDPA flash
# decode_tests  the GPU tests of the decode kernels and the generation engine
# decode_nakta  the decode job without hf
# pdl_ab        decode_speed (nakta, batch 1, 8 and 32, prompt 64) with the decode matmuls launched
#               as programmatic dependents vs serially (NAKTA_PDL), alternating, twice each
# budget        decode_speed at batch 1 only, with the per-launch time budget of one layer
# tune          decode_linear launch configs for the 7B shapes at batch 1 (bench_decode --tune)
# compile       decode_speed's nakta_compile engine (torch.compile reduce-overhead) at batch
#               1 and 32 next to the CUDA-graph capture (nakta), prompt 64, 128 new
# profile       model_profile, HellaSwag-shaped, 1,000 tasks, nakta_cache: time by category and
#               each matmul shape's TFLOP/s against the measured peak (issue 13 item 3)
# profile10     the profile job on HellaSwag 10-shot-shaped tasks (300; ~1,000-token rows)
# gemm          kernel_benchmark.bench_gemm: the 7B block GEMMs at 1,024-16,384 tokens vs the
#               8192^3 rate, in bursts and sustained; Nakta's TMA GEMM (fused SwiGLU) and a plain
#               Triton GEMM beside cuBLAS
# gemm_tests    the GPU tests of the benchmark TMA GEMM, the model and the scoring path
# attn_scoring  bench_attention --tune-scoring: the packed kernel's launch configs and block
#               skipping (none / branch / masked loads) on the scorer's own 0- and 10-shot batches
# engine10      run_all, 300 HellaSwag 10-shot-shaped tasks (--shots 10, embedded lengths),
#               nakta_cache: MFU on unique tokens at ~1,100-token rows
# budget_sweep  run_all, 1,000 real tasks, nakta_cache at token budgets 8,192 / 16,384 / 32,768
# profile_mmlu  model_profile --workload mmlu (prefix cache vs per-task cache), 230 tasks
# decode        decode_speed: nakta + llama_org at batch 1/8/32, prompts 64/512, 128 new; hf
#               (static cache) at batch 1 and 32, prompt 64 (its rows are slow)
# gen           lm-eval generate_until: gsm8k_shaped_local (8-shot) and bbh_shaped_local
#               (3-shot), nakta (default batch, after a --warmup run) vs hf --batch_size 64
# mmlu          lm-eval mmlu_shaped_local 5-shot (57 subjects), nakta vs hf at 64
# hellaswag     lm-eval hellaswag_local 0-shot (3,000 tasks) and 10-shot (300), nakta at
#               default/64/auto vs hf at 64
# plain_hf      hf at 64 on lm-eval as shipped (--hf-harness plain): hellaswag 0/10-shot and
#               MMLU-shaped, next to the hellaswag/mmlu jobs' hf through the fixed entry
# preload_ab    nakta hellaswag_local 0-shot 3,000 tasks through the CLI, the early weight
#               prefetch (NAKTA_LM_EVAL_PRELOAD) on, off, on: wall + timing JSON each (needs $WORK
#               from an lm-eval job first)
# hellaswag10   10-shot, 300 tasks: nakta at the default batch size vs hf at 64
# load_ab       like preload_ab: prefetch + the load on a worker thread (background_load=true)
#               vs neither, alternating, twice each
# load_tests    the GPU tests of the reader and the lm-eval adapter (its load and warm-up)
# read_bench    speed_bench.read_bench on the 7B shard: each reader alone and beside a busy
#               Python thread
# load_matrix   nakta hellaswag_local 0-shot 3,000 tasks through the CLI: as shipped (early
#               weight prefetch), without the prefetch, with background_load (3 x 2, alternating)
# exit_ab       nakta hellaswag_local 0-shot 3,000 tasks through the CLI: its exit without
#               Python's teardown (NAKTA_LM_EVAL_FAST_EXIT, as shipped) vs the normal exit
# importtime    one such run under PYTHONPROFILEIMPORTTIME=1 (the log has each import's cost)
# hellaswag0    the hellaswag job at 0-shot only, nakta at the default batch size vs hf at 64
# first_pass    run_all, 3,000 real tasks, nakta_cache with no warm-up and two timed passes in one
#               process: the first pass (every kernel compiled or loaded from Triton's cache)
#               against the second (issue 13: first <= 1.15x the second)
# tree_tests    the GPU tests of the token-tree scoring path: packed attention (span ends,
#               block skip, prefix pages), model, scoring, prefix cache, lm-eval adapter
# engine        speed_bench run_all, 7B bf16, 1,000 real tasks: nakta_cache vs hf (MFU on
#               unique tokens, tokens computed), and bench_attention's packed kernel
# Run from the repo root with `.whl/` (lm-eval 0.4.13 + deps, fairscale, liger-kernel: made by
# `bash scripts/fetch_device_wheels.sh`, 21 wheels, 14 MB) and `.data/` (hellaswag_val_full.jsonl,
# llama_tokenizer.model, stories260K/: copies from ../shared/data) carried. Each job writes
# $OUT/<job>.tar.gz (its results folder, logs included) and its summary files beside it; the
# device tool returns only a few files per call, so each job's results travel as one archive.
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
export PYTHONUNBUFFERED=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
LOG=$OUT/log.txt
: >"$LOG"
status=0
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv 2>&1 | tee -a "$LOG"
TOK=.data/llama_tokenizer.model
HS=.data/hellaswag_val_full.jsonl
WORK=/tmp/nakta_work  # the random 7B HF checkpoint + its conversion, shared by the lm-eval jobs

pack() {  # pack NAME: $OUT/NAME (a folder) -> $OUT/NAME.tar.gz
  tar czf "$OUT/$1.tar.gz" -C "$OUT" "$1" && rm -rf "${OUT:?}/$1"
}

lm_eval_job() {  # lm_eval_job NAME LIMIT_S ARGS...: lm_eval_speed into $OUT/NAME
  local name=$1 limit=$2
  shift 2
  local reuse=()
  [ -f "$WORK/ready" ] && reuse=(--reuse-work)
  step "$name" "$limit" python3 speed_bench/lm_eval_speed.py --preset 7B --tokenizer "$TOK" \
    --data "$HS" --work "$WORK" "${reuse[@]}" --out "$OUT/$name" "$@"
  [ -f "$WORK/nakta/params.json" ] && touch "$WORK/ready"
  cp "$OUT/$name/lm_eval_summary.md" "$OUT/${name}_summary.md" 2>/dev/null
  pack "$name"
}

ensure_work() {  # the random 7B checkpoints in $WORK, made on a fresh machine by a 10-task
  # nakta run (which also fills Triton's cache)
  [ -f "$WORK/ready" ] || lm_eval_job load_prep 150 --task hellaswag_local --fewshot 0 \
    --models nakta --batch-sizes default --limit 10
}

nakta_cli_run() {  # nakta_cli_run DIR NAME PRELOAD TIMEOUT [MODEL_ARGS_SUFFIX]: one nakta
  # hellaswag_local 0-shot run of 3,000 tasks through the CLI into $OUT/DIR/NAME.{json,log}
  # (needs $WORK from an lm-eval job); its wall, process start to end, goes to the log
  local dir=$OUT/$1 name=$2 pre=$3 limit=$4 extra=${5:-}
  mkdir -p "$dir"
  local t0
  t0=$(date +%s.%N)  # bc may be absent: python does the arithmetic
  NAKTA_LM_EVAL_PRELOAD=$pre NAKTA_LM_EVAL_TIMING=$dir/$name.json \
    NAKTA_HELLASWAG_JSONL=$PWD/$HS NAKTA_LM_EVAL_LOCAL_TASKS=1 timeout "$limit" \
    python3 -m accuracy_test.lm_eval_cli --model nakta \
    --model_args "checkpoint=$WORK/nakta,tokenizer=$TOK,dtype=bf16$extra" \
    --include_path accuracy_test/tasks --tasks hellaswag_local --limit 3000 \
    --device cuda >"$dir/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc wall $(python3 -c "import time; print(round(time.time() - $t0, 2))") s" |
    tee -a "$LOG"
}

for job in "$@"; do
  case $job in
    tests)
      step tests 380 python3 -m pytest -v -m gpu -p no:cacheprovider tests
      grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$LOG" >"$OUT/tests.txt"
      ;;
    profile)
      step profile 200 python3 -m model_profile.profile --workload hellaswag --tasks 1000 \
        --engines nakta_cache --out "$OUT/profile"
      rm -f "$OUT"/profile/*.pt.trace.json
      cp "$OUT/profile/gemms_nakta_cache.md" "$OUT/profile_gemms.md" 2>/dev/null
      cp "$OUT/profile/categories.md" "$OUT/profile_categories.md" 2>/dev/null
      pack profile
      ;;
    profile10)
      step profile10 200 python3 -m model_profile.profile --workload hellaswag --shots 10 \
        --tasks 300 --engines nakta_cache --out "$OUT/profile10"
      rm -f "$OUT"/profile10/*.pt.trace.json
      cp "$OUT/profile10/gemms_nakta_cache.md" "$OUT/profile10_gemms.md" 2>/dev/null
      cp "$OUT/profile10/kernels_nakta_cache.md" "$OUT/profile10_kernels.md" 2>/dev/null
      pack profile10
      ;;
    gemm)
      step gemm 200 python3 -m kernel_benchmark.bench_gemm --tokens 1024,4096,16384 --seconds 3 \
        --out "$OUT/gemm"
      cp "$OUT/gemm/gemm.md" "$OUT/gemm.md" 2>/dev/null
      pack gemm
      ;;
    attn_scoring)
      step attn_scoring 300 python3 -m kernel_benchmark.bench_attention --tune-scoring \
        --out "$OUT/attn_scoring"
      pack attn_scoring
      ;;
    engine10)
      step engine10 200 python3 -m speed_bench.run_all --preset 7B --shots 10 --limit 300 \
        --engines nakta_cache --no-progress --out "$OUT/engine10"
      cp "$OUT/engine10/speed.md" "$OUT/engine10.md" 2>/dev/null
      pack engine10
      ;;
    budget_sweep)
      for b in 8192 16384 32768; do
        step "budget_$b" 150 python3 -m speed_bench.run_all --preset 7B --data "$HS" \
          --tokenizer "$TOK" --limit 1000 --select spread --engines nakta_cache \
          --token-budget "$b" --no-progress --out "$OUT/budget_sweep/b$b"
      done
      pack budget_sweep
      ;;
    profile_mmlu)
      step profile_mmlu 150 python3 -m model_profile.profile --workload mmlu --tasks 230 \
        --engines nakta_cache,nakta_ctx --out "$OUT/profile_mmlu"
      rm -f "$OUT"/profile_mmlu/*.pt.trace.json
      pack profile_mmlu
      ;;
    decode)
      step decode 200 python3 speed_bench/decode_speed.py --preset 7B --batches 1,8,32 \
        --lengths 64:128,512:128 --engines nakta,llama_org --out "$OUT/decode"
      step decode_hf 150 python3 speed_bench/decode_speed.py --preset 7B --batches 1,32 \
        --lengths 64:128 --engines hf --no-budget --out "$OUT/decode/hf"
      cp "$OUT/decode/decode.md" "$OUT/decode.md" 2>/dev/null
      pack decode
      ;;
    decode_nakta)  # the decode job without its slow hf rows
      step decode 240 python3 speed_bench/decode_speed.py --preset 7B --batches 1,8,32 \
        --lengths 64:128,512:128 --engines nakta,llama_org --out "$OUT/decode"
      cp "$OUT/decode/decode.md" "$OUT/decode.md" 2>/dev/null
      pack decode
      ;;
    pdl_ab)
      # decode with the decode matmuls launched as programmatic dependents (as shipped on
      # Hopper) vs serially (NAKTA_PDL=0), alternating, twice each: nakta at batch 1 and 32
      for run in 1 2; do
        for pdl in 1 0; do
          NAKTA_PDL=$pdl step "pdl$pdl-$run" 150 python3 speed_bench/decode_speed.py --preset 7B \
            --batches 1,8,32 --lengths 64:128 --engines nakta --no-budget \
            --out "$OUT/pdl_ab/pdl$pdl-$run"
        done
      done
      pack pdl_ab
      ;;
    budget)
      step budget 120 python3 speed_bench/decode_speed.py --preset 7B --batches 1 \
        --lengths 64:128 --engines nakta --out "$OUT/budget"
      cp "$OUT/budget/decode.md" "$OUT/budget.md" 2>/dev/null
      pack budget
      ;;
    tune)
      step tune 200 python3 -m kernel_benchmark.bench_decode --tune --models 7B --batches 1 \
        --tune-budget 150 --out "$OUT/tune"
      pack tune
      ;;
    compile)
      step compile 240 python3 speed_bench/decode_speed.py --preset 7B --batches 1,32 \
        --lengths 64:128 --engines nakta,nakta_compile --no-budget --out "$OUT/compile"
      cp "$OUT/compile/decode.md" "$OUT/compile.md" 2>/dev/null
      pack compile
      ;;
    prefix_decode)
      step prefix_decode 240 python3 speed_bench/decode_speed.py --preset 7B --batches 32,64 \
        --lengths 896:128 --engines nakta,nakta_rowwise --no-budget --shared-prefix 768 \
        --out "$OUT/prefix_decode/shared"
      pack prefix_decode
      ;;
    plain_decode)
      step plain_decode 200 python3 speed_bench/decode_speed.py --preset 7B --batches 32,64 \
        --lengths 896:128 --engines nakta --no-budget --out "$OUT/plain_decode"
      pack plain_decode
      ;;
    attn_bench)
      step attn_bench 200 python3 -m kernel_benchmark.bench_decode --attention-only \
        --attn-batches 1,32,64 --contexts 128,1024,2048 --out "$OUT/attn_bench"
      pack attn_bench
      ;;
    decode_tests)
      step decode_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short \
        tests/test_decode_attention.py tests/test_decode_linear.py \
        tests/test_generation_engine.py tests/test_decode_speed.py
      ;;
    failing)
      step failing 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short \
        "tests/test_decode_linear.py::test_gpu_llama7b_shapes" \
        tests/test_lm_eval_speed.py
      ;;
    gen)
      lm_eval_job gen 420 --task gsm8k_shaped_local:8:128,bbh_shaped_local:3:128 \
        --batch-sizes default --warmup --hf-batch-sizes 64
      ;;
    mmlu)
      lm_eval_job mmlu 280 --task mmlu_shaped_local:5:20 --batch-sizes default --warmup \
        --hf-batch-sizes 64
      ;;
    hellaswag)
      lm_eval_job hellaswag 540 --task hellaswag_local --fewshot 0,10 --warmup \
        --batch-sizes default,64,auto --hf-batch-sizes 64 --limit 3000 --fewshot-limit 300
      ;;
    plain_hf)
      lm_eval_job plain_hf 420 --task hellaswag_local,mmlu_shaped_local:5:20 --fewshot 0,10 \
        --models hf --hf-harness plain --batch-sizes 64 --limit 3000 --fewshot-limit 300
      ;;
    hellaswag0)
      lm_eval_job hellaswag0 300 --task hellaswag_local --fewshot 0 --warmup \
        --batch-sizes default --hf-batch-sizes 64 --limit 3000
      ;;
    hellaswag10)
      ensure_work  # a fresh machine: checkpoints made, Triton's cache filled by a 10-task run
      lm_eval_job hellaswag10 200 --task hellaswag_local --fewshot 10 \
        --batch-sizes default --hf-batch-sizes 64 --fewshot-limit 300
      ;;
    load_ab)
      # prefetch + the load on a worker thread vs the plain load in the constructor (both off),
      # alternating; the checkpoints made first if this is a fresh machine (a 10-task run,
      # which also fills Triton's cache)
      ensure_work
      for cfg in background blocking background blocking; do
        if [ "$cfg" = blocking ]; then
          nakta_cli_run load_ab "$cfg-$SECONDS" 0 60 ,background_load=false
        else
          nakta_cli_run load_ab "$cfg-$SECONDS" 1 60 ,background_load=true
        fi
      done
      pack load_ab
      ;;
    load_tests)
      step load_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short \
        tests/test_safetensors_read.py tests/test_lm_eval_adapter.py tests/test_prefetch.py
      ;;
    read_bench)
      ensure_work
      step read_bench 200 python3 -m speed_bench.read_bench --repeats 1 \
        --file "$WORK/nakta/model.tp00-of-01.safetensors" --out "$OUT/read_bench"
      cp "$OUT/read_bench/read_bench.md" "$OUT/read_bench.md" 2>/dev/null
      pack read_bench
      ;;
    load_matrix)
      # the load as shipped (weights prefetched from the moment lm-eval's command line is
      # parsed, model built in the constructor) vs no prefetch vs the load on a worker thread,
      # alternating, twice each
      ensure_work
      for rep in 1 2; do
        nakta_cli_run load_matrix "shipped-$rep" 1 60
        nakta_cli_run load_matrix "no_prefetch-$rep" 0 60
        nakta_cli_run load_matrix "background-$rep" 1 60 ,background_load=true
      done
      pack load_matrix
      ;;
    exit_ab)
      # the CLI's exit without Python's teardown (as shipped) vs the normal exit, alternating
      ensure_work
      for fast in 1 0 1 0; do
        NAKTA_LM_EVAL_FAST_EXIT=$fast nakta_cli_run exit_ab "fast_exit$fast-$SECONDS" 1 60
      done
      pack exit_ab
      ;;
    importtime)
      # one nakta 0-shot run (3,000 tasks) under python -X importtime: what each module costs
      # on this host, next to the run's own timing events
      ensure_work
      PYTHONPROFILEIMPORTTIME=1 nakta_cli_run importtime run 1 90
      pack importtime
      ;;
    preload_ab)
      for pre in 1 0 1; do
        nakta_cli_run preload_ab "preload$pre-$SECONDS" "$pre" 120
      done
      pack preload_ab
      ;;
    gemm_tests)
      step gemm_tests 120 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_tma_gemm.py
      step gemm_gpu_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short \
        tests/test_bench_gemm.py tests/test_model.py tests/test_scoring.py \
        tests/test_packed_attention.py tests/test_prefix_cache.py tests/test_generation.py \
        tests/test_generation_engine.py tests/test_lm_eval_adapter.py
      ;;
    tree_tests)
      step tree_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short \
        tests/test_packed_attention.py tests/test_model.py tests/test_scoring.py \
        tests/test_prefix_cache.py tests/test_lm_eval_adapter.py
      ;;
    first_pass)
      step first_pass 240 python3 -m speed_bench.run_all --preset 7B --data "$HS" \
        --tokenizer "$TOK" --limit 3000 --engines nakta_cache --warmup 0 --passes 2 \
        --no-progress --out "$OUT/first_pass"
      cp "$OUT/first_pass/speed.md" "$OUT/first_pass.md" 2>/dev/null
      pack first_pass
      ;;
    engine)
      step engine 240 python3 -m speed_bench.run_all --preset 7B --data "$HS" \
        --tokenizer "$TOK" --limit 1000 --select spread --engines nakta_cache,hf \
        --no-progress --out "$OUT/engine"
      step attention 120 python3 -m kernel_benchmark.bench_attention --out "$OUT/engine/attn"
      cp "$OUT/engine/speed.md" "$OUT/engine.md" 2>/dev/null
      pack engine
      ;;
    *)
      echo "unknown job $job" | tee -a "$LOG"
      status=1
      ;;
  esac
done
grep -v -E "it/s\]|s/it\]" "$LOG" | cut -c1-220 | tail -80
exit $status
