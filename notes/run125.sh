#!/usr/bin/env bash
# For the next session. On an H200 first the decode record of every default variant (none
# since run 65; today's defaults: "auto" schedule, 384 programs at most). Then, either GPU:
# the engine shapes (64 x 1k / 4k: 512 programs, "copies" by the rule, predicted faster than
# "values") against "values" forced by sed in this copy of the tree, one bench process each.
set -u
out=$1; mkdir -p "$out"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
if [[ $gpu == *H200* ]]; then
  timeout 300 python3 -m eval.bench_decode --repeats 3 \
    --points 1x32768 1x65536 1x131072 8x32768 8x131072 32x32768 \
    --variants int2_mosaic_vdims int4_mosaic_vdims bf16_mosaic cudnn_bf16 torch_sdpa_bf16 \
    --out "$out/record/bench_decode.json" > "$out/bench.log" 2>&1
  echo "record rc=$?"; grep -h "^| [0-9]\|ceiling" "$out/bench.log" | cut -c1-150
fi
f=pallas_kernels/decode_attention/gpu_mosaic.py
b() {
  timeout 100 python3 -m eval.bench_decode --repeats 3 --points 64x1024 64x4096 8x131072 \
    --variants int2_mosaic_vdims --no-quantize-pack --out "$out/$1/bench_decode.json" > "$out/$1.log" 2>&1
  echo "$1 rc=$? $(grep -o '"batch": [0-9]*, "context": [0-9]*\|"time_ms": [0-9.]\{6\}' "$out/$1.log" | paste -sd' ')"
}
b auto1
sed -i 's/    overlap: str = "auto",/    overlap: str = "values",/' $f; b values1
sed -i 's/    overlap: str = "values",/    overlap: str = "auto",/' $f; b auto2
sed -i 's/    overlap: str = "auto",/    overlap: str = "values",/' $f; b values2
sed -i 's/    overlap: str = "values",/    overlap: str = "auto",/' $f
