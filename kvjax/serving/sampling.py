"""Next-token sampling from logits: greedy, temperature and top-p, under jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample_next(
    logits: jax.Array,  # f32[B, V]
    key: jax.Array,
    temperature: float,
    top_p: float,
) -> jax.Array:  # i32[B]
    """Greedy when temperature == 0, else temperature sampling restricted to the top-p mass."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        keep_sorted = (jnp.cumsum(probs, axis=-1) - probs) < top_p
        keep = (
            jnp.zeros_like(keep_sorted)
            .at[jnp.arange(logits.shape[0])[:, None], order]
            .set(keep_sorted)
        )
        logits = jnp.where(keep, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
