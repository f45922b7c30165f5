#!/usr/bin/env bash
# Session 33, serving (#13): where does the 2-bit engine step's time beyond its bytes go?
# 8 layers of Qwen3-8B, 64 x 1k, synthetic prefill (run 79's shape), int2_mosaic and bf16_paged:
#  1. default flags, flushing rows staggered (--stagger 128) and not (--stagger 0);
#  2. the same under XLA command buffers that also capture while loops and conditionals
#     (no predicate read back to the host per layer and per step, no launch gaps);
# Prediction: if the per-layer flush conds' host round trips cost what BENCHMARKS.md guesses
# (~20 us each), the staggered int2 step drops ~0.15 ms with command buffers at 8 layers.
set -u
out=$1; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu.txt" 2>&1; cat "$out/gpu.txt"
q8="--hidden-size 4096 --intermediate-size 12288 --num-heads 32 --num-kv-heads 8 --head-dim 128 --vocab-size 151936"
common="--layers 8 $q8 --batch 64 --prompt-len 1024 --new-tokens 49 --synthetic-prefill --ceiling-gib 2"
CB="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"
run() {  # tag, timeout, flags, args...
  local tag=$1 lim=$2 flags=$3; shift 3
  # shellcheck disable=SC2086
  XLA_FLAGS="$flags" timeout "$lim" python3 -m eval.bench_engine $common "$@" --out "$out/$tag" \
    > "$out/$tag.log" 2>&1
  echo "$tag rc=$?"; grep -h "^| [a-z]" "$out/$tag.log" | grep -v "^| mode" | cut -c1-120
}
run s128 130 "" --stagger 128 --modes int2_mosaic bf16_paged
run s128_cmdbuf 130 "$CB" --stagger 128 --modes int2_mosaic bf16_paged
run s0 80 "" --stagger 0 --modes int2_mosaic
run s0_cmdbuf 80 "$CB" --stagger 0 --modes int2_mosaic
