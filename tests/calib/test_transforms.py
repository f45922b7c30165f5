"""Tests for calib.transforms: the papers' lemmas and theorems as properties, the (A, B)
contract for every method, error handling, and directional tests on heavy-tailed data."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calib import transforms as tr

POW2 = st.sampled_from([2, 4, 8, 16, 32, 64])


def _sym_spd(rng: np.random.Generator, d: int) -> np.ndarray:
    x = rng.standard_normal((4 * d, d)) * np.exp(rng.uniform(-2, 2, d))
    r = tr.random_orthogonal(d, int(rng.integers(1 << 30)))
    y = x @ r
    return y.T @ y


def _minmax_fake_quant(x: np.ndarray, bits: int = 2) -> np.ndarray:
    """Per-row asymmetric min/max round-to-nearest fake quantizer (the 'naive INT2' grid)."""
    lo = x.min(axis=-1, keepdims=True)
    hi = x.max(axis=-1, keepdims=True)
    step = (hi - lo) / (2**bits - 1)
    step = np.where(step > 0, step, 1.0)
    return np.clip(np.round((x - lo) / step), 0, 2**bits - 1) * step + lo


# ---------------------------------------------------------------------------- building blocks


@given(d=POW2)
def test_hadamard_orthogonal_symmetric_equal_magnitude(d):
    h = tr.hadamard_matrix(d)
    np.testing.assert_allclose(h @ h.T, np.eye(d), atol=1e-12)
    np.testing.assert_array_equal(h, h.T)
    np.testing.assert_allclose(np.abs(h), d**-0.5)


@pytest.mark.parametrize("d", [0, 3, 12, 96])
def test_hadamard_rejects_non_power_of_two(d):
    with pytest.raises(ValueError, match=f"d={d}"):
        tr.hadamard_matrix(d)


@given(d=POW2)
def test_bit_reversal_is_an_involution_reversing_bits(d):
    beta = tr.bit_reversal_permutation(d)
    nbits = d.bit_length() - 1
    expected = [int(format(k, f"0{nbits}b")[::-1] or "0", 2) for k in range(d)]
    np.testing.assert_array_equal(beta, expected)
    np.testing.assert_array_equal(beta[beta], np.arange(d))


@given(d=POW2)
def test_hadamard_commutes_with_bit_reversal(d):
    # Why U H P_br == (U P_br) H: the Sylvester Hadamard is invariant under bit reversal.
    h, beta = tr.hadamard_matrix(d), tr.bit_reversal_permutation(d)
    np.testing.assert_array_equal(h[np.ix_(beta, beta)], h)


@given(d=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
def test_random_orthogonal(d, seed):
    r = tr.random_orthogonal(d, seed)
    np.testing.assert_allclose(r @ r.T, np.eye(d), atol=1e-10)
    np.testing.assert_array_equal(r, tr.random_orthogonal(d, seed))
    if d > 1:
        assert not np.allclose(r, tr.random_orthogonal(d, seed + 1))


# ---------------------------------------------------------------------------- OSCAR


@settings(deadline=None)
@given(d=POW2, seed=st.integers(0, 2**31 - 1))
def test_oscar_rotation_orthogonal_and_lemma_1(d, seed):
    rng = np.random.default_rng(seed)
    c = _sym_spd(rng, d)
    a = tr.oscar_rotation(c)
    np.testing.assert_allclose(a @ a.T, np.eye(d), atol=1e-10)
    # Lemma 1 on U H (undo P_br: column beta(k) of A is column k of U H) and on A itself.
    beta = tr.bit_reversal_permutation(d)
    uh = a[:, beta]
    target = np.trace(c) / d
    np.testing.assert_allclose(np.diag(uh.T @ c @ uh), target, rtol=1e-9)
    np.testing.assert_allclose(np.diag(a.T @ c @ a), target, rtol=1e-9)


@settings(deadline=None)
@given(d=POW2, seed=st.integers(0, 2**31 - 1))
def test_oscar_bit_reversal_balances_top_eigenvectors_across_groups(d, seed):
    rng = np.random.default_rng(seed)
    c = _sym_spd(rng, d)
    a = tr.oscar_rotation(c)
    h = tr.hadamard_matrix(d)
    u_pbr = a @ h.T  # == U P_br since A = U H P_br = (U P_br) H
    evals, evecs = np.linalg.eigh(c)
    evecs = evecs[:, np.argsort(evals)[::-1]]  # k-th largest first
    # Which position holds the eigenvector with the k-th largest eigenvalue (up to sign)?
    position = np.argmax(np.abs(evecs.T @ u_pbr), axis=1)
    np.testing.assert_allclose(np.abs(np.sum(evecs * u_pbr[:, position], axis=0)), 1, atol=1e-8)
    np.testing.assert_array_equal(position, tr.bit_reversal_permutation(d))
    for g in (2**i for i in range(d.bit_length())):
        groups = position[: d // g] // g
        assert len(set(groups.tolist())) == d // g, (g, groups)


@settings(deadline=None)
@given(d=st.sampled_from([4, 8, 16]), seed=st.integers(0, 2**31 - 1))
def test_oscar_theorem_1_eigenbasis_minimises_frozen_error_surrogate(d, seed):
    # OSCAR Theorem 1: with frozen diagonal residuals sorted ascending, R = U (eigenvalues
    # descending) minimises tr(R^T C R E) over orthogonal R.
    rng = np.random.default_rng(seed)
    c = _sym_spd(rng, d)
    e = np.diag(np.sort(rng.uniform(0.1, 2.0, d)))
    evals, evecs = np.linalg.eigh(c)
    u = evecs[:, np.argsort(evals)[::-1]]
    best = np.trace(u.T @ c @ u @ e)
    for i in range(8):
        r = tr.random_orthogonal(d, seed + i)
        assert best <= np.trace(r.T @ c @ r @ e) * (1 + 1e-9)


# ---------------------------------------------------------------------------- WUSH


@settings(deadline=None)
@given(d=st.sampled_from([2, 4, 8, 16, 32]), seed=st.integers(0, 2**31 - 1))
def test_wush_theorem_3_bound_attained_and_sensitivity_balanced(d, seed):
    rng = np.random.default_rng(seed)
    m, h = _sym_spd(rng, d), _sym_spd(rng, d)
    t = tr.wush_transform(m, h, gamma=0.0)
    t_inv = np.linalg.inv(t)
    sens = t_inv.T @ h @ t_inv  # B_T: sensitivity of each transformed coordinate
    # sigma_i = singular values of M^{1/2} H^{1/2}, i.e. sqrt of the eigenvalues of M H.
    sigma = np.sqrt(np.clip(np.linalg.eigvals(m @ h).real, 0, None))
    bound = np.sum(sigma) ** 2
    np.testing.assert_allclose(np.trace(t @ m @ t.T) * np.trace(sens), bound, rtol=1e-7)
    np.testing.assert_allclose(np.diag(sens), np.trace(sens) / d, rtol=1e-7)
    # c keeps ||T X||_F = ||X||_F at gamma = 0.
    np.testing.assert_allclose(np.trace(t @ m @ t.T), np.trace(m), rtol=1e-9)
    # Any other invertible transform does no better (the bound of Eq. 18).
    other = rng.standard_normal((d, d)) + d * np.eye(d)
    other_inv = np.linalg.inv(other)
    assert np.trace(other @ m @ other.T) * np.trace(other_inv.T @ h @ other_inv) >= bound * (
        1 - 1e-9
    )


@settings(deadline=None)
@given(
    d=st.sampled_from([4, 8, 16]),
    seed=st.integers(0, 2**31 - 1),
    rho_m=st.floats(1e-3, 1e3),
    rho_h=st.floats(1e-3, 1e3),
    gamma=st.sampled_from([0.0, 1e-2, 0.1]),
)
def test_wush_invariant_to_positive_rescaling(d, seed, rho_m, rho_h, gamma):
    rng = np.random.default_rng(seed)
    m, h = _sym_spd(rng, d), _sym_spd(rng, d)
    np.testing.assert_allclose(
        tr.wush_transform(rho_m * m, rho_h * h, gamma),
        tr.wush_transform(m, h, gamma),
        rtol=1e-6,
        atol=1e-9,
    )


@given(d=st.sampled_from([2, 4, 8, 16]), seed=st.integers(0, 2**31 - 1))
def test_wush_pair_is_the_row_convention_of_t(d, seed):
    rng = np.random.default_rng(seed)
    t = tr.wush_transform(_sym_spd(rng, d), _sym_spd(rng, d))
    a, b = tr.wush_pair(t)
    np.testing.assert_allclose(a @ b, np.eye(d), atol=1e-9)
    x = rng.standard_normal((5, d))
    np.testing.assert_allclose(x @ a, (t @ x.T).T, atol=1e-12)
    # Reconstruction: paper T^{-1} Q(T x) equals our Q(x A) B for the same quantizer.
    paper = np.linalg.solve(t, _minmax_fake_quant((t @ x.T).T).T).T
    ours = _minmax_fake_quant(x @ a) @ b
    np.testing.assert_allclose(ours, paper, atol=1e-9)


def test_wush_errors():
    rng = np.random.default_rng(0)
    m = _sym_spd(rng, 8)
    with pytest.raises(ValueError, match="same shape"):
        tr.wush_transform(m, np.eye(4))
    with pytest.raises(ValueError, match="gamma"):
        tr.wush_transform(m, m, gamma=-1.0)
    with pytest.raises(ValueError, match="tr"):
        tr.wush_transform(m, np.zeros((8, 8)))
    with pytest.raises(ValueError, match="head_dim=12"):
        tr.wush_transform(np.eye(12), np.eye(12))
    with pytest.raises(ValueError, match="non-finite"):
        tr.wush_transform(np.full((8, 8), np.nan), m)


# ---------------------------------------------------------------------------- registry


def _random_stats(hkv: int, d: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    names = ("C_Q", "KK", "VV", "C_S", "V_TW", "H_K", "H_V")
    return {n: np.stack([_sym_spd(rng, d) for _ in range(hkv)]) for n in names} | {
        "count": np.asarray(100)
    }


@pytest.mark.parametrize("share", ["head", "layer"])
@pytest.mark.parametrize("method", tr.METHODS)
def test_every_method_pair_inverts_and_preserves_logits(method, share):
    hkv, g, d, dm = 2, 3, 16, 24
    stats = _random_stats(hkv, d)
    w_o = np.random.default_rng(1).standard_normal((dm, hkv * g * d))
    pair = tr.build_transforms(
        method, stats, num_kv_heads=hkv, head_dim=d, w_o=w_o, seed=3, share=share
    )
    rng = np.random.default_rng(2)
    q = rng.standard_normal((hkv, 7, d))
    k = rng.standard_normal((hkv, 5, d))
    for name in ("A_K", "B_K", "A_V", "B_V"):
        assert getattr(pair, name).shape == (hkv, d, d)
        assert getattr(pair, name).dtype == np.float64
    for h in range(hkv):
        np.testing.assert_allclose(pair.A_K[h] @ pair.B_K[h], np.eye(d), atol=1e-8)
        np.testing.assert_allclose(pair.A_V[h] @ pair.B_V[h], np.eye(d), atol=1e-8)
        # Keys: (q B^T) . (k A) == q . k without quantization.
        logits = (q[h] @ pair.B_K[h].T) @ (k[h] @ pair.A_K[h]).T
        np.testing.assert_allclose(logits, q[h] @ k[h].T, atol=1e-8)
    if share == "layer":
        np.testing.assert_array_equal(pair.A_K[0], pair.A_K[1])
        np.testing.assert_array_equal(pair.B_V[0], pair.B_V[1])
    if method in ("identity", "random", "hadamard", "kv_pca", "oscar", "oscar_tokenweight"):
        for h in range(hkv):
            np.testing.assert_allclose(pair.B_K[h], pair.A_K[h].T, atol=1e-12)


def test_registry_uses_the_documented_statistics():
    d = 8
    stats = _random_stats(1, d)
    pair = tr.build_transforms("oscar", stats)
    np.testing.assert_allclose(pair.A_K[0], tr.oscar_rotation(stats["C_Q"][0]))
    np.testing.assert_allclose(pair.A_V[0], tr.oscar_rotation(stats["C_S"][0]))
    pair = tr.build_transforms("oscar_tokenweight", stats)
    np.testing.assert_allclose(pair.A_V[0], tr.oscar_rotation(stats["V_TW"][0]))
    pair = tr.build_transforms("kv_pca", stats)
    np.testing.assert_allclose(pair.A_K[0], tr.oscar_rotation(stats["KK"][0]))
    pair = tr.build_transforms("wush_a", stats, gamma=0.05)
    a, _ = tr.wush_pair(tr.wush_transform(stats["VV"][0], stats["H_V"][0], 0.05))
    np.testing.assert_allclose(pair.A_V[0], a)
    w_o = np.random.default_rng(5).standard_normal((12, 2 * d))  # G = 2 query heads
    pair = tr.build_transforms("wush", stats, w_o=w_o)
    h_v = 2 * sum(w_o[:, j * d : (j + 1) * d].T @ w_o[:, j * d : (j + 1) * d] for j in range(2))
    a, _ = tr.wush_pair(tr.wush_transform(stats["VV"][0], h_v))
    np.testing.assert_allclose(pair.A_V[0], a)
    a, _ = tr.wush_pair(tr.wush_transform(stats["KK"][0], 2 * stats["C_Q"][0]))
    np.testing.assert_allclose(pair.A_K[0], a)


def test_build_transforms_errors():
    stats = _random_stats(2, 8)
    with pytest.raises(ValueError, match="identity"):  # message lists METHODS
        tr.build_transforms("quarot", stats)
    with pytest.raises(ValueError, match="head_dim=12"):
        tr.build_transforms("hadamard", {}, num_kv_heads=2, head_dim=12)
    with pytest.raises(ValueError, match="head_dim=12"):
        tr.build_transforms("oscar", {"C_Q": np.eye(12)[None], "C_S": np.eye(12)[None]})
    tr.build_transforms("random", {}, num_kv_heads=2, head_dim=12)  # no Hadamard: any d
    bad = dict(stats, C_Q=np.where(np.eye(8) > 0, np.inf, 0.0)[None].repeat(2, 0))
    with pytest.raises(ValueError, match="'C_Q'.*non-finite"):
        tr.build_transforms("oscar", bad)
    with pytest.raises(ValueError, match=r"'KK'.*\(2, 8\)"):
        tr.build_transforms("kv_pca", dict(stats, KK=np.ones((2, 8))))
    with pytest.raises(ValueError, match="'C_S'"):
        tr.build_transforms("oscar", {"C_Q": stats["C_Q"]})
    with pytest.raises(ValueError, match="count=0"):
        tr.build_transforms("oscar", dict(stats, count=np.asarray(0)))
    with pytest.raises(ValueError, match="w_o"):
        tr.build_transforms("wush", stats)
    with pytest.raises(ValueError, match="share='heads'"):
        tr.build_transforms("oscar", stats, share="heads")
    with pytest.raises(ValueError, match="num_kv_heads"):
        tr.build_transforms("identity", {})


# ---------------------------------------------------------------------------- directional


def _heavy_tailed(seed: int, n: int, d: int, spectrum: np.ndarray, frame: np.ndarray):
    x = np.asarray(jax.random.t(jax.random.key(seed), 5, (n, d)), np.float64)
    return x * np.sqrt(spectrum) @ frame.T


def _key_logit_error(k: np.ndarray, c_q: np.ndarray, a: np.ndarray, b: np.ndarray) -> float:
    """Relative logit error ||Q (K - K_hat)^T||^2 / ||Q K^T||^2 = tr(E C_Q E^T) / tr(K C_Q K^T)."""
    e = _minmax_fake_quant(k @ a) @ b - k
    return float(np.einsum("ti,ij,tj->", e, c_q, e) / np.einsum("ti,ij,tj->", k, c_q, k))


@pytest.mark.parametrize("seed", [0, 1])
def test_wush_beats_identity_and_hadamard_on_logit_error_with_outlier_channels(seed):
    d, n, g = 32, 4096, 2
    frame = tr.random_orthogonal(d, seed + 100)
    k = _heavy_tailed(seed, n, d, np.ones(d), frame)
    k[:, :3] *= 8.0  # a few outlier channels
    # Anisotropic queries in a basis unrelated to the key channels.
    q = _heavy_tailed(seed + 1, g * n, d, np.exp(-np.arange(d) / 3.0), frame)
    stats = {"KK": (k.T @ k)[None], "VV": (k.T @ k)[None], "C_Q": (q.T @ q)[None]}
    w_o = np.eye(g * d)
    err = {
        m: _key_logit_error(k, stats["C_Q"][0], p.A_K[0], p.B_K[0])
        for m in ("identity", "hadamard", "oscar", "wush")
        for p in [
            tr.build_transforms(
                m, stats | {"C_S": stats["KK"]}, w_o=w_o, head_dim=d, num_kv_heads=1
            )
        ]
    }
    assert err["wush"] < 0.5 * err["hadamard"] < err["identity"], err
    assert err["oscar"] < err["identity"], err


@pytest.mark.parametrize("seed", [0, 1])
def test_oscar_beats_identity_and_hadamard_when_queries_read_key_principal_axes(seed):
    # OSCAR's rotation wins over a data-oblivious Hadamard when the key energy sits in a few
    # directions that are not coordinate axes and queries read a related frame: U_Q H P_br
    # spreads those directions evenly, H alone leaves them lumped in some channels.
    d, n, g = 32, 4096, 2
    frame = tr.random_orthogonal(d, seed + 200)
    spec_k = np.ones(d)
    spec_k[[1, 5, 9]] = 30.0
    k = _heavy_tailed(seed, n, d, spec_k, frame)
    q = _heavy_tailed(seed + 1, g * n, d, np.exp(-np.arange(d) / 4.0), frame)
    c_q = q.T @ q
    stats = {"C_Q": c_q[None], "C_S": c_q[None]}
    err = {
        m: _key_logit_error(k, c_q, p.A_K[0], p.B_K[0])
        for m in ("identity", "hadamard", "oscar")
        for p in [tr.build_transforms(m, stats, head_dim=d, num_kv_heads=1)]
    }
    assert err["oscar"] < 0.9 * min(err["identity"], err["hadamard"]), err


@pytest.mark.parametrize("seed", [0, 1])
def test_wush_beats_identity_and_hadamard_on_value_output_error(seed):
    # Values: error measured after the output projection, ||(V - V_hat) W_O||^2 over the group.
    d, n, g, dm = 32, 4096, 2, 48
    rng = np.random.default_rng(seed)
    v = _heavy_tailed(seed, n, d, np.ones(d), tr.random_orthogonal(d, seed + 300))
    v[:, [0, 7]] *= 6.0
    # Anisotropic o_proj: head blocks with decaying singular values in a random frame.
    w_o = np.concatenate(
        [
            rng.standard_normal((dm, d)) * np.exp(-np.arange(d) / 4.0) @ tr.random_orthogonal(d, j)
            for j in range(g)
        ],
        axis=1,
    )  # [D, G*d]
    stats = {"KK": (v.T @ v)[None], "VV": (v.T @ v)[None], "C_Q": np.eye(d)[None]}
    w_rows = w_o.reshape(dm, g, d).transpose(1, 2, 0)  # [G, d, D] row-convention W_O,g

    def out_err(a, b):
        e = _minmax_fake_quant(v @ a) @ b - v
        return sum(np.sum((e @ w) ** 2) for w in w_rows) / sum(np.sum((v @ w) ** 2) for w in w_rows)

    err = {
        m: out_err(p.A_V[0], p.B_V[0])
        for m in ("identity", "hadamard", "wush")
        for p in [tr.build_transforms(m, stats, w_o=w_o, head_dim=d, num_kv_heads=1)]
    }
    assert err["wush"] < 0.7 * min(err["identity"], err["hadamard"]), err
