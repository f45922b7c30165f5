"""Sliding-window layers (Gemma 3's local layers) in every cache: the mask, the per-layer policy
of the paged cache, and the eval simulation of the chunked paged cache.

Windows are a few tokens and sequences several windows long, so keys leave the window while they
sit in each segment of the paged cache (sink, low-bit, recent).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax.cache import attention as kv_attention
from kvjax.cache.allocator import PageManager
from kvjax.cache.attention import causal_mask
from kvjax.cache.dense import DenseKVCache
from kvjax.cache.paged import CacheConfig, LayerPolicy, PagedKVCache
from kvjax.cache.quantizers import QuantConfig
from kvjax.cache.transforms import KVTransforms
from kvjax.config import ModelConfig
from kvjax.models.model import Transformer

CFG = ModelConfig(
    model_type="gemma3_text",
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_layers=3,
    num_heads=4,
    num_kv_heads=1,
    head_dim=16,
    qk_norm=True,
    sandwich_norms=True,
    hidden_act="gelu_pytorch_tanh",
    norm_style="gemma",
    scale_embeddings=True,
    query_pre_attn_scalar=12.0,
    layer_types=("sliding_attention", "full_attention", "sliding_attention"),
    sliding_window=6,
    rope_local_theta=10000.0,
    rope_theta=1e6,
)
LENGTH = 30


def test_causal_mask_window():
    pos = jnp.arange(10, dtype=jnp.int32)[None]
    m = np.asarray(causal_mask(pos, pos, jnp.ones((1, 10), bool), window=3))[0]
    for t in range(10):
        assert np.flatnonzero(m[t]).tolist() == list(range(max(0, t - 2), t + 1))
    full = np.asarray(causal_mask(pos, pos, jnp.ones((1, 10), bool)))[0]
    np.testing.assert_array_equal(full, np.tril(np.ones((10, 10), bool)))


def test_layer_policies_are_explicit():
    q = QuantConfig("oscar", 2)
    fp = CacheConfig(quant=q).layer_policies(CFG)
    assert fp == (LayerPolicy(6, None, None), LayerPolicy(None, q, q), LayerPolicy(6, None, None))
    mixed = CacheConfig(quant=q, sliding_layers="quantized").layer_policies(CFG)
    assert [p.quant for p in mixed] == [q, q, q]
    assert [p.window for p in mixed] == [6, None, 6]
    with pytest.raises(ValueError, match="sliding_layers='ring'"):
        CacheConfig(sliding_layers="ring")


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, CFG.vocab_size, (2, LENGTH)).astype(np.int32)


@pytest.fixture(scope="module")
def dense_logits(model, tokens):
    out, _ = jax.jit(lambda t: model(t))(jnp.asarray(tokens))
    return np.asarray(out)


def _paged_logits(model, cfg, tokens, ccfg, tf, chunks):
    cache = PagedKVCache.create(cfg, ccfg, tf, tokens.shape[0])
    mgr = PageManager(cache)
    step = jax.jit(lambda t, c: model(t, c))
    outs, i = [], 0
    for n in chunks:
        cache = mgr.prepare(cache, n)
        out, cache = step(jnp.asarray(tokens[:, i : i + n]), cache)
        outs.append(np.asarray(out))
        i += n
    return np.concatenate(outs, axis=1), cache


def test_dense_cache_masks_old_keys(model, tokens, dense_logits):
    cache = DenseKVCache.create(CFG, 2, LENGTH)
    assert cache.windows == (6, None, 6)
    step = jax.jit(lambda t, c: model(t, c))
    out, cache = step(jnp.asarray(tokens[:, :7]), cache)
    outs = [np.asarray(out)]
    for t in range(7, LENGTH):
        out, cache = step(jnp.asarray(tokens[:, t : t + 1]), cache)
        outs.append(np.asarray(out))
    np.testing.assert_allclose(np.concatenate(outs, 1), dense_logits, atol=2e-5, rtol=0)


CHUNKS = [8, 1, 1, 1, 1, 1, 1, 8, 8]  # 30 tokens: a prefill chunk, decode steps, chunks


ALL_SLIDING = dataclasses.replace(CFG, layer_types=("sliding_attention",) * CFG.num_layers)
TWO_BIT = CacheConfig(
    sink=4, keep=4, flush=4, page_size=4, quant=QuantConfig("oscar", 2), max_seq_len=32
)


def test_sliding_layer_pools_follow_the_policy():
    def pools(cfg, ccfg):
        tf = KVTransforms.identity(cfg)
        cache = jax.eval_shape(lambda: PagedKVCache.create(cfg, ccfg, tf, 1))
        return [len(p.k_low) for p in cache.pools]  # 1: full-precision array; 3: codes/scale/zero

    assert pools(CFG, TWO_BIT) == [1, 3, 1]
    assert pools(CFG, dataclasses.replace(TWO_BIT, sliding_layers="quantized")) == [3, 3, 3]


@pytest.fixture(scope="module")
def all_sliding(tokens):
    model = Transformer(ALL_SLIDING, rngs=nnx.Rngs(1))
    want, _ = jax.jit(lambda t: model(t))(jnp.asarray(tokens))
    return model, np.asarray(want)


def test_full_precision_sliding_layers_stay_exact(tokens, all_sliding):
    """Every layer slides; at 2 bits with the default policy the sliding layers keep their
    middle segment in full precision, so the logits equal the plain forward's."""
    model, want = all_sliding
    tf = KVTransforms.identity(ALL_SLIDING)
    got, _ = _paged_logits(model, ALL_SLIDING, tokens, TWO_BIT, tf, CHUNKS)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


