#!/usr/bin/env bash
# Run 97: batch-1 rows with XLA command buffers (CUDA graphs) against without, now that a timed
# jit holds 16 calls: is the ~7 us of wall beyond kernel time per call host launch time?
set -u
out=$1; mkdir -p "$out"
CB="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN --xla_gpu_graph_min_graph_size=1"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu.txt" 2>&1
b() { local name=$1; shift
  timeout 150 python3 -m eval.bench_decode --repeats 3 --no-quantize-pack \
    --points 1x32768 1x65536 1x131072 --variants int2_mosaic_vdims int2_pallas torch_sdpa_bf16 \
    --out "$out/$name.json" > "$out/$name.log" 2>&1; echo "$name rc=$?" >> "$out/gpu.txt"; }
b default
XLA_FLAGS="$CB" b cmdbuf
timeout 100 python3 notes/batch1_timeline.py "$out/tl" 1x65536 int2_mosaic_vdims > "$out/tl_default.log" 2>&1
TIMELINE_TAG=cmdbuf XLA_FLAGS="$CB" timeout 100 python3 notes/batch1_timeline.py "$out/tl" 1x65536 \
  int2_mosaic_vdims > "$out/tl_cmdbuf.log" 2>&1
cat "$out/gpu.txt"; grep -h "^| [0-9]" "$out"/default.log "$out"/cmdbuf.log | cut -c1-100
tail -n 14 "$out"/tl_*.log
