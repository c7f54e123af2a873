#!/usr/bin/env bash
# NAKTA_EARLY_WEIGHT candidates (K tiles of the weight loaded before the batch-1 PDL wait),
# each in a fresh process, the order run twice (the second reversed): decode_speed 7B
# ($ENGINES, default nakta_fp8: the queue is FP8's), batch 1, prompt 64, 128 new. Then the
# compiled FP8 wo kernel's registers / spills at each tile count, and the decode GEMVs' GPU
# tests. One GPU, <= 580 s.
# $OUT receives early_weight_ab.tar.gz (log.txt, a decode folder a run, runs.csv).
# Usage: [ENGINES=nakta,nakta_fp8] bash scripts/gpu_early_weight_ab.sh [CANDIDATE ...]
#   (default candidates: 1 1,residual=4 2 4)
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
stage early_weight_ab
CANDS=("$@")
[ ${#CANDS[@]} -eq 0 ] && CANDS=(1 1,residual=4 2 4)
ORDER=()
for c in "${CANDS[@]}"; do ORDER+=("$c"); done
for ((i = ${#CANDS[@]} - 1; i >= 0; i--)); do ORDER+=("${CANDS[$i]}"); done
n=0
for c in "${ORDER[@]}"; do
  n=$((n + 1))
  name="r${n}_$(echo "$c" | tr ',=' '_-')"
  step "$name" 70 env NAKTA_EARLY_WEIGHT="$c" python3 -m speed_bench.decode_speed --preset 7B \
    --engines "${ENGINES:-nakta_fp8}" --batches 1 --lengths 64:128 --no-budget --out "$STAGE/$name"
done
step registers 90 python3 - <<'PY'
import torch
from nakta_model.kernels import _decode_linear_configs as knobs
from nakta_model.kernels import decode_linear as dl
from nakta_model.kernels._decode_linear_kernels import _decode_linear_kernel
from nakta_model.kernels.fp8_quant import quantize_weight

dev = torch.device("cuda")
x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
r = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
w8, s8 = quantize_weight(torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16) / 64)
for tiles in (1, 2, 3, 4):
    knobs.EARLY_WEIGHT = tiles
    cfg = dl._config(x.dtype, 1, 4096, 4096, "residual", dev, w8.dtype)
    print("fp8 wo knob", tiles, "-> EARLY_W", knobs.early_tiles("residual", 4096, cfg, True))
    dl.decode_linear(x, w8, residual=r, weight_scale=s8)
    torch.cuda.synchronize()
for dc in _decode_linear_kernel.device_caches.values():
    for i, k in enumerate(dc[0].values()):
        print("kernel", i, "regs", getattr(k, "n_regs", "?"), "spills", getattr(k, "n_spills", "?"))
PY
step gpu_tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider -x \
  tests/test_decode_linear.py tests/test_decode_linear_fp8.py tests/test_decode_linear_fp8_prefetch.py
python3 - "$STAGE" <<'PY' 2>&1 | tee -a "$LOG"
import json, pathlib, sys
stage = pathlib.Path(sys.argv[1])
lines = ["run,engine,tok_s,pct_of_floor,floor_tok_s"]
for d in sorted((p for p in stage.iterdir() if p.is_dir()), key=lambda p: int(p.name[1:].split("_")[0])):
    try:
        runs = json.loads((d / "decode_summary.json").read_text())["runs"]
    except Exception as e:
        print(d.name, "missing", e)
        continue
    for r in runs:
        lines.append(f"{d.name},{r['engine']},{r['tok_s']:.2f},{r['pct_of_floor']:.2f},{r['floor_tok_s']:.2f}")
        print(f"{d.name} {r['engine']}: {r['tok_s']:.1f} tok/s, {r['pct_of_floor']:.2f}% of floor")
(stage / "runs.csv").write_text("\n".join(lines) + "\n")
PY
grep -E "^===|passed|failed|^kernel" "$LOG" | tail -30
echo "early_weight_ab status=$status" | tee -a "$LOG"
tar czf "$OUT/early_weight_ab.tar.gz" -C "$(dirname "$STAGE")" early_weight_ab
exit $status
