#!/usr/bin/env bash
# Run 107 (for the next session, on an H200 if one is lent): the decode record with the fused
# query prologue and the steady timing (as run 106 on the H100), and the GPU reference tests
# of the fused path (the 2-bit and 4-bit dims cases first; the whole class takes > 4 min).
set -u
out=$1; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu.txt" 2>&1
timeout 240 python3 -m eval.bench_decode --repeats 3 \
  --points 1x32768 1x65536 1x131072 8x32768 8x131072 32x32768 \
  --variants int2_mosaic_vdims int4_mosaic_vdims bf16_mosaic cudnn_bf16 torch_sdpa_bf16 \
  --out "$out/bench_decode.json" > "$out/bench.log" 2>&1; echo "bench rc=$?" >> "$out/gpu.txt"
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/pallas_kernels/test_decode_attention.py \
  -k "TestDecodeAttentionMosaic and test_matches_reference and dims" > "$out/tests.log" 2>&1
echo "tests rc=$?" >> "$out/gpu.txt"
cat "$out/gpu.txt"; tail -c 300 "$out/tests.log"; echo
grep -h "^| [0-9]\|ceiling\|quantize" "$out/bench.log" | cut -c1-120
