#!/usr/bin/env bash
# Run 96, minimal: the batch-1 targets and 8 x 128k on the H200 with the session-28 defaults.
set -u
out=$1; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu.txt" 2>&1
timeout 300 python3 -m eval.bench_decode --repeats 3 --no-quantize-pack \
  --points 1x32768 1x65536 1x131072 8x131072 \
  --variants int2_mosaic_vdims cudnn_bf16 torch_sdpa_bf16 \
  --out "$out/bench_decode.json" > "$out/bench.log" 2>&1; echo "bench rc=$?" >> "$out/gpu.txt"
cat "$out/gpu.txt"; grep -h "^| [0-9]" "$out/bench.log" | cut -c1-110
