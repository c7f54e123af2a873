# shellcheck shell=bash disable=SC2034
# Sourced by the scripts/reproduce_*.sh jobs (not run on its own): the environment of a GPU
# run, the carried wheels on PYTHONPATH, a time-limited logged step that lets the other steps
# run when one fails, and the archive of the catalogue files a run wrote.

# NVLink multicast stays off on shared multi-GPU hosts; Python prints at once; lm-eval and HF
# never reach for the network.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export LLAMA_ORG_QUIET=1

# Real data: a git-ignored .data/ carried beside the tree (a copy of ../shared/data), else the
# shared folder itself.
DATA=${DATA:-.data}
[ -d "$DATA" ] || DATA=../shared/data
export TOK=$DATA/llama_tokenizer.model
HS_FULL=$DATA/hellaswag_val_full.jsonl
HS_SUB=$DATA/hellaswag_val_subset1000.jsonl

use_wheels() {  # install .whl/*.whl (scripts/fetch_device_wheels.sh) into /tmp/site when carried
  if [ -f /tmp/site/.nakta_wheels ]; then
    export PYTHONPATH=/tmp/site:$PWD
  elif ls .whl/*.whl >/dev/null 2>&1; then
    # bytecode compiled at install, as a user's pip install does (a first lm-eval run otherwise
    # compiles lm-eval's modules on import, seconds in its wall clock)
    python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
    touch /tmp/site/.nakta_wheels
    export PYTHONPATH=/tmp/site:$PWD
  else
    export PYTHONPATH=$PWD
  fi
}

begin() {  # begin NAME: $LOG ($OUT/NAME_log.txt), status=0, $SLUG (the results folder name of
  # this GPU), and the GPU, clocks and commit as the log's first lines
  : "${OUT:?OUT must be set: the folder for the archive and the log}"
  mkdir -p "$OUT"
  JOB=$1
  LOG=$OUT/${JOB}_log.txt
  : >"$LOG"
  status=0
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv \
    2>&1 | tee -a "$LOG"
  git log -1 --format='commit %h %s' 2>/dev/null | cut -c1-120 | tee -a "$LOG"
  STARTED=$(mktemp)  # files under */results/ newer than this are the run's
  SLUG=$(python3 -c "from bench_common.ceilings import device_slug; print(device_slug())")
  echo "results folder: */results/$SLUG" | tee -a "$LOG"
}

step() {  # step NAME SECONDS CMD...: run with a time limit into $LOG; a failure sets status=1
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s) ===" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0))s ===" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || status=1
  return 0
}

random_checkpoint() {  # random_checkpoint DIR [SIZE]: a Nakta checkpoint of random bf16 weights of
  # the preset (default 7B), the LLaMA tokenizer beside them (exported: a step runs it as
  # `step NAME SECONDS bash -c 'random_checkpoint "$0" "$1"' DIR SIZE`)
  python3 - "$1" "${2:-7B}" "$TOK" <<'PY'
import sys
import torch
from nakta_model.checkpoint import write_checkpoint
from nakta_model.config import preset
from speed_bench.weights import RandomWeights

out, size, tok = sys.argv[1:4]
w = RandomWeights(preset(size), f"random-{size}", seed=0)
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
write_checkpoint(out, w.args, lambda n: w.tensor(n, dev, torch.bfloat16).cpu(), 1,
                 torch.bfloat16, force=True, tokenizer=tok)
PY
}
export -f random_checkpoint

finish() {  # the catalogue files this run wrote (*/results/, newer than begin) into
  # $OUT/$JOB.tar.gz, the log's tail to stdout, and the job's status as the exit code
  local changed
  changed=$(find . -path ./.git -prune -o -path '*/results/*' -type f -newer "$STARTED" -print |
    sed 's|^\./||' | grep -v -E '\.pt\.trace\.json$' | sort)
  if [ -n "$changed" ]; then
    # shellcheck disable=SC2086
    tar czf "$OUT/$JOB.tar.gz" $changed && echo "$OUT/$JOB.tar.gz:" && echo "$changed"
  fi
  grep -v -E "it/s\]|s/it\]|%\|" "$LOG" | cut -c1-220 | tail -60
  echo "$JOB status=$status"
  exit "$status"
}
