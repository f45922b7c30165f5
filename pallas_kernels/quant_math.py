"""Per-group quantizer math shared by the quantize+pack kernels and their references.

Every function here works on arrays whose *last axis is one quantization group* of ``G``
channels (``[..., G]``) and reduces only over that axis with ``keepdims=True``. A kernel reshapes
its ``[T, d]`` tile to ``[T, d // G, G]`` and calls the same functions as the pure-jnp path, so
kernel and reference share one definition of every step. Only elementwise ops, broadcasts and
last-axis reductions are used (no sort, no gather, no slicing), which both the Triton and the
Mosaic lowering accept.

All three quantizers are expressed in the layout's reconstruction invariant::

    x_hat = (codes - zero) * scale       codes in [0, 2**bits - 1]

``scale`` and ``zero`` are rounded to the storage dtype (``meta_dtype``) *before* the codes are
chosen, so codes are the nearest levels of the grid that will actually be dequantized.

Quantizers (DESIGN.md section 3):
  * ``oscar``: tau = quantile_kappa(|x|) over the group, clamp x to [-tau, tau], then asymmetric
    min/max affine grid over the clamped values, round to nearest (half up). kappa = 1 is the
    maximum, so it equals ``minmax`` exactly.
  * ``quest``: WUSH-KV Eq. 5 -- symmetric grid of 2**bits bin centres spanning +-alpha_b * RMS,
    alpha_b the Gaussian-MSE-optimal clip (computed numerically at import, see
    :func:`gaussian_optimal_clip`).
  * ``minmax``: asymmetric min/max affine grid, no clip.

Quantile definition (used everywhere in kvjax): numpy's default ``linear`` method on the ``G``
values ``a = |x|``: with sorted values ``v_0 <= ... <= v_{G-1}``, ``h = kappa * (G - 1)``,
``lo = floor(h)``, ``hi = min(lo + 1, G - 1)``, ``q = v_lo + (h - lo) * (v_hi - v_lo)``.
:func:`quantile_sorted` computes it with a sort (fast on whole arrays); :func:`quantile_rank`
computes the same order statistics by rank counting, which a kernel can do exactly: the k-th
order statistic is the smallest ``a_i`` with ``#{j : a_j <= a_i} > k``; :func:`quantile_radix`
finds it bit by bit over the float's order-preserving integer key (32 counting passes over
``[..., G]`` instead of one ``[..., G, G]`` comparison tensor). All apply the same
interpolation, so they agree bit for bit.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp

from pallas_kernels import layout

Method = Literal["oscar", "quest", "minmax"]
METHODS: tuple[str, ...] = ("oscar", "quest", "minmax")

# Bound on |zero| (in code units). A group whose range is tiny relative to its offset would get
# an enormous zero point (and overflow float16); widening the scale to keep |zero| below this
# costs nothing measurable (such rows have range/|offset| < qmax / 2**14).
_ZERO_BOUND = 2.0**14


# ---------------------------------------------------------------------------------------------
# Quest clip constant alpha_b (WUSH-KV Eq. 5)
# ---------------------------------------------------------------------------------------------
def _phi(z: float) -> float:
    return math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)


def _cdf(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def gaussian_grid_mse(alpha: float, bits: int) -> float:
    """E[(Q_alpha(z) - z)^2] for z ~ N(0, 1), Q_alpha the fixed quest grid of 2**bits levels.

    Levels are the bin centres ``delta * (k + 1/2)``, ``k = -2**(b-1) .. 2**(b-1) - 1``, with
    ``delta = 2 alpha / (2**b - 1)`` (so the outer levels are exactly +-alpha); decision
    thresholds are the multiples of ``delta``. Closed form per bin [u, v] with level y:
    ``int (z - y)^2 phi = (1 + y^2)(Phi(v) - Phi(u)) + u phi(u) - v phi(v) - 2y(phi(u) - phi(v))``.
    """
    half = 2 ** (bits - 1)
    delta = 2.0 * alpha / (2**bits - 1)
    total = 0.0
    for k in range(-half, half):
        y = delta * (k + 0.5)
        u = -math.inf if k == -half else delta * k
        v = math.inf if k == half - 1 else delta * (k + 1)
        pu = 0.0 if math.isinf(u) else _phi(u)
        pv = 0.0 if math.isinf(v) else _phi(v)
        upu = 0.0 if math.isinf(u) else u * pu
        vpv = 0.0 if math.isinf(v) else v * pv
        total += (1.0 + y * y) * (_cdf(v) - _cdf(u)) + upu - vpv - 2.0 * y * (pu - pv)
    return total


@functools.cache
def gaussian_optimal_clip(bits: int) -> float:
    """alpha_b: the clip endpoint minimising :func:`gaussian_grid_mse` (golden-section search).

    The MSE is unimodal in alpha on [0.5, 6] for b in {2, 3, 4}; 200 golden steps shrink the
    bracket far below float64 resolution.
    """
    if bits < 1:
        raise ValueError(f"bits={bits} must be >= 1")
    lo, hi = 0.5, 6.0
    g = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = hi - g * (hi - lo), lo + g * (hi - lo)
    fc, fd = gaussian_grid_mse(c, bits), gaussian_grid_mse(d, bits)
    for _ in range(200):
        if fc < fd:
            hi, d, fd = d, c, fc
            c = hi - g * (hi - lo)
            fc = gaussian_grid_mse(c, bits)
        else:
            lo, c, fc = c, d, fd
            d = lo + g * (hi - lo)
            fd = gaussian_grid_mse(d, bits)
    return 0.5 * (lo + hi)


# Computed once at import from the definition above (no hand-typed constants).
QUEST_ALPHA: dict[int, float] = {b: gaussian_optimal_clip(b) for b in (2, 3, 4)}


# ---------------------------------------------------------------------------------------------
# Small elementwise helpers
# ---------------------------------------------------------------------------------------------
def round_half_up(y: jax.Array) -> jax.Array:
    """Round to nearest, ties toward +inf: ``floor(y + 0.5)``.

    Used instead of ``jnp.round`` (ties to even) because every backend lowers ``floor``; the
    kernel and its reference must agree on ties.
    """
    return jnp.floor(y + 0.5)


def qmax(bits: int) -> int:
    """Largest code, ``2**bits - 1``."""
    return (1 << bits) - 1


# Explicit mantissa bits dropped when float32 is rounded to a narrower storage dtype.
_DROPPED_MANTISSA_BITS = {"float16": 13, "bfloat16": 16}
_F16_MIN_NORMAL = 2.0**-14
_F16_MAX = 65504.0


def round_to_dtype(v: jax.Array, dtype: jnp.dtype) -> jax.Array:  # f32 -> f32
    """``v.astype(dtype).astype(float32)`` (round to nearest even, float16 subnormals and
    overflow to inf included), written so that no compiler can drop the rounding.

    XLA on GPU removes ``convert(convert(x, f16), f32)`` pairs by default
    (``xla_allow_excess_precision``), so under jit the plain round trip returned the
    unrounded value there: codes were chosen on a scale that was then stored rounded, and the
    simulated and the stored cache disagreed. Integer ops on the bits are kept by every
    compiler (an add/subtract of a magic constant is not: XLA on CPU folded it), and lower in
    the Triton and Mosaic kernels too.
    """
    dtype = jnp.dtype(dtype)
    v = v.astype(jnp.float32)
    if dtype == jnp.float32:
        return v
    if dtype.name not in _DROPPED_MANTISSA_BITS:
        raise ValueError(f"round_to_dtype: dtype={dtype.name!r}; use float16, bfloat16 or float32")
    drop = _DROPPED_MANTISSA_BITS[dtype.name]
    bits = jax.lax.bitcast_convert_type(v, jnp.int32)
    lsb = jax.lax.shift_right_logical(bits, jnp.int32(drop)) & 1
    # Round half to even on the dropped bits; a carry into the exponent is the right result
    # (up to inf for the largest float32 values at bfloat16).
    rounded = (bits + ((1 << (drop - 1)) - 1) + lsb) & jnp.int32(~((1 << drop) - 1))
    r = jax.lax.bitcast_convert_type(rounded, jnp.float32)
    if dtype == jnp.float16:
        # Below the smallest normal float16 the grid is multiples of 2**-24: round the
        # float32 significand (implicit bit included) shifted to that unit, half to even.
        exp = (jax.lax.shift_right_logical(bits, jnp.int32(23)) & 0xFF) - 127
        mant = (bits & 0x7FFFFF) | 0x800000
        shift = jnp.clip(-(exp + 1), 1, 26)  # 26: everything rounds to 0
        half_lsb = jax.lax.shift_right_logical(mant, shift) & 1
        units = jax.lax.shift_right_logical(
            mant + jax.lax.shift_left(jnp.int32(1), shift - 1) - 1 + half_lsb, shift
        )
        sub = units.astype(jnp.float32) * jnp.float32(2.0**-24)
        sub = jnp.where(bits < 0, -sub, sub)
        r = jnp.where(jnp.abs(v) < _F16_MIN_NORMAL, sub, r)
        r = jnp.where(jnp.abs(r) > _F16_MAX, jnp.where(bits < 0, -jnp.inf, jnp.inf), r)
    return jnp.where(v == v, r, v)  # NaN stays NaN


# ---------------------------------------------------------------------------------------------
# Quantile of |x| over the group
# ---------------------------------------------------------------------------------------------
def quantile_position(
    kappa: jax.Array,  # f32[..., 1] (broadcastable to the group's leading axes)
    n: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Order-statistic indices and weight of numpy's linear quantile over ``n`` values.

    Returns:
      ``(lo, hi, frac)``: int32 indices with ``hi = min(lo + 1, n - 1)`` and float32 ``frac``.
      ``kappa`` is clamped to [0, 1] (traced values cannot be validated).
    """
    h = jnp.clip(jnp.asarray(kappa, jnp.float32), 0.0, 1.0) * jnp.float32(n - 1)
    lo_f = jnp.floor(h)
    frac = h - lo_f
    lo = lo_f.astype(jnp.int32)
    hi = jnp.minimum(lo + 1, n - 1)
    return lo, hi, frac


