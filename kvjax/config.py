"""Model configuration: frozen dataclasses describing a decoder-only transformer.

`ModelConfig` covers the architectures kvjax ports: Llama/SmolLM2, Qwen2, Qwen3, GLM-4
(`glm4`), GLM-4.5/4.6/4.7 (`glm4_moe`), Qwen3-MoE (`qwen3_moe`) and Gemma 3's text decoder
(`gemma3_text`, or the `text_config` of a multimodal `gemma3` checkpoint). Mixture-of-experts
options live in their own small dataclass, `MoEConfig`. Both are built from a HuggingFace
`config.json` dict by `ModelConfig.from_hf_dict`, which is also where unsupported
architectures and option values are rejected.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

# Fields added after the first release; hashed into `fingerprint` only when they differ from
# their defaults, so transforms calibrated before they existed still match their model.
_LATER_FIELDS = (
    "rope_interleaved",
    "sandwich_norms",
    "moe",
    "hidden_act",
    "norm_style",
    "scale_embeddings",
    "query_pre_attn_scalar",
    "final_logit_softcapping",
    "layer_types",
    "sliding_window",
    "rope_local_theta",
)

HIDDEN_ACTS: tuple[str, ...] = ("silu", "gelu_pytorch_tanh")
NORM_STYLES: tuple[str, ...] = ("plain", "gemma")
LAYER_TYPES: tuple[str, ...] = ("full_attention", "sliding_attention")


class UnsupportedModelError(ValueError):
    """The checkpoint describes an architecture or option kvjax does not implement."""


@dataclasses.dataclass(frozen=True)
class _Family:
    """How one HF model_type maps onto the shared decoder block."""

    qk_norm: bool | str  # True/False, or the config key that switches it (GLM-4-MoE)
    bias_default: bool  # attention_bias when config.json does not say
    o_proj_follows_bias: bool  # o_proj gets a bias whenever q/k/v do
    rope_interleaved: bool = False
    sandwich_norms: bool = False
    partial_rotary_default: float = 1.0
    reads_partial_rotary: bool = True  # False: HF ignores partial_rotary_factor (full RoPE)
    moe: str | None = None  # "glm4_moe" | "qwen3_moe": which router/layer-placement scheme
    gemma: bool = False  # Gemma 3: (1 + w) norms, scaled embeddings, GeGLU, local/global layers


_FAMILIES: dict[str, _Family] = {
    "llama": _Family(qk_norm=False, bias_default=False, o_proj_follows_bias=True),
    "qwen2": _Family(qk_norm=False, bias_default=True, o_proj_follows_bias=False),
    "qwen3": _Family(qk_norm=True, bias_default=False, o_proj_follows_bias=True),
    # GLM-4-0414: interleaved (GPT-J style) RoPE on the first half of head_dim, q/k/v bias,
    # extra RMSNorms on the attention and MLP outputs.
    "glm4": _Family(
        qk_norm=False,
        bias_default=True,
        o_proj_follows_bias=False,
        rope_interleaved=True,
        sandwich_norms=True,
        partial_rotary_default=0.5,
    ),
    # GLM-4.5/4.6/4.7: rotate-half RoPE on the first half, optional q/k norm, sigmoid router.
    "glm4_moe": _Family(
        qk_norm="use_qk_norm",
        bias_default=False,
        o_proj_follows_bias=False,
        partial_rotary_default=0.5,
        moe="glm4_moe",
    ),
    "qwen3_moe": _Family(
        qk_norm=True,
        bias_default=False,
        o_proj_follows_bias=True,
        reads_partial_rotary=False,
        moe="qwen3_moe",
    ),
    # Gemma 3 text decoder: q/k norm, four norms per layer, sliding-window layers.
    "gemma3_text": _Family(
        qk_norm=True,
        bias_default=False,
        o_proj_follows_bias=True,
        sandwich_norms=True,
        reads_partial_rotary=False,
        gemma=True,
    ),
}
# A multimodal Gemma 3 checkpoint: its `text_config` describes the decoder kvjax runs.
_FAMILIES["gemma3"] = _FAMILIES["gemma3_text"]
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(_FAMILIES)

ROUTER_SCORINGS: tuple[str, ...] = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Routed (+ shared) experts replacing the MLP of the layers in `sparse_layers`.

    Routing, per token: scores = softmax(logits) (Qwen3-MoE) or sigmoid(logits) (GLM-4-MoE).
    With `score_correction_bias`, the bias is added to the scores for *choosing* experts only
    (DeepSeek-V3's aux-free balancing); the mixing weights are the unbiased scores. Experts
    fall into `n_group` equal groups, each group is ranked by the sum of its two best biased
    scores, and only the best `topk_group` groups stay eligible. The top `num_experts_per_tok`
    eligible experts are picked, their weights renormalised to sum to one when
    `norm_topk_prob`, then multiplied by `routed_scaling_factor`. Shared experts (one MLP of
    width `intermediate_size * num_shared_experts`) see every token and are added unweighted.
    """

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int  # per routed expert
    sparse_layers: tuple[int, ...]  # layers whose MLP is the MoE block; the rest stay dense
    scoring: str = "softmax"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    num_shared_experts: int = 0
    score_correction_bias: bool = False

    def __post_init__(self):
        if self.scoring not in ROUTER_SCORINGS:
            raise ValueError(f"scoring={self.scoring!r}; supported: {ROUTER_SCORINGS}")
        if self.num_experts < 1 or self.intermediate_size < 1:
            raise ValueError(
                f"num_experts={self.num_experts} and intermediate_size="
                f"{self.intermediate_size} must be positive"
            )
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(f"n_group={self.n_group} must divide num_experts={self.num_experts}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
        per_group = self.num_experts // self.n_group
        if self.n_group > 1 and per_group < 2:
            # Groups are ranked by their two best scores.
            raise ValueError(
                f"n_group={self.n_group} leaves {per_group} expert per group; need at least 2"
            )
        if not 1 <= self.num_experts_per_tok <= self.topk_group * per_group:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, "
                f"{self.topk_group * per_group}] (topk_group * experts per group)"
            )
        if self.num_shared_experts < 0:
            raise ValueError(f"num_shared_experts={self.num_shared_experts} must be >= 0")
        if list(self.sparse_layers) != sorted(set(self.sparse_layers)):
            raise ValueError(f"sparse_layers={self.sparse_layers} must be sorted and unique")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MoEConfig:
        d = dict(d)
        d["sparse_layers"] = tuple(d["sparse_layers"])
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and options of a decoder-only transformer.

    Attributes mirror HuggingFace names where one exists. `head_dim` is explicit because
    Qwen3 decouples it from hidden_size / num_heads.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width (MoE models: the dense layers')
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2 style)
    o_proj_bias: bool = False  # bias on o_proj (Llama/Qwen3 set it with attention_bias)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3 style)
    partial_rotary_factor: float = 1.0  # fraction of head_dim that RoPE rotates
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # RoPE pairs channels (2i, 2i+1) (GLM-4) instead of (i, i + rotary_dim/2) (rotate-half).
    rope_interleaved: bool = False
    # RMSNorm on the attention output and on the MLP output before each residual add (GLM-4,
    # Gemma 3).
    sandwich_norms: bool = False
    moe: MoEConfig | None = None
    hidden_act: str = "silu"  # MLP gate activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU)
    # "plain": RMSNorm scales by w. "gemma": by (1 + w) in float32 (weights are stored as offsets
    # from one), and the four per-layer norms carry Gemma's HF names.
    norm_style: str = "plain"
    scale_embeddings: bool = False  # token embeddings times sqrt(hidden_size) (not the tied head)
    query_pre_attn_scalar: float | None = None  # softmax scale is this ** -0.5 (default head_dim)
    final_logit_softcapping: float | None = None  # logits -> c * tanh(logits / c)
    # Per layer "full_attention" or "sliding_attention"; None: every layer full. A sliding layer
    # at query position t sees keys at positions s with t - sliding_window < s <= t.
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    rope_local_theta: float | None = None  # RoPE base of sliding layers (None: rope_theta)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        rot = self.rotary_dim
        if rot % 2 or rot <= 0:
            raise ValueError(
                f"rotary dim {rot} (head_dim={self.head_dim} * partial_rotary_factor="
                f"{self.partial_rotary_factor}) must be a positive even number"
            )
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act={self.hidden_act!r}; supported: {HIDDEN_ACTS}")
        if self.norm_style not in NORM_STYLES:
            raise ValueError(f"norm_style={self.norm_style!r}; supported: {NORM_STYLES}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"layer_types has {len(self.layer_types)} entries for "
                    f"num_layers={self.num_layers}"
                )
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise ValueError(f"layer_types holds {bad}; supported: {LAYER_TYPES}")
            if "sliding_attention" in self.layer_types and (
                self.sliding_window is None or self.sliding_window < 1
            ):
                raise ValueError(
                    f"sliding_window={self.sliding_window} must be a positive token count when "
                    "layer_types has sliding_attention layers"
                )
        if self.query_pre_attn_scalar is not None and not self.query_pre_attn_scalar > 0:
            raise ValueError(f"query_pre_attn_scalar={self.query_pre_attn_scalar} must be > 0")
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:
            raise ValueError(f"final_logit_softcapping={self.final_logit_softcapping} must be > 0")
        if self.moe is not None and any(
            not 0 <= i < self.num_layers for i in self.moe.sparse_layers
        ):
            raise ValueError(
                f"moe.sparse_layers={self.moe.sparse_layers} must lie in [0, "
                f"num_layers={self.num_layers})"
            )

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA ratio)."""
        return self.num_heads // self.num_kv_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @property
    def attention_scale(self) -> float:
        """Softmax scale of q . k: query_pre_attn_scalar ** -0.5 (Gemma), else head_dim ** -0.5."""
        base = self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
        return float(base) ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """Sliding-window length of layer `layer` in tokens, or None for full causal attention."""
        if self.layer_types is not None and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """`layer_window` of every layer, in order."""
        return tuple(self.layer_window(i) for i in range(self.num_layers))

    def layer_rope_theta(self, layer: int) -> float:
        """RoPE base of layer `layer`: `rope_local_theta` for sliding layers when set."""
        if self.layer_window(layer) is not None and self.rope_local_theta is not None:
            return self.rope_local_theta
        return self.rope_theta

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the mixture-of-experts block."""
        return self.moe is not None and layer in self.moe.sparse_layers

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        if isinstance(d.get("eos_token_id"), list):
            d["eos_token_id"] = tuple(d["eos_token_id"])
        if isinstance(d.get("moe"), dict):
            d["moe"] = MoEConfig.from_dict(d["moe"])
        if isinstance(d.get("layer_types"), list):
            d["layer_types"] = tuple(d["layer_types"])
        return cls(**d)

    def fingerprint(self) -> str:
        """Stable hash of the architecture (not the weights)."""
        d = self.to_dict()
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in _LATER_FIELDS:
            if d[name] == defaults[name]:
                del d[name]
        blob = json.dumps(d, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        """Builds a config from a HuggingFace `config.json` dict.

        Raises:
            UnsupportedModelError: unknown `model_type` or an option this port cannot honour
                (non-default RoPE scaling, an activation other than SiLU (GeGLU for Gemma 3),
                Qwen-style sliding-window attention, an unknown router scoring or top-k method,
                attention logit soft-capping, ...), naming the value.
        """
        model_type = hf.get("model_type")
        if model_type not in _FAMILIES:
            raise UnsupportedModelError(
                f"model_type={model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        fam = _FAMILIES[model_type]
        if fam.gemma:
            return _gemma3_config(cls, hf)
        rope_params = hf.get("rope_parameters") or {}
        # transformers < 5 writes `rope_scaling`; >= 5 writes `rope_parameters` (with theta).
        for key, rope in (
            ("rope_scaling", hf.get("rope_scaling")),
            ("rope_parameters", rope_params),
        ):
            if rope and rope.get("rope_type", rope.get("type")) not in (None, "default"):
                raise UnsupportedModelError(f"{key}={rope!r} is not supported (only default RoPE)")
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act={hf.get('hidden_act')!r}; only 'silu'")
        if hf.get("use_sliding_window"):
            raise UnsupportedModelError(
                f"use_sliding_window={hf['use_sliding_window']!r} is not supported "
                "(full causal attention only)"
            )
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        rope_theta = hf.get("rope_theta")
        if rope_theta is None:  # transformers >= 5 keeps it under rope_parameters
            rope_theta = rope_params.get("rope_theta", 10000.0)
        if not fam.reads_partial_rotary:
            partial = 1.0
        elif model_type in ("llama", "qwen2", "qwen3"):
            partial = hf.get("partial_rotary_factor", 1.0)
        else:
            partial = hf.get("partial_rotary_factor")
            if partial is None:
                partial = rope_params.get("partial_rotary_factor", fam.partial_rotary_default)
        qk_norm = fam.qk_norm if isinstance(fam.qk_norm, bool) else bool(hf.get(fam.qk_norm))
        bias = bool(hf.get("attention_bias", fam.bias_default))
        num_layers = hf["num_hidden_layers"]
        eos = hf.get("eos_token_id")
        moe = None
        if fam.moe == "glm4_moe":
            moe = _glm4_moe_config(hf, num_layers)
        elif fam.moe == "qwen3_moe":
            moe = _qwen3_moe_config(hf, num_layers)
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bias,
            o_proj_bias=fam.o_proj_follows_bias and bias,
            qk_norm=qk_norm,
            partial_rotary_factor=float(partial),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            rope_interleaved=fam.rope_interleaved,
            sandwich_norms=fam.sandwich_norms,
            moe=moe,
        )


def _gemma3_rope(hf: dict[str, Any]) -> tuple[float, float]:
    """(global RoPE base, local RoPE base) of a Gemma 3 text config, default RoPE only.

    transformers >= 5 writes `rope_parameters` keyed by layer type; older configs write
    `rope_theta`, `rope_local_base_freq` and `rope_scaling` (applied to global layers).
    Absent values take transformers' Gemma 3 defaults (1e6 global, 1e4 local).
    """
    params = hf.get("rope_parameters") or {}
    if params and not all(isinstance(v, dict) for v in params.values()):
        params = {"full_attention": params}  # one dict for every layer type
    theta = {
        "full_attention": hf.get("rope_theta"),
        "sliding_attention": hf.get("rope_local_base_freq"),
    }
    for layer_type, rope in params.items():
        if layer_type not in LAYER_TYPES:
            raise UnsupportedModelError(
                f"rope_parameters has an entry for layer type {layer_type!r}; known: {LAYER_TYPES}"
            )
        if rope.get("rope_type", rope.get("type")) not in (None, "default"):
            raise UnsupportedModelError(
                f"rope_parameters[{layer_type!r}]={rope!r} is not supported (only default RoPE)"
            )
        if rope.get("rope_theta") is not None:
            theta[layer_type] = rope["rope_theta"]
    scaling = hf.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise UnsupportedModelError(
            f"rope_scaling={scaling!r} is not supported (only default RoPE)"
        )
    g = theta["full_attention"]
    loc = theta["sliding_attention"]
    return float(1e6 if g is None else g), float(1e4 if loc is None else loc)


def _gemma3_config(cls: type[ModelConfig], hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig of a Gemma 3 text decoder (`gemma3_text`, or `gemma3`'s `text_config`).

    Missing keys take the defaults of transformers' `Gemma3TextConfig` where the decoder's
    behaviour depends on them (layer pattern every 6th layer global, local RoPE base 1e4,
    query_pre_attn_scalar 256, tied embeddings).
    """
    top = hf
    if hf.get("model_type") == "gemma3":
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise UnsupportedModelError("model_type='gemma3' config.json lacks a text_config dict")
        hf = {"tie_word_embeddings": top.get("tie_word_embeddings", True), **text}
    act = hf.get("hidden_activation", hf.get("hidden_act", "gelu_pytorch_tanh"))
    if act != "gelu_pytorch_tanh":
        raise UnsupportedModelError(
            f"hidden_activation={act!r} is not supported for gemma3 (only 'gelu_pytorch_tanh')"
        )
    if hf.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError(
            f"attn_logit_softcapping={hf['attn_logit_softcapping']!r} is not supported "
            "(Gemma 3 checkpoints leave it None)"
        )
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedModelError(
            "use_bidirectional_attention=True is not supported (causal decoders only)"
        )
    num_layers = int(hf["num_hidden_layers"])
    layer_types = hf.get("layer_types")
    if layer_types is None:
        pattern = int(hf.get("sliding_window_pattern", 6))
        if pattern < 1:
            raise UnsupportedModelError(f"sliding_window_pattern={pattern} must be >= 1")
        layer_types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    bad = sorted(set(layer_types) - set(LAYER_TYPES))
    if bad:
        raise UnsupportedModelError(f"layer_types holds {bad}; supported: {LAYER_TYPES}")
    if len(layer_types) != num_layers:
        raise UnsupportedModelError(
            f"layer_types has {len(layer_types)} entries for num_hidden_layers={num_layers}"
        )
    window = hf.get("sliding_window", 4096)
    if "sliding_attention" in layer_types and (window is None or int(window) < 1):
        raise UnsupportedModelError(f"sliding_window={window!r} must be a positive token count")
    rope_global, rope_local = _gemma3_rope(hf)
    num_heads = int(hf["num_attention_heads"])
    bias = bool(hf.get("attention_bias", False))
    eos = hf.get("eos_token_id", top.get("eos_token_id"))
    softcap = hf.get("final_logit_softcapping")
    return cls(
        model_type="gemma3_text",
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or 256),
        rope_theta=rope_global,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 131072)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        attention_bias=bias,
        o_proj_bias=bias,
        qk_norm=True,
        bos_token_id=hf.get("bos_token_id", top.get("bos_token_id")),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        sandwich_norms=True,
        hidden_act="gelu_pytorch_tanh",
        norm_style="gemma",
        scale_embeddings=True,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=None if softcap is None else float(softcap),
        layer_types=tuple(layer_types),
        sliding_window=None if window is None else int(window),
        rope_local_theta=rope_local,
    )


def _checked_moe(**kw: Any) -> MoEConfig:
    """MoEConfig(**kw), with its validation errors re-raised as UnsupportedModelError."""
    try:
        return MoEConfig(**kw)
    except ValueError as e:
        raise UnsupportedModelError(f"unsupported MoE configuration: {e}") from e


def _glm4_moe_config(hf: dict[str, Any], num_layers: int) -> MoEConfig:
    """GLM-4-MoE: sigmoid router with score-correction bias and group-limited top-k."""
    # GLM configs do not write these DeepSeek-V3 keys; when present they must name the one
    # scheme this router implements.
    if hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise UnsupportedModelError(
            f"topk_method={hf['topk_method']!r} is not supported for glm4_moe (only 'noaux_tc')"
        )
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        raise UnsupportedModelError(
            f"scoring_func={hf['scoring_func']!r} is not supported for glm4_moe (only 'sigmoid')"
        )
    first_dense = int(hf.get("first_k_dense_replace", 1))
    if not 0 <= first_dense <= num_layers:
        raise UnsupportedModelError(
            f"first_k_dense_replace={first_dense} must be in [0, num_hidden_layers={num_layers}]"
        )
    num_experts = hf.get("n_routed_experts", hf.get("num_local_experts"))
    if num_experts is None:
        raise UnsupportedModelError("glm4_moe config.json lacks n_routed_experts")
    return _checked_moe(
        num_experts=int(num_experts),
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 8)),
        intermediate_size=int(hf["moe_intermediate_size"]),
        sparse_layers=tuple(range(first_dense, num_layers)),
        scoring="sigmoid",
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        n_group=int(hf.get("n_group", 1)),
        topk_group=int(hf.get("topk_group", 1)),
        num_shared_experts=int(hf.get("n_shared_experts", 1)),
        score_correction_bias=True,
    )


def _qwen3_moe_config(hf: dict[str, Any], num_layers: int) -> MoEConfig | None:
    """Qwen3-MoE: softmax top-k router, sparse every `decoder_sparse_step` layers."""
    if hf.get("scoring_func", "softmax") != "softmax":
        raise UnsupportedModelError(
            f"scoring_func={hf['scoring_func']!r} is not supported for qwen3_moe (only 'softmax')"
        )
    if hf.get("topk_method", "greedy") != "greedy":
        raise UnsupportedModelError(
            f"topk_method={hf['topk_method']!r} is not supported for qwen3_moe (only 'greedy')"
        )
    num_experts = int(hf.get("num_experts", hf.get("num_local_experts", 0)) or 0)
    step = int(hf.get("decoder_sparse_step", 1))
    if step < 1:
        raise UnsupportedModelError(f"decoder_sparse_step={step} must be >= 1")
    mlp_only = hf.get("mlp_only_layers") or []
    bad = [i for i in mlp_only if not 0 <= int(i) < num_layers]
    if bad:
        raise UnsupportedModelError(
            f"mlp_only_layers={mlp_only} names layers outside [0, {num_layers})"
        )
    sparse = tuple(i for i in range(num_layers) if i not in set(mlp_only) and (i + 1) % step == 0)
    if num_experts == 0 or not sparse:
        return None  # every layer dense: a plain Qwen3 stack
    return _checked_moe(
        num_experts=num_experts,
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 8)),
        intermediate_size=int(hf["moe_intermediate_size"]),
        sparse_layers=sparse,
        scoring="softmax",
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
    )
