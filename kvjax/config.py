"""Model configuration: frozen dataclasses describing a decoder-only transformer.

`ModelConfig` covers the architectures kvjax ports: Llama/SmolLM2, Qwen2, Qwen3, GLM-4
(`glm4`), GLM-4.5/4.6/4.7 (`glm4_moe`) and Qwen3-MoE (`qwen3_moe`). Mixture-of-experts options
live in their own small dataclass, `MoEConfig`. Both are built from a HuggingFace
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
_LATER_FIELDS = ("rope_interleaved", "sandwich_norms", "moe")


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
}
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
    # RMSNorm on the attention output and on the MLP output before each residual add (GLM-4).
    sandwich_norms: bool = False
    moe: MoEConfig | None = None

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
                (non-default RoPE scaling, an activation other than SiLU, sliding-window
                attention, an unknown router scoring or top-k method, ...), naming the value.
        """
        model_type = hf.get("model_type")
        if model_type not in _FAMILIES:
            raise UnsupportedModelError(
                f"model_type={model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        fam = _FAMILIES[model_type]
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
