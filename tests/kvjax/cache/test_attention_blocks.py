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


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("t, min_block", [(40, 256), (40, 8), (37, 5)])
def test_causal_self_attention_in_query_blocks_is_the_masked_one_shot(
    t, min_block, window, monkeypatch
):
    """Query blocks over the keys up to each block's end give the one-shot causal attention
    (the keys they skip are masked for every query of the block), windows included."""
    from kvjax.cache import attention
    from kvjax.cache.attention import causal_mask, causal_self_attention

    monkeypatch.setattr(attention, "CAUSAL_MIN_BLOCK", min_block)
    blocks = attention.query_blocks(t)
    assert blocks[0][0] == 0 and blocks[-1][1] == t
    assert len(blocks) == min(attention.CAUSAL_BLOCKS, max(1, t // min_block))
    rng = np.random.default_rng(t + min_block)
    q = jnp.asarray(rng.normal(size=(2, t, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, t, 2, 8)), jnp.float32) for _ in range(2))
    pos = jnp.broadcast_to(3 + jnp.arange(t, dtype=jnp.int32), (2, t))
    want = grouped_attention(
        q, k, v, causal_mask(pos, pos, jnp.ones((2, t), bool), window), sm_scale=0.3
    )
    # a fresh jit (its trace reads the patched block size): eager dispatch of every block's
    # ops is the slow part otherwise
    got = jax.jit(lambda *a: causal_self_attention(*a, window, sm_scale=0.3))(q, k, v, pos)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_model_forward_in_query_blocks_is_the_masked_one(monkeypatch):
    """The model's cacheless forward (positions it makes itself, so ordered) in query blocks
    gives the logits of the one-shot masked attention (explicit positions)."""
    from kvjax.cache import attention

    cfg = ModelConfig(model_type="llama", vocab_size=50, hidden_size=32, intermediate_size=48,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)  # fmt: skip
    model = Transformer(cfg, rngs=nnx.Rngs(2))
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 50, (2, 30)), jnp.int32)
    monkeypatch.setattr(attention, "CAUSAL_MIN_BLOCK", 10)  # three blocks
    forward = nnx.jit(lambda m, x, pos: m(x, positions=pos)[0])
    blocked = nnx.jit(lambda m, x: m(x)[0])(model, tokens)
    one_shot = forward(model, tokens, jnp.broadcast_to(jnp.arange(30), (2, 30)))
    np.testing.assert_allclose(blocked, one_shot, rtol=1e-5, atol=1e-5)
