#!/usr/bin/env bash
# Session 36. The decode record of every default variant (H200 if lent: none since run 65),
# then the ring-only / keys-only stage rows at 8 x 128k with s8 key operands (3c67cc9; they
# failed layout inference on jax 0.11.2 with float16 ones), then the Mosaic GPU tests.
set -u
out=$1; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu.txt" 2>&1; cat "$out/gpu.txt"
timeout 290 python3 -m eval.bench_decode --repeats 3 \
  --points 1x32768 1x65536 1x131072 8x32768 8x131072 32x32768 \
  --variants int2_mosaic_vdims int4_mosaic_vdims bf16_mosaic cudnn_bf16 torch_sdpa_bf16 \
  --out "$out/record/bench_decode.json" > "$out/bench.log" 2>&1
echo "record rc=$?"; grep -h "^| [0-9]\|ceiling" "$out/bench.log" | cut -c1-150
timeout 120 python3 -m eval.bench_decode --repeats 3 --points 8x131072 \
  --variants mosaic_stages --stages loads loads_codes keys --no-quantize-pack \
  --out "$out/stages/bench_decode.json" > "$out/stages.log" 2>&1
echo "stages rc=$?"; grep -h "^| [0-9]\|rror" "$out/stages.log" | cut -c1-150 | head -20
timeout 90 python3 -m pytest -q -x -p no:cacheprovider tests/pallas_kernels/test_decode_attention.py \
  -k "TestDecodeAttentionMosaic and test_matches_reference and dims and not exponent and not bulk" \
  > "$out/tests.log" 2>&1; echo "tests rc=$?"; tail -c 300 "$out/tests.log"
