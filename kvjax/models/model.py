"""Flax NNX port of the Llama / Qwen2 / Qwen3 / GLM-4 / GLM-4-MoE / Qwen3-MoE / Gemma 3 decoders.

One module covers the family; the differences are options of `ModelConfig`: q/k RMSNorm per head
(Qwen3, Gemma 3, optional in GLM-4-MoE), q/k/v bias (Qwen2, GLM), partial and interleaved RoPE
(GLM), extra norms on the attention and MLP outputs (GLM-4, Gemma 3), mixture-of-experts MLPs
(`cfg.moe`, math in `kvjax.models.moe`) in the sparse layers, and Gemma 3's pieces: (1 + w)
RMSNorms, GeGLU MLPs, embeddings scaled by sqrt(hidden), softmax scale
query_pre_attn_scalar ** -0.5, and sliding-window layers with their own RoPE base
(`cfg.layer_types`; every cache masks keys older than the window). The attention layer is the
seam the rest of kvjax plugs into:

- it takes a cache object (`kvjax.cache.dense.KVCache` protocol) and positions, and returns the
  updated cache; with no cache it runs plain causal attention over the chunk;
- an opt-in observer (`Transformer.set_observer`) sees post-norm, post-RoPE q, k, v and the
  per-head attention output before o_proj; what it returns is sown as an `nnx.Intermediate`
  named "observed" and collected with `capture_observed`.

Weights arrive as a dict of numpy arrays with HuggingFace names and torch layouts
(`Transformer.from_weights`); GGUF and safetensors loaders produce that dict. Experts may come
one tensor per expert (`mlp.experts.{e}.gate_proj.weight`, the published checkpoints) or
stacked (`mlp.experts.gate_up_proj` [E, 2I, D], transformers' in-memory layout); GLM-4's fused
`mlp.gate_up_proj.weight` is split on load.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.cache.attention import causal_mask, causal_self_attention, grouped_attention
from kvjax.config import ModelConfig
from kvjax.models.moe import MOE_IMPLS, route, routed_experts

# observer(layer_idx, q, k, v, o) -> pytree. q: [B,T,Hq,d], k/v: [B,T,Hkv,d], o: [B,T,Hq,d].
Observer = Callable[[int, jax.Array, jax.Array, jax.Array, jax.Array], Any]


class MissingWeightsError(ValueError):
    """The checkpoint lacks tensors the architecture needs."""


class RMSNorm(nnx.Module):
    """x / rms(x) * (offset + w), in float32. offset is 1 for Gemma (weights stored as w - 1)."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype, offset: float = 0.0):
        self.weight = nnx.Param(jnp.full((dim,), 1.0 - offset, dtype))
        self.eps = eps
        self.offset = offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * (self.offset + self.weight[...].astype(jnp.float32))).astype(x.dtype)


def _norm(cfg: ModelConfig, dim: int, dtype: jnp.dtype) -> RMSNorm:
    return RMSNorm(dim, cfg.rms_norm_eps, dtype, 1.0 if cfg.norm_style == "gemma" else 0.0)


