"""The transform pytree that serving applies: per (layer, KV head) pairs (A, B) with A @ B = I.

Row-vector convention (DESIGN.md section 3): a cached key/value `x` is stored as Q(x A) and read
back as Q(x A) B. For keys the query moves into the stored frame once, `q B^T`, so logits are
`(q B^T) . Q(k A)`. For values the output `(sum_s p_s Q(v_s A)) B` applies B once per head, or
B is folded into W_O and A into W_V (`fold_value_transforms`).

Keys may also be centred: stored as Q((k - mu) A) with mu a fixed per-(layer, KV head) mean
key (after RoPE) from calibration. Every key of a head moves by the same vector, so each query's
logits all move by the same q . mu and the softmax is unchanged: the kernels and the queries need
nothing. A model whose keys share a large offset (Gemma 3's global layers) otherwise spends the
per-token quantizer's range on that offset.

The math that *makes* these matrices lives in `calib/`; a deployment only needs this pytree.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVTransforms:
    """Per-layer key/value transforms and clip ratios.

    Attributes:
      a_k, b_k: f32[L, Hkv, d, d] key transform and its inverse (A_K @ B_K = I).
      a_v, b_v: f32[L, Hkv, d, d] value transform and its inverse.
      clip_k, clip_v: f32[L] quantizer clip parameter per layer (oscar: percentile kappa).
      values_folded: A_V / B_V already folded into W_V / W_O; the cache then leaves values as is.
      key_mean: f32[L, Hkv, d] key offset subtracted before A_K (None: keys not centred).
    """

    a_k: jax.Array
    b_k: jax.Array
    a_v: jax.Array
    b_v: jax.Array
    clip_k: jax.Array
    clip_v: jax.Array
    values_folded: bool = dataclasses.field(default=False, metadata=dict(static=True))
    key_mean: jax.Array | None = None

    @property
    def num_layers(self) -> int:
        return self.a_k.shape[0]

    @classmethod
    def identity(cls, cfg: ModelConfig, clip_k: float = 1.0, clip_v: float = 1.0) -> KVTransforms:
        eye = np.broadcast_to(
            np.eye(cfg.head_dim, dtype=np.float32),
            (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim),
        )
        ones = np.ones((cfg.num_layers,), np.float32)
        return cls(
            *(jnp.asarray(eye) for _ in range(4)),
            jnp.asarray(clip_k * ones),
            jnp.asarray(clip_v * ones),
        )

    def check_matches(self, cfg: ModelConfig) -> None:
        """Raises ValueError naming the mismatch if these transforms do not fit `cfg`."""
        want = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim)
        for name in ("a_k", "b_k", "a_v", "b_v"):
            got = tuple(getattr(self, name).shape)
            if got != want:
                raise ValueError(
                    f"transform {name} has shape {got}, but the model needs {want} "
                    f"(layers, kv_heads, head_dim, head_dim): made for another model?"
                )
        for name in ("clip_k", "clip_v"):
            if tuple(getattr(self, name).shape) != (cfg.num_layers,):
                raise ValueError(
                    f"{name} has shape {getattr(self, name).shape}, want ({cfg.num_layers},)"
                )
        if self.key_mean is not None and tuple(self.key_mean.shape) != want[:3]:
            raise ValueError(
                f"key_mean has shape {tuple(self.key_mean.shape)}, but the model needs "
                f"{want[:3]} (layers, kv_heads, head_dim)"
            )

    # ---- moving activations between the model frame and the stored frame ----------------
    def centred_keys(self, layer: int, k: jax.Array) -> jax.Array:
        """k - mu per KV head (k itself when keys are not centred): f32[B, T, Hkv, d]."""
        k = k.astype(jnp.float32)
        return k if self.key_mean is None else k - self.key_mean[layer].astype(jnp.float32)

    def keys_to_stored(self, layer: int, k: jax.Array) -> jax.Array:
        """(k - mu) A_K per KV head: f[B, T, Hkv, d] -> f32[B, T, Hkv, d]."""
        return jnp.einsum("BTKH,KHJ->BTKJ", self.centred_keys(layer, k), self.a_k[layer])

    def values_to_stored(self, layer: int, v: jax.Array) -> jax.Array:
        """v A_V per KV head: f[B, T, Hkv, d] -> f32[B, T, Hkv, d]."""
        return jnp.einsum("BTKH,KHJ->BTKJ", v.astype(jnp.float32), self.a_v[layer])

    def queries_to_key_frame(self, layer: int, q: jax.Array) -> jax.Array:
        """q B_K^T per query head (its KV head's B_K): f[B, T, Hq, d] -> f32[B, T, Hq, d]."""
        b, t, hq, d = q.shape
        hkv = self.b_k.shape[1]
        qg = q.astype(jnp.float32).reshape(b, t, hkv, hq // hkv, d)
        return jnp.einsum("BTKGH,KJH->BTKGJ", qg, self.b_k[layer]).reshape(q.shape)

    def outputs_from_value_frame(self, layer: int, o: jax.Array) -> jax.Array:
        """o B_V per query head (identity once folded): f[B, T, Hq, d] -> f32[B, T, Hq, d]."""
        if self.values_folded:
            return o.astype(jnp.float32)
        b, t, hq, d = o.shape
        hkv = self.b_v.shape[1]
        og = o.astype(jnp.float32).reshape(b, t, hkv, hq // hkv, d)
        return jnp.einsum("BTKGH,KHJ->BTKGJ", og, self.b_v[layer]).reshape(o.shape)

    def with_values_folded(self) -> KVTransforms:
        """The same transforms with the value pair replaced by identity (after folding)."""
        eye = jnp.broadcast_to(jnp.eye(self.a_v.shape[-1], dtype=self.a_v.dtype), self.a_v.shape)
        return dataclasses.replace(self, a_v=eye, b_v=eye, values_folded=True)


def fold_value_transforms(model, transforms: KVTransforms) -> KVTransforms:
    """Folds A_V into W_V (and its bias) and B_V into W_O, in place on an NNX model.

    Row convention: v' = v A_V = x (W_V^T A_V), and the head output o' B_V feeds o_proj, so
    W_O's per-head input block becomes B_V @ block. Returns the transforms with identity value
    pairs, which is what the cache must then use.
    """
    if transforms.values_folded:
        raise ValueError("value transforms are already folded")
    cfg = model.cfg
    d, hkv, g = cfg.head_dim, cfg.num_kv_heads, cfg.group_size
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        a_v = transforms.a_v[i].astype(jnp.float32)  # [Hkv, d, d]
        b_v = transforms.b_v[i].astype(jnp.float32)
        kv = attn.v_proj.kernel[...]  # [D, Hkv*d]  (flax kernel: y = x @ kernel)
        kv = jnp.einsum("DKH,KHJ->DKJ", kv.reshape(-1, hkv, d).astype(jnp.float32), a_v)
        attn.v_proj.kernel[...] = kv.reshape(-1, hkv * d).astype(attn.v_proj.kernel.dtype)
        if attn.v_proj.bias is not None:
            bv = attn.v_proj.bias[...].reshape(hkv, d).astype(jnp.float32)
            attn.v_proj.bias[...] = (
                jnp.einsum("KH,KHJ->KJ", bv, a_v).reshape(-1).astype(attn.v_proj.bias.dtype)
            )
        ko = attn.o_proj.kernel[...]  # [Hq*d, D]; head j's rows read o_j
        ko = ko.reshape(hkv, g, d, -1).astype(jnp.float32)
        ko = jnp.einsum("KHJ,KGJD->KGHD", b_v, ko)
        attn.o_proj.kernel[...] = ko.reshape(hkv * g * d, -1).astype(attn.o_proj.kernel.dtype)
    return transforms.with_values_folded()
