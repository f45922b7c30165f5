"""Next-token sampling under jit, one set of parameters per row: greedy, temperature, top-k, top-p.

Each row draws with its own key, folded with the index of the token being drawn, so a request's
samples depend on its seed and its tokens only, never on which other requests share the batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: must be >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")


def base_key(seed: int) -> np.ndarray:
    """The raw uint32[2] key a request's draws are folded from."""
    return np.asarray(jax.random.key_data(jax.random.key(seed)), np.uint32)


def filter_logits(
    logits: jax.Array,  # f32[R, V], already divided by the temperature
    top_k: jax.Array,  # i32[R]
    top_p: jax.Array,  # f32[R]
) -> jax.Array:
    """Sets logits outside each row's top-k and smallest top-p mass to -inf (ties stay)."""
    v = logits.shape[-1]
    desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)
    probs = jax.nn.softmax(desc, axis=-1)
    # The smallest prefix whose mass reaches top_p (the first token always stays).
    kept = ((jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]).sum(-1)
    pth = jnp.take_along_axis(desc, (kept - 1)[:, None], axis=-1)
    return jnp.where(logits >= jnp.maximum(kth, pth), logits, -jnp.inf)


def sample_rows(
    logits: jax.Array,  # f32[R, V]
    keys: jax.Array,  # u32[R, 2] raw base keys
    index: jax.Array,  # i32[R] index of the token being drawn (its position)
    temperature: jax.Array,  # f32[R]
    top_k: jax.Array,  # i32[R]
    top_p: jax.Array,  # f32[R]
) -> jax.Array:  # i32[R]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = temperature > 0

    def draw(_):
        scaled = logits / jnp.where(sampled, temperature, 1.0)[:, None]
        needs_filter = jnp.any(sampled & ((top_k > 0) | (top_p < 1)))
        scaled = jax.lax.cond(
            needs_filter, lambda x: filter_logits(x, top_k, top_p), lambda x: x, scaled
        )
        row_keys = jax.vmap(jax.random.fold_in)(keys, index)
        return jax.vmap(jax.random.categorical)(row_keys, scaled).astype(jnp.int32)

    drawn = jax.lax.cond(jnp.any(sampled), draw, lambda _: greedy, None)
    return jnp.where(sampled, drawn, greedy)
