#!/usr/bin/env bash
# The decode record (BENCHMARKS.md "Decode attention") plus a batch-1 timeline, one device call.
# Usage on the device: KVJAX_COMMIT=<hash> bash notes/record_run.sh OUT [points] [variants]
set -u
out=$1
points=${2:-"1x32768 1x65536 1x131072 8x32768 8x131072 32x32768"}
variants=${3:-"int2_pallas int2_mosaic_vdims int4_mosaic_vdims bf16_mosaic cudnn_bf16 torch_sdpa_bf16"}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu.txt" 2>&1
timeout ${TL_TIMEOUT:-120} python3 notes/batch1_timeline.py "$out/tl" 1x65536 int2_mosaic_vdims > "$out/tl.log" 2>&1
echo "timeline rc=$?" >> "$out/gpu.txt"
# shellcheck disable=SC2086
timeout ${BENCH_TIMEOUT:-420} python3 -m eval.bench_decode --points $points --variants $variants \
  --repeats 3 ${BENCH_EXTRA:-} --out "$out/bench_decode.json" > "$out/bench.log" 2>&1
echo "bench rc=$?" >> "$out/gpu.txt"
rm -rf "$out/tl"
cat "$out/gpu.txt" "$out/tl.log"; grep "^|" "$out/bench.log" | tail -n 60
