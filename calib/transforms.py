"""Transform construction: every method's (A, B) pair from finalized calibration statistics.

Host-side numpy float64 math (d <= 256, so eigen/Cholesky work is cheap and exact enough).

Convention (DESIGN.md section 3): row vectors, one pair (A, B) per (layer, KV head) with
`A @ B = I`; the cache stores `Q(x A)` and reconstructs `x_hat = Q(x A) B`. Orthogonal methods
have `B = A^T`. The WUSH paper writes transforms in the column convention (`T x`); the single
place that translates is `wush_pair`.

Each equation has a home findable by name:
  - `hadamard_matrix`            normalised Walsh-Hadamard (Sylvester order)
  - `bit_reversal_permutation`   OSCAR's P_br index map
  - `oscar_rotation`             OSCAR: A = U H P_br from an attention-aware covariance
  - `wush_transform`             WUSH-KV Eq. 1: T = c Had Lambda^{-1/4} U^T L^T
  - `wush_pair`                  column-convention T -> row-convention (A, B)
  - `build_transforms`           the method registry (`METHODS`) over per-KV-head statistics
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

METHODS = (
    "identity",
    "random",
    "hadamard",
    "kv_pca",
    "oscar",
    "oscar_tokenweight",
    "wush",
    "wush_a",
)

# Methods whose construction contains a Walsh-Hadamard factor (power-of-two head_dim needed).
_HADAMARD_METHODS = frozenset(
    {"hadamard", "kv_pca", "oscar", "oscar_tokenweight", "wush", "wush_a"}
)

# (key statistic, value statistic) each method needs from `finalize_stats`. `wush` also needs
# C_Q (its key Hessian) and w_o (its value Hessian); handled in `build_transforms`.
_METHOD_STATS: dict[str, tuple[str, ...]] = {
    "identity": (),
    "random": (),
    "hadamard": (),
    "kv_pca": ("KK", "VV"),
    "oscar": ("C_Q", "C_S"),
    "oscar_tokenweight": ("C_Q", "V_TW"),
    "wush": ("KK", "VV", "C_Q"),
    "wush_a": ("KK", "VV", "H_K", "H_V"),
}


def method_statistics(method: str) -> tuple[str, ...]:
    """Names of the finalized statistics `build_transforms(method, ...)` reads.

    Raises:
        ValueError: unknown method name.
    """
    _check_method(method)
    return _METHOD_STATS[method]


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown transform method {method!r}; expected one of {METHODS}")


def _check_power_of_two(d: int, what: str = "d") -> None:
    if not isinstance(d, int | np.integer) or d < 1 or (d & (d - 1)) != 0:
        raise ValueError(f"{what}={d!r} must be a positive power of two for a Hadamard transform")


def hadamard_matrix(d: int) -> np.ndarray:  # f64[d, d]
    """Normalised Walsh-Hadamard matrix in Sylvester (natural) order.

    Entry (i, j) is (-1)^popcount(i & j) / sqrt(d): symmetric, orthogonal, every entry of
    magnitude d^{-1/2} (the property behind OSCAR's Lemma 1 and WUSH's sensitivity balance).

    Raises:
        ValueError: d is not a positive power of two.
    """
    _check_power_of_two(d)
    idx = np.arange(d)
    parity = np.bitwise_count(idx[:, None] & idx[None, :]) & 1
    return np.where(parity == 0, 1.0, -1.0) / np.sqrt(d)


def bit_reversal_permutation(d: int) -> np.ndarray:  # i64[d]
    """beta with beta[k] = k with its log2(d) bits reversed (an involution).

    For any power-of-two group size G dividing d, beta maps 0..d/G-1 to multiples of G, one
    per group of G consecutive positions, and the balance recurses at every coarser level.

    Raises:
        ValueError: d is not a positive power of two.
    """
    _check_power_of_two(d)
    nbits = d.bit_length() - 1
    out = np.zeros(d, dtype=np.int64)
    k = np.arange(d)
    for b in range(nbits):
        out |= ((k >> b) & 1) << (nbits - 1 - b)
    return out


def random_orthogonal(d: int, seed: int) -> np.ndarray:  # f64[d, d]
    """Haar-distributed random orthogonal matrix (QR of a Gaussian with the sign fix)."""
    if d < 1:
        raise ValueError(f"d={d!r} must be positive")
    rng = np.random.default_rng(seed)
    g = rng.standard_normal((d, d))
    qm, r = np.linalg.qr(g)
    # Without the sign fix QR's output is not Haar distributed.
    return qm * np.where(np.diag(r) < 0, -1.0, 1.0)[None, :]


def _eigh_descending(c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eigenpairs of symmetric c, eigenvalues descending, eigenvector signs canonical.

    The sign fix (largest-magnitude entry positive) makes transforms reproducible across
    LAPACK builds and exactly invariant to rescaling the statistics.
    """
    evals, evecs = np.linalg.eigh(0.5 * (c + c.T))
    order = np.argsort(evals)[::-1]
    evals, evecs = evals[order], evecs[:, order]
    pivot = np.argmax(np.abs(evecs), axis=0)
    signs = np.sign(evecs[pivot, np.arange(evecs.shape[1])])
    return evals, evecs * np.where(signs == 0, 1.0, signs)[None, :]


