"""Attention-aware quantization errors of one layer, used to choose clips and to compare methods.

Everything here takes one layer's observed activations (post-norm, post-RoPE q, k and v of full
causal sequences) and one layer's (A, B) pairs, quantizes the *whole* K/V sequence (no
full-precision windows, isolating the transform, as WUSH-KV section 5.1 does), and measures:

- `key_error`: sum_t e_t C_Q e_t^T with e_t = k_t - Q(k_t A_K) B_K, the expected squared logit
  error over the calibration queries (per KV head);
- `value_error`: || sum_j P_j (V - V_hat) W_O,j ||^2, the attention-output error that value
  quantization causes at the o_proj output;
- `attention_errors`: relative squared errors of logits, softmax and module output, and the KL
  of attention distributions, with K and/or V quantized (the eval's per-layer diagnostics).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.cache.quantizers import QuantConfig, fake_quantize


def roundtrip(
    x: jax.Array,  # f32[B, T, Hkv, d]
    a: jax.Array,  # f32[Hkv, d, d]
    b: jax.Array,  # f32[Hkv, d, d]
    qc: QuantConfig | None,
    clip: jax.Array | float | None,
    mean: jax.Array | None = None,  # f32[Hkv, d] centred keys' offset (`KVTransforms.key_mean`)
) -> jax.Array:  # f32[B, T, Hkv, d]
    """x_hat = Q((x - mean) A) B + mean per KV head (qc None: no quantization; mean None: 0).
    Adding the mean back keeps x_hat comparable with x (the logits move by q . mean)."""
    if mean is not None:
        x = x - mean
    xa = jnp.einsum("BTKH,KHJ->BTKJ", x, a)
    if qc is not None:
        xa = fake_quantize(xa, qc, clip=clip if qc.method == "oscar" else None)
    x_hat = jnp.einsum("BTKJ,KJH->BTKH", xa, b)
    return x_hat if mean is None else x_hat + mean


def _probs(q, k, sm_scale):
    """Causal softmax per query head: [B, Hkv, G, T, S] (and the logits)."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    s = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k) * sm_scale
    causal = jnp.tril(jnp.ones((t, t), bool))
    s = jnp.where(causal, s, -jnp.inf)
    return jax.nn.softmax(s, axis=-1), jnp.where(causal, s, 0.0)


def _module_output(p, v, w_o_heads):
    """y = sum_j (P_j V) W_O,j : [B, T, D]. w_o_heads: [Hkv, G, d, D]."""
    o = jnp.einsum("BKGTS,BSKH->BTKGH", p, v)
    return jnp.einsum("BTKGH,KGHD->BTD", o, w_o_heads)


def w_o_heads(w_o: jax.Array, num_kv_heads: int, head_dim: int) -> jax.Array:
    """torch-layout o_proj weight [D, Hq*d] -> per-head row blocks [Hkv, G, d, D]."""
    dm = w_o.shape[0]
    return w_o.T.reshape(num_kv_heads, -1, head_dim, dm)


def key_error(k, k_hat, c_q):
    """f32[Hkv]: sum_t e_t C_Q e_t^T per KV head (C_Q: [Hkv, d, d])."""
    e = k - k_hat
    return jnp.einsum("BTKX,KXY,BTKY->K", e, c_q, e)


def value_error(q, k, v, v_hat, w_o_h, sm_scale):
    """f32 scalar: squared o_proj-output error caused by replacing V with V_hat."""
    p, _ = _probs(q, k, sm_scale)
    return jnp.sum(_module_output(p, v - v_hat, w_o_h) ** 2)


def attention_errors(
    q: jax.Array,  # f32[B, T, Hq, d]
    k: jax.Array,  # f32[B, T, Hkv, d]
    v: jax.Array,  # f32[B, T, Hkv, d]
    k_hat: jax.Array,  # f32[B, T, Hkv, d] reconstructed keys (k itself = keys not quantized)
    v_hat: jax.Array,  # f32[B, T, Hkv, d]
    w_o_h: jax.Array,  # f32[Hkv, G, d, D]
    sm_scale: float,
) -> dict[str, jax.Array]:
    """Sums of squared errors and references, so callers can pool batches before dividing.

    Returns a dict of f32 scalars: logit_err, logit_ref, prob_err, prob_ref, out_err, out_ref,
    kl_sum, kl_count.
    """
    p, s = _probs(q, k, sm_scale)
    p_hat, s_hat = _probs(q, k_hat, sm_scale)
    y = _module_output(p, v, w_o_h)
    y_hat = _module_output(p_hat, v_hat, w_o_h)
    t = q.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    logp = jnp.log(jnp.where(causal, p, 1.0))
    logp_hat = jnp.log(jnp.where(causal, jnp.maximum(p_hat, 1e-30), 1.0))
    kl = jnp.sum(jnp.where(causal, p * (logp - logp_hat), 0.0))
    return dict(
        logit_err=jnp.sum((s - s_hat) ** 2),
        logit_ref=jnp.sum(s**2),
        prob_err=jnp.sum((p - p_hat) ** 2),
        prob_ref=jnp.sum(p**2),
        out_err=jnp.sum((y - y_hat) ** 2),
        out_ref=jnp.sum(y**2),
        kl_sum=kl,
        kl_count=jnp.asarray(p.shape[0] * p.shape[1] * p.shape[2] * t, jnp.float32),
    )
