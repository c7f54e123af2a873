#!/usr/bin/env bash
# Issue 27's measurements in ONE call of a 2-GPU machine (nvidia-h100-x2), two lanes at once,
# one per GPU (each lane's figures come from its own GPU; bf16 and FP8 of a figure always share
# a process or a lane):
#   lane 0 (GPU 0): FP8 GPU tests; the FP8 decode tuner (rows into
#       nakta_model/kernels/_decode_linear_fp8_tuned.json); decode_speed 7B nakta vs nakta_fp8
#       at batch 1 and 32 (fresh process: tuned rows); the 30B preset in FP8 on this one GPU
#       (decode batch 1, scoring 300 real tasks); parity --quant fp8 on stories260K (10,042 tasks)
#   lane 1 (GPU 1): run_all 7B nakta_cache vs nakta_cache_fp8 on 1,000 real tasks; parity
#       --quant fp8 on the 7B shape (seeded random, 1,000 tasks) and aidreams260K (10,042); a
#       random 7B Nakta checkpoint -> the generate CLI (tokens/s) -> lm-eval hellaswag 0-shot, all
#       10,042 tasks, bf16 vs quant=fp8 through the CLI in fresh processes
# then fp8_report assembles speed_bench/results/<device>/fp8/.
# Run from the repo root with .data/ (llama_tokenizer.model, hellaswag_val_full.jsonl,
# hellaswag_val_subset1000.jsonl, stories260K/, aidreams260K/ made by `python -m
# nakta_model.llama2c ... --max-seq-len 512`) and .whl/ carried:  bash scripts/gpu_fp8_session.sh
# $OUT receives fp8_session.tar.gz (every result folder) and the lanes' logs.
set -uo pipefail
: "${OUT:?OUT must be set (the device tool sets it)}"
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
D=.data
R=$OUT/fp8_session
mkdir -p "$R/parity"
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv | tee "$OUT/gpus.txt"
TOK=$D/llama_tokenizer.model
SUB=$D/hellaswag_val_subset1000.jsonl
FULL=$D/hellaswag_val_full.jsonl
CKPT=/tmp/fp8_session/random-7B

lane0() {
  export CUDA_VISIBLE_DEVICES=0 LOG=$OUT/lane0.txt
  : >"$LOG"
  step fp8_gpu_tests 90 python3 -m pytest -q -m gpu -p no:cacheprovider -x \
    tests/test_fp8_gpu.py tests/test_fp8_kernels.py tests/test_decode_linear_fp8.py
  step tune_fp8_decode 170 python3 -m kernel_benchmark.tune_fp8_decode --budget 120 \
    --batches 1,32,8,64,16,4,2
  step decode_7B 120 python3 -m speed_bench.decode_speed --preset 7B --engines nakta,nakta_fp8 \
    --batches 1,32 --lengths 64:128 --no-budget --out "$R/decode_7B"
  step decode_30B_fp8 80 python3 -m speed_bench.decode_speed --preset 30B \
    --engines nakta_fp8 --batches 1 --lengths 64:64 --no-budget --out "$R/decode_30B_fp8"
  step score_30B_fp8 100 python3 -m speed_bench.run_all --preset 30B --engines nakta_cache_fp8 \
    --data "$SUB" --tokenizer "$TOK" --limit 300 --no-progress --out "$R/scoring_30B_fp8"
  step parity_stories 90 python3 -m accuracy_test.parity --checkpoint $D/stories260K \
    --data "$FULL" --dtype bf16 --quant fp8 --device cuda --no-progress \
    --out "$R/parity/stories260K_bf16_fp8_cuda.json"
  echo "lane0 status=$status" >>"$LOG"
}

lane1() {
  export CUDA_VISIBLE_DEVICES=1 LOG=$OUT/lane1.txt
  : >"$LOG"
  step scoring_7B 130 python3 -m speed_bench.run_all --preset 7B \
    --engines nakta_cache,nakta_cache_fp8 --data "$SUB" --tokenizer "$TOK" --limit 1000 \
    --no-progress --out "$R/scoring_7B"
  step parity_7B 200 python3 -m accuracy_test.parity --preset 7B --random --tokenizer "$TOK" \
    --data "$SUB" --dtype bf16 --quant fp8 --device cuda --no-progress \
    --out "$R/parity/7B-random_bf16_fp8_cuda.json"
  step parity_aidreams 80 python3 -m accuracy_test.parity --checkpoint $D/aidreams260K \
    --data "$FULL" --dtype bf16 --quant fp8 --device cuda --no-progress \
    --out "$R/parity/aidreams260K_bf16_fp8_cuda.json"
  step make_7B_ckpt 100 python3 - "$CKPT" "$TOK" <<'EOF'
import sys, time
import torch
from nakta_model.checkpoint import write_checkpoint
from nakta_model.config import preset
from speed_bench.weights import RandomWeights

out, tok = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
w = RandomWeights(preset("7B"), "random-7B", seed=0)
cuda = torch.device("cuda")
write_checkpoint(out, w.args, lambda n: w.tensor(n, cuda, torch.bfloat16).cpu(), 1,
                 torch.bfloat16, force=True, tokenizer=tok)
print(f"random 7B Nakta checkpoint in {out}: {time.perf_counter() - t0:.1f} s")
EOF
  step generate_cli 60 bash -c "python3 -m nakta_model.generate --checkpoint $CKPT \
    --prompt 'The capital of France is' --max-new-tokens 128 --temperature 0 \
    >$R/generate_7B_bs1.txt 2>&1"
  step lm_eval_fp8 235 python3 speed_bench/lm_eval_quant.py --checkpoint "$CKPT" --data "$FULL" \
    --shots 0 --warmup-limit 0 --run-timeout-s 100 --deadline-s 230 --out "$R/lm_eval"
  echo "lane1 status=$status" >>"$LOG"
}

status=0
lane0 &
lane1 &
wait
export LOG=$OUT/report.txt
: >"$LOG"
step fp8_report 30 python3 -m speed_bench.fp8_report --scoring "$R/scoring_7B/summary.json" \
  --decode "$R/decode_7B/decode_summary.json" --parity "$R"/parity/*.json --out "$R/fp8"
cp nakta_model/kernels/_decode_linear_fp8_tuned.json "$R/" 2>/dev/null
cp -r kernel_benchmark/results/*/fp8_decode_tune* "$R/" 2>/dev/null
rm -rf "$R/lm_eval/work"
for f in lane0 lane1 report; do
  grep -v -E "it/s\]|s/it\]|%\|" "$OUT/$f.txt" | cut -c1-220 | tail -25
done
tar czf "$OUT/fp8_session.tar.gz" -C "$OUT" fp8_session && rm -rf "$R"
grep -h "status=" "$OUT"/lane*.txt
