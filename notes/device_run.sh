#!/usr/bin/env bash
# One batched device call (see notes/device_runs.md): GPU correctness, benchmark, ncu, Engine.
# tests/conftest.py sets full float32 matmul precision, so GPU test runs need no extra flags.
# Usage on the device machine: bash notes/device_run.sh OUT_DIR "bench args..." [steps]
# steps: comma-separated from tests, mosaic, sweep, mixed, suite, bench, ncu (NCU_VARIANTS), ncumosaic
# (NCU_MOSAIC_STAGES at NCU_POINT), kernels (KERNEL_VARIANTS at KERNEL_POINTS), sass (SASS of
# the Mosaic split kernel, SASS_STAGE at SASS_POINT),
# paged, engine. suite = the README's test command (CI subset) on the GPU machine, 8 workers.
# sweep = the whole GPU correctness sweep (slow cases included, `-m ""`); it runs 4 pytest
# workers on the one GPU when pytest-xdist is there or its wheels were carried in .whl/.
set -u
out=$1; bench_args=$2; steps=",${3:-tests,bench,engine},"  # matched as ,name,
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import jax, triton; print('jax', jax.__version__, 'triton', triton.__version__)" >> "$out/gpu.txt" 2>&1
if [[ $steps == *,tests,* ]]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider \
    tests/pallas_kernels/test_decode_attention.py \
    -k "TestDecodeAttention and not Interpret and not sweep" > "$out/tests.log" 2>&1
  echo "tests rc=$?" >> "$out/gpu.txt"
  timeout 120 python3 -m pytest -q -p no:cacheprovider \
    tests/pallas_kernels/test_quantize_pack.py -k hardware > "$out/qp_tests.log" 2>&1
  echo "quantize_pack tests rc=$?" >> "$out/gpu.txt"
fi
# Test-only packages the GPU image may lack, from wheels carried in .whl/ (no network there).
for mod in xdist:pytest-xdist execnet:execnet hypothesis:hypothesis sortedcontainers:sortedcontainers \
  gguf:gguf; do
  python3 -c "import ${mod%%:*}" 2>/dev/null ||
    python3 -m pip install -q --no-index --no-deps --find-links .whl "${mod##*:}" > /dev/null 2>&1
done
if [[ $steps == *,mosaic,* ]]; then
  # The Mosaic GPU body against the reference (its own sweep; no interpret twin exists).
  par=""; python3 -c "import xdist" 2>/dev/null && par="-n ${MOSAIC_WORKERS:-8}"
  # shellcheck disable=SC2086
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${MOSAIC_TIMEOUT:-240} python3 -m pytest -q \
    -p no:cacheprovider $par --maxfail=${MOSAIC_MAXFAIL:-1000} -rf \
    tests/pallas_kernels/test_decode_attention.py -k "${MOSAIC_K:-TestDecodeAttentionMosaic}" \
    > "$out/mosaic_tests.log" 2>&1
  echo "mosaic tests rc=$?" >> "$out/gpu.txt"
fi
if [[ $steps == *,sweep,* ]]; then
  par=""; python3 -c "import xdist" 2>/dev/null && par="-n 4"
  # shellcheck disable=SC2086
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${SWEEP_TIMEOUT:-420} python3 -m pytest -q \
    -p no:cacheprovider -m "" $par tests/pallas_kernels/test_decode_attention.py \
    tests/pallas_kernels/test_quantize_pack.py -k "(TestDecodeAttention and not Interpret) or hardware" \
    > "$out/sweep.log" 2>&1
  echo "sweep rc=$? (${par:-serial})" >> "$out/gpu.txt"
fi
if [[ $steps == *,mixed,* ]]; then
  # The mixed-width and 8-bit-metadata decode cases alone (15; run 44 grepped "meta" too, which
  # matches every Case id, and ran 240 cases in ~4 min with 6 workers).
  python3 -m pytest --collect-only -q -p no:cacheprovider -m "" \
    tests/pallas_kernels/test_decode_attention.py tests/pallas_kernels/test_quantize_pack.py \
    2>/dev/null | grep -v Interpret | grep -i "bits_v=[24]\|uint8" > "$out/mixed_ids.txt"
  par=""; python3 -c "import xdist" 2>/dev/null && par="-n 6"
  # shellcheck disable=SC2086
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${MIXED_TIMEOUT:-280} xargs -d '\n' \
    -a "$out/mixed_ids.txt" python3 -m pytest -q -p no:cacheprovider -m "" $par -rf \
    > "$out/mixed_tests.log" 2>&1
  echo "mixed rc=$?" >> "$out/gpu.txt"
