#!/usr/bin/env bash
# Session 34. The s8 key sums read through the accumulator's bias against converted ones
# (`gpu_mosaic.SUMS_TO_FLOAT`, removed after run 118): GPU tests, then the split kernel alone at 8 x 128k, ring-only
# rows first (loads_codes, loads), then everything with bias / convert sums and keys only;
# ptxas' report (registers). On an H200 the decode record first (notes/run112.sh's branch).
set -u
out=$1; mkdir -p "$out"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
if [[ $gpu == *H200* ]]; then  # the record first, within what the budget leaves
  mkdir -p "$out/record"
  timeout 290 python3 -m eval.bench_decode --repeats 3 \
    --points 1x32768 1x65536 1x131072 8x32768 8x131072 32x32768 \
    --variants int2_mosaic_vdims int4_mosaic_vdims bf16_mosaic cudnn_bf16 torch_sdpa_bf16 \
    --out "$out/record/bench_decode.json" > "$out/record/bench.log" 2>&1
  echo "record rc=$?"; grep -h "^| [0-9]\|ceiling" "$out/record/bench.log" | cut -c1-150
fi
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/pallas_kernels/test_decode_attention.py \
  -k "bias_equal or (TestDecodeAttentionMosaic and dims)" > "$out/tests.log" 2>&1
echo "tests rc=$?"; tail -3 "$out/tests.log"
[[ $gpu == *H200* ]] && exit
timeout 180 python3 -m eval.bench_decode --repeats 3 --points 8x131072 \
  --variants mosaic_stages --stages loads_codes loads full keys --no-quantize-pack \
  --out "$out/stages/bench_decode.json" > "$out/stages.log" 2>&1
echo "stages rc=$?"; grep -h "^| [0-9]\|int2_mosaic_split" "$out/stages.log" | cut -c1-150 | head -30
MOSAIC_GPU_DUMP_PTXAS=1 timeout 45 python3 notes/decode_kernel_once.py mosaic_split:full 8x131072 \
  > "$out/ptxas.log" 2>&1
echo "ptxas rc=$?"; grep -h -i "registers\|spill" "$out/ptxas.log" | sort | uniq -c | head -20
