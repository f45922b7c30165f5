"""Tests for calib.wush_a: the tiled exact Hessians against jax.hessian of the App. C loss,
tiling/batching invariances, validation, and a directional test of the WUSH-A transform."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from calib import transforms as tr
from calib import wush_a


@functools.partial(jax.jit, static_argnames="sm_scale")
def _module_out(q, k, v, w_o, *, sm_scale):
    """Reference GQA module output Y = concat_heads(softmax(q k^T s + causal) v) @ w_o.T."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    s = jnp.einsum("BTKGX,BSKX->BKGTS", qg, k) * sm_scale
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("BKGTS,BSKX->BTKGX", p, v).reshape(b, t, hq * d)
    return o @ w_o.T


def _inputs(seed, b=2, t=7, hkv=2, g=3, d=4, dm=5):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, t, hkv * g, d))
    k = jax.random.normal(ks[1], (b, t, hkv, d))
    v = jax.random.normal(ks[2], (b, t, hkv, d))
    w_o = jax.random.normal(ks[3], (dm, hkv * g * d))
    return q, k, v, w_o


@pytest.mark.parametrize(("q_tile", "k_tile", "sm_scale"), [(3, 2, 0.7), (4, 16, None)])
def test_hessians_equal_jax_hessian_of_attention_output_loss(q_tile, k_tile, sm_scale):
    q, k, v, w_o = _inputs(0)
    # sm_scale=None must mean the model default d ** -0.5.
    ref_scale = k.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    y0 = _module_out(q, k, v, w_o, sm_scale=ref_scale)

    def loss_k(dk):
        return jnp.sum((_module_out(q, k + dk, v, w_o, sm_scale=ref_scale) - y0) ** 2)

    def loss_v(dv):
        return jnp.sum((_module_out(q, k, v + dv, w_o, sm_scale=ref_scale) - y0) ** 2)

    h_k, h_v = wush_a.wush_a_hessians(q, k, v, w_o, sm_scale=sm_scale, q_tile=q_tile, k_tile=k_tile)
    for loss, got in ((loss_k, h_k), (loss_v, h_v)):
        full = jax.jit(jax.hessian(loss))(jnp.zeros_like(k))  # [B, T, K, X, B, T, K, Y]
        # Per-position Hessians are the diagonal blocks; WUSH-A sums them over (b, s).
        ref = jnp.einsum("BTKXBTKY->KXY", full)
        assert got.shape == ref.shape == (k.shape[2], k.shape[3], k.shape[3])
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * float(jnp.abs(ref).max()))


def test_batch_additivity_and_update():
    q, k, v, w_o = _inputs(2)
    h_k, h_v = wush_a.wush_a_hessians(q, k, v, w_o, sm_scale=0.7, q_tile=3, k_tile=2)
    acc = (jnp.zeros_like(h_k), jnp.zeros_like(h_v))
    for i in range(2):
        acc = wush_a.wush_a_update(
            *acc, q[i : i + 1], k[i : i + 1], v[i : i + 1], w_o, sm_scale=0.7, q_tile=5, k_tile=2
        )
    np.testing.assert_allclose(acc[0], h_k, rtol=1e-5, atol=1e-5 * float(jnp.abs(h_k).max()))
    np.testing.assert_allclose(acc[1], h_v, rtol=1e-5, atol=1e-5 * float(jnp.abs(h_v).max()))


def test_hessians_are_symmetric_psd():
    q, k, v, w_o = _inputs(3)  # same shapes and tiles as above: reuses the compiled function
    for h in wush_a.wush_a_hessians(q, k, v, w_o, sm_scale=0.7, q_tile=3, k_tile=2):
        h = np.asarray(h, np.float64)
        np.testing.assert_array_equal(h, np.swapaxes(h, 1, 2))
        assert np.linalg.eigvalsh(h).min() >= -1e-5 * np.abs(h).max()