def _interpolate(v_lo: jax.Array, v_hi: jax.Array, frac: jax.Array) -> jax.Array:
    return v_lo + frac * (v_hi - v_lo)


def quantile_sorted(
    a: jax.Array,  # f32[..., G]
    kappa: jax.Array | float,  # f32 broadcastable to [..., 1]
) -> jax.Array:  # f32[..., 1]
    """Linear-interpolated kappa-quantile of ``a`` over the last axis, via sort."""
    n = a.shape[-1]
    lo, hi, frac = quantile_position(jnp.broadcast_to(kappa, (*a.shape[:-1], 1)), n)
    s = jnp.sort(a, axis=-1)
    v_lo = jnp.take_along_axis(s, lo, axis=-1)
    v_hi = jnp.take_along_axis(s, hi, axis=-1)
    return _interpolate(v_lo, v_hi, frac)


def quantile_rank(
    a: jax.Array,  # f32[..., G]
    kappa: jax.Array | float,  # f32 broadcastable to [..., 1]
) -> jax.Array:  # f32[..., 1]
    """Same value as :func:`quantile_sorted`, by rank counting (kernel-friendly, exact).

    ``cnt_i = #{j : a_j <= a_i}``; the k-th order statistic (0-based) is
    ``min{a_i : cnt_i > k}``. Costs G**2 compares per group, all broadcasts and reductions.
    """
    n = a.shape[-1]
    lo, hi, frac = quantile_position(jnp.broadcast_to(kappa, (*a.shape[:-1], 1)), n)
    le = a[..., None, :] <= a[..., :, None]  # bool[..., G(i), G(j)]: a_j <= a_i
    cnt = jnp.sum(le.astype(jnp.int32), axis=-1)  # i32[..., G]
    inf = jnp.float32(jnp.inf)
    v_lo = jnp.min(jnp.where(cnt > lo, a, inf), axis=-1, keepdims=True)
    v_hi = jnp.min(jnp.where(cnt > hi, a, inf), axis=-1, keepdims=True)
    return _interpolate(v_lo, v_hi, frac)


