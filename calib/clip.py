"""Per-layer clip calibration: choose OSCAR's percentile kappa_K, kappa_V for each bit width.

For each layer, each grid value is scored on held-out calibration activations in the transformed
frame: keys by the C_Q-weighted logit error (`calib.errors.key_error`), values by the o_proj
output error through the real attention probabilities (`calib.errors` value path). The grid
always includes 1.0 (no clip), so a transform that leaves outlier channels in place (identity)
is not forced to clip them, and a clip right for 2 bits is not reused at 4 bits: each bit width
is calibrated on its own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from calib import errors
from kvjax.cache.quantizers import QuantConfig

CLIP_GRID = (0.80, 0.84, 0.88, 0.90, 0.92, 0.94, 0.96, 0.98, 1.0)
PAPER_CLIPS = (0.96, 0.92)  # OSCAR's defaults (kappa_K, kappa_V)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "sm_scale"))
def _grid_errors(q, k, v, a_k, b_k, a_v, b_v, c_q, w_o_h, grid, *, bits, group_size, sm_scale):
    """(key errors f32[len(grid)], value errors f32[len(grid)]) for one layer."""
    qc = QuantConfig(method="oscar", bits=bits, group_size=group_size)
    p, _ = errors._probs(q, k, sm_scale)

    def one(kappa):
        k_hat = errors.roundtrip(k, a_k, b_k, qc, kappa)
        v_hat = errors.roundtrip(v, a_v, b_v, qc, kappa)
        ek = jnp.sum(errors.key_error(k, k_hat, c_q))
        ev = jnp.sum(errors._module_output(p, v - v_hat, w_o_h) ** 2)
        return ek, ev

    return jax.lax.map(one, grid)


def calibrate_clips(
    acts: list[tuple[np.ndarray, np.ndarray, np.ndarray]],  # per layer (q, k, v) held out
    pairs: list,  # per layer objects with A_K, B_K, A_V, B_V [Hkv, d, d]
    c_q: list[np.ndarray],  # per layer C_Q [Hkv, d, d] (any positive scale)
    w_o: list[np.ndarray],  # per layer o_proj weight [D, Hq*d]
    *,
    bits: int,
    group_size: int | None = None,
    grid: tuple[float, ...] = CLIP_GRID,
    sm_scale: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Best (kappa_K f32[L], kappa_V f32[L]) on the grid, per layer; `sm_scale` is the model's
    softmax scale (`ModelConfig.attention_scale`; None: head_dim ** -0.5)."""
    if 1.0 not in grid:
        raise ValueError(f"clip grid {grid} must include 1.0 (no clip)")
    g = jnp.asarray(grid, jnp.float32)
    best_k, best_v = [], []
    for (q, k, v), pr, cq, wo in zip(acts, pairs, c_q, w_o):
        hkv, d = pr.A_K.shape[0], pr.A_K.shape[-1]
        f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
        ek, ev = _grid_errors(
            f(q),
            f(k),
            f(v),
            f(pr.A_K),
            f(pr.B_K),
            f(pr.A_V),
            f(pr.B_V),
            f(cq),
            errors.w_o_heads(f(wo), hkv, d),
            g,
            bits=bits,
            group_size=group_size,
            sm_scale=d**-0.5 if sm_scale is None else float(sm_scale),
        )
        best_k.append(grid[int(np.argmin(np.asarray(ek)))])
        best_v.append(grid[int(np.argmin(np.asarray(ev)))])
    return np.asarray(best_k, np.float32), np.asarray(best_v, np.float32)
