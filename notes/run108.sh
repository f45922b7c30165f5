#!/usr/bin/env bash
# (The change it tested was reverted in 70b8f72: the kernel stopped with an illegal instruction at
# 32 x 32k and in the GPU tests, and measured no faster before that; notes/device_runs.md 108.)
# Run 108: split kernels reading their page-table entries straight from the flat split table
# and their token counts from the query metadata (no per-call table concatenate in XLA). GPU
# tests, then the record with today's defaults (run 106's command), then the tree before the
# change (runs/ab_base = 075cf1e, carried) in the same call.
set -u
out=$1; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu.txt" 2>&1; cat "$out/gpu.txt"
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/pallas_kernels/test_decode_attention.py \
  -k "TestDecodeAttentionMosaic and (test_matches_reference and dims and not exponent and not bulk and not uint8 or full_precision_split_sizes) or two_token_streams or overlapped_mmas" \
  > "$out/tests.log" 2>&1; echo "tests rc=$?"; tail -c 600 "$out/tests.log"; echo
pts="1x32768 1x65536 1x131072 8x32768 8x131072 32x32768"
timeout 230 python3 -m eval.bench_decode --repeats 3 --points $pts \
  --variants int2_mosaic_vdims int4_mosaic_vdims bf16_mosaic cudnn_bf16 torch_sdpa_bf16 \
  --out "$out/bench_decode.json" > "$out/bench.log" 2>&1; echo "record rc=$?"
(cd runs/ab_base && timeout 110 python3 -m eval.bench_decode --repeats 3 --points $pts \
  --variants int2_mosaic_vdims torch_sdpa_bf16 --no-quantize-pack --out "$out/bench_base.json") \
  > "$out/bench_base.log" 2>&1; echo "base rc=$?"
grep -h "^| [0-9]\|ceiling" "$out/bench.log" "$out/bench_base.log" | cut -c1-110
