#!/usr/bin/env bash
# Run 104: GPU tests of the fused query prologue (session 31), the steady-state timing (3x
# minus 1x batches, 05496a8) at the points with the old prologue beside the new, then
# the sink/recent split size at batch 8-32 (1 page by default there, 2 and 4 beside it).
set -u
out=$1; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu.txt" 2>&1
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/pallas_kernels/test_decode_attention.py \
  -k "TestDecodeAttentionMosaic or prologue" > "$out/tests.log" 2>&1; echo "tests rc=$?" >> "$out/gpu.txt"
timeout 290 python3 -m eval.bench_decode --repeats 3 --no-quantize-pack \
  --points 1x32768 1x131072 8x32768 8x131072 32x32768 \
  --variants int2_mosaic_vdims int2_mosaic_vdims_qtriton int4_mosaic_vdims bf16_mosaic \
    cudnn_bf16 torch_sdpa_bf16 \
  --out "$out/bench_decode.json" > "$out/bench.log" 2>&1; echo "bench rc=$?" >> "$out/gpu.txt"
timeout 140 python3 -m eval.bench_decode --repeats 3 --no-quantize-pack \
  --points 8x32768 8x131072 32x32768 \
  --variants int2_mosaic_vdims int2_mosaic_vdims_fp2 int2_mosaic_vdims_fp4 torch_sdpa_bf16 \
  --out "$out/bench_decode_fp_splits.json" > "$out/fp.log" 2>&1; echo "fp rc=$?" >> "$out/gpu.txt"
cat "$out/gpu.txt"; tail -3 "$out/tests.log"; grep -h "^| [0-9]\|ceiling" "$out/bench.log" "$out/fp.log" | cut -c1-120