def rope_cos_sin(
    positions: jax.Array,  # i32[B, T]
    rotary_dim: int,
    theta: float,
    interleaved: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [B, T, rotary_dim], laid out for `apply_rope` (HF conventions).

    Rotate-half pairs channel i with i + rotary_dim/2, so frequencies repeat as [f, f];
    interleaved RoPE (GLM-4) pairs 2i with 2i+1, so each frequency appears twice in a row.
    """
    inv_freq = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    if interleaved:
        emb = jnp.repeat(freqs, 2, axis=-1)
    else:
        emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(
    x: jax.Array,  # f[B, T, H, d]
    cos: jax.Array,  # f32[B, T, rotary_dim]
    sin: jax.Array,  # f32[B, T, rotary_dim]
    interleaved: bool = False,
) -> jax.Array:
    """Rotates the first cos.shape[-1] channels of x; the rest pass through unchanged."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot].astype(jnp.float32), x[..., rot:]
    if interleaved:
        pairs = xr.reshape(*xr.shape[:-1], rot // 2, 2)
        rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(xr.shape)
    else:
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
            self.q_norm = _norm(cfg, d, dtype)
            self.k_norm = _norm(cfg, d, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.window = cfg.layer_window(layer_idx)  # None: full causal attention
        self.observer: Observer | None = None

    def __call__(
        self,
        x: jax.Array,  # f[B, T, D]
        positions: jax.Array,  # i32[B, T]
        rope: tuple[jax.Array, jax.Array],  # cos, sin [B, T, rotary_dim]
        cache: Any | None,
        ordered: bool = False,  # positions increase along T (the model made them)
    ) -> tuple[jax.Array, Any | None]:
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, *rope, interleaved=cfg.rope_interleaved)
        k = apply_rope(k, *rope, interleaved=cfg.rope_interleaved)
        if cache is None and ordered:
            o = causal_self_attention(q, k, v, positions, self.window, sm_scale=cfg.attention_scale)
        elif cache is None:
            valid = jnp.ones((b, t), bool)
            mask = causal_mask(positions, positions, valid, self.window)
            o = grouped_attention(q, k, v, mask, sm_scale=cfg.attention_scale)
        else:
            o, cache = cache.attend(self.layer_idx, q, k, v, positions)
        if self.observer is not None:
            observed = self.observer(
                self.layer_idx,
                q.astype(jnp.float32),
                k.astype(jnp.float32),
                v.astype(jnp.float32),
                o,
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                self.sow(nnx.Intermediate, "observed", observed)
        y = self.o_proj(o.astype(x.dtype).reshape(b, t, cfg.num_heads * cfg.head_dim))
        return y, cache


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); act is SiLU (SwiGLU) or tanh-GELU (GeGLU, Gemma)."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        intermediate_size: int | None = None,
    ):
        width = cfg.intermediate_size if intermediate_size is None else intermediate_size
        lin = dict(use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.gate_proj = nnx.Linear(cfg.hidden_size, width, **lin)
        self.up_proj = nnx.Linear(cfg.hidden_size, width, **lin)
        self.down_proj = nnx.Linear(width, cfg.hidden_size, **lin)
        self.hidden_act = cfg.hidden_act

    def __call__(self, x: jax.Array) -> jax.Array:
        g = self.gate_proj(x)
        if self.hidden_act == "gelu_pytorch_tanh":
            g = jax.nn.gelu(g, approximate=True)
        else:
            g = jax.nn.silu(g)
        return self.down_proj(g * self.up_proj(x))


class Router(nnx.Module):
    """Expert router (HF `mlp.gate`): logits = x W^T, then `kvjax.models.moe.route`."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype):
        moe = cfg.moe
        # The sigmoid router's weight and bias stay float32 (HF keeps them so in every dtype).
        self.weight_dtype = jnp.float32 if moe.scoring == "sigmoid" else dtype
        self.weight = nnx.Param(jnp.zeros((moe.num_experts, cfg.hidden_size), self.weight_dtype))
        if moe.score_correction_bias:
            self.e_score_correction_bias = nnx.Param(jnp.zeros((moe.num_experts,), jnp.float32))
        else:
            self.e_score_correction_bias = None
        self.moe = moe

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x f[N, D] -> (weights f32[N, k], expert indices i32[N, k])."""
        logits = x.astype(self.weight_dtype) @ self.weight[...].T  # [N, E]
        bias = self.e_score_correction_bias
        return route(logits.astype(jnp.float32), self.moe, None if bias is None else bias[...])


class Experts(nnx.Module):
    """Routed SwiGLU experts stacked on a leading expert axis (HF `mlp.experts`)."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype):
        e, d, i = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size
        # x @ w layout (like nnx.Linear kernels); HF stores each expert as [out, in].
        self.gate_proj = nnx.Param(jnp.zeros((e, d, i), dtype))
        self.up_proj = nnx.Param(jnp.zeros((e, d, i), dtype))
        self.down_proj = nnx.Param(jnp.zeros((e, i, d), dtype))


class SparseMoE(nnx.Module):
    """Routed experts plus optional always-on shared experts (GLM-4-MoE)."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, impl: str = "sorted"):
        moe = cfg.moe
        self.gate = Router(cfg, dtype)
        self.experts = Experts(cfg, dtype)
        if moe.num_shared_experts:
            width = moe.intermediate_size * moe.num_shared_experts
            self.shared_experts = MLP(cfg, dtype, rngs, intermediate_size=width)
        else:
            self.shared_experts = None
        self.impl = impl

    def __call__(self, x: jax.Array) -> jax.Array:  # f[B, T, D] -> f[B, T, D]
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        weights, idx = self.gate(flat)
        ex = self.experts
        y = routed_experts(
            flat,
            idx,
            weights,
            ex.gate_proj[...],
            ex.up_proj[...],
            ex.down_proj[...],
            impl=self.impl,
        ).reshape(b, t, d)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.input_layernorm = _norm(cfg, cfg.hidden_size, dtype)
        self.self_attn = Attention(cfg, layer_idx, dtype, rngs)
        self.post_attention_layernorm = _norm(cfg, cfg.hidden_size, dtype)
        if cfg.is_sparse_layer(layer_idx):
            self.mlp = SparseMoE(cfg, dtype, rngs)
        else:
            self.mlp = MLP(cfg, dtype, rngs)
        if cfg.sandwich_norms:
            self.post_self_attn_layernorm = _norm(cfg, cfg.hidden_size, dtype)
            self.post_mlp_layernorm = _norm(cfg, cfg.hidden_size, dtype)
        else:
            self.post_self_attn_layernorm = self.post_mlp_layernorm = None

    def __call__(self, x, positions, rope, cache, ordered=False):
        h, cache = self.self_attn(self.input_layernorm(x), positions, rope, cache, ordered)
        if self.post_self_attn_layernorm is not None:
            h = self.post_self_attn_layernorm(h)
        x = x + h
        h = self.mlp(self.post_attention_layernorm(x))
        if self.post_mlp_layernorm is not None:
            h = self.post_mlp_layernorm(h)
        return x + h, cache


class Transformer(nnx.Module):
    """Decoder-only causal LM. `__call__(tokens, cache=None) -> (logits f32[B,T,V], cache)`."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype = jnp.float32, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype, rngs) for i in range(cfg.num_layers)])
        self.norm = _norm(cfg, cfg.hidden_size, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nnx.Linear(
                cfg.hidden_size,
                cfg.vocab_size,
                use_bias=False,
                dtype=dtype,
                param_dtype=dtype,
                rngs=rngs,
            )

    def __call__(
        self,
        tokens: jax.Array,  # i32[B, T]
        cache: Any | None = None,
        positions: jax.Array | None = None,  # i32[B, T]; default: cache lengths + arange(T)
        logits_at: jax.Array | None = None,  # i32[B]: only this position's logits ([B, 1, V])
    ) -> tuple[jax.Array, Any | None]:
        b, t = tokens.shape
        ordered = positions is None
        if positions is None:
            start = cache.lengths if cache is not None else jnp.zeros((b,), jnp.int32)
            positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        cfg = self.cfg
        ropes = {
            theta: rope_cos_sin(positions, cfg.rotary_dim, theta, cfg.rope_interleaved)
            for theta in sorted({cfg.layer_rope_theta(i) for i in range(cfg.num_layers)})
        }
        x = self.embed_tokens(tokens)
        if cfg.scale_embeddings:  # Gemma: the scale is rounded to the weights' dtype, as in HF
            x = x * jnp.asarray(cfg.hidden_size**0.5, self.dtype).astype(x.dtype)
        for i, layer in enumerate(self.layers):
            x, cache = layer(x, positions, ropes[cfg.layer_rope_theta(i)], cache, ordered)
        if logits_at is not None:  # serving: a [B, T, V] logits tensor is the largest one
            x = x[jnp.arange(b), logits_at][:, None]
        x = self.norm(x)
        if self.lm_head is None:
            logits = self.embed_tokens.attend(x)
        else:
            logits = self.lm_head(x)
        logits = logits.astype(jnp.float32)
        if cfg.final_logit_softcapping is not None:
            cap = cfg.final_logit_softcapping
            logits = cap * jnp.tanh(logits / cap)
        if cache is not None:
            cache = cache.advance(t)
        return logits, cache

    # ----- observer seam -----
    def set_observer(self, observer: Observer | None) -> None:
        """Installs (or removes, with None) the calibration/diagnostic observer on every layer."""
        for layer in self.layers:
            layer.self_attn.observer = observer

    def set_moe_impl(self, impl: str) -> None:
        """Chooses how every MoE layer computes its routed mixture (see `kvjax.models.moe`).

        Raises:
            ValueError: `impl` is not one of `kvjax.models.moe.MOE_IMPLS`.
        """
        if impl not in MOE_IMPLS:
            raise ValueError(f"impl={impl!r}; use one of {MOE_IMPLS}")
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.impl = impl

    # ----- weights -----
    @classmethod
    def from_weights(
        cls,
        cfg: ModelConfig,
        weights: Mapping[str, np.ndarray],
        dtype: jnp.dtype = jnp.float32,
        *,
        moe_impl: str = "sorted",
    ) -> Transformer:
        """Builds the model from HF-named tensors (torch layout: Linear weight is [out, in]).

        Args:
            cfg: the architecture.
            weights: tensors by HF name; extra tensors (e.g. GLM's next-token-prediction
                layers) are ignored. Per-expert and stacked expert layouts are both accepted.
            dtype: parameter and activation dtype (the sigmoid router stays float32).
            moe_impl: routed-mixture implementation for MoE layers (`kvjax.models.moe.MOE_IMPLS`).

        Raises:
            MissingWeightsError: listing every tensor the architecture needs but did not get.
            ValueError: a tensor has the wrong shape.
        """
        model = nnx.eval_shape(lambda: cls(cfg, dtype, rngs=nnx.Rngs(0)))
        canon = _canonical_weights(cfg, weights)
        missing = []
        for name, sources in _weight_requirements(cfg):
            if name not in canon:
                missing += [s for s in sources if s not in weights and s not in missing]
        if missing:
            shown = ", ".join(missing[:8]) + (
                f" ... ({len(missing)} in all)" if len(missing) > 8 else ""
            )
            raise MissingWeightsError(f"checkpoint is missing tensors: {shown}")
        graphdef, state = nnx.split(model)
        flat = dict(nnx.to_flat_state(state))
        new_flat = {}
        for path, var in flat.items():
            name, transpose = _hf_name(path, cfg)
            arr = np.asarray(canon[name])
            if transpose:
                arr = np.swapaxes(arr, -1, -2)
            want = var.get_value()
            if arr.shape != tuple(want.shape):
                raise ValueError(
                    f"tensor {name} has shape {arr.shape}, expected {tuple(want.shape)}"
                    f"{' (transposed)' if transpose else ''} for {cfg.model_type}"
                )
            new_flat[path] = var.replace(jnp.asarray(arr, want.dtype))
        state = nnx.from_flat_state(new_flat)
        model = nnx.merge(graphdef, state)
        model.set_moe_impl(moe_impl)
        return model


def _weight_requirements(cfg: ModelConfig) -> list[tuple[str, list[str]]]:
    """(name `_hf_name` asks for, the published-checkpoint tensors that provide it) pairs.

    Mostly one-to-one; GLM-4's dense gate/up come from one fused tensor, and stacked expert
    tensors from one tensor per expert.
    """
    reqs: list[tuple[str, list[str]]] = []

    def plain(*names: str) -> None:
        reqs.extend((n, [n]) for n in names)

    plain("model.embed_tokens.weight", "model.norm.weight")
    if not cfg.tie_word_embeddings:
        plain("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        norms = ["input_layernorm", "post_attention_layernorm"]
        if cfg.sandwich_norms:
            norms += ["post_self_attn_layernorm", "post_mlp_layernorm"]
        plain(*(p + _norm_hf_name(cfg, n) + ".weight" for n in norms))
        plain(
            *(p + f"self_attn.{proj}.weight" for proj in ("q_proj", "k_proj", "v_proj", "o_proj"))
        )
        if cfg.attention_bias:
            plain(*(p + f"self_attn.{x}.bias" for x in ("q_proj", "k_proj", "v_proj")))
        if cfg.o_proj_bias:
            plain(p + "self_attn.o_proj.bias")
        if cfg.qk_norm:
            plain(p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight")
        m = p + "mlp."
        if not cfg.is_sparse_layer(i):
            if cfg.model_type == "glm4":
                reqs += [
                    (m + f"{x}_proj.weight", [m + "gate_up_proj.weight"]) for x in ("gate", "up")
                ]
                plain(m + "down_proj.weight")
            else:
                plain(*(m + f"{x}_proj.weight" for x in ("gate", "up", "down")))
            continue
        plain(m + "gate.weight")
        if cfg.moe.score_correction_bias:
            plain(m + "gate.e_score_correction_bias")
        for x in ("gate", "up", "down"):
            per_expert = [m + f"experts.{e}.{x}_proj.weight" for e in range(cfg.moe.num_experts)]
            reqs.append((m + f"experts.{x}_proj", per_expert))
        if cfg.moe.num_shared_experts:
            plain(*(m + f"shared_experts.{x}_proj.weight" for x in ("gate", "up", "down")))
    return reqs


def expected_weight_names(cfg: ModelConfig) -> list[str]:
    """Tensor names a published HF checkpoint of this architecture holds (one per expert)."""
    names: list[str] = []
    for _, sources in _weight_requirements(cfg):
        names += [s for s in sources if not names or names[-1] != s]
    return names


def _canonical_weights(cfg: ModelConfig, weights: Mapping[str, np.ndarray]) -> dict:
    """`weights` plus the tensors `_hf_name` asks for that a checkpoint stores differently.

    GLM-4's fused `mlp.gate_up_proj.weight` [2I, D] is split into gate [I, D] and up [I, D].
    Experts become stacked `mlp.experts.{gate,up,down}_proj` [E, out, in], from either one
    tensor per expert or transformers' stacked `gate_up_proj` [E, 2I, D] + `down_proj`.
    Partial expert sets are left out, so the caller reports what is missing.
    """
    out = dict(weights)
    for i in range(cfg.num_layers):
        m = f"model.layers.{i}.mlp."
        if not cfg.is_sparse_layer(i):
            fused = m + "gate_up_proj.weight"
            if fused in weights and m + "gate_proj.weight" not in weights:
                gu = np.asarray(weights[fused])
                out[m + "gate_proj.weight"], out[m + "up_proj.weight"] = np.split(gu, 2, axis=0)
            continue
        ex = m + "experts."
        if ex + "gate_up_proj" in weights and ex + "gate_proj" not in weights:
            gu = np.asarray(weights[ex + "gate_up_proj"])
            out[ex + "gate_proj"], out[ex + "up_proj"] = np.split(gu, 2, axis=1)
            continue
        for x in ("gate", "up", "down"):
            names = [ex + f"{e}.{x}_proj.weight" for e in range(cfg.moe.num_experts)]
            if ex + f"{x}_proj" not in weights and all(n in weights for n in names):
                out[ex + f"{x}_proj"] = np.stack([np.asarray(weights[n]) for n in names])
    return out


# Gemma names the four per-layer norms by position: kvjax's (GLM-4's) names -> Gemma's.
_GEMMA_NORM_NAMES = {
    "post_self_attn_layernorm": "post_attention_layernorm",  # on the attention output
    "post_attention_layernorm": "pre_feedforward_layernorm",  # before the MLP
    "post_mlp_layernorm": "post_feedforward_layernorm",  # on the MLP output
}


def _norm_hf_name(cfg: ModelConfig, name: str) -> str:
    """HF name of the per-layer norm kvjax calls `name`."""
    return _GEMMA_NORM_NAMES.get(name, name) if cfg.norm_style == "gemma" else name


def _hf_name(path: tuple, cfg: ModelConfig) -> tuple[str, bool]:
    """Maps an NNX state path to (HF tensor name, needs its last two axes swapped)."""
    parts = [str(p) for p in path]
    if parts[0] == "layers" and len(parts) == 4 and parts[2].endswith("layernorm"):
        parts[2] = _norm_hf_name(cfg, parts[2])
    leaf = parts[-1]
    if parts[0] == "embed_tokens":
        return "model.embed_tokens.weight", False
    if parts[0] == "lm_head":
        return "lm_head.weight", True
    prefix = "model." if parts[0] in ("layers", "norm") else ""
    if leaf == "kernel":
        return prefix + ".".join(parts[:-1]) + ".weight", True
    if len(parts) > 1 and parts[-2] == "experts":  # stacked [E, in, out] vs HF [E, out, in]
        return prefix + ".".join(parts), True
    return prefix + ".".join(parts), False


def capture_observed(model: Transformer) -> list[Any]:
    """Pops what the observer sowed during the last call, one entry per layer (in order)."""
    inter = nnx.pop(model, nnx.Intermediate)
    out = []
    for i in range(len(model.layers)):
        node = inter["layers"][i]["self_attn"]["observed"]
        val = node.get_value() if isinstance(node, nnx.Variable) else node
        out.append(val[0] if isinstance(val, tuple) else val)
    return out
