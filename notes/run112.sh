#!/usr/bin/env bash
# Session 33: on an H200 the decode record (#12's targets were set there; none lent since run 65),
# on an H100 the serving-step experiment of notes/run111.sh instead.
set -u
out=$1; mkdir -p "$out"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
if [[ $gpu == *H200* ]]; then
  timeout 330 python3 -m eval.bench_decode --repeats 3 \
    --points 1x32768 1x65536 1x131072 8x32768 8x131072 32x32768 \
    --variants int2_mosaic_vdims int4_mosaic_vdims bf16_mosaic cudnn_bf16 torch_sdpa_bf16 \
    --out "$out/bench_decode.json" > "$out/bench.log" 2>&1
  echo "bench rc=$?"; grep -h "^| [0-9]\|ceiling" "$out/bench.log" | cut -c1-120
else
  bash notes/run111.sh "$out"
fi
