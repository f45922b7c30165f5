#!/usr/bin/env bash
# Run 93: the decode record with the batch-1 cuts as defaults (Triton query prologue, 1-page
# sink/recent splits) against the old call in the same run; honest timing (16 copies, 10 rounds).
set -u
out=$1; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu.txt" 2>&1
b() { local name=$1 to=$2; shift 2
  timeout "$to" python3 -m eval.bench_decode --repeats 3 --no-quantize-pack "$@" \
    --out "$out/$name.json" > "$out/$name.log" 2>&1; echo "$name rc=$?" >> "$out/gpu.txt"; }
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/pallas_kernels/test_decode_attention.py \
  -k "split_sizes or query_prologue" > "$out/tests.log" 2>&1; echo "tests rc=$?" >> "$out/gpu.txt"
b batch1 120 --points 1x32768 1x65536 1x131072 --variants int2_mosaic_vdims \
  int2_mosaic_vdims_qxla_fp4 cudnn_bf16 torch_sdpa_bf16
b large 170 --points 8x32768 8x131072 32x32768 --variants int2_mosaic_vdims \
  int2_mosaic_vdims_qxla_fp4 cudnn_bf16 torch_sdpa_bf16
cat "$out/gpu.txt"; tail -n 2 "$out/tests.log"; grep -h "^| [0-9]" "$out"/*.log | cut -c1-110
