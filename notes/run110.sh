#!/usr/bin/env bash
# For the next session (H200 if one is lent, else H100; ~540 s in one call): the GPU tests of
# the split-grid sink/recent pages (prologue "fused_grid", built in session 32, lowered on
# the CPU only) and the Mosaic reference tests; then one bench that is both the record of
# every variant with today's defaults (the transposed accumulator store is not yet in a
# one-run record) and the A/B of "fused_grid" against the default; then the split kernel's
# stages at 8 x 128k with the `loads_codes` row (do the four metadata copies per step bound
# the ring?).
set -u
out=$1; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu.txt" 2>&1; cat "$out/gpu.txt"
t=tests/pallas_kernels/test_decode_attention.py
timeout 70 python3 -m pytest -q -x -p no:cacheprovider $t -k split_grid > "$out/tests_grid.log" 2>&1
echo "grid tests rc=$?"; tail -c 400 "$out/tests_grid.log"; echo
timeout 90 python3 -m pytest -q -x -p no:cacheprovider $t \
  -k "TestDecodeAttentionMosaic and test_matches_reference and dims and not exponent and not bulk" \
  > "$out/tests.log" 2>&1; echo "tests rc=$?"; tail -c 300 "$out/tests.log"; echo
timeout 300 python3 -m eval.bench_decode --repeats 3 \
  --points 1x32768 1x65536 1x131072 8x32768 8x131072 32x32768 \
  --variants int2_mosaic_vdims int2_mosaic_vdims_grid int4_mosaic_vdims int4_mosaic_vdims_grid \
  bf16_mosaic cudnn_bf16 torch_sdpa_bf16 --out "$out/bench_decode.json" > "$out/bench.log" 2>&1
echo "bench rc=$?"; grep -h "^| [0-9]\|ceiling\|quantize" "$out/bench.log" | cut -c1-120
timeout 110 python3 -m eval.bench_decode --repeats 3 --points 8x131072 --variants mosaic_stages \
  --no-quantize-pack --out "$out/bench_stages.json" > "$out/bench_stages.log" 2>&1
echo "stages rc=$?"; grep -h "^| [0-9]" "$out/bench_stages.log" | cut -c1-120