def oscar_rotation(c: np.ndarray) -> np.ndarray:  # f64[d, d]
    """OSCAR rotation A = U H P_br for an attention-aware covariance C (OSCAR section 3.4.2).

    U holds the eigenvectors of C sorted by descending eigenvalue (aligns channels with what
    attention reads), H is the normalised Hadamard matrix (Lemma 1: diag((U H)^T C (U H)) =
    tr(C)/d, every channel equally important), and P_br is the bit-reversal column permutation
    (column beta(k) of A is column k of U H).

    What P_br acts on: the Sylvester Hadamard commutes with bit reversal
    (H[beta(i), beta(j)] = H[i, j]), so U H P_br == (U P_br) H exactly. Read that way, P_br
    places the eigenvector with the k-th largest eigenvalue at position beta(k) before the
    Hadamard mixes, and the top d/G eigenvectors occupy d/G distinct groups of G positions.
    Both readings of the paper's "U H P_br" therefore agree, and Lemma 1 holds for A itself
    because a permutation of a constant diagonal is constant.

    Args:
        c: f64[d, d] symmetric positive semidefinite covariance (C_Q, C_S, K^T K, ...).

    Returns:
        f64[d, d] orthogonal A (so B = A^T); x_rot = x A.

    Raises:
        ValueError: C not square, not finite, or d not a power of two.
    """
    c = _check_square_finite(c, "C")
    d = c.shape[0]
    _check_power_of_two(d, "head_dim")
    _, u = _eigh_descending(c)
    perm = bit_reversal_permutation(d)
    uh = u @ hadamard_matrix(d)
    a = np.empty_like(uh)
    a[:, perm] = uh  # column beta(k) <- column k
    return a


def wush_transform(m: np.ndarray, h: np.ndarray, gamma: float = 1e-2) -> np.ndarray:  # f64[d, d]
    """WUSH transform T = Wush(M, H, gamma), WUSH-KV Eq. 1, in the paper's column convention.

    L L^T = H + gamma tr(H)/d I;  U Lambda U^T = L^T (M + gamma tr(M)/d I) L;
    c = (1 + gamma)^{1/2} tr(M)^{1/2} tr(Lambda^{1/2})^{-1/2};  T = c Had Lambda^{-1/4} U^T L^T.

    With gamma = 0, T attains the bound tr(T M T^T) tr(T^-T H T^-1) >= (sum sigma_i)^2 of
    Theorem 3 and is sensitivity-balanced (constant diagonal of T^-T H T^-1). T is invariant
    to independent positive rescaling of M and H.

    Args:
        m: f64[d, d] Gram matrix of the quantized tensor (sum over tokens of x^T x).
        h: f64[d, d] Hessian of the loss with respect to that tensor's perturbation.
        gamma: damping ratio >= 0.

    Returns:
        f64[d, d] T acting on column vectors; use `wush_pair` for the row convention.

    Raises:
        ValueError: bad shapes, non-finite entries, gamma < 0, zero trace, non-PSD H, or d not a
            power of two.
    """
    m = _check_square_finite(m, "M")
    h = _check_square_finite(h, "H")
    if m.shape != h.shape:
        raise ValueError(f"M and H must have the same shape, got {m.shape=} {h.shape=}")
    if not np.isfinite(gamma) or gamma < 0:
        raise ValueError(f"gamma={gamma!r} must be finite and >= 0")
    d = m.shape[0]
    _check_power_of_two(d, "head_dim")
    tr_m, tr_h = float(np.trace(m)), float(np.trace(h))
    if tr_m <= 0 or tr_h <= 0:
        raise ValueError(f"Wush needs positive traces, got tr(M)={tr_m!r} tr(H)={tr_h!r}")
    eye = np.eye(d)
    h_damped = 0.5 * (h + h.T) + gamma * tr_h / d * eye
    m_damped = 0.5 * (m + m.T) + gamma * tr_m / d * eye
    try:
        ell = np.linalg.cholesky(h_damped)
    except np.linalg.LinAlgError as err:
        raise ValueError(
            f"damped Hessian is not positive definite (gamma={gamma!r}, tr(H)={tr_h!r})"
        ) from err
    lam, u = _eigh_descending(ell.T @ m_damped @ ell)
    if lam[-1] <= 0:
        raise ValueError(
            f"L^T M L is singular (smallest eigenvalue {lam[-1]!r}); raise gamma={gamma!r}"
        )
    scale = np.sqrt(1.0 + gamma) * np.sqrt(tr_m) / np.sqrt(np.sum(np.sqrt(lam)))
    return scale * hadamard_matrix(d) @ (lam[:, None] ** -0.25 * u.T) @ ell.T


