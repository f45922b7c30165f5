"""Attention math shared by every cache: grouped-query attention over explicit key/value sets.

This is the reference ("slow, obvious") path. Caches gather their keys and values (dense, or
dequantized from pages) and call `grouped_attention`; the Pallas decode kernels in
`pallas_kernels/` are tested against the same math. The model's cacheless forward over a whole
window uses `causal_self_attention` (the same math in query blocks).

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


# Causal self-attention of a whole window in query blocks: queries [a, b) read keys [0, b) only.
CAUSAL_BLOCKS = 8  # query blocks at most,
CAUSAL_MIN_BLOCK = 256  # of this many queries at least


def query_blocks(t: int) -> list[tuple[int, int]]:
    """The query blocks [a, b) of a T-token window (one block below 2 x CAUSAL_MIN_BLOCK)."""
    n = min(CAUSAL_BLOCKS, max(1, t // CAUSAL_MIN_BLOCK))
    bounds = [round(i * t / n) for i in range(n + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def causal_self_attention(
    q: jax.Array,  # f[B, T, Hq, d]
    k: jax.Array,  # f[B, T, Hkv, d]
    v: jax.Array,  # f[B, T, Hkv, d]
    positions: jax.Array,  # i32[B, T], increasing along T
    window: int | None,
    *,
    sm_scale: float,
) -> jax.Array:  # f32[B, T, Hq, d]
    """`grouped_attention` under `causal_mask(positions, positions, all valid, window)`, in
    query blocks over the keys up to each block's end: with positions increasing along T the
    keys after a block are masked for all of its queries. At 8 blocks that is about half the
    scores of one [T, T] pass, and each block's scores stay small; the same values up to float
    summation order."""
    valid = jnp.ones(positions.shape, bool)
    outs = [
        grouped_attention(
            q[:, a:b],
            k[:, :b],
            v[:, :b],
            causal_mask(positions[:, a:b], positions[:, :b], valid[:, :b], window),
            sm_scale=sm_scale,
        )
        for a, b in query_blocks(q.shape[1])
    ]
    return jnp.concatenate(outs, axis=1)


# ------------------------------------------------------------------------------------------
# Blocked attention: partial softmax state per key block, merged flash-style
# ------------------------------------------------------------------------------------------
# A partial over one key block: (m f32[B, K, G, T] running max (-inf where no key is valid),
# l f32[B, K, G, T] sum of exp(s - m), acc f32[B, K, G, T, d] sum of exp(s - m) v).
Partial = tuple[jax.Array, jax.Array, jax.Array]


def attention_partial(
    qg: jax.Array,  # f32[B, T, K, G, d] grouped queries
    k: jax.Array,  # f[B, S, K, d]
    v: jax.Array,  # f[B, S, K, d]
    mask: jax.Array,  # bool[B, T, S]
    *,
    sm_scale: float,
) -> Partial:
    """Softmax state of the queries over one block of keys; masked slots (NaN or garbage
    included) never reach it. Only this block's ``[T, S]`` scores exist at once."""
    keep = mask.any(axis=1)[:, :, None, None]
    k32 = jnp.where(keep, k.astype(jnp.float32), 0.0)
    v32 = jnp.where(keep, v.astype(jnp.float32), 0.0)
    s = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k32) * sm_scale
    m = mask[:, None, None, :, :]
    s = jnp.where(m, s, -jnp.inf)
    s_max = jnp.max(s, axis=-1)
    p = jnp.where(m, jnp.exp(s - jnp.where(jnp.isfinite(s_max), s_max, 0.0)[..., None]), 0.0)
    return s_max, jnp.sum(p, axis=-1), jnp.einsum("BKGTS,BSKH->BKGTH", p, v32)


def empty_partial(qg: jax.Array) -> Partial:
    """The state before any key: max -inf, nothing summed."""
    b, t, kh, g, d = qg.shape
    return (
        jnp.full((b, kh, g, t), -jnp.inf, jnp.float32),
        jnp.zeros((b, kh, g, t), jnp.float32),
        jnp.zeros((b, kh, g, t, d), jnp.float32),
    )


def merge_partials(a: Partial, b: Partial) -> Partial:
    """Softmax state over both blocks' keys. Merging a block with no valid key leaves the
    other state bit-identical (its weight is exactly 0, the other's exactly 1)."""
    m = jnp.maximum(a[0], b[0])
    safe = jnp.where(jnp.isfinite(m), m, 0.0)
    wa = jnp.where(jnp.isfinite(a[0]), jnp.exp(a[0] - safe), 0.0)
    wb = jnp.where(jnp.isfinite(b[0]), jnp.exp(b[0] - safe), 0.0)
    return m, a[1] * wa + b[1] * wb, a[2] * wa[..., None] + b[2] * wb[..., None]


def finish_partial(state: Partial, q_shape: tuple[int, ...]) -> jax.Array:
    """f32[B, T, Hq, d] output of a merged state; rows that saw no key are zeros."""
    _, l, acc = state
    o = acc / jnp.where(l > 0, l, 1.0)[..., None]  # [B, K, G, T, d]
    return o.transpose(0, 3, 1, 2, 4).reshape(q_shape)
