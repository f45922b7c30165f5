#!/usr/bin/env bash
# Run 107: the transposed accumulator store (1a0bd6b: no transpose after the split kernel) and
# the sink/recent pages inside the fused prologue ("fused_fp"), against the tree before them
# (runs/ab_base = 26423d9, carried) in the same call: GPU tests first, then both benches.
set -u
out=$1; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu.txt" 2>&1; cat "$out/gpu.txt"
timeout 170 python3 -m pytest -q -x -p no:cacheprovider tests/pallas_kernels/test_decode_attention.py \
  -k "sink_recent or bf16_body_matches or two_token_streams or narrow_mma or overlapped_mmas" \
  > "$out/tests.log" 2>&1; echo "tests rc=$?"; tail -c 600 "$out/tests.log"; echo
pts="1x32768 1x65536 1x131072 8x32768 8x131072 32x32768"
timeout 200 python3 -m eval.bench_decode --repeats 3 --points $pts \
  --variants int2_mosaic_vdims int2_mosaic_vdims_fpq int4_mosaic_vdims_fpq cudnn_bf16 torch_sdpa_bf16 \
  --out "$out/bench_new.json" > "$out/bench_new.log" 2>&1; echo "new rc=$?"
(cd runs/ab_base && timeout 150 python3 -m eval.bench_decode --repeats 3 --points $pts \
  --variants int2_mosaic_vdims torch_sdpa_bf16 --out "$out/bench_base.json") > "$out/bench_base.log" 2>&1
echo "base rc=$?"
for f in new base; do echo "== $f"; grep -h "^| [0-9]\|ceiling" "$out/bench_$f.log" | cut -c1-110; done
