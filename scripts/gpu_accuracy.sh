#!/usr/bin/env bash
# GPU accuracy runs for Nakta (helper H5). Run from the repo root on the GPU machine:
#
#   bash scripts/gpu_accuracy.sh            # everything (parity + lm-eval check)
#   bash scripts/gpu_accuracy.sh parity     # only the parity runs (no lm-eval wheels needed)
#   bash scripts/gpu_accuracy.sh lmeval     # only the lm-eval check
#
# Run from the repo root.
# Needs, git-ignored, carried:
#   .whl/*.whl          fairscale (llama_org), liger (unused here) -- as for every GPU call
#   .whl/lmeval/*.whl   lm-eval 0.4.13 and the deps the machine lacks (24 wheels, 56.8 MiB,
#                       list in readme_accuracy.md; copy from /work/helpers/wheels_lmeval/)
#   .data/stories260K/  .data/llama_tokenizer.model  .data/hellaswag_val_full.txt.bz2
#   .data/hellaswag_val_subset1000.jsonl           (4.4 MB; the full .data is 13 MB)
# Suggested carry (one call, ~62 MiB):
#   [".whl", ".data/stories260K", ".data/llama_tokenizer.model",
#    ".data/hellaswag_val_full.txt.bz2", ".data/hellaswag_val_subset1000.jsonl"]
# If that is over the carry limit, run `parity` without .whl/lmeval, then `lmeval` without the
# llama tokenizer and the .bz2.
#
# Writes at most 8 files to $OUT:
#   stories260K_bf16_cuda.{json,md}     stories260K, all 10,042 tasks, bf16 (target: acc and
#                                       acc_norm within 0.1 pt, flips listed with margins)
#   stories260K_fp32_cuda.json          same in fp32 (target: identical predictions)
#   7B-random_bf16_cuda.{json,md}       7B shape, same random weights in both, LLaMA tokenizer,
#                                       1,000 tasks (flips counted, each with its margin)
#   lm_eval_check_stories260K_bf16_cuda.json   lm-eval through both adapters == parity.py
#   gpu_accuracy.log                    this script's output
# Copy them to accuracy_test/results/<device>/ (and its README index) to keep them.

# Smoke test elsewhere: DEVICE=cpu LIMIT=5 PRESET=stories260K \
#   RAND_TOK=.data/stories260K/tokenizer.model OUT=/tmp/x bash scripts/gpu_accuracy.sh
set -uo pipefail
PHASE="${1:-all}"
DEVICE="${DEVICE:-cuda}"
PRESET="${PRESET:-7B}"
RAND_TOK="${RAND_TOK:-.data/llama_tokenizer.model}"
LIM=()
[ -n "${LIMIT:-}" ] && LIM=(--limit "$LIMIT")
case "$PHASE" in all|parity|lmeval) ;; *) echo "usage: $0 [all|parity|lmeval]"; exit 2 ;; esac
OUT="${OUT:-/tmp/nakta_gpu_accuracy}"
mkdir -p "$OUT"
LOG="$OUT/gpu_accuracy.log"
exec > >(tee -a "$LOG") 2>&1
D=.data
TMP=$(mktemp -d)

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || { echo "cannot install .whl/*.whl"; exit 1; }
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false LLAMA_ORG_QUIET=1

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
git log --oneline -1 2>/dev/null || true

fail=0
step() {  # step NAME CMD...: run, time, keep going on failure
  local name=$1; shift
  echo; echo "=== $name"; local t0=$SECONDS
  "$@"; local rc=$?
  echo "=== $name: exit $rc, $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || fail=1
  return $rc
}

if [ "$PHASE" != lmeval ]; then
  step "stories260K bf16, 10,042 tasks" python3 -m accuracy_test.parity \
    --checkpoint $D/stories260K --tokenizer $D/stories260K/tokenizer.model \
    --data $D/hellaswag_val_full.txt.bz2 --dtype bf16 --device $DEVICE --no-progress ${LIM[@]+"${LIM[@]}"} \
    --out "$OUT/stories260K_bf16_$DEVICE.json"
  step "stories260K fp32, 10,042 tasks" python3 -m accuracy_test.parity \
    --checkpoint $D/stories260K --tokenizer $D/stories260K/tokenizer.model \
    --data $D/hellaswag_val_full.txt.bz2 --dtype fp32 --device $DEVICE --no-progress ${LIM[@]+"${LIM[@]}"} \
    --out "$TMP/stories260K_fp32_$DEVICE.json" \
    && cp "$TMP/stories260K_fp32_$DEVICE.json" "$OUT/"
  step "7B-shape random bf16, 1,000 tasks" python3 -m accuracy_test.parity \
    --preset $PRESET --random --seed 0 --tokenizer $RAND_TOK \
    --data $D/hellaswag_val_subset1000.jsonl --dtype bf16 --device $DEVICE --no-progress ${LIM[@]+"${LIM[@]}"} \
    --out "$OUT/$PRESET-random_bf16_$DEVICE.json"
fi

if [ "$PHASE" != parity ]; then
  if ! python3 -c "import lm_eval" 2>/dev/null && ls .whl/lmeval/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/lmeval_site .whl/lmeval/*.whl \
      && export PYTHONPATH="/tmp/lmeval_site:$PYTHONPATH"
  fi
  if python3 -c "import lm_eval, datasets; print('lm_eval', lm_eval.__version__, 'datasets', datasets.__version__)"; then
    step "lm-eval through the adapters vs parity.py (stories260K bf16, 1,000 tasks)" \
      python3 -m accuracy_test.lm_eval_check \
      --checkpoint $D/stories260K --tokenizer $D/stories260K/tokenizer.model \
      --data $D/hellaswag_val_subset1000.jsonl --dtype bf16 --device $DEVICE --no-progress ${LIM[@]+"${LIM[@]}"} \
      --out "$TMP/lm_eval_check_stories260K_bf16_$DEVICE.json" \
      && cp "$TMP/lm_eval_check_stories260K_bf16_$DEVICE.json" "$OUT/"
  else
    echo; echo "=== SKIP lm-eval check: lm_eval not importable (carry .whl/lmeval/*.whl)"
  fi
fi

echo; echo "=== summary"
python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
for p in sorted(Path(sys.argv[1]).glob("*.json")):
    r = json.loads(p.read_text())
    if "models" in r:
        for m in r["models"]:
            print(f"{p.name}: {m['model']} lm-eval {m['lm_eval']} parity {m['parity']} match={m['match']}")
        continue
    n, o = r["nakta"], r["llama_org"]
    print(f"{p.name}: nakta acc {n['acc']:.4f} acc_norm {n['acc_norm']:.4f} ({n['seconds']:.1f} s) | "
          f"llama_org acc {o['acc']:.4f} acc_norm {o['acc_norm']:.4f} ({o['seconds']:.1f} s) | "
          f"diff {r['acc_diff_pt']:+.3f}/{r['acc_norm_diff_pt']:+.3f} pt | flips {r['n_flips']} | "
          f"max|dll| {r['ll_abs_diff']['max']:.3g} | median ref margin {r['reference_acc_margin_median']}")
    if r["flips"]:
        m = sorted(f["margin"] for f in r["flips"])
        print(f"   flip margins: min {m[0]:.3g} median {m[len(m)//2]:.3g} max {m[-1]:.3g}")
EOF
rm -rf "$TMP"
ls -la "$OUT"
exit $fail
