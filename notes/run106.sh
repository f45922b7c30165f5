#!/usr/bin/env bash
# Run 106: the decode record in one run with today's defaults (the fused query prologue,
# 063f7e5) and the steady timing: the six points, quantize_pack beside them.
set -u
out=$1; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu.txt" 2>&1
timeout 240 python3 -m eval.bench_decode --repeats 3 \
  --points 1x32768 1x65536 1x131072 8x32768 8x131072 32x32768 \
  --variants int2_mosaic_vdims int4_mosaic_vdims bf16_mosaic cudnn_bf16 torch_sdpa_bf16 \
  --out "$out/bench_decode.json" > "$out/bench.log" 2>&1; echo "bench rc=$?" >> "$out/gpu.txt"
cat "$out/gpu.txt"; grep -h "^| [0-9]\|ceiling\|quantize" "$out/bench.log" | cut -c1-120
