"""Flax NNX port of the Llama / Qwen2 / Qwen3 decoder stack.

One module covers the family: q/k RMSNorm per head (Qwen3) and q/k/v bias (Qwen2) are options
of `ModelConfig`. The attention layer is the seam the rest of kvjax plugs into:

- it takes a cache object (`kvjax.kv_cache.KVCache` protocol) and positions, and returns the
  updated cache; with no cache it runs plain causal attention over the chunk;
- an opt-in observer (`Transformer.set_observer`) sees post-norm, post-RoPE q, k, v and the
  per-head attention output before o_proj; what it returns is sown as an `nnx.Intermediate`
  named "observed" and collected with `capture_observed`.

Weights arrive as a dict of numpy arrays with HuggingFace names and torch layouts
(`Transformer.from_weights`); GGUF and safetensors loaders produce that dict.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.attention import causal_mask, grouped_attention
from kvjax.config import ModelConfig

# observer(layer_idx, q, k, v, o) -> pytree. q: [B,T,Hq,d], k/v: [B,T,Hkv,d], o: [B,T,Hq,d].
Observer = Callable[[int, jax.Array, jax.Array, jax.Array, jax.Array], Any]


class MissingWeightsError(ValueError):
    """The checkpoint lacks tensors the architecture needs."""


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def rope_cos_sin(
    positions: jax.Array, rotary_dim: int, theta: float
) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [B, T, rotary_dim] for rotate-half RoPE (HF convention)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates the first cos.shape[-1] channels of x [B, T, H, d]; the rest pass through."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot].astype(jnp.float32), x[..., rot:]
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = xr * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return jnp.concatenate([out.astype(x.dtype), xp], axis=-1)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: jnp.dtype, rngs: nnx.Rngs):
        d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        lin = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.q_proj = nnx.Linear(cfg.hidden_size, hq * d, use_bias=cfg.attention_bias, **lin)
        self.k_proj = nnx.Linear(cfg.hidden_size, hkv * d, use_bias=cfg.attention_bias, **lin)
        self.v_proj = nnx.Linear(cfg.hidden_size, hkv * d, use_bias=cfg.attention_bias, **lin)
        self.o_proj = nnx.Linear(hq * d, cfg.hidden_size, use_bias=cfg.o_proj_bias, **lin)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.observer: Observer | None = None

    def __call__(
        self,
        x: jax.Array,  # f[B, T, D]
        positions: jax.Array,  # i32[B, T]
        rope: tuple[jax.Array, jax.Array],  # cos, sin [B, T, rotary_dim]
        cache: Any | None,
    ) -> tuple[jax.Array, Any | None]:
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is None:
            valid = jnp.ones((b, t), bool)
            o = grouped_attention(
                q, k, v, causal_mask(positions, positions, valid), sm_scale=cfg.head_dim**-0.5
            )
        else:
            o, cache = cache.attend(self.layer_idx, q, k, v, positions)
        if self.observer is not None:
            observed = self.observer(
                self.layer_idx, q.astype(jnp.float32), k.astype(jnp.float32),
                v.astype(jnp.float32), o,
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                self.sow(nnx.Intermediate, "observed", observed)
        y = self.o_proj(o.astype(x.dtype).reshape(b, t, cfg.num_heads * cfg.head_dim))
        return y, cache


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        lin = dict(use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.gate_proj = nnx.Linear(cfg.hidden_size, cfg.intermediate_size, **lin)
        self.up_proj = nnx.Linear(cfg.hidden_size, cfg.intermediate_size, **lin)
        self.down_proj = nnx.Linear(cfg.intermediate_size, cfg.hidden_size, **lin)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, layer_idx, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(self, x, positions, rope, cache):
        h, cache = self.self_attn(self.input_layernorm(x), positions, rope, cache)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, cache


class Transformer(nnx.Module):
    """Decoder-only causal LM. `__call__(tokens, cache=None) -> (logits f32[B,T,V], cache)`."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype = jnp.float32, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        self.layers = nnx.List(
            [DecoderLayer(cfg, i, dtype, rngs) for i in range(cfg.num_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nnx.Linear(
                cfg.hidden_size, cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype,
                rngs=rngs,
            )

    def __call__(
        self,
        tokens: jax.Array,  # i32[B, T]
        cache: Any | None = None,
        positions: jax.Array | None = None,  # i32[B, T]; default: cache lengths + arange(T)
    ) -> tuple[jax.Array, Any | None]:
        b, t = tokens.shape
        if positions is None:
            start = cache.lengths if cache is not None else jnp.zeros((b,), jnp.int32)
            positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        rope = rope_cos_sin(positions, self.cfg.rotary_dim, self.cfg.rope_theta)
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x, cache = layer(x, positions, rope, cache)
        x = self.norm(x)
        if self.lm_head is None:
            logits = self.embed_tokens.attend(x)
        else:
            logits = self.lm_head(x)
        if cache is not None:
            cache = cache.advance(t)
        return logits.astype(jnp.float32), cache

    # ----- observer seam -----
    def set_observer(self, observer: Observer | None) -> None:
        """Installs (or removes, with None) the calibration/diagnostic observer on every layer."""
        for layer in self.layers:
            layer.self_attn.observer = observer

    # ----- weights -----
    @classmethod
    def from_weights(
        cls, cfg: ModelConfig, weights: Mapping[str, np.ndarray], dtype: jnp.dtype = jnp.float32
    ) -> Transformer:
        """Builds the model from HF-named tensors (torch layout: Linear weight is [out, in]).

        Raises:
            MissingWeightsError: listing every tensor the architecture needs but did not get.
        """
        model = nnx.eval_shape(lambda: cls(cfg, dtype, rngs=nnx.Rngs(0)))
        needed = expected_weight_names(cfg)
        missing = [n for n in needed if n not in weights]
        if missing:
            shown = ", ".join(missing[:8]) + (f" ... ({len(missing)} in all)" if len(missing) > 8 else "")
            raise MissingWeightsError(f"checkpoint is missing tensors: {shown}")
        graphdef, state = nnx.split(model)
        flat = dict(nnx.to_flat_state(state))
        new_flat = {}
        for path, var in flat.items():
            name, transpose = _hf_name(path)
            arr = np.asarray(weights[name])
            if transpose:
                arr = arr.T
            if arr.shape != tuple(var.get_value().shape):
                raise ValueError(
                    f"tensor {name} has shape {arr.shape}, expected {tuple(var.get_value().shape)}"
                    f"{' (transposed)' if transpose else ''} for {cfg.model_type}"
                )
            new_flat[path] = var.replace(jnp.asarray(arr, dtype))
        state = nnx.from_flat_state(new_flat)
        return nnx.merge(graphdef, state)


def expected_weight_names(cfg: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names.append(p + f"self_attn.{proj}.weight")
        if cfg.attention_bias:
            names += [p + f"self_attn.{x}.bias" for x in ("q_proj", "k_proj", "v_proj")]
        if cfg.o_proj_bias:
            names.append(p + "self_attn.o_proj.bias")
        if cfg.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names += [p + f"mlp.{x}.weight" for x in ("gate_proj", "up_proj", "down_proj")]
    return names


def _hf_name(path: tuple) -> tuple[str, bool]:
    """Maps an NNX state path to (HF tensor name, needs transpose)."""
    parts = [str(p) for p in path]
    leaf = parts[-1]
    if parts[0] == "embed_tokens":
        return "model.embed_tokens.weight", False
    if parts[0] == "lm_head":
        return "lm_head.weight", True
    prefix = "model." if parts[0] in ("layers", "norm") else ""
    if leaf == "kernel":
        return prefix + ".".join(parts[:-1]) + ".weight", True
    return prefix + ".".join(parts[:-1] + [leaf if leaf != "weight" else "weight"]), False


def split_model(model: Transformer):
    """(graphdef, params) for use with jax.jit: `nnx.merge(graphdef, params)` inside."""
    return nnx.split(model)


def capture_observed(model: Transformer) -> list[Any]:
    """Pops what the observer sowed during the last call, one entry per layer (in order)."""
    inter = nnx.pop(model, nnx.Intermediate)
    out = []
    for i in range(len(model.layers)):
        node = inter["layers"][i]["self_attn"]["observed"]
        val = node.value if hasattr(node, "value") else node
        out.append(val[0] if isinstance(val, tuple) else val)
    return out
