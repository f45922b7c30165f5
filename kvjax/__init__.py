"""kvjax: calibrated low-bit KV-cache compression (OSCAR, WUSH-KV) for JAX.

The package is in wings, each importing only the ones below it
(serving -> models -> cache -> config):

- `kvjax.serving`: the engine (requests, continuous batching, on-device decode windows,
  memory-budget admission, prefix sharing), sampling, sharding rules.
- `kvjax.models`: model ports, MoE, HF and GGUF loaders, the tokenizer, `load_model`.
- `kvjax.cache`: quantizers, the transform pytree (A, B), dense and paged caches, the page
  allocator, attention math.
- top level: `config` (model configs), `assets` (shipped models and texts), `storage`
  (orbax-stored transforms) and the CLIs `calibrate` and `generate`.

Typical use::

    import kvjax
    lm = kvjax.load_model()                       # the shipped SmolLM2-135M
    tf = kvjax.load_transforms("transforms/oscar", lm.config)
    eng = kvjax.Engine(lm.model, cache_kind="paged", transforms=tf,
                       cache_cfg=kvjax.CacheConfig(quant=kvjax.QuantConfig(bits=2)),
                       engine_cfg=kvjax.EngineConfig(kv_memory_gb=2.0), tokenizer=lm.tokenizer)
    req = eng.submit("The capital of France is", max_new_tokens=8)
    eng.run()                                     # or: for req, token in eng.stream(): ...
"""

from kvjax.cache.allocator import PageManager, PagePoolExhausted
from kvjax.cache.dense import DenseKVCache
from kvjax.cache.paged import CacheConfig, PagedKVCache
from kvjax.cache.quantizers import QuantConfig, QuantizedArray
from kvjax.cache.transforms import KVTransforms, fold_value_transforms
from kvjax.config import ModelConfig, UnsupportedModelError
from kvjax.models.loading import LoadedModel, load_model
from kvjax.models.tokenizer import Tokenizer
from kvjax.serving.engine import Engine, EngineConfig, GenerationResult, Request
from kvjax.serving.sampling import SamplingParams
from kvjax.storage import load_transforms, save_transforms

__all__ = [
    "CacheConfig",
    "DenseKVCache",
    "Engine",
    "EngineConfig",
    "GenerationResult",
    "KVTransforms",
    "LoadedModel",
    "ModelConfig",
    "PageManager",
    "PagePoolExhausted",
    "PagedKVCache",
    "QuantConfig",
    "QuantizedArray",
    "Request",
    "SamplingParams",
    "Tokenizer",
    "UnsupportedModelError",
    "fold_value_transforms",
    "load_model",
    "load_transforms",
    "save_transforms",
]
