#!/usr/bin/env bash
# Run 96: the decode record (issue #12's "one run") with the session-28 defaults: every point,
# every primary variant, quantize_pack per step; the GPU tests of the batch-1 cuts first.
set -u
out=$1; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu.txt" 2>&1
timeout 70 python3 -m pytest -q -p no:cacheprovider tests/pallas_kernels/test_decode_attention.py \
  -k "split_sizes or query_prologue" > "$out/tests.log" 2>&1; echo "tests rc=$?" >> "$out/gpu.txt"
timeout 470 python3 -m eval.bench_decode --repeats 3 \
  --points 1x32768 1x65536 1x131072 8x32768 8x131072 32x32768 \
  --variants int2_pallas int4_pallas int2_mosaic_vdims int4_mosaic_vdims bf16_pallas \
  bf16_mosaic cudnn_bf16 torch_sdpa_bf16 \
  --out "$out/bench_decode.json" > "$out/bench.log" 2>&1; echo "bench rc=$?" >> "$out/gpu.txt"
cat "$out/gpu.txt"; tail -n 2 "$out/tests.log"; grep -h "^| [0-9]" "$out/bench.log" | cut -c1-110
