#!/usr/bin/env bash
# Batch-1 decode attention with and without XLA command buffers (CUDA graphs), the way torch
# SDPA is already timed (inside a CUDA graph): timelines of one call and the bench rows.
# Usage on the device: bash notes/cmdbuf_batch1.sh OUT "points" "variants"
set -u
out=$1; points=${2:-"1x32768 1x65536 1x131072"}; variants=${3:-"int2_mosaic_vdims int2_pallas"}
mkdir -p "$out"
CB="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN --xla_gpu_graph_min_graph_size=1"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu.txt" 2>&1
for pt in 1x65536; do
  # shellcheck disable=SC2086
  timeout 150 python3 notes/batch1_timeline.py "$out/tl" $pt $variants > "$out/tl_default_$pt.log" 2>&1
  # shellcheck disable=SC2086
  TIMELINE_TAG=cmdbuf XLA_FLAGS="$CB" timeout 150 python3 notes/batch1_timeline.py "$out/tl" $pt $variants \
    > "$out/tl_cmdbuf_$pt.log" 2>&1
done
# shellcheck disable=SC2086
timeout 200 python3 -m eval.bench_decode --points $points --variants $variants torch_sdpa_bf16 \
  --repeats 3 --no-quantize-pack --out "$out/bench_default.json" > "$out/bench_default.log" 2>&1
# shellcheck disable=SC2086
XLA_FLAGS="$CB" timeout 200 python3 -m eval.bench_decode --points $points --variants $variants \
  torch_sdpa_bf16 --repeats 3 --no-quantize-pack --out "$out/bench_cmdbuf.json" > "$out/bench_cmdbuf.log" 2>&1
tail -n 30 "$out"/tl_*.log; grep -h "ms\b\|GB/s" "$out"/bench_*.log | tail -n 40
