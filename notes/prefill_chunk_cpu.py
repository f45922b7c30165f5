"""Seconds per 512-token prefill chunk of a tiny 2-layer model on the paged 2-bit cache (CPU),
reference attention, for the checkout at ARGV[1] and max_seq_len ARGV[2]:

    python notes/prefill_chunk_cpu.py /path/to/checkout 32768

Session 9 used it to compare the one-shot reference prefill attention (before 0e1292b) with the
blocked one (a git worktree of each commit)."""

import sys
import time

sys.path.insert(0, sys.argv[1])
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.cache.allocator import PageManager
from kvjax.cache.paged import CacheConfig, PagedKVCache
from kvjax.cache.quantizers import QuantConfig
from kvjax.cache.transforms import KVTransforms
from kvjax.config import ModelConfig
from kvjax.models.model import Transformer

cfg = ModelConfig(
    model_type="llama",
    vocab_size=256,
    hidden_size=256,
    intermediate_size=512,
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    head_dim=32,
)
model = Transformer(cfg, rngs=nnx.Rngs(0))
g, p = nnx.split(model)
step = jax.jit(lambda t, c: nnx.merge(g, p)(t, c))
cc = CacheConfig(quant=QuantConfig(bits=2), max_seq_len=int(sys.argv[2]))
cache = PagedKVCache.create(cfg, cc, KVTransforms.identity(cfg), 1)
mgr = PageManager(cache)
toks = np.random.default_rng(0).integers(0, 256, size=(1, 4096))
times = []
for i in range(8):
    cache = mgr.prepare(cache, 512)
    t0 = time.perf_counter()
    out, cache = step(jnp.asarray(toks[:, i * 512 : (i + 1) * 512]), cache)
    out.block_until_ready()
    times.append(time.perf_counter() - t0)
print(
    sys.argv[1],
    "max_seq_len",
    sys.argv[2],
    "per 512-token chunk (s), after compile:",
    [round(t, 3) for t in times[1:]],
)
