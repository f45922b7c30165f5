"""Model configuration: one frozen dataclass describing a decoder-only transformer.

`ModelConfig` covers the architectures kvjax ports (Llama/SmolLM2, Qwen2, Qwen3, and the GLM /
MoE families added on top). It is built from a HuggingFace `config.json` dict by
`ModelConfig.from_hf_dict`, which is also where unsupported architectures are rejected.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

# model_type -> (qk_norm, attention_bias default, o_proj follows attention_bias). Architectures
# whose attention block is the Llama block with optional q/k RMSNorm and optional biases.
_DENSE_FAMILIES: dict[str, tuple[bool, bool, bool]] = {
    "llama": (False, False, True),
    "qwen2": (False, True, False),
    "qwen3": (True, False, True),
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(_DENSE_FAMILIES)


class UnsupportedModelError(ValueError):
    """The checkpoint describes an architecture or option kvjax does not implement."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and options of a decoder-only transformer.

    Attributes mirror HuggingFace names where one exists. `head_dim` is explicit because
    Qwen3 decouples it from hidden_size / num_heads.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        if isinstance(d.get("eos_token_id"), list):
            d["eos_token_id"] = tuple(d["eos_token_id"])
        return cls(**d)

    def fingerprint(self) -> str:
        """Stable hash of the architecture (not the weights)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        """Builds a config from a HuggingFace `config.json` dict.

        Raises:
            UnsupportedModelError: unknown `model_type` or an option this port cannot honour.
        """
        model_type = hf.get("model_type")
        if model_type not in _DENSE_FAMILIES:
            raise UnsupportedModelError(
                f"model_type={model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        qk_norm, bias_default, o_follows = _DENSE_FAMILIES[model_type]
        rope_scaling = hf.get("rope_scaling") or None
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (
            None,
            "default",
        ):
            raise UnsupportedModelError(
                f"rope_scaling={rope_scaling!r} is not supported (only default RoPE)"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act={hf.get('hidden_act')!r}; only 'silu'")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        rope_theta = hf.get("rope_theta")
        if rope_theta is None:  # transformers >= 5 keeps it under rope_parameters
            rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        eos = hf.get("eos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", bias_default)),
            o_proj_bias=o_follows and bool(hf.get("attention_bias", bias_default)),
            qk_norm=qk_norm,
            partial_rotary_factor=float(hf.get("partial_rotary_factor", 1.0)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        )