def test_validation_errors():
    q, k, v, w_o = _inputs(4)
    with pytest.raises(ValueError, match="w_o.shape"):
        wush_a.wush_a_hessians(q, k, v, w_o[:, :-1])
    with pytest.raises(ValueError, match="k.shape"):
        wush_a.wush_a_hessians(q, k, v[:, :-1], w_o)
    with pytest.raises(ValueError, match="Hq=5"):
        wush_a.wush_a_hessians(q[:, :, :5], k, v, w_o[:, : 5 * 4])
    with pytest.raises(ValueError, match="tile"):
        wush_a.wush_a_hessians(q, k, v, w_o, q_tile=0)
    with pytest.raises(ValueError, match="h_k.shape"):
        wush_a.wush_a_update(jnp.zeros((1, 4, 4)), jnp.zeros((1, 4, 4)), q, k, v, w_o)


def _minmax_fake_quant(x: np.ndarray, bits: int = 2) -> np.ndarray:
    """Per-row asymmetric min/max round-to-nearest fake quantizer."""
    lo = x.min(axis=-1, keepdims=True)
    hi = x.max(axis=-1, keepdims=True)
    step = (hi - lo) / (2**bits - 1)
    step = np.where(step > 0, step, 1.0)
    return np.clip(np.round((x - lo) / step), 0, 2**bits - 1) * step + lo


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_wush_a_beats_identity_and_hadamard_on_module_output_error(seed):
    # WUSH-A's Hessians are those of the module-output loss, so that is the error to check:
    # quantize keys only, then values only, and compare ||Y_hat - Y||^2 / ||Y||^2.
    b, t, hkv, g, d, dm = 16, 64, 1, 2, 16, 32
    ks = jax.random.split(jax.random.key(seed), 3)
    k = np.asarray(jax.random.t(ks[0], 5, (b, t, hkv, d)), np.float64)
    k[..., :2] *= 6.0  # outlier key channels
    spec = 2.0 * np.exp(-np.arange(d) / 3.0)  # anisotropic queries in a random frame
    q = np.asarray(jax.random.t(ks[1], 5, (b, t, hkv * g, d)), np.float64)
    q = q * np.sqrt(spec) @ tr.random_orthogonal(d, seed).T
    v = np.asarray(jax.random.t(ks[2], 5, (b, t, hkv, d)), np.float64)
    v[..., 3] *= 6.0
    rng = np.random.default_rng(seed)
    w_o = np.concatenate(
        [
            rng.standard_normal((dm, d))
            * np.exp(-np.arange(d) / 4.0)
            @ tr.random_orthogonal(d, j + 7)
            for j in range(hkv * g)
        ],
        axis=1,
    )
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v, w_o)]
    h_k, h_v = wush_a.wush_a_hessians(*f32, q_tile=32, k_tile=32)
    kf, vf = k.reshape(-1, hkv, d), v.reshape(-1, hkv, d)
    stats = {
        "KK": np.einsum("NKX,NKY->KXY", kf, kf),
        "VV": np.einsum("NKX,NKY->KXY", vf, vf),
        "H_K": np.asarray(h_k, np.float64),
        "H_V": np.asarray(h_v, np.float64),
    }
    sm = d**-0.5
    y = np.asarray(_module_out(*f32, sm_scale=sm), np.float64)

    def rel_err(pair, which):
        a, bb = (pair.A_K, pair.B_K) if which == "k" else (pair.A_V, pair.B_V)
        x = k if which == "k" else v
        x_hat = np.einsum(
            "BTKX,KXY->BTKY", _minmax_fake_quant(np.einsum("BTKX,KXY->BTKY", x, a)), bb
        )
        kk, vv = (x_hat, v) if which == "k" else (k, x_hat)
        args = [jnp.asarray(z, jnp.float32) for z in (q, kk, vv, w_o)]
        y_hat = np.asarray(_module_out(*args, sm_scale=sm), np.float64)
        return float(np.sum((y_hat - y) ** 2) / np.sum(y**2))

    pairs = {
        m: tr.build_transforms(m, stats, num_kv_heads=hkv, head_dim=d)
        for m in ("identity", "hadamard", "wush_a")
    }
    for which in ("k", "v"):
        err = {m: rel_err(p, which) for m, p in pairs.items()}
        assert err["wush_a"] < 0.7 * min(err["identity"], err["hadamard"]), (which, err)
