# Sourced by the scripts/gpu_*.sh jobs (not run on its own): the carried wheels on PYTHONPATH,
# and a time-limited, logged step that lets the other steps run when one fails.

# NVLink multicast stays off on the shared multi-GPU hosts (the device tool's KINDS.md); Python
# prints at once; lm-eval and HF never reach for the network.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

use_wheels() {  # install .whl/*.whl (fairscale, liger-kernel) into /tmp/site when carried
  if [ -f /tmp/site/.nakta_wheels ]; then  # done by an outer script: a second install under a
    export PYTHONPATH=/tmp/site:$PWD  # running lane would swap files it is importing
  elif ls .whl/*.whl >/dev/null 2>&1; then
    # bytecode compiled at install, as a user's pip install does: without it a machine's first
    # lm-eval run compiled lm-eval's and its deps' modules on import (seconds in its wall)
    python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
    touch /tmp/site/.nakta_wheels
    export PYTHONPATH=/tmp/site:$PWD
  else
    export PYTHONPATH=$PWD
  fi
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

stage() {  # stage NAME: a fresh $STAGE (/tmp/NAME.XXXXXX/NAME) and its $LOG, status=0, and the
  # GPU's name, memory and clock as the log's first line (the tar of $STAGE is the job's result)
  STAGE=$(mktemp -d "/tmp/$1.XXXXXX")/$1
  mkdir -p "$STAGE"
  LOG=$STAGE/log.txt
  : >"$LOG"
  status=0
  nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee -a "$LOG"
}

tuner_jobs() {  # processes a tuner may compile with: the cores but two, 1 to 12
  local n=$(($(nproc) - 2))
  [ "$n" -gt 12 ] && n=12
  [ "$n" -lt 1 ] && n=1
  echo "$n"
}

gpu_count() {  # GPUs this host shows (1 where nvidia-smi shows none)
  local n
  n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  [ "$n" -ge 1 ] && echo "$n" || echo 1
}

lane() {  # lane N: this (sub)shell drives GPU N (N mod the host's GPUs, so a session written
  # for 4 GPUs runs on 2 in waves: run_lanes) on that GPU's share of the cores (cores / GPUs: a
  # lane making weights on every core delayed another lane's decode-graph launches), logging
  # to $OUT/laneN.txt
  local n=$1 gpus gpu share
  gpus=$(gpu_count)
  gpu=$((n % gpus))
  share=$(($(nproc) / gpus))
  export CUDA_VISIBLE_DEVICES=$gpu LOG=$OUT/lane$n.txt OMP_NUM_THREADS=$share
  taskset -cp "$((gpu * share))-$((gpu * share + share - 1))" $BASHPID >/dev/null 2>&1
  : >"$LOG"
}

run_lanes() {  # run_lanes FN...: each function in the background, as many at once as the host
  # has GPUs (lane k of a wave on GPU k), the next wave when one ends
  local gpus i=0 fn
  gpus=$(gpu_count)
  for fn in "$@"; do
    "$fn" &
    i=$((i + 1))
    [ $((i % gpus)) -eq 0 ] && wait
  done
  wait
}

decode_runs() {  # decode_runs DIR RUN...: each DIR/RUN/decode_summary.json's rows, one line a
  # row (engine, batch, tok/s, % of its floor): the A/B scripts' summary
  python3 - "$@" <<'PY'
import json, pathlib, sys
stage = pathlib.Path(sys.argv[1])
for run in sys.argv[2:]:
    try:
        d = json.loads((stage / run / "decode_summary.json").read_text())
    except Exception as e:
        print(run, "missing", e)
        continue
    for r in d["runs"]:
        print(f"{run} {r['engine']} b{r['batch']}: {r['tok_s']:.1f} tok/s, {r['pct_of_floor']:.1f}% of floor")
PY
}

prefetch_best() {  # prefetch_best CSV: tune_fp8_decode's best PREFETCH=0 and PREFETCH=1 row
  # per kind (CUDA-core path), beside each other
  python3 - "$1" <<'PY'
import sys
import pandas as pd
df = pd.read_csv(sys.argv[1])
df = df[(df["path"] != "bf16") & (df["status"] == "ok") & (df["USE_DOT"] == 0)]
for (kind, pf), g in df.groupby(["kind", "PREFETCH"]):
    b = g.loc[g["us"].idxmin()]
    print(f"{kind} PREFETCH={pf}: {b['pct_copy_bw']:.1f}% of copy bw, {b['us']:.1f} us "
          f"(BLOCK_N={b['BLOCK_N']} BLOCK_K={b['BLOCK_K']} warps={b['num_warps']})")
PY
}
