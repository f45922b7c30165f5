"""Load a Llama or Gemma 3 GGUF file as a HuggingFace-layout float32 state dict.

The model ports consume weights named and laid out exactly as a HuggingFace checkpoint
(`model.layers.{i}.self_attn.q_proj.weight` is [out, in], like `torch.nn.Linear`). A GGUF file
differs in up to four ways, each undone here:

1. names: llama.cpp's `blk.{i}.attn_q.weight` etc. (see `_LAYER_TENSORS`, `_GEMMA3_TENSORS`);
2. storage: quantized blocks (Q4_1, Q4_K, Q5_0, Q6_K, Q8_0, ...) are dequantized with
   `gguf.quants.dequantize`, and GGUF lists dimensions fastest-first, the reverse of numpy (a
   [out, in] matrix is recorded as (in, out)), which `dequantize` already turns into numpy order;
3. RoPE layout (llama only): llama.cpp's converter permutes the rows of attn_q/attn_k within each
   head so that its interleaved-pair RoPE matches HF's rotate-half RoPE. `unpermute_qk` inverts
   that. Gemma GGUFs keep HF's row order (llama.cpp runs NEOX-style RoPE for Gemma), so their
   rows are left alone;
4. norms (Gemma only): HF's Gemma RMSNorm scales by (1 + w); llama.cpp's converter stores
   1 + w, so the loader subtracts 1 from every `*norm.weight` to give back HF's w.

Gemma 3 facts the GGUF metadata does not carry are taken from llama.cpp / transformers'
Gemma 3 defaults: every 6th layer global, the rest sliding over
`{arch}.attention.sliding_window` tokens (a `{arch}.attention.sliding_window_pattern` key,
where present, decides instead); local RoPE base 1e4; query_pre_attn_scalar = head_dim
(hidden / heads for the 62-layer 27B, as llama.cpp does). The real-model tests
(`tests/kvjax/models/test_real_gemma3.py`) check them against transformers on the real file;
norm offset and row order were confirmed by perplexity (rows permuted the llama way: ~3500,
norms without the -1: ~1e8, as loaded: ~23 on 1024 tokens of the evaluation plays).

Example:
    >>> from kvjax import assets
    >>> from kvjax.models import gguf_loader
    >>> cfg, weights, tok = gguf_loader.load_gguf(assets.default_model_path())
    >>> weights["model.layers.0.self_attn.q_proj.weight"].shape   # [Hq * hd, D]
    (576, 576)
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from typing import Any

import gguf
import numpy as np
from gguf.quants import dequantize

from kvjax.config import ModelConfig, UnsupportedModelError
from kvjax.models.tokenizer import Tokenizer

SUPPORTED_GGUF_ARCHITECTURES: tuple[str, ...] = ("llama", "gemma3")

# GGUF per-block tensor suffix -> HF suffix under `model.layers.{i}.`.
_LAYER_TENSORS: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Present only in checkpoints with q/k/v biases (ModelConfig.attention_bias).
_LAYER_BIAS_TENSORS: dict[str, str] = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
}
_LM_HEAD = ("output.weight", "lm_head.weight")  # absent when embeddings are tied

# Gemma 3: q/k norms and four norms per layer, under Gemma's HF names.
_GEMMA3_TENSORS: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GEMMA3_SWA_PATTERN = 6  # llama.cpp's `set_swa_pattern(6)`; transformers' sliding_window_pattern
_GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base_train_swa; transformers' default

# Metadata keys a Llama GGUF must carry (after the `{arch}.` prefix).
_REQUIRED_KEYS = (
    "block_count",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "context_length",
)


# --- metadata ---------------------------------------------------------------------------------


def _field_value(field: gguf.ReaderField) -> Any:
    """Plain Python value of one GGUF key/value field (str, int, float, bool or a list)."""
    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        elem = field.types[-1]
        if elem == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        if elem == gguf.GGUFValueType.ARRAY:
            raise ValueError(f"nested GGUF arrays are not supported (key {field.name!r})")
        # Each element is a 1-element numpy part; one concatenate beats 50k `.item()` calls.
        if not field.data:
            return []
        return np.concatenate([field.parts[i] for i in field.data]).tolist()
    if kind == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]][0].item()


def read_metadata(source: str | os.PathLike[str] | gguf.GGUFReader) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as plain Python values.

    Args:
        source: a path or an open `gguf.GGUFReader`.
    """
    reader = source if isinstance(source, gguf.GGUFReader) else _open_reader(source)
    # "GGUF.*" entries are the file header (version, counts), not model metadata.
    return {
        name: _field_value(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")
    }


def _open_reader(path: str | os.PathLike[str]) -> gguf.GGUFReader:
    p = pathlib.Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"GGUF path {str(p)!r} does not exist or is not a file")
    try:
        return gguf.GGUFReader(p, "r")
    except (ValueError, OSError, IndexError, KeyError, EOFError) as e:
        # A truncated file fails deep inside gguf (an IndexError reading past its end).
        reason = str(e) or type(e).__name__
        raise ValueError(
            f"{str(p)!r} is not a readable GGUF file ({p.stat().st_size} bytes; {reason})"
        ) from e


