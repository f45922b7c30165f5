"""The drift check: reference moments from calibration Grams, the cache's running sums, the
engine's report, and storage next to the transforms."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax.cache.dense import DenseKVCache
from kvjax.cache.paged import CacheConfig
from kvjax.cache.quantizers import QuantConfig
from kvjax.cache.transforms import KVTransforms
from kvjax.config import ModelConfig
from kvjax.models.model import Transformer
from kvjax.serving import drift
from kvjax.serving.engine import Engine, EngineConfig
from kvjax.storage import (
    TransformsCheckpointError,
    load_drift_reference,
    save_transforms,
)

CFG = ModelConfig(
    model_type="llama", vocab_size=61, hidden_size=64, intermediate_size=96, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=32,
)  # fmt: skip
LOW = CacheConfig(sink=8, keep=8, flush=8, page_size=4, quant=QuantConfig(bits=2), max_seq_len=128)
ECFG = EngineConfig(max_seqs=4, prefill_chunk=16, prefill_tokens_per_step=32, decode_steps=4)


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, rngs=nnx.Rngs(0))


def test_reference_is_the_stored_frame_mean_square():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 500, 8)) * np.arange(1, 9)  # [Hkv, tokens, d]
    a = np.stack([np.linalg.qr(rng.normal(size=(8, 8)))[0] for _ in range(2)])
    gram = np.einsum("hti,htj->hij", x, x) / x.shape[1]
    ref = drift.reference_from_grams([gram], [gram], a[None], a[None])
    want = np.mean(np.einsum("hti,hij->htj", x, a) ** 2, axis=1)
    np.testing.assert_allclose(ref.k[0], want, rtol=1e-5)


def test_scores_are_zero_on_the_reference_and_the_log2_ratio_off_it():
    ref = np.random.default_rng(1).uniform(0.5, 2.0, size=(3, 2, 16)).astype(np.float32)
    np.testing.assert_allclose(drift.layer_scores(ref, ref), 0.0, atol=1e-7)
    s = drift.layer_scores(4.0 * ref, ref)
    assert np.all((s > 1.9) & (s <= 2.0))
    with pytest.raises(ValueError, match=r"served moments \(3, 2, 8\)"):
        drift.layer_scores(ref[..., :8], ref)


def test_engine_moments_sum_every_served_token(model):
    ps = [np.random.default_rng(2).integers(0, 61, n).tolist() for n in (21, 40)]
    ecfg = dataclasses.replace(ECFG, drift_check=True)
    # Full-precision pages, so every layer's keys equal a dense prefill's (with 2-bit pages the
    # layers after the first see quantized attention); the flushes still run.
    fp = dataclasses.replace(LOW, quant=None)
    eng = Engine(model, cache_kind="paged", cache_cfg=fp, engine_cfg=ecfg)
    out = eng.generate(ps, 6).tokens
    fed = [p + o[:-1] for p, o in zip(ps, out)]  # the last token is never fed back
    moments = eng.cache.moments
    assert float(moments[0].count) == sum(len(f) for f in fed)
    # Identity transforms: the stored frame is the model's; a dense prefill of the same tokens.
    graphdef, params = nnx.split(model)
    want_k = [np.zeros((2, 32)) for _ in range(2)]
    for f in fed:
        cache = DenseKVCache.create(CFG, 1, len(f))
        _, cache = nnx.merge(graphdef, params)(jnp.asarray([f]), cache)
        for layer in range(2):
            want_k[layer] += np.sum(np.square(np.asarray(cache.k[layer][0])), axis=0)
    for layer in range(2):
        np.testing.assert_allclose(np.asarray(moments[layer].k2), want_k[layer], rtol=1e-4)
    # The report of served moments against themselves scores 0 and flags nothing.
    served = np.stack([np.asarray(m.k2) / np.asarray(m.count) for m in moments])
    served_v = np.stack([np.asarray(m.v2) / np.asarray(m.count) for m in moments])
    rep = eng.drift_report(drift.DriftReference(served, served_v), reset=True)
    assert rep["max"] < 1e-4 and rep["flagged_layers"] == []
    assert float(eng.cache.moments[0].count) == 0.0
    shifted = drift.DriftReference(served * 8.0, served_v)
    eng = Engine(model, cache_kind="paged", cache_cfg=LOW, engine_cfg=ecfg)
    eng.generate(ps[:1], 3)
    rep = eng.drift_report(shifted)
    assert rep["flagged_layers"] == [0, 1] and min(rep["k"]) > drift.THRESHOLD


def test_drift_report_needs_the_check_on(model):
    eng = Engine(model, cache_kind="paged", cache_cfg=LOW, engine_cfg=ECFG)
    ref = drift.DriftReference(np.ones((2, 2, 32), np.float32), np.ones((2, 2, 32), np.float32))
    assert eng.cache.moments is None  # off: the cache carries nothing
    with pytest.raises(ValueError, match="drift_check=True"):
        eng.drift_report(ref)
    with pytest.raises(ValueError, match="needs cache_kind='paged', not 'dense'"):
        Engine(model, cache_kind="dense", engine_cfg=dataclasses.replace(ECFG, drift_check=True))


def test_reference_is_stored_beside_the_transforms(tmp_path):
    tf = KVTransforms.identity(CFG)
    rng = np.random.default_rng(3)
    ref = drift.DriftReference(
        rng.uniform(size=(2, 2, 32)).astype(np.float32),
        rng.uniform(size=(2, 2, 32)).astype(np.float32),
    )
    save_transforms(tmp_path / "t", tf, dict(model_fingerprint="x"), extras=ref.arrays())
    got = load_drift_reference(tmp_path / "t")
    np.testing.assert_array_equal(got.k, ref.k)
    np.testing.assert_array_equal(got.v, ref.v)
    save_transforms(tmp_path / "old", tf, dict(model_fingerprint="x"))
    with pytest.raises(TransformsCheckpointError, match="no drift reference"):
        load_drift_reference(tmp_path / "old")
    np.savez(tmp_path / "t" / "extras.npz", drift_k=ref.k * 2, drift_v=ref.v)
    with pytest.raises(TransformsCheckpointError, match="drift_k does not match"):
        load_drift_reference(tmp_path / "t")