@pytest.mark.slow
def test_quantized_policy_quantizes_sliding_layers(tokens, all_sliding):
    model, want = all_sliding
    tf = KVTransforms.identity(ALL_SLIDING)
    quantized = dataclasses.replace(TWO_BIT, sliding_layers="quantized")
    got, _ = _paged_logits(model, ALL_SLIDING, tokens, quantized, tf, CHUNKS)
    assert np.abs(got - want).max() > 1e-3


@pytest.mark.parametrize(
    "sink, keep",
    [
        pytest.param(8, 4, id="sink8_keep4"),
        pytest.param(0, 4, id="nosink_keep4", marks=pytest.mark.slow),
        pytest.param(4, 12, id="sink4_keep12", marks=pytest.mark.slow),
    ],
)
def test_paged_cache_masks_old_keys_in_every_segment(model, tokens, dense_logits, sink, keep):
    """Full precision everywhere, so the paged logits must equal the plain forward's while keys
    leave the sliding windows from the sink, low-bit and recent segments."""
    tf = KVTransforms.identity(CFG)
    ccfg = CacheConfig(sink=sink, keep=keep, flush=4, page_size=4, quant=None, max_seq_len=32)
    got, _ = _paged_logits(model, CFG, tokens, ccfg, tf, CHUNKS)
    np.testing.assert_allclose(got, dense_logits, atol=2e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("min_block", [256, 8])  # one query block, or five
def test_eval_simulation_matches_paged_cache_with_windows(model, min_block, monkeypatch):
    """eval's one-pass simulation of the chunked paged cache honours windows and the policy."""
    from eval import common

    monkeypatch.setattr(kv_attention, "CAUSAL_MIN_BLOCK", min_block)
    windows = np.random.default_rng(3).integers(0, CFG.vocab_size, (2, 41)).astype(np.int32)
    scorer = common.TokenScorer(model)
    tf = KVTransforms.identity(CFG)
    for policy in ("full_precision", "quantized"):
        ccfg = CacheConfig(
            sink=4,
            keep=8,
            flush=4,
            page_size=4,
            quant=QuantConfig("oscar", 2),
            max_seq_len=48,
            sliding_layers=policy,
        )
        sim = scorer.one_pass(windows, ccfg, tf, 4)
        real = scorer.chunked(windows, ccfg, tf, 4)
        np.testing.assert_allclose(sim, real, atol=5e-5, rtol=0, err_msg=policy)


@pytest.mark.slow
def test_pallas_decode_routes_sliding_layers_to_the_reference_path():
    """attention='pallas' (interpret mode on CPU): global layers decode through the 2-bit kernel
    at Gemma 3 270M's head shape (head_dim 256, one KV head for four query heads), sliding layers
    through the reference path; the logits match the all-reference cache."""
    cfg = dataclasses.replace(
        CFG,
        num_layers=2,
        head_dim=256,
        query_pre_attn_scalar=256.0,
        layer_types=("sliding_attention", "full_attention"),
    )
    model = Transformer(cfg, rngs=nnx.Rngs(2))
    tokens = np.random.default_rng(4).integers(0, cfg.vocab_size, (1, 56)).astype(np.int32)
    tf = KVTransforms.identity(cfg)
    ref_cfg = CacheConfig(  # the kernels take pages of >= 16 tokens
        sink=16, keep=16, flush=16, page_size=16, quant=QuantConfig("oscar", 2), max_seq_len=64
    )
    chunks = [40] + [1] * 16  # decode steps read sink, low-bit and recent pages
    want, _ = _paged_logits(model, cfg, tokens, ref_cfg, tf, chunks)
    pallas_cfg = dataclasses.replace(ref_cfg, attention="pallas")
    got, _ = _paged_logits(model, cfg, tokens, pallas_cfg, tf, chunks)
    # test_paged_cache's kernel-vs-reference budget: the quantize+pack kernel and the jnp
    # quantizer may round a borderline code differently.
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, atol=2e-3 * scale, rtol=0)