_SIGN = -(1 << 31)  # int32 0x80000000
_LOW31 = (1 << 31) - 1  # int32 0x7fffffff


def _order_key(a: jax.Array) -> jax.Array:  # f32[...] -> i32[...]
    """Integer key with the float's order (signed int32 compare): non-negative floats keep
    their bits, negative floats flip the 31 bits below the sign."""
    b = jax.lax.bitcast_convert_type(a, jnp.int32)
    return jnp.where(b >= 0, b, b ^ _LOW31)


def _from_order_key(k: jax.Array) -> jax.Array:  # i32[...] -> f32[...]
    return jax.lax.bitcast_convert_type(jnp.where(k >= 0, k, k ^ _LOW31), jnp.float32)


def quantile_radix(
    a: jax.Array,  # f32[..., G] (no NaN)
    kappa: jax.Array | float,  # f32 broadcastable to [..., 1]
) -> jax.Array:  # f32[..., 1]
    """Same value as :func:`quantile_sorted`, by a radix select on the order keys (kernels).

    The ``lo``-th order statistic's key ``K`` is built from the top bit down in the unsigned
    view ``U = K ^ 0x80000000``: bit ``b`` is set when fewer than ``lo + 1`` keys lie below the
    candidate with it set. The ``hi``-th statistic is then ``K`` itself if more than ``hi`` keys
    are ``<= K``, else the smallest value above ``K`` (``hi = lo + 1`` there). 33 counting
    passes over ``[..., G]``; exact, like :func:`quantile_rank`.
    """
    n = a.shape[-1]
    lo, hi, frac = quantile_position(jnp.broadcast_to(kappa, (*a.shape[:-1], 1)), n)
    key = _order_key(a.astype(jnp.float32))

    def step(i, prefix):  # prefix: U's bits found so far, from the top
        cand = prefix | jnp.left_shift(jnp.int32(1), 31 - i)  # bit 31: 0x80000000
        below = jnp.sum((key < (cand ^ _SIGN)).astype(jnp.int32), axis=-1, keepdims=True)
        return jnp.where(below <= lo, cand, prefix)

    # A loop, not 32 unrolled passes: one pass of code in the kernels and in interpret mode.
    prefix = jax.lax.fori_loop(0, 32, step, jnp.zeros(lo.shape, jnp.int32))
    k_lo = prefix ^ _SIGN
    v_lo = _from_order_key(k_lo)
    at_most = jnp.sum((key <= k_lo).astype(jnp.int32), axis=-1, keepdims=True)
    inf = jnp.float32(jnp.inf)
    above = jnp.min(jnp.where(key > k_lo, a, inf), axis=-1, keepdims=True)
    v_hi = jnp.where(at_most > hi, v_lo, above)
    return _interpolate(v_lo, v_hi, frac)


