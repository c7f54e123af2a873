#!/usr/bin/env bash
# H7 GPU job (nvidia-h200-x2, < 8 min): multi-GPU HellaSwag speed under torchrun.
#   7B  : 1 GPU vs dp=2 (2 replicas)          target: dp=2 >= 1.85x one GPU
#   13B : 1 GPU vs tp=2 (one replica, 2 GPUs)
#   30B : tp=2 (tasks/s, MFU); 30B on 1 GPU too if time is left (65 GB fits an H200)
#   then speed_bench.scaling (speed-up, efficiency, prediction agreement vs 1 GPU), the
#   NCCL test (tests/test_parallel.py -m gpu: tp=2 / dp=2 over NCCL == one GPU) and
#   accuracy_test.parity --tp 2 (nakta over NCCL vs llama_org MP=2, stories260K_mp2).
# Engine: nakta_cache only (Nakta's HellaSwag engine), bf16, random weights of each preset shape
# (same seed -> same weights on every grid), real HellaSwag text spread over the validation file.
#
# Run from the repo root with `.data/` (copy of shared/data) and `.whl/` carried:
#   bash scripts/gpu_multi.sh
# $OUT receives (6 files):
#   multi_gpu_results.tar.gz  every run folder (summary.json, speed.csv/md/png) + scaling/
#                             -> untar into speed_bench/results/<device>/ (parity/ ->
#                             accuracy_test/results/<device>/)
#   scaling.md scaling.json scaling.png   the combined table
#   multi_gpu_log.txt         full log;  pytest_gpu.txt  the NCCL test output
# CPU smoke test of this script (tiny model, gloo, 2 processes): MULTI_SMOKE=1 OUT=/tmp/x bash gpu_multi.sh
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# NVLink multicast stays off on the shared machines (KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
LOG=$OUT/multi_gpu_log.txt
: >"$LOG"
DEADLINE=${DEADLINE:-450}  # seconds for all steps together (the job limit is 8 min)
WORK=$(mktemp -d /tmp/multi_gpu.XXXX)
status=0
step() {  # step NAME LIMIT CMD...: time-limited, logged, independent of the other steps
  local name=$1 limit=$2 left=$((DEADLINE - SECONDS))
  shift 2
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 30 ]; then
    echo "=== $name: SKIPPED (${left}s left of ${DEADLINE}s) ===" | tee -a "$LOG"
    status=1
    return 0
  fi
  echo "=== $name (limit ${limit}s, t=${SECONDS}s) ===" | tee -a "$LOG"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0))s ===" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || { echo "FAILED $name" | tee -a "$LOG"; status=1; }
  return 0
}
TORCHRUN=(python3 -m torch.distributed.run --standalone --nproc_per_node 2)
{ nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv; nvidia-smi topo -m; } \
  >>"$LOG" 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())" \
  2>&1 | tee -a "$LOG"

if [ "${MULTI_SMOKE:-0}" = 1 ]; then
  M7=tiny M13=tiny M30=tiny N7=8 N13=8 N30=8
  COMMON=(--engines nakta_cache --no-progress --device cpu)
else
  M7=7B M13=13B M30=30B N7=2000 N13=1000 N30=1000
  COMMON=(--engines nakta_cache --no-progress --data .data/hellaswag_val_full.jsonl
    --tokenizer .data/llama_tokenizer.model --select spread)
fi
bench() {  # bench MODEL TP DP TASKS LIMIT
  local m=$1 tp=$2 dp=$3 n=$4 limit=$5 dir=$WORK/random-$1-tp$2-dp$3
  if [ $((tp * dp)) -eq 1 ]; then
    step "$m tp$tp dp$dp ($n tasks)" "$limit" python3 -m speed_bench.run_all --preset "$m" \
      --limit "$n" --out "$dir" "${COMMON[@]}"
  else
    step "$m tp$tp dp$dp ($n tasks)" "$limit" "${TORCHRUN[@]}" -m speed_bench.run_all \
      --preset "$m" --tp "$tp" --dp "$dp" --limit "$n" --out "$dir" "${COMMON[@]}"
  fi
  grep -E "^(nakta_cache|\[nakta_cache\]|measured|device)" "$LOG" | tail -3
}
# 2000 tasks for 7B: ~10 s timed on one GPU, so start-up tails do not decide the dp ratio.
bench "$M7" 1 1 "$N7" 110
bench "$M7" 1 2 "$N7" 110
bench "$M13" 1 1 "$N13" 110
bench "$M13" 2 1 "$N13" 110
bench "$M30" 2 1 "$N30" 140
if [ $((DEADLINE - SECONDS)) -gt 110 ]; then
  bench "$M30" 1 1 "$N30" 110
fi

runs=$(ls "$WORK"/random-*/summary.json 2>/dev/null)
if [ -n "$runs" ]; then
  # shellcheck disable=SC2086
  step scaling 60 python3 -m speed_bench.scaling $runs --out "$WORK/scaling"
  cp "$WORK"/scaling/scaling.{md,json,png} "$OUT"/ 2>/dev/null
  tar czf "$OUT/multi_gpu_results.tar.gz" -C "$WORK" .
fi
if [ "${MULTI_SMOKE:-0}" != 1 ]; then
  step pytest_gpu 100 python3 -m pytest -q -m gpu tests/test_parallel.py
  sed -n '/=== pytest_gpu (/,$p' "$LOG" >"$OUT/pytest_gpu.txt"
  # nakta tp=2 (NCCL) vs llama_org MP=2 on Meta's real 2-shard checkpoint, 2,000 tasks, fp32
  mkdir -p "$WORK/parity"
  step parity_tp2 90 "${TORCHRUN[@]}" -m accuracy_test.parity --tp 2 \
    --checkpoint .data/stories260K_mp2 --tokenizer .data/stories260K/tokenizer.model \
    --data .data/hellaswag_val_full.jsonl --limit 2000 --dtype fp32 --no-progress \
    --out "$WORK/parity/stories260K_mp2_tp2_fp32_cuda.json"
  grep -E "flipped|log-likelihood" "$LOG" | tail -2
  tar czf "$OUT/multi_gpu_results.tar.gz" -C "$WORK" .
fi
echo "---- summary ----"
cat "$WORK/scaling/scaling.md" 2>/dev/null | tail -12
grep -E "^(===|FAILED|error:)" "$LOG"
ls -la "$OUT"
exit $status
