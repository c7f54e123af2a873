#!/usr/bin/env bash
# wo's weights asked of L2 during decode attention (NAKTA_WO_L2_PREFETCH), one GPU, A/B in
# fresh processes (off, on, off, on): decode_speed 7B bf16 and FP8 at batch 1 (prompt 64, 128
# new), and the greedy tokens of both settings compared (the hint must not change a bit).
# <= 480 s by the step limits. $OUT receives wo_prefetch_ab.tar.gz (wo_prefetch_ab/: log.txt,
# off1/ on1/ off2/ on2/ decode results, tokens_*.json).
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
[ $# -ge 1 ] && lane "$1"
use_wheels
STAGE=$(mktemp -d /tmp/wo_ab.XXXXXX)/wo_prefetch_ab
mkdir -p "$STAGE"
LOG=$STAGE/log.txt
: >"$LOG"
status=0
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv 2>&1 | tee -a "$LOG"
D="python3 -m speed_bench.decode_speed --preset 7B --engines nakta,nakta_fp8 --batches 1 --lengths 64:128 --no-budget"
TOK='
import json, os, sys, torch
from nakta_model import random_model
from nakta_model.config import PRESETS
from nakta_model.generation import Generator, GenerationRequest
out = {}
for quant in (None, "fp8"):
    torch.manual_seed(0)
    m = random_model(PRESETS["7B"], "cuda", quant=quant)
    g = Generator(m, max_batch=1, max_seq_len=256)
    prompt = [1] + [int(t) for t in torch.randint(3, 32000, (63,), generator=torch.Generator().manual_seed(1))]
    out[quant or "bf16"] = g.generate([GenerationRequest(prompt, 64)])[0].tokens
    del g, m
    torch.cuda.empty_cache()
json.dump(out, open(sys.argv[1], "w"))
print({k: v[:8] for k, v in out.items()})
'
for run in off1 on1 off2 on2; do
  v=0; [ "${run#on}" != "$run" ] && v=1
  step "decode_$run" 100 env NAKTA_WO_L2_PREFETCH=$v $D --out "$STAGE/$run"
done
step tokens_off 90 env NAKTA_WO_L2_PREFETCH=0 python3 -c "$TOK" "$STAGE/tokens_off.json"
step tokens_on 90 env NAKTA_WO_L2_PREFETCH=1 python3 -c "$TOK" "$STAGE/tokens_on.json"
python3 - "$STAGE" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys, pathlib
s = pathlib.Path(sys.argv[1])
for run in ("off1", "on1", "off2", "on2"):
    try:
        d = json.loads((s / run / "decode_summary.json").read_text())
    except Exception as e:
        print(run, "missing", e); continue
    for r in d["runs"]:
        print(f"{run} {r['engine']} b{r['batch']}: {r['tok_s']:.1f} tok/s, {r['pct_of_floor']:.1f}% of floor")
try:
    a, b = (json.loads((s / f"tokens_{k}.json").read_text()) for k in ("off", "on"))
    print("tokens identical:", a == b)
except Exception as e:
    print("tokens missing", e)
PY
grep -E "^===|rror" "$LOG" | tail -14
echo "wo_prefetch_ab status=$status" | tee -a "$LOG"
tar czf "$OUT/wo_prefetch_ab.tar.gz" -C "$(dirname "$STAGE")" wo_prefetch_ab
exit $status
