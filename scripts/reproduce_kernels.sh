#!/usr/bin/env bash
# Reproduces the kernel catalogue (kernel_benchmark/results/<device>/) on one GPU: each kernel
# against PyTorch eager, torch.compile and the peer libraries (Liger-Kernel, TE when
# importable), in bytes against the copy bandwidth measured in the same run; and the GPU tests.
# < 10 min a job.
#   OUT=/tmp/out bash scripts/reproduce_kernels.sh [tests] [rope] [norm] [attention]
#       [attention_tune] [gemm] [decode_attention] [decode_gemm] [fp8] [tune]
# Settings (environment): QUANT (bf16 | fp8: decode_gemm at FP8 weights; tune runs the FP8
# decode tuners, which rewrite nakta_model/kernels/_*_tuned.json for this GPU family);
# TUNE_MODELS (the bf16 batch-1 tuner's shapes, default 7B; e.g. llama3-8B,llama3.2-1B);
# decode_attention's ATTN_BATCHES, ATTN_CONTEXTS and KV_CACHE (fp8: the e4m3 cache beside). Carry
# `.whl/` (fairscale, liger-kernel: scripts/fetch_device_wheels.sh). Writes into the catalogue
# folder of this GPU (and the tuned tables), then $OUT/kernels.tar.gz and $OUT/kernels_log.txt.
set -uo pipefail
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
use_wheels
begin kernels
QUANT=${QUANT:-bf16}
K=kernel_benchmark/results/$SLUG
NJOBS=$(($(nproc) - 2))  # the tuners' compile processes: the cores but two, 1 to 12
[ "$NJOBS" -gt 12 ] && NJOBS=12
[ "$NJOBS" -lt 1 ] && NJOBS=1
jobs=("$@")
[ ${#jobs[@]} -eq 0 ] && jobs=(rope norm attention)
for job in "${jobs[@]}"; do
  case $job in
    tests) step gpu_tests 580 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests ;;
    rope) step bench_rope 540 python3 -m kernel_benchmark.bench_rope ;;
    norm)
      step bench_rmsnorm 240 python3 -m kernel_benchmark.bench_rmsnorm
      step bench_swiglu 300 python3 -m kernel_benchmark.bench_swiglu
      ;;
    attention) step bench_attention 300 python3 -m kernel_benchmark.bench_attention ;;
    attention_tune)  # the packed kernel's launch values on the scorer's own 0-/10-shot batches
      step attention_tune 400 python3 -m kernel_benchmark.bench_attention --tune-scoring ;;
    gemm)  # the 7B block GEMMs against the 8192^3 rate, in bursts and sustained
      step bench_gemm 300 python3 -m kernel_benchmark.bench_gemm --tokens 1024,4096,16384 \
        --seconds 3 ;;
    decode_attention)
      step decode_attention 300 python3 -m kernel_benchmark.bench_decode --attention-only \
        --attn-batches "${ATTN_BATCHES:-1,32,64}" --contexts "${ATTN_CONTEXTS:-128,1024,2048}" \
        --kv-cache "${KV_CACHE:-bf16}" --out "$K/decode_attention" ;;
    decode_gemm)  # where the decode step switches from the GEMVs to GEMMs (step_gemm.CROSSOVER)
      dir=$K/decode_gemm
      [ "$QUANT" = fp8 ] && dir=$K/decode_gemm_fp8
      step decode_gemm 400 python3 -m kernel_benchmark.bench_decode_gemm --models 7B \
        --quants "$QUANT" --rows 1,8,16,32,64,128,256 --sections blocks --out "$dir" ;;
    fp8) step bench_fp8 300 python3 -m kernel_benchmark.bench_fp8 ;;
    tune)
      if [ "$QUANT" = fp8 ]; then
        step tune_fp8_decode 280 python3 -m kernel_benchmark.tune_fp8_decode --budget 240 \
          --jobs "$NJOBS"
        step tune_fp8_decode_gemm 200 python3 -m kernel_benchmark.tune_fp8_decode \
          --kernel gemm --budget 160 --jobs "$NJOBS"
      else
        step tune_decode_linear 300 python3 -m kernel_benchmark.bench_decode --tune \
          --models "${TUNE_MODELS:-7B}" --batches 1 --tune-budget 240
      fi
      ;;
    *) echo "unknown job $job" | tee -a "$LOG"; status=2 ;;
  esac
done
finish
