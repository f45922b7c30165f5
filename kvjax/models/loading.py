"""One entry for every model source: a local HF directory, a GGUF file, or a shipped model
(by name, `kvjax.assets.MODELS`: "smollm2-135m", the default, or "gemma3-270m").

`load_model(path)` returns a `LoadedModel` (Flax model, tokenizer, config, fingerprint). The
fingerprint identifies config *and* weights, so transforms calibrated for one model are refused
by another (`kvjax.storage`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib

import jax.numpy as jnp
import numpy as np

from kvjax import assets
from kvjax.config import ModelConfig
from kvjax.models.model import Transformer
from kvjax.models.tokenizer import Tokenizer


@dataclasses.dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    cfg: ModelConfig
    fingerprint: str
    source: str


def model_fingerprint(cfg: ModelConfig, weights: dict[str, np.ndarray]) -> str:
    """sha256 over the config and a strided sample of every tensor's bytes (fast for big models).

    Any retrained or differently quantized checkpoint changes the sampled values.
    """
    h = hashlib.sha256(cfg.fingerprint().encode())
    for name in sorted(weights):
        w = np.asarray(weights[name])
        flat = w.reshape(-1)
        step = max(1, flat.size // 4096)
        h.update(name.encode())
        h.update(str(w.shape).encode())
        h.update(np.ascontiguousarray(flat[::step].astype(np.float32)).tobytes())
    return h.hexdigest()[:32]


def load_model(
    path: str | os.PathLike[str] | None = None, dtype: jnp.dtype = jnp.float32
) -> LoadedModel:
    """Loads a model by path (HF checkpoint directory or `.gguf`) or shipped-model name.

    Args:
        path: a directory, a `.gguf` file, the name of a shipped model (`kvjax.assets.MODELS`,
            used when no file or directory of that name exists), or None for the default
            (SmolLM2-135M).
        dtype: parameter and activation dtype.

    Raises:
        ValueError: the path does not exist and is no shipped model's name, or is neither a
            directory nor a .gguf file (or any loader error: unsupported architecture, missing
            tensors, corrupt files).
        kvjax.assets.AssetError: a shipped model could not be fetched or failed its checksum.
    """
    if path is None:
        path = assets.default_model_path()
    elif str(path) in assets.MODELS and not pathlib.Path(path).expanduser().exists():
        path = assets.model_path(str(path))
    p = pathlib.Path(path).expanduser()
    if p.is_dir():
        from kvjax.models.hf_loader import load_hf_checkpoint

        cfg, weights = load_hf_checkpoint(p)
        tokenizer = Tokenizer.from_hf_dir(p)
    elif p.is_file() and p.suffix == ".gguf":
        from kvjax.models.gguf_loader import load_gguf

        cfg, weights, tokenizer = load_gguf(p)
    elif not p.exists():
        raise ValueError(
            f"model path {str(p)!r} does not exist (shipped models: {', '.join(assets.MODELS)})"
        )
    else:
        raise ValueError(f"model path {str(p)!r} is neither a HF checkpoint dir nor a .gguf file")
    fp = model_fingerprint(cfg, weights)
    model = Transformer.from_weights(cfg, weights, dtype)
    return LoadedModel(model=model, tokenizer=tokenizer, cfg=cfg, fingerprint=fp, source=str(p))