QUANTILE_IMPLS = {"sort": quantile_sorted, "rank": quantile_rank, "radix": quantile_radix}


# ---------------------------------------------------------------------------------------------
# Scale / zero / codes
# ---------------------------------------------------------------------------------------------
def affine_scale_zero(
    lo: jax.Array,  # f32[..., 1] group minimum (after any clipping)
    hi: jax.Array,  # f32[..., 1] group maximum
    bits: int,
    meta_dtype: jnp.dtype = jnp.float16,
) -> tuple[jax.Array, jax.Array]:  # (f32[..., 1], f32[..., 1]) already rounded to meta_dtype
    """Asymmetric grid ``scale = (hi - lo) / qmax``, ``zero = -lo / scale``.

    Constant groups (``hi == lo``, or a scale that underflows the storage dtype) get
    ``scale = 1, zero = -lo``: every code is 0 and ``(0 - zero) * 1`` reproduces the constant
    (up to rounding of ``zero`` to ``meta_dtype``) with no division by zero.
    """
    q = jnp.float32(qmax(bits))
    if jnp.dtype(meta_dtype) == jnp.uint8:
        # 8-bit metadata (`layout`): the zero point has a bounded range, so a group whose
        # values share one sign gets a scale wide enough to keep -lo / scale inside it.
        z_lo, z_hi = layout.zero_u8_range(bits)
        scale = jnp.maximum((hi - lo) / q, jnp.maximum(lo, 0.0) / jnp.float32(-z_lo))
        scale = jnp.maximum(scale, jnp.maximum(-lo, 0.0) / jnp.float32(z_hi))
        scale_m = layout.round_scale_u8(scale)  # never 0: the encoding's smallest is 2**-8
        return scale_m, layout.round_zero_u8(-lo / scale_m, bits)
    mag = jnp.maximum(jnp.abs(lo), jnp.abs(hi))
    scale = jnp.maximum((hi - lo) / q, mag / jnp.float32(_ZERO_BOUND))
    scale_m = round_to_dtype(scale, meta_dtype)
    degenerate = (hi <= lo) | (scale_m <= 0.0)
    scale_m = jnp.where(degenerate, jnp.float32(1.0), scale_m)
    zero = jnp.where(degenerate, -lo, -lo / scale_m)
    return scale_m, round_to_dtype(zero, meta_dtype)


