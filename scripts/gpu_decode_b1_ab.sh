#!/usr/bin/env bash
# Batch-1 decode settings A/B'd in fresh processes: each NAME=VAR=VALUE[,VAR=VALUE] setting
# ("base" = no change) runs decode_speed 7B ($ENGINES, default nakta,nakta_fp8), batch 1,
# prompt 64, 128 new, the settings' order run twice (the second reversed); then the
# decode timeline of the default tree (FP8) and the GPU tests named in $TESTS (default: the
# batch-1 decode kernels and the step); before the timeline, each setting's greedy tokens (FP8,
# 96 new) as a hash: the settings must agree. One GPU, <= 590 s.
# $OUT receives decode_b1_ab.tar.gz (log.txt, a decode folder a run, runs.csv, timeline/).
# Usage: bash scripts/gpu_decode_b1_ab.sh base stepoff=NAKTA_STEP_KERNELS=0 ...
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
stage decode_b1_ab
SPECS=("$@")
[ ${#SPECS[@]} -eq 0 ] && SPECS=(base)
ORDER=("${SPECS[@]}")
for ((i = ${#SPECS[@]} - 1; i >= 0; i--)); do ORDER+=("${SPECS[$i]}"); done
n=0
for spec in "${ORDER[@]}"; do
  n=$((n + 1))
  name=${spec%%=*}
  envs=()
  if [ "$spec" != "$name" ]; then IFS=',' read -r -a envs <<<"${spec#*=}"; fi
  step "r${n}_$name" 70 env "${envs[@]}" python3 -m speed_bench.decode_speed --preset 7B \
    --engines "${ENGINES:-nakta,nakta_fp8}" --batches 1 --lengths 64:128 --no-budget \
    --out "$STAGE/r${n}_$name"
done
for spec in "${SPECS[@]}"; do  # each setting's greedy tokens: the settings must agree
  name=${spec%%=*}
  envs=()
  if [ "$spec" != "$name" ]; then IFS=',' read -r -a envs <<<"${spec#*=}"; fi
  step "tokens_$name" 60 env "${envs[@]}" python3 - <<'PY'
import hashlib
import torch
from nakta_model.generation import Generator, greedy_requests
from nakta_model.loading import load
from speed_bench.weights import weight_source

w = weight_source("7B", None, 0)
dev = torch.device("cuda")
model = load(w.source(dev, torch.bfloat16), dev, torch.bfloat16, quant="fp8")
prompt = [1] + [(i * 7919) % 31000 + 3 for i in range(63)]
out = Generator(model, max_batch=1, max_seq_len=200).generate(greedy_requests([prompt], 96, None))
toks = out[0].tokens
print("TOKENS", hashlib.sha1(str(toks).encode()).hexdigest()[:16], toks[:8])
PY
done
step timeline 90 python3 -m model_profile.decode_timeline --preset 7B --quant fp8 \
  --out "$STAGE/timeline"
# shellcheck disable=SC2086
step gpu_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider -x \
  ${TESTS:-tests/test_greedy_advance.py tests/test_step_inputs.py tests/test_decode_attention.py tests/test_decode_attention_paged.py tests/test_generation_engine.py tests/test_generation_pipeline.py tests/test_generation_paged.py}
python3 - "$STAGE" <<'PY' 2>&1 | tee -a "$LOG"
import json, pathlib, sys
stage = pathlib.Path(sys.argv[1])
lines = ["run,engine,tok_s,pct_of_floor,floor_tok_s"]
runs = [p for p in stage.iterdir() if p.is_dir() and p.name[:1] == "r" and p.name[1:2].isdigit()]
for d in sorted(runs, key=lambda p: int(p.name[1:].split("_")[0])):
    try:
        rows = json.loads((d / "decode_summary.json").read_text())["runs"]
    except Exception as e:
        print(d.name, "missing", e)
        continue
    for r in rows:
        lines.append(f"{d.name},{r['engine']},{r['tok_s']:.2f},{r['pct_of_floor']:.2f},{r['floor_tok_s']:.2f}")
        print(f"{d.name} {r['engine']}: {r['tok_s']:.1f} tok/s, {r['pct_of_floor']:.2f}% of floor")
(stage / "runs.csv").write_text("\n".join(lines) + "\n")
PY
grep -E "^===|passed|failed|Step |^TOKENS" "$LOG" | tail -40
echo "decode_b1_ab status=$status" | tee -a "$LOG"
tar czf "$OUT/decode_b1_ab.tar.gz" -C "$(dirname "$STAGE")" decode_b1_ab
exit $status
