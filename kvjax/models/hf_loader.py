"""Local HuggingFace checkpoint directories: config.json + safetensors (single or sharded).

No network: the directory must already hold the files. Tensors are read with a small
safetensors parser over a memory map so bf16/f16/f32 checkpoints all load without torch.

A multimodal Gemma 3 checkpoint (`model_type: gemma3`) loads as its text decoder: the config is
its `text_config`, the decoder's tensors lose their `language_model` prefix (both the published
`language_model.model.*` and transformers 5's `model.language_model.*` spellings) and the vision
tower is left out.
"""

from __future__ import annotations

import json
import pathlib
import struct

import ml_dtypes
import numpy as np

from kvjax.config import ModelConfig

_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F64": np.float64,
    "I64": np.int64,
    "I32": np.int32,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class CheckpointError(ValueError):
    """A checkpoint directory or file is malformed, truncated or incomplete."""


def read_safetensors(path: str | pathlib.Path) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file as numpy arrays (memory-mapped, read-only)."""
    path = pathlib.Path(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    if raw.size < 8:
        raise CheckpointError(f"{path} is too small to be a safetensors file ({raw.size} bytes)")
    (hlen,) = struct.unpack("<Q", bytes(raw[:8]))
    if 8 + hlen > raw.size:
        raise CheckpointError(f"{path}: header length {hlen} exceeds file size {raw.size}")
    try:
        header = json.loads(bytes(raw[8 : 8 + hlen]))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from e
    base = 8 + hlen
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        if base + end > raw.size:
            raise CheckpointError(
                f"{path}: tensor {name} runs past the end of the file (truncated?)"
            )
        dt = np.dtype(_DTYPES[info["dtype"]])
        arr = np.frombuffer(raw, dtype=dt, count=(end - start) // dt.itemsize, offset=base + start)
        out[name] = arr.reshape(info["shape"])
    return out


def load_hf_checkpoint(path: str | pathlib.Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Reads `config.json` and every safetensors shard of a local HF directory.

    Raises:
        UnsupportedModelError: the config names an architecture kvjax does not port.
        CheckpointError: missing config/weights files or a shard listed in the index is absent.
    """
    path = pathlib.Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path} has no config.json; expected a HuggingFace checkpoint dir")
    raw_cfg = json.loads(cfg_file.read_text())
    cfg = ModelConfig.from_hf_dict(raw_cfg)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = sorted(p.name for p in path.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{path} holds no *.safetensors files")
    weights: dict[str, np.ndarray] = {}
    for shard in shards:
        f = path / shard
        if not f.is_file():
            raise CheckpointError(f"shard {shard} listed in {index.name} is missing from {path}")
        weights.update(read_safetensors(f))
    if raw_cfg.get("model_type") == "gemma3":
        weights = _gemma3_text_weights(weights)
    return cfg, weights


# Prefixes of a multimodal Gemma 3 checkpoint's text decoder -> the text-only model's names.
_GEMMA3_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
)


def _gemma3_text_weights(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The decoder's tensors of a `Gemma3ForConditionalGeneration` checkpoint, renamed."""
    out = {}
    for name, x in weights.items():
        for old, new in _GEMMA3_TEXT_PREFIXES:
            if name.startswith(old):
                out[new + name[len(old) :]] = x
                break
    return out
