#!/usr/bin/env bash
# Run 91: the decode record with honest batch-1 timing, issue #15's kernel rows, batch-1 extras.
set -u
out=$1; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu.txt" 2>&1
b() { local name=$1 to=$2; shift 2
  timeout "$to" python3 -m eval.bench_decode --repeats 3 --no-quantize-pack "$@" \
    --out "$out/$name.json" > "$out/$name.log" 2>&1; echo "$name rc=$?" >> "$out/gpu.txt"; }
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/pallas_kernels/test_decode_attention.py \
  -k "split_sizes or query_prologue" > "$out/fp_split_tests.log" 2>&1; echo "tests rc=$?" >> "$out/gpu.txt"
b batch1 140 --points 1x32768 1x65536 1x131072 --variants int2_mosaic_vdims int2_mosaic_vdims_fp1 \
  int2_mosaic_vdims_qtriton int2_mosaic_vdims_qtriton_fp1 int2_pallas cudnn_bf16 torch_sdpa_bf16
b large 250 --points 8x32768 8x131072 32x32768 --variants int2_mosaic_vdims int4_mosaic_vdims \
  bf16_mosaic cudnn_bf16 torch_sdpa_bf16
b alloc 80 --points 8x131072 --variants int2_mosaic_vdims int2_mosaic_vdims_meta_uint8 \
  int2k_int4v_mosaic_vdims int4k_int2v_mosaic_vdims
cat "$out/gpu.txt"; tail -n 2 "$out/fp_split_tests.log"; grep -h "^| [0-9]" "$out"/*.log | cut -c1-110
