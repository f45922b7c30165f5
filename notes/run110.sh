#!/usr/bin/env bash
# For the next session (H200 if one is lent, else H100; ~420 s): the record of every variant
# with today's defaults (run 106's command: the transposed accumulator store of session 32 is
# not yet in a one-run record), then the split kernel's stages at 8 x 128k with the new
# `loads_codes` row (the two code copies per step without the four metadata copies: do the
# metadata copies bound the ring?), then the Mosaic reference tests.
set -u
out=$1; mkdir -p "$out"
bash "$(dirname "$0")/run106.sh" "$out"
timeout 120 python3 -m eval.bench_decode --repeats 3 --points 8x131072 --variants mosaic_stages \
  --no-quantize-pack --out "$out/bench_stages.json" > "$out/bench_stages.log" 2>&1
echo "stages rc=$?"; grep -h "^| [0-9]" "$out/bench_stages.log" | cut -c1-120
timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/pallas_kernels/test_decode_attention.py \
  -k "TestDecodeAttentionMosaic and test_matches_reference and dims" > "$out/tests.log" 2>&1
echo "tests rc=$?"; tail -c 300 "$out/tests.log"; echo
