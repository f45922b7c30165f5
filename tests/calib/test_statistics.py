"""Tests for calib.statistics: init/update/merge/finalize against float64 one-shot sums."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from calib import statistics as cs
from calib import transforms as tr
from calib import wush_a

HKV, G, D, DM = 2, 3, 8, 12


def _batch(seed: int, b: int = 2, t: int = 6):
    """q, k, v, o of one batch of causal sequences (Student-t, 5 dof); o is the real output."""
    rng = np.random.default_rng(seed)
    q, k, v = (
        jnp.asarray(rng.standard_t(5, shape), jnp.float32)
        for shape in ((b, t, HKV * G, D), (b, t, HKV, D), (b, t, HKV, D))
    )
    return q, k, v, _attention(q, k, v)


@jax.jit
def _attention(q, k, v):
    b, t = q.shape[:2]
    s = jnp.einsum("BTKGX,BSKX->BKGTS", q.reshape(b, t, HKV, G, D), k) * D**-0.5
    p = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf), axis=-1)
    return jnp.einsum("BKGTS,BSKX->BTKGX", p, v).reshape(b, t, HKV * G, D)


def _w_o(seed: int = 9):
    return jax.random.normal(jax.random.key(seed), (DM, HKV * G * D))


def _reference(q, k, v, o, c_w):
    """One-shot float64 sums with numpy (C_W: fixed C_Q for V_TW's token weights)."""
    q, k, v, o = (np.asarray(x, np.float64) for x in (q, k, v, o))
    n = q.shape[0] * q.shape[1]
    qg = q.reshape(n, HKV, G, D)
    og = o.reshape(n, HKV, G, D)
    kf, vf = k.reshape(n, HKV, D), v.reshape(n, HKV, D)
    w = np.einsum("NKX,KXY,NKY->NK", kf, c_w, kf)
    return {
        "C_Q": np.einsum("NKGX,NKGY->KXY", qg, qg),
        "KK": np.einsum("NKX,NKY->KXY", kf, kf),
        "VV": np.einsum("NKX,NKY->KXY", vf, vf),
        "C_S": np.einsum("NKGX,NKGY->KXY", og, og),
        "V_TW": np.einsum("NK,NKX,NKY->KXY", w, vf, vf),
    }


def test_required_stats():
    assert cs.required_stats(["identity", "random", "hadamard"]) == frozenset()
    assert cs.required_stats(["oscar"]) == {"C_Q", "C_S"}
    assert cs.required_stats(["kv_pca", "wush"]) == {"KK", "VV", "C_Q"}
    assert cs.required_stats(["oscar_tokenweight"]) == {"C_Q", "V_TW"}
    assert cs.required_stats(["wush_a"]) == {"KK", "VV", "H_K", "H_V"}
    assert cs.required_stats(tr.METHODS) == set(cs.STAT_NAMES)
    with pytest.raises(ValueError, match="'pca'.*oscar"):
        cs.required_stats(["oscar", "pca"])


def test_init_stats():
    stats = cs.init_stats({"KK", "C_Q"}, HKV, D)
    assert set(stats) == {"KK", "C_Q", "count"}
    assert stats["KK"].shape == (HKV, D, D) and stats["KK"].dtype == jnp.float32
    assert int(stats["count"]) == 0
    with pytest.raises(ValueError, match="'XX'"):
        cs.init_stats({"XX"}, HKV, D)
    with pytest.raises(ValueError, match="num_kv_heads=0"):
        cs.init_stats({"KK"}, 0, D)


def test_many_small_batches_match_one_shot_float64():
    names = ("C_Q", "KK", "VV", "C_S", "V_TW")
    c_w = np.asarray(_reference(*_batch(100), np.zeros((HKV, D, D)))["C_Q"]) / 12
    update = jax.jit(cs.update_stats)
    stats = cs.init_stats(names, HKV, D)
    batches = [_batch(i, b=1, t=8) for i in range(40)]
    for q, k, v, o in batches:
        stats = update(stats, q, k, v, o, c_q_weights=jnp.asarray(c_w, jnp.float32))
    cat = [jnp.concatenate(xs, axis=0) for xs in zip(*batches)]
    ref = _reference(*cat, c_w)
    n = 40 * 8
    got = cs.finalize_stats(stats)
    assert int(got["count"]) == n
    for name in names:
        assert got[name].dtype == np.float64
        np.testing.assert_allclose(got[name], ref[name] / n, rtol=1e-5, atol=1e-6)


def test_several_batches_equal_one_batch_including_wush_a():
    names = cs.STAT_NAMES
    w_o = _w_o()
    q, k, v, o = _batch(1, b=3, t=7)
    kw = dict(w_o=w_o, c_q_weights=jnp.eye(D)[None].repeat(HKV, 0), q_tile=4, k_tile=4)
    one = cs.update_stats(cs.init_stats(names, HKV, D), q, k, v, o, **kw)
    many = cs.init_stats(names, HKV, D)
    for i in range(3):
        s = slice(i, i + 1)
        many = cs.update_stats(many, q[s], k[s], v[s], o[s], **kw)
    assert int(one["count"]) == int(many["count"]) == 21
    for name in names:
        scale = float(jnp.abs(one[name]).max())
        np.testing.assert_allclose(many[name], one[name], rtol=1e-5, atol=1e-5 * scale)
    h_k, h_v = wush_a.wush_a_hessians(q, k, v, w_o, q_tile=4, k_tile=4)
    np.testing.assert_allclose(one["H_K"], h_k, rtol=1e-6)
    np.testing.assert_allclose(one["H_V"], h_v, rtol=1e-6)


def test_c_s_is_v_t_s_t_s_v_summed_over_the_group():
    # DESIGN.md: C_S is the Gram of per-head outputs, equal to V^T S^T S V.
    q, k, v, o = _batch(3, b=1, t=9)
    stats = cs.update_stats(cs.init_stats({"C_S"}, HKV, D), q, k, v, o)
    s = jnp.einsum("TKGX,SKX->KGTS", q[0].reshape(9, HKV, G, D), k[0]) * D**-0.5
    p = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((9, 9), bool)), s, -jnp.inf), axis=-1)
    ref = jnp.einsum("SKX,KGTS,KGTU,UKY->KXY", v[0], p, p, v[0])
    np.testing.assert_allclose(stats["C_S"], ref, rtol=1e-5, atol=1e-5)


