#!/usr/bin/env bash
# Serving-engine device call (see notes/device_runs.md): engine tests on the GPU, the batch-1
# 100k decode step (bf16 paged vs 2-bit), and a bench_serving run at Qwen3-8B shapes.
# Usage on the device machine: bash notes/serving_device.sh OUT_DIR [steps] [serving args...]
# steps: comma-separated from tests, engine, serving.
set -u
out=$1; steps=${2:-tests,engine,serving}; shift 2 || true
mkdir -p "$out"
q8b="--layers 36 --hidden-size 4096 --intermediate-size 12288 --num-heads 32 --num-kv-heads 8 --head-dim 128 --vocab-size 151936"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" > "$out/gpu.txt" 2>&1
for mod in hypothesis:hypothesis sortedcontainers:sortedcontainers; do
  python3 -c "import ${mod%%:*}" 2>/dev/null ||
    python3 -m pip install -q --no-index --no-deps --find-links .whl "${mod##*:}" > /dev/null 2>&1
done
if [[ $steps == *tests* ]]; then
  timeout ${TESTS_TIMEOUT:-120} python3 -m pytest -q -p no:cacheprovider -x \
    tests/kvjax/serving/test_engine.py -k "ragged or prefix or stream" > "$out/engine_tests.log" 2>&1
  echo "engine tests rc=$?" >> "$out/gpu.txt"
fi
if [[ $steps == *engine* ]]; then
  # shellcheck disable=SC2086
  timeout ${ENGINE_TIMEOUT:-200} python3 -m eval.bench_engine $q8b --batch 1 \
    --prompt-len ${ENGINE_PROMPT:-100000} --new-tokens 33 --modes bf16_paged int2_pallas \
    --out "$out/engine" > "$out/engine.log" 2>&1
  echo "bench_engine rc=$?" >> "$out/gpu.txt"
fi
if [[ $steps == *serving* ]]; then
  # shellcheck disable=SC2086
  timeout ${SERVING_TIMEOUT:-240} python3 -m eval.bench_serving $q8b --kv-memory-gb 10 "$@" \
    --out "$out/serving" > "$out/serving.log" 2>&1
  echo "bench_serving rc=$?" >> "$out/gpu.txt"
fi
cat "$out/gpu.txt"; tail -n 4 "$out/engine_tests.log" 2>/dev/null
tail -n 12 "$out/engine.log" "$out/serving.log" 2>/dev/null
