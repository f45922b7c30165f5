"""Prefill + decode loops over any cache, jit-compiled, with greedy / temperature / top-p sampling.

`Engine` owns the jitted step (`nnx.merge` inside `jax.jit`, the cache donated) and, for the
paged cache, the host `PageManager` that plans each step. Library use:

    lm = kvjax.load_model()                 # shipped SmolLM2
    eng = Engine(lm.model, cache_kind="paged", transforms=tf, cache_cfg=CacheConfig(...))
    out = eng.generate([lm.tokenizer.encode("The capital of France is")], max_new_tokens=8)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.cache.allocator import PageManager
from kvjax.cache.dense import DenseKVCache
from kvjax.cache.paged import CacheConfig, PagedKVCache
from kvjax.cache.transforms import KVTransforms
from kvjax.models.model import Transformer
from kvjax.serving.sampling import sample_next


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per sequence (prompt excluded)
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int

    @property
    def decode_tokens_per_second(self) -> float:
        n = self.decode_steps * len(self.tokens)
        return n / self.decode_seconds if self.decode_seconds > 0 else float("nan")


class Engine:
    """Runs a model with a dense full-precision cache or the paged low-bit cache."""

    def __init__(
        self,
        model: Transformer,
        *,
        cache_kind: Literal["dense", "paged"] = "dense",
        transforms: KVTransforms | None = None,
        cache_cfg: CacheConfig | None = None,
        prefill_chunk: int = 512,
    ):
        if cache_kind not in ("dense", "paged"):
            raise ValueError(f"cache_kind={cache_kind!r}; use 'dense' or 'paged'")
        self.model = model
        self.cfg = model.cfg
        self.cache_kind = cache_kind
        self.cache_cfg = cache_cfg or CacheConfig()
        self.transforms = transforms if transforms is not None else KVTransforms.identity(self.cfg)
        self.transforms.check_matches(self.cfg)
        self.prefill_chunk = prefill_chunk
        self.graphdef, self.params = nnx.split(model)

        def step(params, tokens, cache, transforms):
            # Transforms travel beside the donated cache: donating them would free the
            # caller's copy after the first step on GPU/TPU.
            if transforms is not None:
                cache = cache.replace(transforms=transforms)
            m = nnx.merge(self.graphdef, params)
            logits, cache = m(tokens, cache)
            if transforms is not None:
                cache = cache.replace(transforms=None)
            return logits[:, -1], cache

        self._step = jax.jit(step, donate_argnums=(2,))
        self.manager: PageManager | None = None

    def new_cache(self, batch_size: int, max_len: int):
        if self.cache_kind == "dense":
            return DenseKVCache.create(self.cfg, batch_size, max_len, self.model.dtype)
        ccfg = dataclasses.replace(self.cache_cfg, max_seq_len=max_len)
        cache = PagedKVCache.create(self.cfg, ccfg, self.transforms, batch_size)
        self.manager = PageManager(cache)
        return cache

    def run_chunk(self, cache, tokens: np.ndarray):
        """One model call on `tokens` i32[B, T] appended to every sequence of `cache`."""
        if self.cache_kind == "dense":
            need = int(np.max(np.asarray(cache.lengths))) + tokens.shape[1]
            if need > cache.max_len:
                raise ValueError(
                    f"dense cache of max_len={cache.max_len} cannot take {need} tokens"
                )
        else:
            cache = self.manager.prepare(cache, tokens.shape[1])
        tokens = jnp.asarray(tokens, jnp.int32)
        if self.cache_kind == "dense":
            return self._step(self.params, tokens, cache, None)
        tf = cache.transforms
        logits, cache = self._step(self.params, tokens, cache.replace(transforms=None), tf)
        return logits, cache.replace(transforms=tf)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        eos_ids: Sequence[int] = (),
    ) -> GenerationResult:
        """Generates for a batch of equal-length prompts; stops early when all hit EOS."""
        lens = {len(p) for p in prompts}
        if len(lens) != 1 or 0 in lens:
            raise ValueError(f"prompts must be non-empty and of equal length, got {sorted(lens)}")
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"temperature={temperature} must be >= 0, top_p={top_p} in (0, 1]")
        tokens = np.asarray(prompts, np.int32)
        b, t = tokens.shape
        cache = self.new_cache(b, t + max_new_tokens)
        t0 = time.perf_counter()
        logits = None
        for i in range(0, t, self.prefill_chunk):
            logits, cache = self.run_chunk(cache, tokens[:, i : i + self.prefill_chunk])
        logits.block_until_ready()
        t1 = time.perf_counter()
        key = jax.random.key(seed)
        out = np.zeros((b, 0), np.int32)
        done = np.zeros((b,), bool)
        steps = 0
        t_first = None  # decode timing starts after the first step, which includes compilation
        for _ in range(max_new_tokens):
            key, sub = jax.random.split(key)
            nxt = np.asarray(sample_next(logits, sub, temperature, top_p))
            out = np.concatenate([out, nxt[:, None]], axis=1)
            done |= np.isin(nxt, list(eos_ids))
            if done.all() or out.shape[1] == max_new_tokens:
                break
            logits, cache = self.run_chunk(cache, nxt[:, None])
            if t_first is None:
                logits.block_until_ready()
                t_first = time.perf_counter()
            else:
                steps += 1
        if t_first is not None:
            logits.block_until_ready()
        t2 = time.perf_counter()
        result = []
        for row in out.tolist():
            cut = next((i + 1 for i, x in enumerate(row) if x in eos_ids), len(row))
            result.append(row[:cut])
        self.last_cache = cache
        return GenerationResult(result, t1 - t0, (t2 - t_first) if t_first else 0.0, steps)