def affine_codes(
    x: jax.Array,  # f32[..., G]
    scale: jax.Array,  # f32[..., 1]
    zero: jax.Array,  # f32[..., 1]
    bits: int,
) -> jax.Array:  # i32[..., G] in [0, qmax]
    """Nearest level of the grid ``(c - zero) * scale``, clamped to [0, qmax]."""
    c = round_half_up(x / scale + zero)
    return jnp.clip(c, 0.0, jnp.float32(qmax(bits))).astype(jnp.int32)


def dequantize_groups(
    codes: jax.Array,  # int[..., G]
    scale: jax.Array,  # float[..., 1]
    zero: jax.Array,  # float[..., 1]
) -> jax.Array:  # f32[..., G]
    """The reconstruction invariant ``(codes - zero) * scale`` in float32."""
    return (codes.astype(jnp.float32) - zero.astype(jnp.float32)) * scale.astype(jnp.float32)


def oscar_clip(
    x: jax.Array,  # f32[..., G]
    kappa: jax.Array | float,  # broadcastable to [..., 1]
    quantile: Literal["sort", "rank", "radix"] = "sort",
) -> jax.Array:  # f32[..., G]
    """OSCAR per-token percentile clip: clamp to +-quantile_kappa(|x|) of the group."""
    tau = QUANTILE_IMPLS[quantile](jnp.abs(x), kappa)
    return jnp.clip(x, -tau, tau)


