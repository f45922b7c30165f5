"""One decode window of the Engine under ncu: per-kernel device time of a serving-like step.

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum \
        --print-summary per-kernel python3 notes/engine_window_ncu.py int2_mosaic 8 64 4096

jax.profiler traces hung around the Mosaic GPU body (device runs 69, 71); ncu brackets one
window with cuProfilerStart/Stop instead. Rows of staggered lengths (spread over 128 tokens)
flush at different steps as in serving; prefill is skipped (bench_engine --synthetic-prefill).
"""

import ctypes
import sys

import jax
import numpy as np

from eval import common
from eval.bench_engine import prefill_skipped
from eval.bench_serving import make_engine
from kvjax.serving.engine import EngineConfig

mode, layers, batch, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
new = 80
shape = common.ModelShape(layers, 4096, 12288, 32, 8, 128, 151936)
model = common.random_model(shape, prompt + new)
ecfg = EngineConfig(max_seqs=batch, prefill_chunk=512, prefill_tokens_per_step=512 * batch,
                    decode_steps=16, prefix_sharing=False)  # fmt: skip
eng = make_engine(model, mode, max_len=prompt + new, engine_cfg=ecfg)
rng = np.random.default_rng(0)
with prefill_skipped(True):
    for i in range(batch):
        eng.submit(rng.integers(0, shape.vocab_size, prompt - (i * 128) // batch).tolist(), new)
    while not all(r.decoding for r in eng.running) or len(eng.running) < batch:
        eng.step()
    eng.step()  # compiled and warm
    eng.step()
    jax.effects_barrier()
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:  # no GPU driver (a CPU smoke run): time the window unprofiled
        cuda = None
    if cuda is not None:
        cuda.cuProfilerStart()
    eng.step()
    jax.effects_barrier()
    if cuda is not None:
        cuda.cuProfilerStop()
print("decode windows", eng.stats["decode_windows"], "steps", eng.stats["decode_steps"],
      "step ms", 1e3 * eng.stats["decode_seconds"] / eng.stats["decode_steps"])  # fmt: skip
