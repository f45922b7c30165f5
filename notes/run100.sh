#!/usr/bin/env bash
# Run 100: the Mosaic body's split target at 256 programs (was 1024): the decode record with the
# new default, then the old split count (x4) against it in one run at the points it changes.
set -u
out=$1; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu.txt" 2>&1
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/pallas_kernels/test_decode_attention.py \
  -k "split" > "$out/tests.log" 2>&1; echo "tests rc=$?" >> "$out/gpu.txt"
timeout 300 python3 -m eval.bench_decode --repeats 3 \
  --points 1x32768 1x65536 1x131072 8x32768 8x131072 32x32768 \
  --variants int2_pallas int4_pallas int2_mosaic_vdims int4_mosaic_vdims bf16_pallas \
  bf16_mosaic cudnn_bf16 torch_sdpa_bf16 \
  --out "$out/bench_decode.json" > "$out/bench.log" 2>&1; echo "bench rc=$?" >> "$out/gpu.txt"
timeout 150 python3 -m eval.bench_decode --repeats 3 --no-quantize-pack \
  --points 2x65536 8x32768 8x131072 32x32768 --variants int2_mosaic_vdims \
  int2_mosaic_vdims_splits_x4 int4_mosaic_vdims int4_mosaic_vdims_splits_x4 torch_sdpa_bf16 \
  --out "$out/splits_ab.json" > "$out/splits_ab.log" 2>&1; echo "ab rc=$?" >> "$out/gpu.txt"
cat "$out/gpu.txt"; tail -n 2 "$out/tests.log"; grep -h "^| [0-9]" "$out/bench.log" "$out/splits_ab.log" | cut -c1-110