def quantize_groups(
    x: jax.Array,  # f32[..., G]
    method: Method,
    bits: int,
    *,
    clip: jax.Array | float | None = None,  # broadcastable to [..., 1]
    meta_dtype: jnp.dtype = jnp.float16,
    quantile: Literal["sort", "rank", "radix"] = "sort",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Quantizes each group (last axis) with one of the three methods.

    Args:
      x: values, float32; last axis is one group of ``G`` channels.
      method: 'oscar', 'quest' or 'minmax'.
      bits: code width (2, 3 or 4 here; the math works for any b >= 1).
      clip: oscar: kappa in (0, 1] (None = 1, no clip); quest: the clip endpoint in RMS units
        (None = alpha_b); minmax: must be None.
      meta_dtype: storage dtype of scale and zero; they are rounded to it before coding
        (uint8: the 8-bit encoding of `pallas_kernels.layout`).
      quantile: 'sort' (reference) or 'rank' / 'radix' (kernels) implementation of the oscar
        quantile.

    Returns:
      ``(codes i32[..., G], scale f32[..., 1], zero f32[..., 1])`` with
      ``x_hat = (codes - zero) * scale``; scale and zero hold meta_dtype-representable values.
    """
    x = x.astype(jnp.float32)
    meta_dtype = jnp.dtype(meta_dtype)
    if method == "minmax" or method == "oscar":
        if method == "minmax":
            if clip is not None:
                raise ValueError(f"clip={clip!r} given for method='minmax', which never clips")
            xc = x
        else:
            xc = x if clip is None else oscar_clip(x, clip, quantile)
        lo = jnp.min(xc, axis=-1, keepdims=True)
        hi = jnp.max(xc, axis=-1, keepdims=True)
        scale, zero = affine_scale_zero(lo, hi, bits, meta_dtype)
        return affine_codes(xc, scale, zero, bits), scale, zero
    if method == "quest":
        return quest_quantize(x, bits, clip=clip, meta_dtype=meta_dtype)
    raise ValueError(f"method={method!r} is not one of {METHODS}")


def quest_quantize(
    x: jax.Array,  # f32[..., G]
    bits: int,
    *,
    clip: jax.Array | float | None = None,  # alpha override, broadcastable to [..., 1]
    meta_dtype: jnp.dtype = jnp.float16,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """WUSH-KV Eq. 5 in (codes, scale, zero) form.

    ``delta = 2 alpha RMS(x) / (2**b - 1)``; ``code = clamp(floor(x / delta), -h, h - 1) + h``
    with ``h = 2**(b-1)``; reconstruction ``delta * (code - h + 1/2)``, i.e. ``scale = delta``
    and ``zero = h - 1/2`` (exact in every meta dtype), a grid symmetric about 0. A zero group
    (or one whose delta underflows meta_dtype) gets scale 0 and reconstructs as exact zeros.
    """
    x = x.astype(jnp.float32)
    alpha = jnp.float32(QUEST_ALPHA.get(bits) or gaussian_optimal_clip(bits))
    if clip is not None:
        alpha = jnp.asarray(clip, jnp.float32)
    half = 1 << (bits - 1)
    g = x.shape[-1]
    rms = jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) / jnp.float32(g))
    delta = 2.0 * alpha * rms / jnp.float32(2**bits - 1)
    if jnp.dtype(meta_dtype) == jnp.uint8:  # zero = h - 1/2 is byte 128 of the zero grid
        delta = layout.round_scale_u8(delta)
    else:
        delta = round_to_dtype(delta, jnp.dtype(meta_dtype))
    safe = jnp.where(delta > 0.0, delta, jnp.float32(1.0))
    k = jnp.clip(jnp.floor(x / safe), -half, half - 1) + half
    zero = jnp.full_like(delta, half - 0.5)
    return k.astype(jnp.int32), delta, zero


def transform_quantize_tile(
    x: jax.Array,  # f32|bf16[T, d] tokens of one KV head
    a: jax.Array,  # f32[d, d] transform A of that head
    clip: jax.Array | None,  # f32, broadcastable to [T, 1, 1]; None = method default
    *,
    method: Method,
    bits: int,
    group_size: int,
    meta_dtype: jnp.dtype,
    quantile: Literal["sort", "rank", "radix"] = "radix",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One tile of the quantize+pack pipeline: ``x @ A`` -> group quantize -> planar pack.

    The body every quantize+pack kernel runs on its tile (no slicing, concatenation or sort,
    so it lowers on Triton and Mosaic alike).

    Returns:
      ``(packed i32[T, d // n], scale meta_dtype[T, d // G], zero meta_dtype[T, d // G])``.
    """
    t, d = x.shape
    ng = d // group_size
    # Full float32 matmul: the transform must not add bf16/tf32 error on top of quantization.
    y = jnp.dot(
        x.astype(jnp.float32),
        a.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )  # f32[T, d]
    yg = y.reshape(t, ng, group_size)  # f32[T, d/G, G]
    codes, scale, zero = quantize_groups(
        yg, method, bits, clip=clip, meta_dtype=meta_dtype, quantile=quantile
    )
    packed = layout.pack_tile(codes.reshape(t, d), bits)  # i32[T, d/n]
    return (
        packed,
        layout.encode_meta(scale.reshape(t, ng), meta_dtype, "scale", bits),
        layout.encode_meta(zero.reshape(t, ng), meta_dtype, "zero", bits),
    )
