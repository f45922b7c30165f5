#!/usr/bin/env bash
# Session 36. On an H200 first the decode record of every default variant (none since run
# 65). Then, either GPU: ptxas' registers of the split kernel with the value MMAs waited
# before the key unpack (overlap "copies": can it fit a third CTA per SM, <= 168?) against
# the default (174 in run 118); the split kernel alone at 8 x 128k, default / copies /
# keys-only, and the ring-only rows with s8 key operands (3c67cc9); the Mosaic GPU schedule
# tests (copies and values against the serial twin).
set -u
out=$1; mkdir -p "$out"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
if [[ $gpu == *H200* ]]; then
  timeout 250 python3 -m eval.bench_decode --repeats 3 \
    --points 1x32768 1x65536 1x131072 8x32768 8x131072 32x32768 \
    --variants int2_mosaic_vdims int4_mosaic_vdims bf16_mosaic cudnn_bf16 torch_sdpa_bf16 \
    --out "$out/record/bench_decode.json" > "$out/bench.log" 2>&1
  echo "record rc=$?"; grep -h "^| [0-9]\|ceiling" "$out/bench.log" | cut -c1-150
fi
for o in values copies; do
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 40 python3 notes/decode_kernel_once.py mosaic_split:full:$o 8x131072 \
    > "$out/ptxas_$o.log" 2>&1
  echo "ptxas $o rc=$?"; grep -h -i "registers\|spill" "$out/ptxas_$o.log" | sort | uniq -c | head -4
done
timeout 150 python3 -m eval.bench_decode --repeats 3 --points 8x131072 \
  --variants mosaic_stages --stages full keys loads loads_codes --no-quantize-pack \
  --out "$out/stages/bench_decode.json" > "$out/stages.log" 2>&1
echo "stages rc=$?"; grep -h "^| [0-9]\|rror" "$out/stages.log" | cut -c1-150 | head -20
timeout 80 python3 -m pytest -q -x -p no:cacheprovider tests/pallas_kernels/test_decode_attention.py \
  -k "overlapped_mmas_match or (TestDecodeAttentionMosaic and test_matches_reference and dims and not exponent and not bulk)" \
  > "$out/tests.log" 2>&1; echo "tests rc=$?"; tail -c 300 "$out/tests.log"
