"""End-to-end sensitivity of the model to one (layer, K/V) cache at one format: the
``--allocation-objective kl`` of a bit allocation (`calib.allocation`).

The ``attention`` objective scores each (layer, K/V) cache by its layer's relative
attention-output error; it cannot see how much that layer's error matters to the model's
output. This module measures that directly: for slot ``s`` (layer ``l``'s keys, or its values)
and format ``f`` (width and scale/zero encoding), the model runs on held-out calibration windows
with only that cache read back from format ``f`` (the method's transform, the clip calibrated
for ``f``'s width, the oscar quantizer), every other cache exact, and the sink and recent
windows kept in full precision as the paged cache keeps them: query ``t`` reads key/value ``s``
from low-bit storage iff ``sink <= s < quant_end(t)`` (`CacheConfig.quant_end`, tokens fed one
per call). The score is the mean over scored positions of KL(p_fp || p_q) between the
full-precision and the quantized next-token distributions, in nats per token.

KL is used rather than the change of next-token NLL: it is never negative and does not average
away in sign, so one or two held-out windows suffice. For small independent perturbations it is
second order and additive across caches, which is what the knapsack's summed objective assumes.

The quantized slot is a traced index (`SingleCacheQuant.target`), so every slot of one format
reuses one compiled forward; layers other than the target run plain attention (`lax.cond`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from calib import errors
from kvjax.cache.attention import causal_mask, grouped_attention, split_heads_by_group
from kvjax.cache.budget import Format
from kvjax.cache.paged import CacheConfig
from kvjax.cache.quantizers import QuantConfig
from kvjax.models.loading import LoadedModel

OBJECTIVES: tuple[str, ...] = ("attention", "kl", "kl_scaled")
OBJECTIVE_TEXT = {
    "attention": "relative attention-output error per (layer, K/V) with only that cache "
    "quantized, on the held-out calibration windows",
    "kl": "mean KL(full precision || quantized) of the next-token distribution, nats per token, "
    "per (layer, K/V) with only that cache quantized (sink/recent windows full precision), "
    "measured at every format on the held-out calibration windows",
    "kl_scaled": "mean KL(full precision || quantized) of the next-token distribution, nats per "
    "token, per (layer, K/V) with only that cache quantized (sink/recent windows full "
    "precision), measured at the cheapest format on the held-out calibration windows; other "
    "formats scaled by their relative attention-output error",
}


@flax.struct.dataclass
class SingleCacheQuant:
    """Cache-protocol object for ONE full-window call from position 0: the keys (``target =
    2 l``) or the values (``2 l + 1``) of layer ``l`` are read from low-bit storage in the
    middle segment, every other cache is exact. ``target = -1`` quantizes nothing."""

    a_k: jax.Array  # f32[L, Hkv, d, d]
    b_k: jax.Array
    a_v: jax.Array
    b_v: jax.Array
    clip_k: jax.Array  # f32[L] clips of the format's width
    clip_v: jax.Array
    target: jax.Array  # i32 scalar
    lengths: jax.Array  # i32[B], zeros
    qc: QuantConfig = flax.struct.field(pytree_node=False)
    windows: CacheConfig = flax.struct.field(pytree_node=False)
    sm_scale: float = flax.struct.field(pytree_node=False)
    layer_windows: tuple[int | None, ...] = flax.struct.field(pytree_node=False, default=())
    key_mean: jax.Array | None = None  # f32[L, Hkv, d] (centred keys) or None

    def attend(self, layer, q, k, v, positions):
        window = self.layer_windows[layer] if self.layer_windows else None
        b, t = positions.shape
        mask = causal_mask(positions, positions, jnp.ones((b, t), bool), window)

        def plain(q, k, v):
            return grouped_attention(q, k, v, mask, sm_scale=self.sm_scale)

        def quantized(q, k, v):
            q, k, v = (x.astype(jnp.float32) for x in (q, k, v))

            # Only the target cache is read back from low-bit storage (one roundtrip, not two).
            def keys_low(k, v):
                mu = None if self.key_mean is None else self.key_mean[layer]
                kq = errors.roundtrip(
                    k, self.a_k[layer], self.b_k[layer], self.qc, self.clip_k[layer], mu
                )
                return kq, v

            def values_low(k, v):
                vq = errors.roundtrip(
                    v, self.a_v[layer], self.b_v[layer], self.qc, self.clip_v[layer]
                )
                return k, vq

            k_hat, v_hat = jax.lax.cond(self.target % 2 == 0, keys_low, values_low, k, v)
            q_end = self.windows.quant_end(positions)  # [B, T]: tokens stored before t
            s_pos = positions[:, None, :]
            low = (s_pos >= self.windows.sink) & (s_pos < q_end[:, :, None]) & mask
            low = low[:, None, None]  # [B, 1, 1, T, S]
            qg = split_heads_by_group(q, k.shape[2])  # [B, T, K, G, H]
            s_fp = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k)
            s_lo = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k_hat)
            s = jnp.where(low, s_lo, s_fp) * self.sm_scale
            s = jnp.where(mask[:, None, None], s, -jnp.inf)
            p = jax.nn.softmax(s, axis=-1)
            o = jnp.einsum("BKGTS,BSKH->BTKGH", jnp.where(low, 0.0, p), v)
            o = o + jnp.einsum("BKGTS,BSKH->BTKGH", jnp.where(low, p, 0.0), v_hat)
            return o.reshape(q.shape)

        o = jax.lax.cond(self.target // 2 == layer, quantized, plain, q, k, v)
        return o, self

    def advance(self, num_tokens: int) -> SingleCacheQuant:
        return self.replace(lengths=self.lengths + num_tokens)


def _kl_per_position(logits_fp: jax.Array, logits_q: jax.Array) -> jax.Array:  # f32[B, T]
    lp = jax.nn.log_softmax(logits_fp, axis=-1)
    lq = jax.nn.log_softmax(logits_q, axis=-1)
    return jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1)


def kl_bit_errors(
    lm: LoadedModel,
    windows: np.ndarray,  # i32[N, T] held-out calibration windows
    pairs: Sequence,  # per layer TransformPair (A_K, B_K, A_V, B_V)
    clips_by_bits: dict[int, tuple[np.ndarray, np.ndarray]],
    formats: Sequence[Format],
    cache_windows: tuple[int, int, int] = (16, 128, 16),
    group_size: int | None = None,
    progress: bool = True,
    layers: Sequence[int] | None = None,
    key_mean: np.ndarray | None = None,
) -> dict[str, np.ndarray]:  # format name -> f64[L, 2] mean KL (nats per token)
    """Mean KL(p_fp || p_q) per (layer, K/V) with only that cache in each format.

    Args:
      lm: the model.
      windows: the held-out calibration windows (never the evaluation text).
      pairs: the method's per-layer transforms (`calib.transforms.TransformPair`).
      clips_by_bits: width -> (key clips f32[L], value clips f32[L]).
      formats: the allocation's candidate formats.
      cache_windows: sink, keep, flush of the simulated cache (full-precision windows).
      group_size: channels per scale/zero.
      layers: the layers to measure (None: all); the others (layers that hold no low-bit
        pages, `calib.allocation.lowbit_layers`) get 0 without a forward.
      key_mean: f32[L, Hkv, d] mean keys subtracted before the key transform (centred keys).

    Raises:
      ValueError: the windows are too short for any position to read a low-bit token.
    """
    sink, keep, flush = cache_windows
    wcfg = CacheConfig(sink=sink, keep=keep, flush=flush, page_size=1, quant=None)
    t = windows.shape[1]
    if wcfg.quant_end(t - 1) <= sink:
        raise ValueError(
            f"held-out windows of {t} tokens are too short for windows {sink}/{keep}/{flush}: "
            f"no position reads a low-bit token"
        )
    n_layers = lm.cfg.num_layers
    measured = range(n_layers) if layers is None else sorted(set(layers))
    slots = [2 * i + j for i in measured for j in (0, 1)]
    graphdef, params = nnx.split(lm.model)
    a_k, b_k, a_v, b_v = (
        jnp.asarray(np.stack([getattr(p, name) for p in pairs]), jnp.float32)
        for name in ("A_K", "B_K", "A_V", "B_V")
    )
    layer_windows = tuple(lm.cfg.layer_windows)
    km = None if key_mean is None else jnp.asarray(key_mean, jnp.float32)

    @jax.jit
    def reference(params, tokens):
        m = nnx.merge(graphdef, params)
        logits, _ = m(tokens)
        return logits

    @jax.jit  # one compilation per format (the quantizer is static in the cache)
    def run(params, tokens, logits_fp, cache):
        m = nnx.merge(graphdef, params)
        logits, _ = m(tokens, cache)
        return jnp.mean(_kl_per_position(logits_fp, logits))

    tokens = [jnp.asarray(w[None, :-1], jnp.int32) for w in windows]
    refs = [reference(params, x) for x in tokens]
    out: dict[str, np.ndarray] = {}
    t0 = time.perf_counter()
    done, total = 0, len(formats) * len(slots)
    for f in formats:
        qc = QuantConfig(method="oscar", bits=f.bits, group_size=group_size,
                         meta_dtype=f.meta_dtype)  # fmt: skip
        ck, cv = clips_by_bits[f.bits]
        e = np.zeros((n_layers, 2))
        for s in slots:
            vals = []
            for x, ref in zip(tokens, refs):
                cache = SingleCacheQuant(
                    a_k, b_k, a_v, b_v,
                    jnp.asarray(ck, jnp.float32), jnp.asarray(cv, jnp.float32),
                    jnp.asarray(s, jnp.int32), jnp.zeros((x.shape[0],), jnp.int32),
                    qc=qc, windows=wcfg, sm_scale=lm.cfg.attention_scale,
                    layer_windows=layer_windows, key_mean=km,
                )  # fmt: skip
                vals.append(float(run(params, x, ref, cache)))
            e[s // 2, s % 2] = max(float(np.mean(vals)), 0.0)
            done += 1
            if progress and (done % 10 == 0 or done == total):
                el = time.perf_counter() - t0
                print(f"[calibrate] kl objective: {done}/{total} caches, {el:.0f}s",
                      file=sys.stderr, flush=True)  # fmt: skip
        out[f.name] = e
    return out


def scaled_errors(
    measured: np.ndarray,  # f64[L, 2] KL at the reference format
    attention: dict[str, np.ndarray],  # format name -> f64[L, 2] attention-output errors
    reference: str,
) -> dict[str, np.ndarray]:
    """KL estimates of every format from the KL measured at `reference`: each (layer, K/V)
    cache's KL per unit of its attention-output error at `reference`, times its attention
    error at the other format (a cache whose reference error is 0 gets 0)."""
    ref = np.asarray(attention[reference], np.float64)
    ratio = np.divide(measured, ref, out=np.zeros_like(ref), where=ref > 0)
    return {n: ratio * np.asarray(e, np.float64) for n, e in attention.items()}


def cheapest(formats: Sequence[Format], head_dim: int, group_size: int | None = None) -> Format:
    """The candidate with the fewest stored bits (first listed on ties): the one `kl_scaled`
    measures, since most caches of a tight budget sit there."""
    return min(formats, key=lambda f: f.bits_per_token(head_dim, group_size))
