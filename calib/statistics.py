"""Streaming calibration statistics: init / update / merge / finalize over a pytree of sums.

One layer's statistics are a dict of float32 sums, each f32[Hkv, d, d] (one matrix per KV
head), plus an int32 token count under "count". `update_stats` is pure and jit-safe (the dict
keys are pytree structure, hence static); `merge_stats` adds two accumulators (data-parallel
replicas, resumed runs); `finalize_stats` returns float64 numpy means for `calib.transforms`.

Statistics (row vectors; query head j reads KV head j // G, G = Hq // Hkv):
  C_Q  sum over the group's query heads and tokens of q^T q      (OSCAR keys, WUSH key Hessian)
  KK   sum over tokens of k^T k                                  (kv_pca keys, WUSH key Gram)
  VV   sum over tokens of v^T v                                  (kv_pca values, WUSH value Gram)
  C_S  sum over the group of o^T o: the Gram of per-head attention outputs, which equals
       V^T S^T S V summed over the group (OSCAR values), so S is never materialised
  V_TW sum over tokens of w_t v^T v with w_t = k C_Q k^T           (oscar_tokenweight values)
  H_K, H_V  exact attention Hessians of WUSH-KV Appendix C       (wush_a; see calib.wush_a)

V_TW's weights need C_Q before it is known. Choice: by default the weights use the running
mean C_Q including the current batch (one pass; the first batches are weighted by a noisier
C_Q, which converges as the pass proceeds); passing `c_q_weights` (e.g. C_Q from a finished
first pass) makes V_TW exactly the two-pass quantity. The scale of C_Q does not matter for the
rotation (eigenvectors only), so using a per-token mean keeps batches comparable.

Sums stay float32 (bf16 sums stop moving after a few hundred steps); each batch is reduced
with one einsum before it is added, so rounding grows with the number of batches, not tokens.
The int32 count limits one accumulator to 2^31 - 1 tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from calib import transforms, wush_a

STAT_NAMES = ("C_Q", "KK", "VV", "C_S", "V_TW", "H_K", "H_V")
COUNT = "count"


def required_stats(methods: Iterable[str]) -> frozenset[str]:
    """Statistics to accumulate so every method in `methods` can be built.

    Raises:
        ValueError: an unknown method name (lists `calib.transforms.METHODS`).
    """
    if isinstance(methods, str):
        methods = (methods,)
    names: set[str] = set()
    for method in methods:
        names.update(transforms.method_statistics(method))
    return frozenset(names)


def _check_names(names: Iterable[str]) -> tuple[str, ...]:
    names = tuple(sorted(set(names)))
    unknown = [n for n in names if n not in STAT_NAMES]
    if unknown:
        raise ValueError(f"unknown statistics {unknown}; expected names from {STAT_NAMES}")
    return names


def init_stats(names: Iterable[str], num_kv_heads: int, head_dim: int) -> dict[str, jax.Array]:
    """Zero accumulator for one layer: name -> f32[Hkv, d, d], plus "count" -> i32[].

    Raises:
        ValueError: unknown statistic name or non-positive sizes.
    """
    names = _check_names(names)
    if num_kv_heads < 1 or head_dim < 1:
        raise ValueError(f"num_kv_heads={num_kv_heads} and head_dim={head_dim} must be positive")
    stats = {n: jnp.zeros((num_kv_heads, head_dim, head_dim), jnp.float32) for n in names}
    stats[COUNT] = jnp.zeros((), jnp.int32)
    return stats


def _stat_shape(stats: Mapping[str, jax.Array]) -> tuple[int, int]:
    names = _check_names(n for n in stats if n != COUNT)
    if COUNT not in stats:
        raise ValueError(f"stats has no {COUNT!r} entry; build it with init_stats (got {names})")
    shapes = {n: tuple(stats[n].shape) for n in names}
    if not names:
        raise ValueError("stats holds no statistics; build it with init_stats")
    first = shapes[names[0]]
    if len(first) != 3 or first[1] != first[2] or any(s != first for s in shapes.values()):
        raise ValueError(f"statistics must all be [Hkv, d, d], got {shapes}")
    return first[0], first[1]


def update_stats(
    stats: Mapping[str, jax.Array],
    q: jax.Array,  # f32[B, T, Hq, d] after head-wise Norm and RoPE
    k: jax.Array,  # f32[B, T, Hkv, d] after head-wise Norm and RoPE
    v: jax.Array,  # f32[B, T, Hkv, d]
    o: jax.Array | None = None,  # f32[B, T, Hq, d] per-head attention outputs (before o_proj)
    *,
    w_o: jax.Array | None = None,  # f32[D, Hq*d], torch layout; needed for H_K / H_V
    c_q_weights: jax.Array | None = None,  # f32[Hkv, d, d] fixed C_Q for V_TW's token weights
    sm_scale: float | None = None,
    q_tile: int = 128,
    k_tile: int = 128,
) -> dict[str, jax.Array]:
    """Add one batch of full causal sequences (positions 0..T-1, all tokens valid).

    Only the statistics present in `stats` are computed. jit-safe; shape checks run at trace
    time.

    Args:
        stats: accumulator from `init_stats` (or a previous update).
        q, k, v, o: one layer's activations.
        w_o: o_proj weight; required when H_K or H_V is accumulated.
        c_q_weights: C_Q used for V_TW's weights w_t = k C k^T; default the running mean C_Q.
        sm_scale: softmax scale for the WUSH-A Hessians; defaults to d ** -0.5.
        q_tile, k_tile: WUSH-A tile sizes (memory bound).

    Returns:
        The updated accumulator (a new dict).

    Raises:
        ValueError: shape mismatches, or an input a requested statistic needs is missing.
    """
    hkv, d = _stat_shape(stats)
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"expected 4-D q, k, v, got {q.shape=} {k.shape=} {v.shape=}")
    b, t, hq, dq = q.shape
    if k.shape != (b, t, hkv, d) or v.shape != k.shape:
        raise ValueError(
            f"{k.shape=} {v.shape=} must be (B, T, Hkv, d) = {(b, t, hkv, d)} for {q.shape=} "
            f"and statistics of shape [{hkv}, {d}, {d}]"
        )
    if dq != d or hq % hkv != 0:
        raise ValueError(f"{q.shape=}: need head_dim {d} and Hq a multiple of Hkv={hkv}")
    g = hq // hkv
    if "C_S" in stats:
        if o is None:
            raise ValueError("statistic 'C_S' needs o, the per-head attention outputs")
        if o.shape != q.shape:
            raise ValueError(f"{o.shape=} must equal {q.shape=}")
    if ("H_K" in stats or "H_V" in stats) and w_o is None:
        raise ValueError("statistics 'H_K'/'H_V' need w_o, the o_proj weight [D, Hq*d]")
    if "V_TW" in stats and c_q_weights is None and "C_Q" not in stats:
        raise ValueError("statistic 'V_TW' needs 'C_Q' accumulated too, or c_q_weights")
    if c_q_weights is not None and c_q_weights.shape != (hkv, d, d):
        raise ValueError(f"{c_q_weights.shape=} must be [Hkv, d, d] = {(hkv, d, d)}")

    f32 = jnp.float32
    qg = q.astype(f32).reshape(b, t, hkv, g, d)  # [B, T, K, G, X]
    k32, v32 = k.astype(f32), v.astype(f32)
    out = dict(stats)
    n_new = stats[COUNT] + b * t
    if "C_Q" in stats:
        out["C_Q"] = stats["C_Q"] + jnp.einsum("BTKGX,BTKGY->KXY", qg, qg)
    if "KK" in stats:
        out["KK"] = stats["KK"] + jnp.einsum("BTKX,BTKY->KXY", k32, k32)
    if "VV" in stats:
        out["VV"] = stats["VV"] + jnp.einsum("BTKX,BTKY->KXY", v32, v32)
    if "C_S" in stats:
        og = o.astype(f32).reshape(b, t, hkv, g, d)
        out["C_S"] = stats["C_S"] + jnp.einsum("BTKGX,BTKGY->KXY", og, og)
    if "V_TW" in stats:
        if c_q_weights is None:
            c_w = out["C_Q"] / n_new.astype(f32)  # running mean, this batch included
        else:
            c_w = c_q_weights.astype(f32)
        w = jnp.einsum("BTKX,KXY,BTKY->BTK", k32, c_w, k32)  # w_t = k C_Q k^T
        out["V_TW"] = stats["V_TW"] + jnp.einsum("BTK,BTKX,BTKY->KXY", w, v32, v32)
    if "H_K" in stats or "H_V" in stats:
        h_k, h_v = wush_a.wush_a_hessians(
            q, k, v, w_o, sm_scale=sm_scale, q_tile=q_tile, k_tile=k_tile
        )
        if "H_K" in stats:
            out["H_K"] = stats["H_K"] + h_k
        if "H_V" in stats:
            out["H_V"] = stats["H_V"] + h_v
    out[COUNT] = n_new
    return out


def merge_stats(a: Mapping[str, jax.Array], b: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Sum two accumulators with the same statistics (data-parallel replicas, resume).

    Raises:
        ValueError: the two hold different statistics or shapes.
    """
    if set(a) != set(b):
        raise ValueError(f"cannot merge statistics {sorted(a)} with {sorted(b)}")
    for n in a:
        if tuple(a[n].shape) != tuple(b[n].shape):
            raise ValueError(f"statistic {n!r}: shapes {a[n].shape} and {b[n].shape} differ")
    return {n: a[n] + b[n] for n in a}


def finalize_stats(stats: Mapping[str, jax.Array]) -> dict[str, np.ndarray]:
    """Per-token means as float64 numpy: name -> f64[Hkv, d, d], plus "count" -> int64 scalar.

    Raises:
        ValueError: zero token count or non-finite sums.
    """
    _stat_shape(stats)
    count = int(np.asarray(stats[COUNT]))
    if count <= 0:
        raise ValueError(f"cannot finalize statistics accumulated over count={count} tokens")
    out: dict[str, np.ndarray] = {COUNT: np.asarray(count, dtype=np.int64)}
    for n, x in stats.items():
        if n == COUNT:
            continue
        x64 = np.asarray(x, dtype=np.float64)
        if not np.all(np.isfinite(x64)):
            raise ValueError(f"statistic {n!r} (shape {x64.shape}) has non-finite entries")
        out[n] = x64 / count
    return out
