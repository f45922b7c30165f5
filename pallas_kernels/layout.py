"""The one module that owns kvjax's bit layout and page shapes.

Everything that needs to know how low-bit codes sit in memory imports this module: the
quantize+pack kernel, the paged decode-attention kernels, their pure-jnp references and the
paged cache. No other module does stride or packing arithmetic.

Bit layout
----------
Bits 2 and 4 are stored packed in ``uint8`` with ``n = 8 // bits`` codes per byte. 3 bits is
stored bit-sliced, ``3 d / 8`` bytes per row: the codes' low two bits in the 2-bit planar layout
below (``d / 4`` bytes), then their high bit in the same planar layout at one bit per code
(``d / 8`` bytes, byte ``j`` holding channel ``j + i * d / 8`` at bit ``i``). Only the reference
paths read 3-bit pages (the kernels take 2 and 4; ``codes_per_byte(3)`` is 1 and
``is_packed(3)`` False in that sense); `packed_dim` gives every width's row length.

Packing is *planar* along the last (channel) axis. For a row of ``d`` codes, byte ``j``
(``0 <= j < d // n``) holds code ``j + i * (d // n)`` at bit offset ``i * bits`` for
``i = 0 .. n-1``. Unpacking therefore yields ``n`` *contiguous* channel slices, so a kernel can
dot each slice with the matching contiguous slice of the query instead of de-interleaving.

Reconstruction invariant (per token, per KV head, per group of ``G`` channels)::

    x_hat = (codes - zero) * scale

with ``scale`` and ``zero`` stored as floats (``zero`` is real-valued, not an integer), or, with
``meta_dtype="uint8"``, as one byte each (see "8-bit scale and zero" below).

8-bit scale and zero (``meta_dtype="uint8"``)
---------------------------------------------
The cheaper metadata: 16 bits per group instead of 32 (2.25 bits per element at 2 bits and
head_dim 64, 2.125 at head_dim 128, vs 2.5 / 2.25 with float16). Both bytes decode with
integer ops and a bitcast only, so every backend reconstructs the identical float32:

* scale: an unsigned minifloat with 4 exponent and 4 mantissa bits and a fixed exponent bias
  ``SCALE_U8_BIAS``: byte ``e << 4 | m`` is ``2**(e - SCALE_U8_BIAS) * (1 + m / 16)``, so
  scales from ``2**-8`` to ``248`` at relative steps of 1/16 to 1/32 (encoding rounds to
  nearest, half to even, and clamps into that range).
* zero: fixed point, ``zero = (z - 128) / U + qmax / 2`` with ``U = ZERO_U8_UNITS[bits]`` (32,
  16, 8 levels per code at 2, 3, 4 bits, a power of two so the decode is exact), centred on
  the middle of the code range; quest's ``qmax / 2`` is byte 128 exactly. The quantizer widens
  the scale of a group whose zero would fall outside ``[(0 - 128) / U, 127 / U] + qmax / 2``
  (only groups whose values all share one sign), so the grid still covers the group.

Page pools (one set per layer and per K/V; one page = ``page_size`` consecutive tokens of one
sequence)::

    codes:        u8[num_pages, kv_heads, page_size, head_dim // n]
    scale, zero:  meta_dtype[num_pages, kv_heads, page_size, head_dim // G]
    full-prec.:   fp_dtype[num_pages, kv_heads, page_size, head_dim]

All cached vectors are stored in the transformed frame (``x @ A``).

Value pages, dimension-major (``value_layout="dims"``)
-----------------------------------------------------
A value page may instead store its codes packed along *tokens*: ``u8[num_pages, kv_heads,
head_dim, page_size // n]``, byte ``j`` of dimension row ``r`` holding the codes of tokens
``j + i * (page_size // n)`` (planar, as above, but over the page's tokens). Each plane of a
page is then a ``[head_dim, page_size // n]`` tile whose contraction axis is tokens, which is
what the value product ``O^T = V^T p`` needs as the register operand of a tensor-core MMA
(the Mosaic GPU decode body). Scales and zeros keep their per-token layout.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence

import jax
import jax.numpy as jnp

SUPPORTED_BITS: tuple[int, ...] = (2, 3, 4)
PACKED_BITS: tuple[int, ...] = (2, 4)
META_DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32", "uint8")
# The 8-bit metadata encoding (module docstring): scale exponent bias and zero levels per code.
META_U8 = "uint8"
SCALE_U8_BIAS = 8
ZERO_U8_UNITS: dict[int, int] = {2: 32, 3: 16, 4: 8}
FP_DTYPES: tuple[str, ...] = ("bfloat16", "float32", "float16")
CODES_DTYPE = jnp.uint8


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r} is not supported; expected one of {SUPPORTED_BITS}")


def is_packed(bits: int) -> bool:
    """Whether codes of this width use the planar layout the kernels read (2, 4), not the
    bit-sliced 3-bit rows of the reference paths."""
    _check_bits(bits)
    return bits in PACKED_BITS


def codes_per_byte(bits: int) -> int:
    """Codes per byte of the planar layout: ``8 // bits`` for 2 and 4 bits; 1 for 3 bits,
    which is bit-sliced instead (`packed_dim`)."""
    _check_bits(bits)
    return 8 // bits if bits in PACKED_BITS else 1


def packed_dim(d: int, bits: int) -> int:
    """Length of the last axis after packing a row of ``d`` codes (3 bits: ``3 d / 8``)."""
    n = codes_per_byte(bits)
    if bits == 3:
        if d <= 0 or d % 8:
            raise ValueError(f"d={d} must be a positive multiple of 8 for 3-bit rows")
        return 3 * d // 8
    if d <= 0 or d % n:
        raise ValueError(f"d={d} must be a positive multiple of codes_per_byte({bits})={n}")
    return d // n


def _pack_planar(codes: jax.Array, bits: int, n: int) -> jax.Array:  # u8[..., d] -> u8[..., d/n]
    d = codes.shape[-1]
    m = d // n
    planes = codes.reshape(*codes.shape[:-1], n, m)  # u8[..., n, d//n]; plane i = codes i*m..
    out = planes[..., 0, :]
    for i in range(1, n):
        # Bit fields are disjoint, so OR is exact (no carries).
        out = out | (planes[..., i, :] << jnp.uint8(i * bits))
    return out


def _unpack_planar(packed: jax.Array, bits: int, n: int) -> jax.Array:  # u8[..., m] -> [..., n m]
    mask = jnp.uint8((1 << bits) - 1)
    planes = [(packed >> jnp.uint8(i * bits)) & mask for i in range(n)]
    return jnp.concatenate(planes, axis=-1)


def _normalise_dtype_name(dtype: object, allowed: Sequence[str], what: str) -> str:
    try:
        name = jnp.dtype(dtype).name
    except TypeError as e:
        raise ValueError(f"{what}={dtype!r} is not a dtype; expected one of {allowed}") from e
    if name not in allowed:
        raise ValueError(f"{what}={dtype!r} is not supported; expected one of {allowed}")
    return name


def pack_codes(
    codes: jax.Array,  # u8[..., d], each value in [0, 2**bits)
    bits: int,
) -> jax.Array:  # u8[..., d // n]
    """Packs codes planar-wise along the last axis (see the module docstring).

    Codes are assumed to lie in ``[0, 2**bits)``; higher bits are masked off so that an
    out-of-range code cannot corrupt its neighbours. 3 bits: the bit-sliced rows of the module
    docstring.

    Args:
      codes: integer codes; last axis is the channel axis of length ``d``.
      bits: code width, one of 2, 3, 4.

    Returns:
      uint8 array whose last axis is ``d // codes_per_byte(bits)``.
    """
    n = codes_per_byte(bits)
    d = codes.shape[-1]
    packed_dim(d, bits)  # validates d
    mask = (1 << bits) - 1
    codes = codes.astype(jnp.uint8) & jnp.uint8(mask)
    if bits == 3:  # low two bits 2-bit planar, then the high bit 1-bit planar
        lo = _pack_planar(codes & jnp.uint8(3), 2, 4)
        hi = _pack_planar(codes >> jnp.uint8(2), 1, 8)
        return jnp.concatenate([lo, hi], axis=-1)
    return _pack_planar(codes, bits, n)


def unpack_planes(
    packed: jax.Array,  # u8|i32[..., m] packed bytes (a whole row or a tile of one)
    bits: int,
) -> list[jax.Array]:  # n x (same dtype)[..., m]
    """Returns the ``n`` planar code slices of a packed array, lowest bit field first.

    Slice ``i`` holds channels ``[i*m, (i+1)*m)`` of the unpacked row (``m`` = packed length).
    Pure elementwise shifts and masks in the input dtype, so it works inside Pallas kernels on
    tiles (uint8 or widened int32 bytes) as well as on whole arrays.

    Args:
      packed: packed bytes; any integer dtype holding values in [0, 256).
      bits: code width, one of 2, 3, 4 (3 returns ``[packed]``).

    Returns:
      list of ``codes_per_byte(bits)`` arrays, each shaped like ``packed``.
    """
    n = codes_per_byte(bits)
    if n == 1:
        return [packed]
    mask = (1 << bits) - 1
    dt = packed.dtype
    return [(packed >> jnp.asarray(i * bits, dt)) & jnp.asarray(mask, dt) for i in range(n)]


def pack_tile(
    codes: jax.Array,  # int[..., d] (uint8 or int32), each value in [0, 2**bits)
    bits: int,
) -> jax.Array:  # same dtype[..., d // n]
    """Kernel-friendly :func:`pack_codes`: same bytes, built from a reshape and a sum.

    Triton lowering has no value slicing, so the planes are separated by reshaping to
    ``[..., n, d // n]`` and combined by summing ``code << (i * bits)`` over the plane axis
    (the bit fields are disjoint, so the sum equals the OR). Keeps the input dtype; cast to
    uint8 at the store.
    """
    if bits not in PACKED_BITS:
        raise ValueError(f"bits={bits}: kernels pack {PACKED_BITS} (3-bit rows are bit-sliced)")
    n = codes_per_byte(bits)
    d = codes.shape[-1]
    m = packed_dim(d, bits)
    planes = codes.reshape(*codes.shape[:-1], n, m)  # int[..., n, d//n]
    plane_idx = jax.lax.broadcasted_iota(codes.dtype, (n, m), 0)  # [n, m]: row i holds i
    weights = jnp.left_shift(jnp.ones_like(plane_idx), plane_idx * jnp.asarray(bits, codes.dtype))
    return jnp.sum(planes * weights, axis=-2).astype(codes.dtype)


def scatter_tokens(
    pool: jax.Array,  # T[num_pages, kv_heads, page_size, w]
    values: jax.Array,  # T[N, kv_heads, w]
    page_idx: jax.Array,  # i32[N] physical page of each token
    slot: jax.Array,  # i32[N] position of each token inside its page
) -> jax.Array:  # T[num_pages, kv_heads, page_size, w]
    """Writes token-major rows into a page pool at (page, slot); the one page-write primitive.

    Works for the code, scale/zero and full-precision pools alike. Duplicate (page, slot)
    pairs are a caller bug (last write wins, unspecified order).
    """
    if pool.ndim != 4 or values.ndim != 3:
        raise ValueError(f"{pool.shape=} must be 4-D and {values.shape=} 3-D")
    if values.shape[1:] != (pool.shape[1], pool.shape[3]):
        raise ValueError(f"{values.shape=} does not match pool rows {pool.shape=}")
    if page_idx.shape != values.shape[:1] or slot.shape != values.shape[:1]:
        raise ValueError(f"{page_idx.shape=} and {slot.shape=} must both be ({values.shape[0]},)")
    # pool[page_idx, :, slot] has shape [N, kv_heads, w] (advanced indices first).
    return pool.at[page_idx, :, slot].set(values.astype(pool.dtype), mode="drop")


def unpack_codes(
    packed: jax.Array,  # u8[..., d // n]
    bits: int,
    d: int,
) -> jax.Array:  # u8[..., d]
    """Inverse of :func:`pack_codes`.

    Args:
      packed: packed bytes whose last axis is ``d // codes_per_byte(bits)``.
      bits: code width, one of 2, 3, 4.
      d: number of channels in the unpacked row.

    Returns:
      uint8 codes with last axis ``d``.
    """
    m = packed_dim(d, bits)
    if packed.shape[-1] != m:
        raise ValueError(f"{packed.shape=} does not match d={d}, bits={bits}: expected last={m}")
    packed = packed.astype(jnp.uint8)
    if bits == 3:
        lo = _unpack_planar(packed[..., : d // 4], 2, 4)
        hi = _unpack_planar(packed[..., d // 4 :], 1, 8)
        return lo | (hi << jnp.uint8(2))
    return jnp.concatenate(unpack_planes(packed, bits), axis=-1)


# ------------------------------------------------------------------------------------------
# 8-bit scale and zero (meta_dtype="uint8"): encode, decode, and the representable grid
# ------------------------------------------------------------------------------------------
_SCALE_U8_DROP = 23 - 4  # float32 mantissa bits below the encoding's 4
_SCALE_U8_MIN_BITS = (127 - SCALE_U8_BIAS) << 23  # 2**-bias
_SCALE_U8_MAX_BITS = ((127 - SCALE_U8_BIAS + 15) << 23) | (15 << _SCALE_U8_DROP)


def scale_u8_range() -> tuple[float, float]:
    """Smallest and largest scale the 8-bit encoding represents."""
    return 2.0**-SCALE_U8_BIAS, 2.0 ** (15 - SCALE_U8_BIAS) * (1 + 15 / 16)


def zero_u8_range(bits: int) -> tuple[float, float]:
    """Smallest and largest zero point the 8-bit encoding represents at ``bits``."""
    _check_bits(bits)
    u, mid = ZERO_U8_UNITS[bits], ((1 << bits) - 1) / 2
    return -128 / u + mid, 127 / u + mid


def round_scale_u8(s: jax.Array) -> jax.Array:  # f32 -> f32 on the 8-bit scale grid
    """Nearest 8-bit scale (half to even on the dropped mantissa bits), clamped to its range;
    non-positive and NaN inputs give the smallest scale."""
    s = s.astype(jnp.float32)
    b = jax.lax.bitcast_convert_type(s, jnp.int32)
    lsb = jax.lax.shift_right_logical(b, jnp.int32(_SCALE_U8_DROP)) & 1
    r = (b + ((1 << (_SCALE_U8_DROP - 1)) - 1) + lsb) & jnp.int32(~((1 << _SCALE_U8_DROP) - 1))
    r = jnp.clip(r, _SCALE_U8_MIN_BITS, _SCALE_U8_MAX_BITS)
    r = jnp.where(s > 0.0, r, _SCALE_U8_MIN_BITS)  # also NaN (compares false)
    return jax.lax.bitcast_convert_type(r, jnp.float32)


def round_zero_u8(z: jax.Array, bits: int) -> jax.Array:  # f32 -> f32 on the zero grid
    """Nearest representable 8-bit zero point (ties up), clamped to `zero_u8_range`."""
    return _decode_zero_u8(_zero_u8_code(z, bits), bits)


def _zero_u8_code(z: jax.Array, bits: int) -> jax.Array:  # f32 -> i32 in [0, 255]
    u, mid = ZERO_U8_UNITS[bits], ((1 << bits) - 1) / 2
    c = jnp.floor((z.astype(jnp.float32) - jnp.float32(mid)) * jnp.float32(u) + 0.5) + 128.0
    return jnp.clip(c, 0.0, 255.0).astype(jnp.int32)


def _decode_zero_u8(c: jax.Array, bits: int) -> jax.Array:  # int -> f32 (exact)
    # (c - 128) / U + mid as one multiply-add: c / U and mid - 128 / U are exact (U is a power
    # of two), so the sum rounds once, to the same float32 as the two-step form.
    u, mid = ZERO_U8_UNITS[bits], ((1 << bits) - 1) / 2
    return c.astype(jnp.int32).astype(jnp.float32) * jnp.float32(1.0 / u) + jnp.float32(
        mid - 128 / u
    )


def _decode_scale_u8(c: jax.Array) -> jax.Array:  # int -> f32 (exact)
    # Byte e << 4 | m shifted left by 19 is e << 23 | m << 19: adding the biased exponent's
    # offset gives the float32 bits in one multiply-add (no field extraction).
    c = c.astype(jnp.int32)
    b = c * jnp.int32(1 << _SCALE_U8_DROP) + jnp.int32((127 - SCALE_U8_BIAS) << 23)
    return jax.lax.bitcast_convert_type(b, jnp.float32)


def encode_meta(
    x: jax.Array,  # f32[...] scales or zero points already on the storage grid
    meta_dtype: object,
    kind: str,  # "scale" or "zero"
    bits: int,
) -> jax.Array:  # meta_dtype[...]
    """Stored form of scales / zero points: a cast for float dtypes, the byte for uint8."""
    if jnp.dtype(meta_dtype) != jnp.uint8:
        return x.astype(meta_dtype)
    if kind == "zero":
        return _zero_u8_code(x, bits).astype(jnp.uint8)
    if kind != "scale":
        raise ValueError(f"kind={kind!r} must be 'scale' or 'zero'")
    b = jax.lax.bitcast_convert_type(round_scale_u8(x), jnp.int32)
    e = jax.lax.shift_right_logical(b, jnp.int32(23)) - (127 - SCALE_U8_BIAS)
    m = jax.lax.shift_right_logical(b, jnp.int32(_SCALE_U8_DROP)) & 15
    return (jax.lax.shift_left(e, jnp.int32(4)) | m).astype(jnp.uint8)


def decode_scale(stored: jax.Array) -> jax.Array:  # meta[...] -> f32[...]
    """Float32 scales from their stored form (the stored dtype says which encoding)."""
    if stored.dtype == jnp.uint8:
        return _decode_scale_u8(stored)
    return stored.astype(jnp.float32)


def decode_zero(stored: jax.Array, bits: int) -> jax.Array:  # meta[...] -> f32[...]
    """Float32 zero points from their stored form (uint8: the fixed point of ``bits``)."""
    if stored.dtype == jnp.uint8:
        return _decode_zero_u8(stored, bits)
    return stored.astype(jnp.float32)


VALUE_LAYOUTS: tuple[str, ...] = ("tokens", "dims")


def pack_value_page_dims_major(
    codes: jax.Array,  # u8[..., page, d], each value in [0, 2**bits)
    bits: int,
) -> jax.Array:  # u8[..., d, page // n]
    """Packs a value page dimension-major (see the module docstring), 2 or 4 bits."""
    if not is_packed(bits):
        raise ValueError(f"bits={bits} has no packed dimension-major layout")
    return pack_codes(jnp.swapaxes(codes, -1, -2), bits)


def unpack_value_page_dims_major(
    packed: jax.Array,  # u8[..., d, page // n]
    bits: int,
    page_size: int,
) -> jax.Array:  # u8[..., page, d]
    """Inverse of `pack_value_page_dims_major`."""
    return jnp.swapaxes(unpack_codes(packed, bits, page_size), -1, -2)


@dataclasses.dataclass(frozen=True)
class PageLayout:
    """Page-pool shapes and byte costs for one layer's K (or V) cache.

    Hashable, so it can be a static argument of jitted functions.

    Attributes:
      page_size: tokens per page (``P``).
      num_kv_heads: KV heads per layer (``Hkv``).
      head_dim: channels per head (``d``).
      bits: low-bit code width; 2 and 4 packed planar, 3 bit-sliced (reference paths only).
      group_size: channels sharing one (scale, zero); ``None`` means ``head_dim``.
      meta_dtype: storage dtype name of scale and zero ('float16', 'bfloat16', 'float32', or
        'uint8': the 8-bit encoding of the module docstring).
      fp_dtype: storage dtype name of full-precision pages ('bfloat16', 'float32', 'float16').
    """

    page_size: int
    num_kv_heads: int
    head_dim: int
    bits: int = 2
    group_size: int | None = None
    meta_dtype: str = "float16"
    fp_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("page_size", "num_kv_heads", "head_dim"):
            object.__setattr__(self, name, _positive_int(getattr(self, name), name))
        _check_bits(self.bits)
        g = self.head_dim if self.group_size is None else self.group_size
        g = _positive_int(g, "group_size")
        if self.head_dim % g:
            raise ValueError(f"head_dim={self.head_dim} is not divisible by group_size={g}")
        n = 8 if self.bits == 3 else codes_per_byte(self.bits)
        if self.head_dim % n:
            raise ValueError(
                f"head_dim={self.head_dim} is not divisible by {n} ({self.bits}-bit rows)"
            )
        # Normalise so equal layouts compare (and hash) equal whatever spelling was used.
        object.__setattr__(self, "group_size", g)
        object.__setattr__(
            self, "meta_dtype", _normalise_dtype_name(self.meta_dtype, META_DTYPES, "meta_dtype")
        )
        object.__setattr__(
            self, "fp_dtype", _normalise_dtype_name(self.fp_dtype, FP_DTYPES, "fp_dtype")
        )

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def codes_per_byte(self) -> int:
        """``n``: codes per stored byte (1 for 3 bits)."""
        return codes_per_byte(self.bits)

    @property
    def packed(self) -> bool:
        """Whether codes are bit-packed (2 and 4 bits)."""
        return is_packed(self.bits)

    @property
    def packed_dim(self) -> int:
        """Last-axis length of a code row: ``head_dim // n`` (3 bits: ``3 head_dim / 8``)."""
        return packed_dim(self.head_dim, self.bits)

    @property
    def num_groups(self) -> int:
        """Groups per head: ``head_dim // group_size``."""
        return self.head_dim // self.group_size

    @property
    def codes_dtype(self) -> jnp.dtype:
        return jnp.dtype(CODES_DTYPE)

    @property
    def meta_jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.meta_dtype)

    @property
    def fp_jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.fp_dtype)

    # ---- pool shapes ---------------------------------------------------------------------
    def codes_shape(self, num_pages: int) -> tuple[int, int, int, int]:
        """``u8[num_pages, kv_heads, page_size, head_dim // n]``."""
        num_pages = _check_num_pages(num_pages)
        return (num_pages, self.num_kv_heads, self.page_size, self.packed_dim)

    def meta_shape(self, num_pages: int) -> tuple[int, int, int, int]:
        """Shape of the scale pool and of the zero pool: ``[P#, kv_heads, page, d // G]``."""
        num_pages = _check_num_pages(num_pages)
        return (num_pages, self.num_kv_heads, self.page_size, self.num_groups)

    def fp_shape(self, num_pages: int) -> tuple[int, int, int, int]:
        """``fp_dtype[num_pages, kv_heads, page_size, head_dim]``."""
        num_pages = _check_num_pages(num_pages)
        return (num_pages, self.num_kv_heads, self.page_size, self.head_dim)

    def token_codes_shape(self, num_tokens: int) -> tuple[int, int, int]:
        """Token-major (unpaged) code shape ``u8[N, kv_heads, head_dim // n]``."""
        return (num_tokens, self.num_kv_heads, self.packed_dim)

    def token_meta_shape(self, num_tokens: int) -> tuple[int, int, int]:
        """Token-major (unpaged) scale/zero shape ``[N, kv_heads, head_dim // G]``."""
        return (num_tokens, self.num_kv_heads, self.num_groups)

    # ---- byte accounting -----------------------------------------------------------------
    @property
    def lowbit_bytes_per_token(self) -> int:
        """Bytes one token occupies in the low-bit pools (codes + scale + zero, all KV heads)."""
        meta = 2 * self.num_groups * self.meta_jnp_dtype.itemsize
        return self.num_kv_heads * (self.packed_dim + meta)

    @property
    def fp_bytes_per_token(self) -> int:
        """Bytes one token occupies in the full-precision pools (all KV heads)."""
        return self.num_kv_heads * self.head_dim * self.fp_jnp_dtype.itemsize

    @property
    def bits_per_element(self) -> float:
        """Stored bits per cached element in low-bit pages, scale and zero included."""
        return 8.0 * self.lowbit_bytes_per_token / (self.num_kv_heads * self.head_dim)

    @property
    def lowbit_bytes_per_page(self) -> int:
        return self.page_size * self.lowbit_bytes_per_token

    @property
    def fp_bytes_per_page(self) -> int:
        return self.page_size * self.fp_bytes_per_token

    # ---- addressing ----------------------------------------------------------------------
    def page_and_slot(self, position: jax.Array | int) -> tuple[jax.Array, jax.Array]:
        """Maps a token position within a segment to (page-table entry, slot within page)."""
        position = jnp.asarray(position)
        return position // self.page_size, position % self.page_size

    def num_pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens of one sequence."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens} must be >= 0")
        return -(-num_tokens // self.page_size)


def _positive_int(v: object, name: str) -> int:
    if isinstance(v, bool):
        raise ValueError(f"{name}={v!r} must be a positive int")
    try:
        i = operator.index(v)
    except TypeError as e:
        raise ValueError(f"{name}={v!r} must be a positive int") from e
    if i <= 0:
        raise ValueError(f"{name}={v!r} must be a positive int")
    return i


def _check_num_pages(num_pages: int) -> int:
    return _positive_int(num_pages, "num_pages")
