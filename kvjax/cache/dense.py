"""The cache protocol the attention layer talks to, and the full-precision dense cache.

A cache is an immutable pytree. The model calls, for each layer,
`o, cache = cache.attend(layer, q, k, v, positions)` with post-norm, post-RoPE q/k and v of the
new tokens, then `cache = cache.advance(num_new_tokens)` once after the last layer.
`attend` stores the new keys/values and returns the per-head attention output of the new
queries over everything the sequence has stored (causal within the chunk).
The quantized paged cache (`kvjax.cache.paged`) implements the same protocol.
"""

from __future__ import annotations

from typing import Protocol

import flax.struct
import jax
import jax.numpy as jnp

from kvjax.cache.attention import causal_mask, grouped_attention
from kvjax.config import ModelConfig


class KVCache(Protocol):
    lengths: jax.Array  # i32[B] tokens stored per sequence

    def attend(
        self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, KVCache]: ...

    def advance(self, num_tokens: int) -> KVCache: ...


@flax.struct.dataclass
class DenseKVCache:
    """Contiguous full-precision cache: per layer k, v of shape [B, S_max, Hkv, d].

    Sequences in a batch may hold different lengths (`lengths`); a call appends the same number
    of new tokens to each. Slot s holds position s. Layers with a sliding window
    (`ModelConfig.layer_windows`) mask keys more than `window - 1` positions behind the query;
    they still store every token (the buffer is one array per layer).
    """

    k: tuple[jax.Array, ...]  # per layer f[B, S_max, Hkv, d]
    v: tuple[jax.Array, ...]
    lengths: jax.Array  # i32[B]
    sm_scale: float = flax.struct.field(pytree_node=False)
    # Per layer sliding-window length or None (full causal); () means no layer slides.
    windows: tuple[int | None, ...] = flax.struct.field(pytree_node=False, default=())

    @classmethod
    def create(
        cls,
        cfg: ModelConfig,
        batch_size: int,
        max_len: int,
        dtype: jnp.dtype = jnp.float32,
        lengths: jax.Array | None = None,
    ) -> DenseKVCache:
        shape = (batch_size, max_len, cfg.num_kv_heads, cfg.head_dim)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
        if lengths is None:
            lengths = jnp.zeros((batch_size,), jnp.int32)
        return cls(
            k=zeros,
            v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
            lengths=jnp.asarray(lengths, jnp.int32),
            sm_scale=cfg.attention_scale,
            windows=cfg.layer_windows,
        )

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    def attend(
        self,
        layer: int,
        q: jax.Array,  # f[B, T, Hq, d]
        k: jax.Array,  # f[B, T, Hkv, d]
        v: jax.Array,  # f[B, T, Hkv, d]
        positions: jax.Array,  # i32[B, T]
    ) -> tuple[jax.Array, DenseKVCache]:
        kl, vl = self.k[layer], self.v[layer]
        if k.shape[2:] != kl.shape[2:]:
            raise ValueError(f"{k.shape=} does not match cache layer shape {kl.shape=}")
        write = jax.vmap(
            lambda buf, new, start: jax.lax.dynamic_update_slice_in_dim(
                buf, new.astype(buf.dtype), start, axis=0
            )
        )
        kl = write(kl, k, self.lengths)
        vl = write(vl, v, self.lengths)
        s_max = kl.shape[1]
        kv_pos = jnp.broadcast_to(jnp.arange(s_max, dtype=jnp.int32), (kl.shape[0], s_max))
        valid = kv_pos < (self.lengths + q.shape[1])[:, None]
        window = self.windows[layer] if self.windows else None
        o = grouped_attention(
            q, kl, vl, causal_mask(positions, kv_pos, valid, window), sm_scale=self.sm_scale
        )
        new = self.replace(
            k=self.k[:layer] + (kl,) + self.k[layer + 1 :],
            v=self.v[:layer] + (vl,) + self.v[layer + 1 :],
        )
        return o, new

    def advance(self, num_tokens: int) -> DenseKVCache:
        return self.replace(lengths=self.lengths + num_tokens)
