#!/usr/bin/env bash
# Run 98: where 8 x 32k loses to 8 x 128k (28% vs 40% of the ceiling on the H200, run 65): the
# split count of the Mosaic body (x0.25 / x0.5 / x2 the automatic 1024-program choice: waves
# and per-CTA ramp) and the fixed cost of the call without low-bit tokens.
set -u
out=$1; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu.txt" 2>&1
timeout 280 python3 -m eval.bench_decode --repeats 3 --no-quantize-pack \
  --points 8x32768 8x131072 32x32768 --variants int2_mosaic_vdims \
  int2_mosaic_vdims_splits_quarter int2_mosaic_vdims_splits_half int2_mosaic_vdims_splits_x2 \
  int2_mosaic_vdims_fp_segment_only torch_sdpa_bf16 \
  --out "$out/splits.json" > "$out/splits.log" 2>&1; echo "splits rc=$?" >> "$out/gpu.txt"
cat "$out/gpu.txt"; grep -h "^| [0-9]" "$out/splits.log" | cut -c1-100
