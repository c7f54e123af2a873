#!/usr/bin/env bash
# One device call: GPU tests of the new paths (prefix cache, generation engine, tuned decode
# configs, fast loader), the house redesign's before/after (kernels and speed_bench; the "before"
# tree is a `git archive` of dc16e0d in .scratch/before), and MMLU-shaped scoring with and
# without the prefix cache against HF transformers. Each step has its own time limit and writes
# under $OUT as it goes.
#   git archive dc16e0d nakta_model llama_org speed_bench pyproject.toml | tar -x -C .scratch/before
#   OUT=/tmp/out bash scripts/gpu_final.sh      # from the repo root, data in .data/
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
ROOT=$PWD
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    .whl/fairscale-*.whl .whl/liger_kernel-*.whl && export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt"
step() { echo "== $(date +%T) $1"; }
pack() { tar -C "$OUT" -cf "$OUT/$1.tar" "$1" "$1.log" 2>/dev/null && rm -rf "${OUT:?}/$1"; }  # few files back

step "GPU tests"
timeout "${TEST_S:-110}" python3 -m pytest -v -m gpu -p no:cacheprovider \
    tests/test_prefix_cache.py tests/test_generation_engine.py tests/test_decode_linear.py \
    tests/test_safetensors_read.py tests/test_logprobs.py tests/test_model.py \
    tests/test_packed_attention.py > "$OUT/gpu_tests.txt" 2>&1
grep -c PASSED "$OUT/gpu_tests.txt"; grep -E "FAILED|ERROR" "$OUT/gpu_tests.txt" | head; tail -1 "$OUT/gpu_tests.txt"

step "kernels before/after"
timeout 70 python3 -m kernel_benchmark.before_after --before .scratch/before \
    --out "$OUT/kernels" > "$OUT/kernels.log" 2>&1
tail -3 "$OUT/kernels.log"; pack kernels

step "MMLU-shaped: prefix cache vs per-task cache vs HF"
timeout 65 python3 -m speed_bench.run_all --preset 7B --workload mmlu --limit 230 --warmup 24 \
    --engines nakta_cache,nakta_ctx,hf --no-progress --out "$OUT/mmlu" > "$OUT/mmlu.log" 2>&1
tail -6 "$OUT/mmlu.log"; pack mmlu

SPEED=(--preset 7B --data "$ROOT/.data/hellaswag_val_full.jsonl"
       --tokenizer "$ROOT/.data/llama_tokenizer.model" --limit 1000 --select spread
       --engines nakta_cache,nakta --no-progress)
step "speed_bench after"
timeout 40 python3 -m speed_bench.run_all "${SPEED[@]}" --out "$OUT/speed_after" \
    > "$OUT/speed_after.log" 2>&1
tail -4 "$OUT/speed_after.log"; pack speed_after
step "speed_bench before (dc16e0d)"
(cd .scratch/before && timeout 40 python3 -m speed_bench.run_all "${SPEED[@]}" \
    --out "$OUT/speed_before" > "$OUT/speed_before.log" 2>&1)
tail -4 "$OUT/speed_before.log"; pack speed_before

step "done"
