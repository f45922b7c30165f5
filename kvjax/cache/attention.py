"""Attention math shared by every cache: grouped-query attention over explicit key/value sets.

This is the reference ("slow, obvious") path. Caches gather their keys and values (dense, or
dequantized from pages) and call `grouped_attention`; the Pallas decode kernels in
`pallas_kernels/` are tested against the same math.

Query head j reads KV head j // G, G = Hq // Hkv (HuggingFace `repeat_kv` order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def split_heads_by_group(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """[B, T, Hq, d] -> [B, T, Hkv, G, d] (query heads grouped under the KV head they read)."""
    b, t, hq, d = q.shape
    if hq % num_kv_heads:
        raise ValueError(f"{q.shape=}: Hq={hq} is not a multiple of num_kv_heads={num_kv_heads}")
    return q.reshape(b, t, num_kv_heads, hq // num_kv_heads, d)


def grouped_attention(
    q: jax.Array,  # f[B, T, Hq, d]
    k: jax.Array,  # f[B, S, Hkv, d]
    v: jax.Array,  # f[B, S, Hkv, d]
    mask: jax.Array,  # bool[B, T, S]; True where query t may read key s
    *,
    sm_scale: float,
) -> jax.Array:  # f32[B, T, Hq, d]
    """Softmax attention with GQA, computed in float32.

    Masked scores are set to -inf before the softmax and masked probabilities are zeroed with
    `where`, so NaN or garbage in masked key/value slots never reaches the output.
    """
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"incompatible shapes {q.shape=} {k.shape=} {v.shape=}")
    if mask.shape != (q.shape[0], q.shape[1], k.shape[1]):
        raise ValueError(f"{mask.shape=} does not match {q.shape=} and {k.shape=}")
    hkv = k.shape[2]
    qg = split_heads_by_group(q.astype(jnp.float32), hkv)  # [B, T, K, G, H]
    k32 = jnp.where(mask.any(axis=1)[:, :, None, None], k.astype(jnp.float32), 0.0)
    v32 = jnp.where(mask.any(axis=1)[:, :, None, None], v.astype(jnp.float32), 0.0)
    s = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k32) * sm_scale  # [B, K, G, T, S]
    m = mask[:, None, None, :, :]
    s = jnp.where(m, s, -jnp.inf)
    s_max = jnp.max(s, axis=-1, keepdims=True)
    s_max = jnp.where(jnp.isfinite(s_max), s_max, 0.0)  # rows with no valid key
    p = jnp.where(m, jnp.exp(s - s_max), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    o = jnp.einsum("BKGTS,BSKH->BTKGH", p, v32)  # [B, T, K, G, H]
    return o.reshape(q.shape).astype(jnp.float32)


def causal_mask(
    q_positions: jax.Array,
    kv_positions: jax.Array,
    kv_valid: jax.Array,
    window: int | None = None,
) -> jax.Array:
    """bool[B, T, S]: key s visible to query t iff valid and kv_pos[s] <= q_pos[t].

    Args:
      q_positions: i32[B, T] absolute positions of the queries.
      kv_positions: i32[B, S] absolute positions of the keys.
      kv_valid: bool[B, S] which key slots hold data.
      window: sliding-window length (Gemma 3's local layers): additionally require
        q_pos[t] - kv_pos[s] < window, so a query sees itself and the window - 1 keys before it.
        None: full causal attention.
    """
    diff = q_positions[:, :, None] - kv_positions[:, None, :]  # [B, T, S]
    mask = (diff >= 0) & kv_valid[:, None, :]
    if window is not None:
        mask &= diff < window
    return mask
