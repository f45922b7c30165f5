#!/usr/bin/env bash
# Run 105: the fused query prologue as float32 dots (5c463e5): GPU tests against the reference
# (as many as 70 s allow), the record at the points with the old prologue beside it,
# and the 8 x 32k / 1 x 32k timelines.
set -u
out=$1; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu.txt" 2>&1
timeout 70 python3 -m pytest -q -x -p no:cacheprovider tests/pallas_kernels/test_decode_attention.py \
  -k "TestDecodeAttentionMosaic and test_matches_reference" > "$out/tests.log" 2>&1; echo "tests rc=$?" >> "$out/gpu.txt"
timeout 290 python3 -m eval.bench_decode --repeats 3 --no-quantize-pack \
  --points 1x32768 1x65536 1x131072 8x32768 8x131072 32x32768 \
  --variants int2_mosaic_vdims int2_mosaic_vdims_qtriton int4_mosaic_vdims bf16_mosaic \
    cudnn_bf16 torch_sdpa_bf16 \
  --out "$out/bench_decode.json" > "$out/bench.log" 2>&1; echo "bench rc=$?" >> "$out/gpu.txt"
for p in 8x32768 1x32768; do
  timeout 40 python3 notes/batch1_timeline.py "$out" $p int2_mosaic_vdims >> "$out/timeline.log" 2>&1
done
cat "$out/gpu.txt"; tail -c 300 "$out/tests.log"; echo; grep -h "^| [0-9]\|ceiling" "$out/bench.log" | cut -c1-120
grep -h "us/call\|  gap" "$out/timeline.log"
