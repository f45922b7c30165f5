"""WUSH-A: exact attention Hessians for keys and values in grouped-query attention.

WUSH-KV Appendix C (Eqs. 44, 56, 60, 61). For KV head h with query heads g = 0..G-1 reading it,
head-coupling matrices Gamma_{g,g'} = W_O,g W_O,g'^T (W_O,g: [d, D] row-convention output matrix
of query head (h, g)), sm_scale = 1/tau, and causal attention probabilities p_{g,t,s}:

  H_K(h) = 2 sm_scale^2 sum_s sum_t sum_{g,g'} p_{g,t,s} p_{g',t,s}
           (v_s - o_{g,t})^T Gamma_{g,g'} (v_s - o_{g',t}) q_{g,t}^T q_{g',t}
  H_V(h) = 2 sum_s sum_t sum_{g,g'} p_{g,t,s} p_{g',t,s} Gamma_{g,g'}

(row vectors; both are summed over cache positions s and calibration sequences, Eq. 61). They
are the Hessians, at zero perturbation, of the module-output loss ||Y'(delta) - Y||_F^2 with
respect to perturbing one cached key or value.

The (t, s) pairs are visited tile by tile, like flash attention: for each query tile a first
sweep over the causal key tiles finds the softmax log-normaliser and the head outputs, and a
second sweep forms the exact probabilities and accumulates. Working memory is
O(B * q_tile * k_tile * Hq * G), never O(T^2). Everything is float32 and jit-able.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def head_coupling(
    w_o: jax.Array,  # f[D, Hq*d], torch layout: y = concat_heads(o) @ w_o.T
    num_kv_heads: int,
    head_dim: int,
) -> jax.Array:  # f32[Hkv, G, G, d, d]
    """Gamma[h, g, g'] = W_O,(h,g) W_O,(h,g')^T (WUSH-KV Eq. 44) from o_proj's torch weight.

    Query head j = h * G + g owns columns j*d:(j+1)*d of w_o; its row-convention output
    matrix is that slice transposed, [d, D].
    """
    if w_o.ndim != 2 or w_o.shape[1] % (num_kv_heads * head_dim) != 0:
        raise ValueError(
            f"{w_o.shape=} is not [D, Hq*d] with Hq a multiple of Hkv={num_kv_heads}, d={head_dim}"
        )
    dm = w_o.shape[0]
    g = w_o.shape[1] // (num_kv_heads * head_dim)
    blocks = w_o.astype(jnp.float32).reshape(dm, num_kv_heads, g, head_dim)  # [D, K, G, X]
    return jnp.einsum("MKGX,MKIY->KGIXY", blocks, blocks)  # [K, G, I, X, Y]


def _validate(q: jax.Array, k: jax.Array, v: jax.Array, w_o: jax.Array) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"expected 4-D q, k, v, got {q.shape=} {k.shape=} {v.shape=}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape=} {v.shape=}")
    b, t, hq, d = q.shape
    if k.shape[:2] != (b, t) or k.shape[3] != d:
        raise ValueError(f"q {q.shape} and k {k.shape} disagree on batch, length or head_dim")
    if hq % k.shape[2] != 0:
        raise ValueError(f"{q.shape=}: Hq={hq} is not a multiple of Hkv={k.shape[2]}")
    if w_o.ndim != 2 or w_o.shape[1] != hq * d:
        raise ValueError(f"{w_o.shape=} must be [D, Hq*d] = [D, {hq * d}]")


@functools.partial(jax.jit, static_argnames=("sm_scale", "q_tile", "k_tile"))
def wush_a_hessians(
    q: jax.Array,  # f32[B, T, Hq, d] after Norm and RoPE
    k: jax.Array,  # f32[B, T, Hkv, d] after Norm and RoPE
    v: jax.Array,  # f32[B, T, Hkv, d]
    w_o: jax.Array,  # f32[D, Hq*d], torch layout
    *,
    sm_scale: float | None = None,
    q_tile: int = 128,
    k_tile: int = 128,
) -> tuple[jax.Array, jax.Array]:  # (f32[Hkv, d, d], f32[Hkv, d, d])
    """Exact WUSH-A key and value Hessians of one batch of full causal sequences.

    Args:
        q, k, v: activations of B independent sequences, positions 0..T-1, all tokens valid.
        w_o: o_proj weight, torch layout.
        sm_scale: softmax scale (1/tau); defaults to d ** -0.5.
        q_tile, k_tile: tile sizes bounding working memory; T need not divide them.

    Returns:
        (H_K, H_V), each f32[Hkv, d, d], summed over sequences and cache positions.

    Raises:
        ValueError: inconsistent shapes or non-positive tile sizes (at trace time).
    """
    _validate(q, k, v, w_o)
    if q_tile < 1 or k_tile < 1:
        raise ValueError(f"tile sizes must be positive, got {q_tile=} {k_tile=}")
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    scale = float(d**-0.5 if sm_scale is None else sm_scale)
    gamma = head_coupling(w_o, hkv, d)  # [K, G, I, X, Y]

    # Pad to whole tiles; padded keys are masked out, padded queries contribute nothing.
    tq, tk = min(q_tile, t), min(k_tile, t)
    nq, nk = -(-t // tq), -(-t // tk)
    qg = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, nq * tq - t), (0, 0), (0, 0)))
    qg = qg.reshape(b, nq * tq, hkv, g, d)
    kp = jnp.pad(k.astype(jnp.float32), ((0, 0), (0, nk * tk - t), (0, 0), (0, 0)))
    vp = jnp.pad(v.astype(jnp.float32), ((0, 0), (0, nk * tk - t), (0, 0), (0, 0)))

    def key_tile(j):
        kj = jax.lax.dynamic_slice_in_dim(kp, j * tk, tk, axis=1)  # [B, S, K, X]
        vj = jax.lax.dynamic_slice_in_dim(vp, j * tk, tk, axis=1)  # [B, S, K, X]
        return kj, vj, j * tk + jnp.arange(tk)

    def logits(qi, tpos, kj, spos):
        s = jnp.einsum("BTKGX,BSKX->BTKGS", qi, kj) * scale  # [B, T, K, G, S]
        visible = (spos[None, :] <= tpos[:, None]) & (spos[None, :] < t)  # [T, S]
        return jnp.where(visible[None, :, None, None, :], s, -jnp.inf)

    def query_tile(i, carry):
        h_k, w_pp = carry
        qi = jax.lax.dynamic_slice_in_dim(qg, i * tq, tq, axis=1)  # [B, T, K, G, X]
        tpos = i * tq + jnp.arange(tq)
        q_valid = (tpos < t).astype(jnp.float32)  # [T]
        # Causality: key tiles past the last query of this tile are never visible.
        n_keys = jnp.minimum(nk, ((i + 1) * tq + tk - 1) // tk)

        # Sweep 1: online softmax -> log-normaliser and head outputs o_{g,t}.
        def sweep1(j, c):
            m, l, acc = c
            kj, vj, spos = key_tile(j)
            s = logits(qi, tpos, kj, spos)
            m_new = jnp.maximum(m, s.max(axis=-1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[..., None])
            l = l * alpha + p.sum(axis=-1)
            acc = acc * alpha[..., None] + jnp.einsum("BTKGS,BSKX->BTKGX", p, vj)
            return m_new, l, acc

        init = (
            jnp.full((b, tq, hkv, g), -jnp.inf, jnp.float32),
            jnp.zeros((b, tq, hkv, g), jnp.float32),
            jnp.zeros((b, tq, hkv, g, d), jnp.float32),
        )
        # Key tile 0 (position 0) is visible to every query, so m is finite after it.
        m, l, acc = jax.lax.fori_loop(0, n_keys, sweep1, init)
        lse = m + jnp.log(l)  # [B, T, K, G]
        o = acc / l[..., None]  # [B, T, K, G, X]
        o_gam = jnp.einsum("KGIXY,BTKIY->BTKGIX", gamma, o)  # Gamma_{gg'} o_{g'}
        o_gam_o = jnp.einsum("BTKGX,BTKGIX->BTKGI", o, o_gam)  # o_g^T Gamma_{gg'} o_{g'}

        # Sweep 2: exact probabilities; accumulate sum_s p p r and sum_{t,s} p p.
        def sweep2(j, c):
            coef, wpp = c
            kj, vj, spos = key_tile(j)
            p = jnp.exp(logits(qi, tpos, kj, spos) - lse[..., None])  # [B, T, K, G, S]
            p = p * q_valid[None, :, None, None, None]
            v_gam = jnp.einsum("BSKX,KGIXY->BSKGIY", vj, gamma)  # v_s^T Gamma_{gg'}
            v_gam_v = jnp.einsum("BSKGIY,BSKY->BSKGI", v_gam, vj)  # v^T Gamma_{gg'} v
            v_gam_o = jnp.einsum("BSKX,BTKGIX->BTSKGI", vj, o_gam)  # v^T Gamma_{gg'} o_{g'}
            # (v - o_g)^T Gamma_{gg'} (v - o_g'); the o_g^T Gamma v term is v_gam_o with g<->g'.
            r = (
                v_gam_v[:, None] - v_gam_o - jnp.swapaxes(v_gam_o, -1, -2) + o_gam_o[:, :, None]
            )  # [B, T, S, K, G, I]
            pt = jnp.moveaxis(p, -1, 2)  # [B, T, S, K, G]
            pp = pt[..., :, None] * pt[..., None, :]  # [B, T, S, K, G, I]
            return coef + jnp.sum(pp * r, axis=2), wpp + jnp.sum(pp, axis=(0, 1, 2))

        coef, w_tile = jax.lax.fori_loop(
            0,
            n_keys,
            sweep2,
            (jnp.zeros((b, tq, hkv, g, g), jnp.float32), jnp.zeros((hkv, g, g), jnp.float32)),
        )
        h_k = h_k + jnp.einsum("BTKGI,BTKGX,BTKIY->KXY", coef, qi, qi)
        return h_k, w_pp + w_tile

    h_k, w_pp = jax.lax.fori_loop(
        0,
        nq,
        query_tile,
        (jnp.zeros((hkv, d, d), jnp.float32), jnp.zeros((hkv, g, g), jnp.float32)),
    )
    h_k = 2.0 * scale**2 * h_k
    h_v = 2.0 * jnp.einsum("KGI,KGIXY->KXY", w_pp, gamma)
    # Symmetrise: the sums are symmetric in exact arithmetic, float32 rounding is not.
    return 0.5 * (h_k + jnp.swapaxes(h_k, 1, 2)), 0.5 * (h_v + jnp.swapaxes(h_v, 1, 2))


def wush_a_update(
    h_k: jax.Array,  # f32[Hkv, d, d] running sum
    h_v: jax.Array,  # f32[Hkv, d, d] running sum
    q: jax.Array,  # f32[B, T, Hq, d]
    k: jax.Array,  # f32[B, T, Hkv, d]
    v: jax.Array,  # f32[B, T, Hkv, d]
    w_o: jax.Array,  # f32[D, Hq*d]
    *,
    sm_scale: float | None = None,
    q_tile: int = 128,
    k_tile: int = 128,
) -> tuple[jax.Array, jax.Array]:
    """Add one batch's WUSH-A Hessians to running sums (the statistics module's hook)."""
    if h_k.shape != h_v.shape or h_k.shape != (k.shape[2], k.shape[3], k.shape[3]):
        raise ValueError(f"{h_k.shape=} {h_v.shape=} must both be [Hkv, d, d] for {k.shape=}")
    dh_k, dh_v = wush_a_hessians(q, k, v, w_o, sm_scale=sm_scale, q_tile=q_tile, k_tile=k_tile)
    return h_k + dh_k, h_v + dh_v
