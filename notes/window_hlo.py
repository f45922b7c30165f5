"""Optimized HLO of the engine's decode window, and the copies in it (device tool, not a test).

    python notes/window_hlo.py OUT_DIR MODE [layers batch context]

Builds a random model of Qwen3-8B layer shapes, fills `batch` sequences of `context` tokens
with skipped prefills, captures the arguments of one decode window, compiles it on this
backend and writes `window_MODE.hlo.txt` plus a summary: every copy of a cache-pool-sized
buffer (with the computation it sits in: inside the scan body it costs a pool per step) and
the fused computations of the `input_reduce_fusion*` kernels a profile showed.
"""

import re
import sys

import jax
import numpy as np

from eval import common
from eval.bench_engine import prefill_skipped
from eval.bench_serving import make_engine
from kvjax.serving import engine as E
from kvjax.serving.engine import EngineConfig

out, mode = sys.argv[1], sys.argv[2]
layers, batch, context = (int(x) for x in (sys.argv[3:] or ["2", "64", "4096"]))
shape = common.ModelShape(layers, 4096, 12288, 32, 8, 128, 151936)
if jax.default_backend() == "cpu":
    shape = common.ModelShape(layers, 128, 256, 4, 2, 64, 256)
model = common.random_model(shape, context + 64)
ecfg = EngineConfig(
    max_seqs=batch, prefill_chunk=512, prefill_tokens_per_step=512 * batch, decode_steps=16,
    prefix_sharing=False,
)  # fmt: skip
eng = make_engine(model, mode, max_len=context + 64, engine_cfg=ecfg)
captured = {}
real = E._decode_window_call


def spy(*args):
    captured.setdefault("args", args)
    return real(*args)


E._decode_window_call = spy
prompts = np.random.default_rng(0).integers(0, shape.vocab_size, (batch, context))
with prefill_skipped(True):
    eng.generate(prompts.tolist(), 17)
txt = real.lower(*captured["args"]).compile().as_text()
with open(f"{out}/window_{mode}.hlo.txt", "w") as f:
    f.write(txt)
pools = {tuple(x.shape) for x in jax.tree.leaves(eng.cache.pools)}
lines, comp = [], None
for line in txt.splitlines():
    if line and not line.startswith(" ") and "{" in line:
        comp = line.split("(")[0].strip()
    m = re.search(r"= \S+\[([^\]]*)\]\S* copy(-start)?\(", line)
    if m and tuple(int(d) for d in m.group(1).split(",") if d) in pools:
        lines.append(f"{comp} | {line.strip()[:160]}")
summary = [f"{mode}: {len(lines)} pool-sized copies; pool shapes {sorted(pools)}", *lines]
for name in sorted(set(re.findall(r"(input_reduce_fusion[._\d]*)", txt)))[:12]:
    body = re.search(r"\n(%?fused_computation[^\n]*\n(?:  [^\n]*\n)*?)\}", txt)
    callers = [ln.strip()[:220] for ln in txt.splitlines() if f"%{name} = " in ln]
    summary += [f"-- {name}", *callers]
with open(f"{out}/window_{mode}.summary.txt", "w") as f:
    f.write("\n".join(summary) + "\n")
print("\n".join(summary[:40]))