fi
if [[ $steps == *,suite,* ]]; then
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${SUITE_TIMEOUT:-480} python3 -m pytest -q \
    -p no:cacheprovider -n 8 -rfE > "$out/suite.log" 2>&1
  echo "suite rc=$?" >> "$out/gpu.txt"
fi
if [[ $steps == *,bench,* ]]; then
  # shellcheck disable=SC2086
  timeout ${BENCH_TIMEOUT:-300} python3 -m eval.bench_decode $bench_args --out "$out/bench_decode.json" \
    > "$out/bench.log" 2>&1
  echo "bench rc=$?" >> "$out/gpu.txt"
fi
if [[ $steps == *,ncu,* ]]; then
  for v in ${NCU_VARIANTS:-int2_pallas}; do
    timeout 120 ncu --clock-control none -k regex:paged_decode_int --launch-count 1 \
      --section LaunchStats --section Occupancy --section WarpStateStats \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SchedulerStats \
      python3 notes/decode_kernel_once.py $v > "$out/ncu_$v.txt" 2>&1
    echo "ncu $v rc=$?" >> "$out/gpu.txt"
  done
fi
if [[ $steps == *,ncumosaic,* ]]; then
  # The Mosaic split kernel alone per stage (loads only ... everything) under ncu: DRAM and L2
  # throughput, TMA/barrier stalls, occupancy: why the TMA ring alone reads 64% of the ceiling.
  for st in ${NCU_MOSAIC_STAGES:-loads full}; do
    timeout 150 ncu --clock-control none -k regex:mosaic --launch-skip 1 --launch-count 1 \
      --section LaunchStats --section Occupancy --section WarpStateStats \
      --section MemoryWorkloadAnalysis --section SchedulerStats --section SpeedOfLight \
      --section ComputeWorkloadAnalysis --section InstructionStats \
      python3 notes/decode_kernel_once.py ${NCU_MOSAIC_KIND:-mosaic_split}:$st ${NCU_POINT:-8x131072} \
      > "$out/ncu_mosaic_$st.txt" 2>&1
    echo "ncu mosaic $st rc=$?" >> "$out/gpu.txt"
  done
fi
if [[ $steps == *,kernels,* ]]; then
  # Every kernel of one decode-attention call (the last of two) with its duration: where the
  # fixed cost at batch 1 goes (prologue, split kernel, merge fusions, epilogue).
  for v in ${KERNEL_VARIANTS:-int2_pallas}; do
    for pt in ${KERNEL_POINTS:-1x65536 8x131072}; do
      timeout 120 ncu --clock-control none --metrics gpu__time_duration.sum \
        python3 notes/decode_kernel_once.py $v $pt > "$out/kernels_${v}_$pt.txt" 2>&1
      echo "kernels $v $pt rc=$?" >> "$out/gpu.txt"
    done
  done
fi
if [[ $steps == *,sass,* ]]; then
  # SASS and ptxas report of the Mosaic split kernel (SASS_STAGE), tarred (too many files).
  MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_TO="$out/sass_dump" timeout 150 \
    python3 notes/decode_kernel_once.py mosaic_split:${SASS_STAGE:-full} ${SASS_POINT:-8x16384} \
    > "$out/sass_run.log" 2>&1
  echo "sass rc=$?" >> "$out/gpu.txt"
  tar czf "$out/sass_dump.tgz" -C "$out" sass_dump && rm -rf "$out/sass_dump"
fi
if [[ $steps == *,paged,* ]]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m "" \
    tests/kvjax/cache/test_paged_cache.py -k "pallas or identity" > "$out/paged_tests.log" 2>&1
  echo "paged rc=$?" >> "$out/gpu.txt"
fi
if [[ $steps == *,engine,* ]]; then
  timeout 240 python3 -m eval.bench_engine --layers 4 --new-tokens 32 \
    --modes bf16_dense int2_pallas int2_reference --out "$out/bench_engine" > "$out/engine.log" 2>&1
  echo "engine rc=$?" >> "$out/gpu.txt"
fi
cat "$out/gpu.txt"; tail -n 5 "$out/tests.log" "$out/mosaic_tests.log" "$out/sweep.log" "$out/suite.log" "$out/bench.log" 2>/dev/null