def wush_pair(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Translate a column-convention transform T (paper: quantize T x) into row-convention (A, B).

    The only place the two conventions meet: x A = (T x^T)^T, so A = T^T; reconstruction
    T^{-1} Q(T x^T) becomes Q(x A) T^{-T}, so B = T^{-T}. Then A @ B = I.

    Returns:
        (A, B), each f64[d, d].
    """
    t = _check_square_finite(t, "T")
    return t.T.copy(), np.linalg.inv(t).T


@dataclasses.dataclass(frozen=True)
class TransformPair:
    """Per-layer transforms for keys and values, one (A, B) per KV head.

    Invariant: A_K[h] @ B_K[h] == I and A_V[h] @ B_V[h] == I; stored = Q(x A), x_hat = Q(x A) B.
    """

    A_K: np.ndarray  # f64[Hkv, d, d]
    B_K: np.ndarray  # f64[Hkv, d, d]
    A_V: np.ndarray  # f64[Hkv, d, d]
    B_V: np.ndarray  # f64[Hkv, d, d]


def _check_square_finite(x: np.ndarray, name: str) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] != x.shape[1]:
        raise ValueError(f"{name} must be a square matrix, got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} (shape {x.shape}) has non-finite entries")
    return x


def _output_hessian(w_o: np.ndarray, num_kv_heads: int, head_dim: int) -> np.ndarray:
    """2 sum_g W_O,g W_O,g^T per KV head (WUSH-KV Eq. 4 value Hessian) -> f64[Hkv, d, d].

    w_o is o_proj's torch-layout weight [D, Hq*d]; head j's row-convention output matrix is
    w_o[:, j*d:(j+1)*d].T, so W_O,j W_O,j^T = slice^T slice.
    """
    w_o = np.asarray(w_o, dtype=np.float64)
    if w_o.ndim != 2 or w_o.shape[1] % (num_kv_heads * head_dim) != 0:
        raise ValueError(
            f"{w_o.shape=} is not [D, Hq*d] with Hq a multiple of Hkv={num_kv_heads}, d={head_dim}"
        )
    if not np.all(np.isfinite(w_o)):
        raise ValueError(f"w_o (shape {w_o.shape}) has non-finite entries")
    dm = w_o.shape[0]
    g = w_o.shape[1] // (num_kv_heads * head_dim)
    blocks = w_o.reshape(dm, num_kv_heads, g, head_dim)  # [D, K, G, d]
    return 2.0 * np.einsum("MKGI,MKGJ->KIJ", blocks, blocks)


def _get_stat(stats: Mapping[str, np.ndarray], name: str, method: str) -> np.ndarray:
    if name not in stats:
        raise ValueError(
            f"method {method!r} needs statistic {name!r}; got {sorted(stats)} "
            "(accumulate with calib.statistics.required_stats)"
        )
    x = np.asarray(stats[name], dtype=np.float64)
    if x.ndim != 3 or x.shape[1] != x.shape[2]:
        raise ValueError(f"statistic {name!r} must be [Hkv, d, d], got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"statistic {name!r} (shape {x.shape}) has non-finite entries")
    return x


def _check_count(stats: Mapping[str, np.ndarray]) -> None:
    if "count" in stats:
        count = float(np.asarray(stats["count"]))
        if not count > 0:
            raise ValueError(f"statistics were accumulated over count={count!r} tokens")


def build_transforms(
    method: str,
    stats: Mapping[str, np.ndarray],
    *,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    w_o: np.ndarray | None = None,  # f[D, Hq*d], torch layout (y = concat_heads(o) @ w_o.T)
    seed: int = 0,
    gamma: float = 1e-2,
    share: str = "head",
) -> TransformPair:
    """Build one layer's key and value transforms for `method`.

    Methods (DESIGN.md table): identity; random (Haar orthogonal, keys and values drawn
    independently per head from `seed`); hadamard; kv_pca = oscar_rotation(KK) / (VV);
    oscar = oscar_rotation(C_Q) / (C_S); oscar_tokenweight = oscar_rotation(C_Q) / (V_TW);
    wush = Wush(KK, 2 C_Q) / Wush(VV, 2 sum_g W_O,g W_O,g^T); wush_a = Wush(KK, H_K) / (VV, H_V).

    Args:
        method: one of METHODS.
        stats: finalized statistics, name -> f64[Hkv, d, d] (an optional scalar "count" is
            checked to be positive).
        num_kv_heads: Hkv; required only when no statistic carries it (identity/random/hadamard).
        head_dim: d; likewise.
        w_o: o_proj weight, needed by `wush`.
        seed: seed for `random` (pass a per-layer seed to decorrelate layers).
        gamma: WUSH damping ratio.
        share: "head" (one transform per KV head) or "layer" (statistics summed over heads,
            one transform replicated to every head).

    Returns:
        TransformPair with A_K, B_K, A_V, B_V each f64[Hkv, d, d].

    Raises:
        ValueError: unknown method or share, missing/ill-shaped/non-finite statistics, zero
            count, head_dim not a power of two for Hadamard-based methods, missing w_o for wush.
    """
    _check_method(method)
    if share not in ("head", "layer"):
        raise ValueError(f"share={share!r} must be 'head' or 'layer'")
    _check_count(stats)
    needed = {name: _get_stat(stats, name, method) for name in _METHOD_STATS[method]}
    shapes = {name: x.shape for name, x in needed.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"statistics for {method!r} disagree in shape: {shapes}")
    if needed:
        hkv, d, _ = next(iter(needed.values())).shape
        if num_kv_heads is not None and num_kv_heads != hkv:
            raise ValueError(f"num_kv_heads={num_kv_heads} but statistics have Hkv={hkv}")
        if head_dim is not None and head_dim != d:
            raise ValueError(f"head_dim={head_dim} but statistics have d={d}")
    else:
        if num_kv_heads is None or head_dim is None:
            raise ValueError(
                f"method {method!r} uses no statistics; pass num_kv_heads and head_dim "
                f"(got num_kv_heads={num_kv_heads!r}, head_dim={head_dim!r})"
            )
        hkv, d = int(num_kv_heads), int(head_dim)
        if hkv < 1 or d < 1:
            raise ValueError(f"num_kv_heads={hkv} and head_dim={d} must be positive")
    if method in _HADAMARD_METHODS:
        _check_power_of_two(d, "head_dim")

    if method == "wush":
        if w_o is None:
            raise ValueError("method 'wush' needs w_o (the o_proj weight [D, Hq*d])")
        needed["H_V_simple"] = _output_hessian(w_o, hkv, d)
    if share == "layer":
        # One transform per layer: pool the statistics of every head, then replicate.
        needed = {name: x.sum(axis=0, keepdims=True) for name, x in needed.items()}
    n = 1 if share == "layer" else hkv

    a_k, b_k, a_v, b_v = (np.empty((n, d, d)) for _ in range(4))
    for i in range(n):
        ak, av = _build_one(method, {name: x[i] for name, x in needed.items()}, d, seed, gamma, i)
        if isinstance(ak, tuple):  # WUSH: already (A, B)
            (a_k[i], b_k[i]), (a_v[i], b_v[i]) = ak, av
        else:  # orthogonal: B = A^T
            a_k[i], b_k[i], a_v[i], b_v[i] = ak, ak.T, av, av.T
    if share == "layer":
        a_k, b_k, a_v, b_v = (np.repeat(x, hkv, axis=0) for x in (a_k, b_k, a_v, b_v))
    return TransformPair(A_K=a_k, B_K=b_k, A_V=a_v, B_V=b_v)


def _build_one(method: str, s: dict[str, np.ndarray], d: int, seed: int, gamma: float, head: int):
    """Key and value transforms for one KV head (or one pooled layer)."""
    if method == "identity":
        return np.eye(d), np.eye(d)
    if method == "random":
        # Distinct, reproducible draws for (head, key) and (head, value).
        return (
            random_orthogonal(d, np.random.SeedSequence([seed, head, 0]).generate_state(1)[0]),
            random_orthogonal(d, np.random.SeedSequence([seed, head, 1]).generate_state(1)[0]),
        )
    if method == "hadamard":
        return hadamard_matrix(d), hadamard_matrix(d)
    if method == "kv_pca":
        return oscar_rotation(s["KK"]), oscar_rotation(s["VV"])
    if method == "oscar":
        return oscar_rotation(s["C_Q"]), oscar_rotation(s["C_S"])
    if method == "oscar_tokenweight":
        return oscar_rotation(s["C_Q"]), oscar_rotation(s["V_TW"])
    if method == "wush":
        return (
            wush_pair(wush_transform(s["KK"], 2.0 * s["C_Q"], gamma)),
            wush_pair(wush_transform(s["VV"], s["H_V_simple"], gamma)),
        )
    if method == "wush_a":
        return (
            wush_pair(wush_transform(s["KK"], s["H_K"], gamma)),
            wush_pair(wush_transform(s["VV"], s["H_V"], gamma)),
        )
    raise AssertionError(method)  # unreachable: _check_method ran first