def check_architecture(meta: Mapping[str, Any], source: str = "GGUF file") -> str:
    """Returns `general.architecture`, raising unless kvjax can load it.

    Raises:
        UnsupportedModelError: naming the architecture found and the supported ones.
    """
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{source} has general.architecture={arch!r}; load_gguf supports: "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    return arch


def config_from_gguf_metadata(
    meta: Mapping[str, Any], tensor_names: set[str] | frozenset[str]
) -> ModelConfig:
    """Builds the `ModelConfig` described by Llama GGUF metadata.

    Args:
        meta: metadata from `read_metadata`.
        tensor_names: names of the tensors in the file; tied embeddings and attention biases
            are detected from which tensors exist, as llama.cpp does.

    Raises:
        UnsupportedModelError: not a plain dense Llama or Gemma 3 (MoE, scaled RoPE, ...).
        ValueError: required metadata is missing.
    """
    arch = check_architecture(meta)
    missing = [f"{arch}.{k}" for k in _REQUIRED_KEYS if f"{arch}.{k}" not in meta]
    if missing:
        raise ValueError(f"GGUF metadata lacks required keys {missing}")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    if get("expert_count", 0):
        raise UnsupportedModelError(
            f"{arch}.expert_count={get('expert_count')}: mixture-of-experts GGUFs are not supported"
        )
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none", "") or "rope_freqs.weight" in tensor_names:
        raise UnsupportedModelError(
            f"scaled RoPE (rope.scaling.type={scaling!r}, rope_freqs tensor present="
            f"{'rope_freqs.weight' in tensor_names}) is not supported (only default RoPE)"
        )
    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // num_heads))
    value_dim = int(get("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise UnsupportedModelError(
            f"attention.key_length={head_dim} != attention.value_length={value_dim}"
        )
    rot = int(get("rope.dimension_count", head_dim))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size", len(tokens) if tokens is not None else None)
    if vocab is None:
        raise ValueError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    eos = [
        int(meta[k])
        for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        if meta.get(k) is not None
    ]
    eos = list(dict.fromkeys(eos))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    num_layers = int(get("block_count"))
    gemma: dict[str, Any] = {}
    if arch == "gemma3":
        if get("final_logit_softcapping") is not None or get("attn_logit_softcapping"):
            raise UnsupportedModelError(
                f"{arch}.attn_logit_softcapping={get('attn_logit_softcapping')!r} / "
                f"final_logit_softcapping={get('final_logit_softcapping')!r}: soft-capped "
                "Gemma GGUFs are not supported"
            )
        window = get("attention.sliding_window")
        if window is None:
            raise ValueError(f"GGUF metadata lacks {arch}.attention.sliding_window")
        scalar = hidden / num_heads if num_layers == 62 else head_dim  # llama.cpp: 27B differs
        pattern = get("attention.sliding_window_pattern", _GEMMA3_SWA_PATTERN)
        if isinstance(pattern, list):  # newer converters: one flag per layer, True = sliding
            if len(pattern) != num_layers:
                raise ValueError(
                    f"{arch}.attention.sliding_window_pattern has {len(pattern)} flags for "
                    f"{num_layers} layers"
                )
            sliding = [bool(x) for x in pattern]
        elif int(pattern) >= 1:
            sliding = [bool((i + 1) % int(pattern)) for i in range(num_layers)]
        else:
            raise UnsupportedModelError(
                f"{arch}.attention.sliding_window_pattern={pattern!r} must be >= 1"
            )
        gemma = dict(
            sandwich_norms=True,
            qk_norm=True,
            hidden_act="gelu_pytorch_tanh",
            norm_style="gemma",
            scale_embeddings=True,
            query_pre_attn_scalar=float(scalar),
            layer_types=tuple("sliding_attention" if x else "full_attention" for x in sliding),
            sliding_window=int(window),
            rope_local_theta=_GEMMA3_LOCAL_ROPE_BASE,
        )
    return ModelConfig(
        model_type="gemma3_text" if arch == "gemma3" else "llama",
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rope_theta=_f32_to_float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=_f32_to_float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings=_LM_HEAD[0] not in tensor_names,
        attention_bias=any(f"blk.0.{k}" in tensor_names for k in _LAYER_BIAS_TENSORS),
        partial_rotary_factor=rot / head_dim,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=(eos[0] if len(eos) == 1 else tuple(eos)) if eos else None,
        **gemma,
    )


def _f32_to_float(x: float) -> float:
    """Shortest decimal that round-trips a float32 field (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(x)))


# --- tensors ----------------------------------------------------------------------------------


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's per-head row permutation of attn_q / attn_k (weights or biases).

    llama.cpp stores each head's rows as interleaved pairs (0, hd/2, 1, hd/2 + 1, ...) so that
    its RoPE rotates adjacent elements; HF's rotate-half RoPE wants the halves contiguous.

    Args:
        w: f32[n_head * hd, D] weight or f32[n_head * hd] bias, rows in llama.cpp order.
        n_head: number of heads in the projection (query heads for q, KV heads for k).

    Returns:
        The same array with rows in HF order.
    """
    rows = w.shape[0]
    if rows % n_head or (rows // n_head) % 2:
        raise ValueError(f"{w.shape=} rows are not n_head={n_head} heads of even size")
    hd = rows // n_head
    # [n_head, hd/2, 2, ...] -> [n_head, 2, hd/2, ...]: pair element j moves to half j.
    return w.reshape(n_head, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    per_layer = {
        "input_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (q, d),
        "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d),
        "self_attn.o_proj.weight": (d, q),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "post_attention_layernorm.weight": (d,),
        "mlp.gate_proj.weight": (f, d),
        "mlp.up_proj.weight": (f, d),
        "mlp.down_proj.weight": (d, f),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
        "pre_feedforward_layernorm.weight": (d,),
        "post_feedforward_layernorm.weight": (d,),
    }
    shapes = {
        "model.embed_tokens.weight": (cfg.vocab_size, d),
        "model.norm.weight": (d,),
        "lm_head.weight": (cfg.vocab_size, d),
    }
    for i in range(cfg.num_layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in per_layer.items()})
    return shapes


def gguf_to_hf_names(cfg: ModelConfig) -> dict[str, str]:
    """GGUF tensor name -> HF name for every tensor a checkpoint of `cfg` must hold."""
    names = dict(_GLOBAL_TENSORS)
    if not cfg.tie_word_embeddings:
        names[_LM_HEAD[0]] = _LM_HEAD[1]
    layer_map = _GEMMA3_TENSORS if cfg.norm_style == "gemma" else _LAYER_TENSORS
    layer_map = layer_map | (_LAYER_BIAS_TENSORS if cfg.attention_bias else {})
    for i in range(cfg.num_layers):
        names.update({f"blk.{i}.{g}": f"model.layers.{i}.{h}" for g, h in layer_map.items()})
    return names


def _dequantize(t: gguf.ReaderTensor) -> np.ndarray:
    try:
        x = dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise UnsupportedModelError(
            f"tensor {t.name!r} uses GGML type {t.tensor_type.name}, which gguf cannot dequantize"
        ) from e
    # GGUF records dims fastest-first; numpy order is the reverse.
    want = tuple(int(n) for n in reversed(t.shape))
    x = np.asarray(x).reshape(want)
    if x.dtype != np.float32 or np.may_share_memory(x, t.data):
        x = np.array(x, dtype=np.float32)  # own the memory: don't pin the file's mmap
    return x


def load_gguf(
    path: str | os.PathLike[str],
) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer]:
    """Loads a Llama or Gemma 3 GGUF as (config, HF-layout float32 weights, tokenizer).

    Args:
        path: the `.gguf` file.

    Returns:
        `(cfg, weights, tokenizer)`. `weights` maps HF names (`model.embed_tokens.weight`
        f32[V, D], `model.layers.{i}.self_attn.q_proj.weight` f32[Hq*hd, D], ...) to float32
        arrays; `lm_head.weight` is absent when `cfg.tie_word_embeddings`. q/k rows are in HF
        (rotate-half RoPE) order; Gemma norm weights are HF's w (scale 1 + w).

    Raises:
        UnsupportedModelError: `general.architecture` is not llama or gemma3, or the file uses
            an option this port cannot honour (MoE, scaled RoPE, unknown tensors, unknown quant
            type).
        ValueError: the file is unreadable or lacks tensors or metadata.
    """
    reader = _open_reader(path)
    meta = read_metadata(reader)
    check_architecture(meta, source=str(path))
    tensors = {t.name: t for t in reader.tensors}
    cfg = config_from_gguf_metadata(meta, frozenset(tensors))

    names = gguf_to_hf_names(cfg)
    missing = sorted(set(names) - set(tensors))
    if missing:
        shown = ", ".join(missing[:20]) + (
            f", ... ({len(missing)} in all)" if len(missing) > 20 else ""
        )
        raise ValueError(f"{path} lacks tensors required by its metadata: {shown}")
    extra = sorted(set(tensors) - set(names))
    if extra:
        raise UnsupportedModelError(
            f"{path} holds tensors this {cfg.model_type} port does not use, so it would run a "
            f"different model: {', '.join(extra[:20])}"
        )

    shapes = _expected_shapes(cfg)
    weights: dict[str, np.ndarray] = {}
    for gname, hname in names.items():
        x = _dequantize(tensors[gname])
        if x.shape != shapes[hname]:
            raise ValueError(
                f"tensor {gname!r} has shape {x.shape}, expected {shapes[hname]} for {hname}"
            )
        if cfg.norm_style == "gemma":
            if gname.endswith("norm.weight"):
                x -= 1.0  # llama.cpp stored 1 + w; HF's Gemma RMSNorm adds the 1 itself
        elif gname.endswith(("attn_q.weight", "attn_q.bias")):
            x = unpermute_qk(x, cfg.num_heads)
        elif gname.endswith(("attn_k.weight", "attn_k.bias")):
            x = unpermute_qk(x, cfg.num_kv_heads)
        weights[hname] = x

    tokenizer = Tokenizer.from_gguf_metadata(meta)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the embedding only "
            f"{cfg.vocab_size} rows"
        )
    return cfg, weights, tokenizer
