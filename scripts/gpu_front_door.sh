#!/usr/bin/env bash
# GPU job for issue 29's front door: the text-generation CLI (python -m nakta_model.generate)
# on a random LLaMA-7B Nakta checkpoint in bf16, made here from seeded random weights with the
# LLaMA tokenizer inside it (so the CLI finds its own tokenizer), then two timed generations:
# one prompt (batch 1, 256 new tokens, greedy) and 8 prompts batched from a file (128 new
# tokens each, sampled at temperature 0.8, top-k 200, seed 0). Each run warms up once first
# (Triton compilation, CUDA-graph capture; not timed) and prints its tokens/s and time to
# first token on stderr.
#
#   OUT=/some/dir bash scripts/gpu_front_door.sh      # from the repo root, .data/ carried
#
# Writes to $OUT: log.txt, front_door/generate_7B_bs1.txt and generate_7B_bs8.txt (each run's
# stdout + stderr: the text, the timing line), front_door/summary.md (the timing lines).
# About 2-3 minutes on a fresh H100 (13.5 GB written and read back, Triton's cache cold).
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
export PYTHONUNBUFFERED=1
LOG=$OUT/log.txt
: >"$LOG"
status=0
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv 2>&1 | tee -a "$LOG"
R=$OUT/front_door
mkdir -p "$R"
CKPT=/tmp/nakta_front_door/random-7B
TOK=.data/llama_tokenizer.model

step make_random_7B 150 python3 - "$CKPT" "$TOK" <<'EOF'
import sys, time
import torch
from nakta_model.checkpoint import write_checkpoint
from nakta_model.config import preset
from speed_bench.weights import RandomWeights

out, tok = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
weights = RandomWeights(preset("7B"), "random-7B", seed=0)
cuda = torch.device("cuda")
write_checkpoint(
    out, weights.args, lambda name: weights.tensor(name, cuda, torch.bfloat16).cpu(), 1,
    torch.bfloat16, force=True, tokenizer=tok,
)
print(f"random 7B Nakta checkpoint (bf16) in {out}: {time.perf_counter() - t0:.1f} s")
EOF

step generate_bs1 120 bash -c "python3 -m nakta_model.generate --checkpoint $CKPT \
  --prompt 'The capital of France is' --max-new-tokens 256 --temperature 0 \
  >$R/generate_7B_bs1.txt 2>&1"

printf '%s\n' 'Once upon a time' 'The meaning of life is' 'In a distant galaxy' \
  'def fibonacci(n):' 'The best way to learn a language' 'Breaking news:' \
  'Dear diary, today' 'The recipe calls for' >"$R/prompts.txt"
step generate_bs8 120 bash -c "python3 -m nakta_model.generate --checkpoint $CKPT \
  --prompts-file $R/prompts.txt --max-new-tokens 128 --temperature 0.8 --top-k 200 --seed 0 \
  >$R/generate_7B_bs8.txt 2>&1"

{
  echo "# generate CLI, random LLaMA-7B (bf16), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
  echo
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo
  for f in "$R"/generate_7B_bs*.txt; do
    echo "- $(basename "$f" .txt): $(grep 'tokens/s' "$f" | tail -1)"
  done
} >"$R/summary.md"
cat "$R/summary.md" | tee -a "$LOG"
rm -rf /tmp/nakta_front_door
exit $status
