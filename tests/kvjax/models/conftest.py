"""Shared setup of the HuggingFace-parity tests: save a transformers model, load it through
kvjax, and compare full-sequence prefill and chunked decode logits (float32, 1e-4 of the
largest logit)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache.allocator import PageManager
from kvjax.cache.dense import DenseKVCache
from kvjax.cache.paged import CacheConfig, PagedKVCache
from kvjax.cache.transforms import KVTransforms
from kvjax.models.hf_loader import load_hf_checkpoint
from kvjax.models.model import Transformer


class Parity:
    @staticmethod
    def perturb(model, router_scale: float | None = None) -> None:
        """Random init leaves norms at 1 and biases at 0 (and MoE router scores near uniform):
        perturb norms/biases, spread router logits, so every path is exercised."""
        import torch

        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    p.add_(0.1 * torch.randn_like(p))
                elif router_scale is not None and name.endswith("mlp.gate.weight"):
                    p.mul_(router_scale)

    @staticmethod
    def load(hf, directory):
        """(kvjax model, config, weights) of the transformers model `hf` saved to `directory`."""
        hf.save_pretrained(directory, safe_serialization=True)
        cfg, weights = load_hf_checkpoint(directory)
        return Transformer.from_weights(cfg, weights), cfg, weights

    @staticmethod
    def tol(ref) -> float:
        return 1e-4 * max(1.0, float(np.abs(ref).max()))

    @staticmethod
    def hf_logits(hf, tokens) -> np.ndarray:
        import torch

        with torch.no_grad():
            return hf(torch.tensor(tokens)).logits.numpy()

    def check_prefill(self, hf, model, cfg, length: int = 24) -> None:
        tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, length))
        ref = self.hf_logits(hf, tokens)
        out, _ = jax.jit(lambda t: model(t))(jnp.asarray(tokens, jnp.int32))
        np.testing.assert_allclose(np.asarray(out), ref, atol=self.tol(ref), rtol=0)

    def check_decode(self, hf, model, cfg, length: int = 12, prefill: int = 5) -> None:
        """A `prefill`-token chunk through the dense cache, then one token at a time."""
        tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, length))
        ref = self.hf_logits(hf, tokens)
        cache = DenseKVCache.create(cfg, batch_size=2, max_len=length + 4)
        step = jax.jit(lambda tok, c: model(tok, c))
        out, cache = step(jnp.asarray(tokens[:, :prefill], jnp.int32), cache)
        outs = [np.asarray(out)]
        for t in range(prefill, length):
            out, cache = step(jnp.asarray(tokens[:, t : t + 1], jnp.int32), cache)
            outs.append(np.asarray(out))
        np.testing.assert_allclose(np.concatenate(outs, axis=1), ref, atol=self.tol(ref), rtol=0)
        assert np.asarray(cache.lengths).tolist() == [length, length]

    def check_paged_decode(
        self, hf, model, cfg, cache_cfg: CacheConfig, length: int = 12, prefill: int = 5
    ) -> None:
        """As `check_decode`, through the paged cache (identity transforms; with
        `cache_cfg.quant=None` every segment is exact, so the logits must match HF)."""
        tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, size=(2, length))
        ref = self.hf_logits(hf, tokens)
        cache = PagedKVCache.create(cfg, cache_cfg, KVTransforms.identity(cfg), batch_size=2)
        mgr = PageManager(cache)
        step = jax.jit(lambda tok, c: model(tok, c))
        outs = []
        bounds = [(0, prefill)] + [(t, t + 1) for t in range(prefill, length)]
        for i, j in bounds:
            cache = mgr.prepare(cache, j - i)
            out, cache = step(jnp.asarray(tokens[:, i:j], jnp.int32), cache)
            outs.append(np.asarray(out))
        np.testing.assert_allclose(np.concatenate(outs, axis=1), ref, atol=self.tol(ref), rtol=0)
        assert np.asarray(cache.lengths).tolist() == [length, length]


@pytest.fixture(scope="session")
def parity() -> Parity:
    return Parity()
