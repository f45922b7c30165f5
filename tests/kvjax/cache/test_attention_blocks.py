"""Blocked (online-softmax) attention against the one-shot reference, and the paged cache's
reference path at block sizes that split the low-bit segment."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax.cache import paged
from kvjax.cache.allocator import PageManager
from kvjax.cache.attention import (
    attention_partial,
    empty_partial,
    finish_partial,
    grouped_attention,
    merge_partials,
    split_heads_by_group,
)
from kvjax.cache.paged import CacheConfig, PagedKVCache
from kvjax.cache.quantizers import QuantConfig
from kvjax.cache.transforms import KVTransforms
from kvjax.config import ModelConfig
from kvjax.models.model import Transformer


def _inputs(seed=0, b=2, t=5, s=37, hq=4, hkv=2, d=8):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, t, hq, d)), jnp.float32)
    k = rng.normal(size=(b, s, hkv, d))
    v = rng.normal(size=(b, s, hkv, d))
    mask = rng.random((b, t, s)) < 0.6
    mask[1, 2] = False  # a query row with no visible key
    k[~mask.any(axis=1)] = np.nan  # slots no query sees hold garbage
    v[~mask.any(axis=1)] = np.nan
    return q, jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), jnp.asarray(mask)


@pytest.mark.parametrize("bounds", [(0, 37), (0, 10, 11, 37), (0, 1, 20, 36, 37)])
def test_blocks_merge_to_one_shot_attention(bounds):
    q, k, v, mask = _inputs()
    qg = split_heads_by_group(q, k.shape[2])
    state = empty_partial(qg)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        part = attention_partial(qg, k[:, lo:hi], v[:, lo:hi], mask[:, :, lo:hi], sm_scale=0.3)
        state = merge_partials(state, part)
    got = finish_partial(state, q.shape)
    want = grouped_attention(q, k, v, mask, sm_scale=0.3)
    assert bool(jnp.isfinite(got).all())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got[1, 2]), 0.0)


def test_merging_a_block_with_no_visible_key_changes_nothing():
    q, k, v, mask = _inputs(seed=1)
    qg = split_heads_by_group(q, k.shape[2])
    state = attention_partial(qg, k, v, mask, sm_scale=0.5)
    none = attention_partial(qg, k, v, jnp.zeros_like(mask), sm_scale=0.5)
    merged = merge_partials(state, none)
    for a, b in zip(state, merged):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


CFG = ModelConfig(
    model_type="llama",
    vocab_size=61,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
)


@pytest.mark.parametrize("window", [24])  # layer 0 sliding, layer 1 full
def test_paged_reference_path_is_independent_of_the_key_block(monkeypatch, window):
    """Logits of a 2-bit paged cache whose low-bit segment spans many pages: one page per
    online-softmax block equals one block for everything, to float32 rounding (a sliding
    layer's window cutting through the blocks included)."""
    model_cfg = CFG
    if window:
        layers = ("sliding_attention", "full_attention")
        model_cfg = dataclasses.replace(CFG, layer_types=layers, sliding_window=window)
    model = Transformer(model_cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    step = jax.jit(lambda tokens, cache: nnx.merge(graphdef, params)(tokens, cache))
    cc = CacheConfig(
        sink=8, keep=8, flush=8, page_size=4, quant=QuantConfig(bits=2), max_seq_len=96,
        sliding_layers="quantized",
    )  # fmt: skip
    tokens = np.random.default_rng(3).integers(0, CFG.vocab_size, size=(2, 72))
    outs = {}
    for block in (4, 4096):
        monkeypatch.setattr(paged, "LOWBIT_KEY_BLOCK", block)
        cache = PagedKVCache.create(model_cfg, cc, KVTransforms.identity(model_cfg), 2)
        mgr = PageManager(cache)
        got = []
        chunks = [40, 16, 1, 1, 1]
        for i, c in enumerate(chunks):
            start = sum(chunks[:i])
            cache = mgr.prepare(cache, c)
            out, cache = step(jnp.asarray(tokens[:, start : start + c]), cache)
            got.append(np.asarray(out))
        assert mgr.segments(0)[1] > 16  # several low-bit pages
        outs[block] = np.concatenate(got, axis=1)
    scale = np.abs(outs[4096]).max()
    np.testing.assert_allclose(outs[4], outs[4096], atol=1e-5 * scale, rtol=0)
