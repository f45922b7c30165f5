#!/usr/bin/env bash
# Session 33. On an H200: the decode record (notes/run112.sh's H200 branch). On an H100:
#  1. the removed split-grid design (a copy of 606931a carried as runs/ab_grid) against the
#     default at the serving engine's shapes, 64 x 1k / 2k / 4k, where the BF16 sink/recent
#     window is most of the 2-bit call's bytes (is the grid worth a shape rule there?);
#  2. the split kernel at 8 x 128k: everything, keys only (no value side), loads only (six
#     copies a step), the two code copies alone (`loads_codes`): what each part costs;
#  3. ptxas' report of the default split kernel (registers, so CTAs per SM).
set -u
out=$1; mkdir -p "$out"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
if [[ $gpu == *H200* ]]; then
  bash notes/run112.sh "$out"; exit
fi
root=$PWD
(cd runs/ab_grid && timeout 150 python3 -m eval.bench_decode --repeats 5 \
  --points 64x1024 64x2048 64x4096 --variants int2_mosaic_vdims int2_mosaic_vdims_grid \
  bf16_mosaic --no-quantize-pack --out "$out/grid/bench_decode.json" > "$out/grid.log" 2>&1)
echo "grid rc=$?"; grep -h "^| [0-9]" "$out/grid.log" | cut -c1-120
cd "$root" && timeout 240 python3 -m eval.bench_decode --repeats 3 --points 8x131072 \
  --variants mosaic_stages --stages loads_codes loads keys full --no-quantize-pack \
  --out "$out/stages/bench_decode.json" > "$out/stages.log" 2>&1
echo "stages rc=$?"; grep -h "^| [0-9]" "$out/stages.log" | cut -c1-120
MOSAIC_GPU_DUMP_PTXAS=1 timeout 90 python3 notes/decode_kernel_once.py mosaic_split:full 8x131072 \
  > "$out/ptxas.log" 2>&1
echo "ptxas rc=$?"; grep -h -i "registers\|spill\|smem\|shared" "$out/ptxas.log" | sort | uniq -c | head -20