def test_v_tw_default_uses_running_mean_c_q():
    q, k, v, o = _batch(4, b=2, t=5)
    stats = cs.update_stats(cs.init_stats({"C_Q", "V_TW"}, HKV, D), q, k, v, o)
    c_running = np.asarray(stats["C_Q"], np.float64) / 10  # this batch's mean C_Q
    ref = _reference(q, k, v, o, c_running)["V_TW"]
    np.testing.assert_allclose(stats["V_TW"], ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
    with pytest.raises(ValueError, match="'V_TW' needs 'C_Q'"):
        cs.update_stats(cs.init_stats({"V_TW"}, HKV, D), q, k, v, o)


def test_merge_equals_sequential():
    names = ("C_Q", "KK", "C_S")
    a_in, b_in = _batch(5), _batch(6)
    seq = cs.update_stats(cs.update_stats(cs.init_stats(names, HKV, D), *a_in), *b_in)
    merged = cs.merge_stats(
        cs.update_stats(cs.init_stats(names, HKV, D), *a_in),
        cs.update_stats(cs.init_stats(names, HKV, D), *b_in),
    )
    assert int(merged["count"]) == int(seq["count"])
    for n in names:
        np.testing.assert_allclose(merged[n], seq[n], rtol=1e-6)
    with pytest.raises(ValueError, match="cannot merge"):
        cs.merge_stats(merged, cs.init_stats({"KK"}, HKV, D))
    with pytest.raises(ValueError, match="'KK'"):
        cs.merge_stats(cs.init_stats({"KK"}, HKV, D), cs.init_stats({"KK"}, HKV, 2 * D))


def test_finalize_errors():
    with pytest.raises(ValueError, match="count=0"):
        cs.finalize_stats(cs.init_stats({"KK"}, HKV, D))
    stats = cs.update_stats(cs.init_stats({"KK"}, HKV, D), *_batch(7))
    stats["KK"] = stats["KK"].at[0, 0, 0].set(jnp.nan)
    with pytest.raises(ValueError, match="'KK'.*non-finite"):
        cs.finalize_stats(stats)


def test_update_validation_at_trace_time():
    stats = cs.init_stats({"KK", "C_S", "H_K"}, HKV, D)
    q, k, v, o = _batch(8)
    update = jax.jit(cs.update_stats)
    with pytest.raises(ValueError, match="k.shape"):
        update(stats, q, k[:, :, :1], v[:, :, :1], o, w_o=_w_o())
    with pytest.raises(ValueError, match="q.shape"):
        update(stats, q[:, :, :5], k, v, o[:, :, :5], w_o=_w_o())
    with pytest.raises(ValueError, match="o.shape"):
        update(stats, q, k, v, o[:, :-1], w_o=_w_o())
    with pytest.raises(ValueError, match="needs o"):
        update(stats, q, k, v, None, w_o=_w_o())
    with pytest.raises(ValueError, match="need w_o"):
        update(stats, q, k, v, o)
    with pytest.raises(ValueError, match="c_q_weights.shape"):
        cs.update_stats(cs.init_stats({"C_Q", "V_TW"}, HKV, D), q, k, v, o, c_q_weights=jnp.eye(D))


def test_finalized_stats_build_every_method():
    w_o = _w_o()
    names = cs.required_stats(tr.METHODS)
    stats = cs.init_stats(names, HKV, D)
    for i in range(2):
        stats = cs.update_stats(stats, *_batch(20 + i, b=2, t=16), w_o=w_o, q_tile=8, k_tile=8)
    final = cs.finalize_stats(stats)
    for method in tr.METHODS:
        pair = tr.build_transforms(method, final, num_kv_heads=HKV, head_dim=D, w_o=w_o)
        for h in range(HKV):
            np.testing.assert_allclose(pair.A_K[h] @ pair.B_K[h], np.eye(D), atol=1e-8)
            np.testing.assert_allclose(pair.A_V[h] @ pair.B_V[h], np.eye(D), atol=1e-8)
