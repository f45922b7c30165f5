"""Per-tile math shared by every decode-attention backend body, and their static config.

Kernel algebra (DESIGN.md section 5), with ``k_hat = s (c - z)`` per group of channels:

    q . k_hat                = s (q . c) - s z sum(q)
    sum_t p_t s_t (c_t - z_t) = sum_t (p_t s_t) c_t - sum_t p_t s_t z_t

so the inner loops are plain tensor-core dots of the query (or the probabilities) against
small-integer code planes; scales and zero points are applied per token outside the dot.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import layout

# Finite "minus infinity": keeps exp2(m_old - m_new) well defined when a split saw no key.
NEG_INF = -0.7 * float(jnp.finfo(jnp.float32).max)
LOG2E = math.log2(math.e)
# Dtype of the low-bit dot operands. Codes (< 16) are exact in it and it keeps 3 more mantissa
# bits of the query / probabilities than bfloat16; values are O(1) so the range is no concern.
CODE_DOT_DTYPE = jnp.float16
# "gpu": Pallas Triton body; "gpu_mosaic": Pallas Mosaic GPU (Hopper) low-bit body; "tpu".
BACKENDS = ("gpu", "gpu_mosaic", "tpu")
BF16_PAGES_PER_BLOCK = 8


# ------------------------------------------------------------------------------------------
# Static configuration shared by the backend bodies
# ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static facts a backend body needs; hashable so it can be a jit static argument.

    Attributes:
      head_dim: ``d``.
      page_size: tokens per page.
      group_pad: query heads per KV head after padding (tensor-core M dimension).
      n_chunks: channel chunks the output is accumulated in (``codes_per_byte`` of the
        value width for the mixed kernel, 1 for the BF16 baseline); chunk ``i`` covers
        channels ``[i*d/n, (i+1)*d/n)``, matching planar value code plane ``i``.
      bits: low-bit key code width, or ``None`` for the BF16-only baseline (no low-bit set).
      group_size: channels sharing one scale/zero (``None`` for the baseline).
      scale_log2: ``sm_scale * log2(e)``; logits are kept in base-2 units so the softmax uses
        ``exp2``.
      pages_per_block: pages gathered per inner-loop step.
      has_query_transform / has_value_inverse: whether the optional matrices are given to
        the split body (the GPU path applies them in separate prologue/epilogue kernels and
        passes ``False`` here).
      gather: how a body reads a block of low-bit pages (each backend lists its modes in
        ``GATHER_MODES``). ``"rows"`` (Triton): one 2-D pointer gather per tile (keys loaded
        already transposed, ``[d/n, T]``), so no reshape or transpose sits between the load
        and the dot and Triton loads the packed bytes straight into the tensor-core operand
        layout. ``"pages"`` (TPU): one page per grid step through BlockSpecs. ``"tma"``
        (Mosaic GPU): a ring of tensor-map copies into swizzled tiles; ``"bulk"`` (Mosaic
        GPU): the same ring of plain bulk copies of each tile's contiguous bytes.
      int_to_float: how codes become float16 dot operands. ``"convert"``: an int->float
        convert. ``"exponent"``: OR the code into the mantissa of float16 1024.0
        (``0x6400 | c`` is ``1024 + c`` exactly) and subtract 1024, in 16-bit integer and
        half-precision ops. ``"asm"`` (Triton, Mosaic GPU): the same trick two codes per
        32-bit instruction in inline PTX (`gpu_triton`, `gpu_mosaic._planes_asm`); in
        interpret mode Triton runs the ``"exponent"`` twin, which yields the identical
        float16 values.
      row_sums: how the low-bit loop keeps the softmax denominator and the value zero-point
        correction. ``"deferred"`` (GPU): as ``[Gp, T]`` tiles rescaled like the accumulators
        and reduced once after the loop, so the row max is the only cross-warp reduction per
        step. ``"per_step"`` (TPU): reduced every step.
      group: real query heads per KV head (``<= group_pad``); the GPU body writes only these
        rows of its split partials (a quarter of the bytes at GQA 4), ``None`` = all.
      value_layout: ``"tokens"`` or ``"dims"`` (`pallas_kernels.layout.VALUE_LAYOUTS`).
      bits_v: value code width when it differs from the keys' (a layer of a bit allocation
        with its own K and V widths); ``None`` = ``bits``. The query is split into the key
        planes' chunks (`key_chunks`), the output into the value planes' (`n_chunks`).
      prologue: how a body builds its query operands (Mosaic GPU, `gpu_mosaic.PROLOGUES`:
        ``"fused"``, one kernel from the queries as they come, transform included; ``"triton"``,
        that kernel after the API's convert and `head_matmul`; ``"xla"`` ops. The other bodies
        take ``"xla"``).
    """

    head_dim: int
    page_size: int
    group_pad: int
    n_chunks: int
    bits: int | None
    group_size: int | None
    scale_log2: float
    pages_per_block: int
    has_query_transform: bool
    has_value_inverse: bool
    gather: str = "pages"
    int_to_float: str = "convert"
    row_sums: str = "per_step"
    group: int | None = None
    value_layout: str = "tokens"
    bits_v: int | None = None
    prologue: str = "xla"

    @property
    def value_bits(self) -> int | None:
        """Value code width (``bits`` unless ``bits_v`` says otherwise)."""
        return self.bits if self.bits_v is None else self.bits_v

    @property
    def key_chunks(self) -> int:
        """Query chunks that meet the key code planes (``codes_per_byte(bits)``)."""
        return self.n_chunks if self.bits is None else layout.codes_per_byte(self.bits)

    @property
    def key_chunk(self) -> int:
        """Channels per key code plane."""
        return self.head_dim // self.key_chunks

    @property
    def key_plane_group(self) -> tuple[int, ...]:
        """Scale/zero group of each key code plane."""
        g = self.head_dim if self.group_size is None else self.group_size
        return tuple((i * self.key_chunk) // g for i in range(self.key_chunks))

    @property
    def value_packed_width(self) -> int:
        """Packed bytes per token row of the low-bit values."""
        assert self.value_bits is not None
        return self.head_dim // layout.codes_per_byte(self.value_bits)

    @property
    def chunk(self) -> int:
        """Channels per output chunk (= packed bytes per row for the low-bit set)."""
        return self.head_dim // self.n_chunks

    @property
    def packed_width(self) -> int:
        """Packed bytes per token row of the low-bit set (``d / codes_per_byte``)."""
        assert self.bits is not None
        return self.head_dim // layout.codes_per_byte(self.bits)

    @property
    def num_groups(self) -> int:
        return 1 if self.group_size is None else self.head_dim // self.group_size

    @property
    def plane_group(self) -> tuple[int, ...]:
        """Scale/zero group of each (value) code plane (every plane lies inside one group)."""
        g = self.head_dim if self.group_size is None else self.group_size
        return tuple((i * self.chunk) // g for i in range(self.n_chunks))


# ------------------------------------------------------------------------------------------
# Per-tile math shared by the GPU and TPU bodies
# ------------------------------------------------------------------------------------------
def _dot_nt(a: jax.Array, b: jax.Array, precision=None) -> jax.Array:
    """``a @ b.T`` with float32 accumulation."""
    return lax.dot_general(
        a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def _dot_nn(a: jax.Array, b: jax.Array, precision=None) -> jax.Array:
    """``a @ b`` with float32 accumulation."""
    return lax.dot_general(
        a, b, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def tile_query_chunks(
    q: jax.Array,  # f32[Gp, d] query rows of one KV head's group, original frame
    qt_chunk_cols: list[jax.Array] | None,  # n x f32[d, d/n] column blocks of B_K^T, or None
    q_chunks_plain: list[jax.Array] | None,  # n x f32[Gp, d/n] (used when no transform)
) -> list[jax.Array]:  # n x f32[Gp, d/n] transformed-frame query chunks
    """Transformed query split into the chunks that meet code plane ``i``.

    Taking column blocks of the transform (rather than slicing a product) keeps every step a
    whole-tile dot, which the Triton backend needs.
    """
    if qt_chunk_cols is None:
        assert q_chunks_plain is not None
        return q_chunks_plain
    return [_dot_nn(q, c, precision=lax.Precision.HIGHEST) for c in qt_chunk_cols]


def tile_group_sums(
    q_chunks16: list[jax.Array],  # n x f16[Gp, d/n]
    plane_group: tuple[int, ...],
    num_groups: int,
) -> list[jax.Array]:  # num_groups x f32[Gp]
    """``sum(q)`` over each scale group, from the same rounded query the dots see."""
    sums: list[jax.Array | None] = [None] * num_groups
    for i, qc in enumerate(q_chunks16):
        s = jnp.sum(qc.astype(jnp.float32), axis=1)
        g = plane_group[i]
        sums[g] = s if sums[g] is None else sums[g] + s
    return sums  # type: ignore[return-value]


def tile_lowbit_logits(
    q_chunks16: list[jax.Array],  # n x f16[Gp, d/n]
    q_sums: list[jax.Array],  # num_groups x f32[Gp]
    planes: list[jax.Array],  # n x f16[T, d/n] code planes (small integers), or [d/n, T]
    scales: list[jax.Array],  # num_groups x f32[1, T], zero where the token is invalid
    zeros: list[jax.Array],  # num_groups x f32[1, T], zero where the token is invalid
    plane_group: tuple[int, ...],
    keys_transposed: bool = False,  # planes are [d/n, T] (loaded transposed)
) -> jax.Array:  # f32[Gp, T] = q . k_hat
    """``q . k_hat = sum_g s_g (q_g . c_g) - s_g z_g sum(q_g)``: n plain dots, then scales."""
    dot = _dot_nn if keys_transposed else _dot_nt
    raw: list[jax.Array | None] = [None] * len(scales)
    for i, plane in enumerate(planes):
        r = dot(q_chunks16[i], plane)  # [Gp, T]
        g = plane_group[i]
        raw[g] = r if raw[g] is None else raw[g] + r
    out = None
    for g, r in enumerate(raw):
        if r is None:
            continue
        term = scales[g] * r - (scales[g] * zeros[g]) * q_sums[g][:, None]
        out = term if out is None else out + term
    return out


def tile_lowbit_values(
    p: jax.Array,  # f32[Gp, T] unnormalised probabilities, zero on invalid tokens
    planes: list[jax.Array],  # n x f16[T, d/n]
    scales: list[jax.Array],  # num_groups x f32[1, T]
    zeros: list[jax.Array],  # num_groups x f32[1, T]
    plane_group: tuple[int, ...],
) -> list[jax.Array]:  # n x f32[Gp, d/n]
    """``sum_t p_t s_t (c_t - z_t)`` per chunk: one dot of ``p*s`` with the plane, minus a
    per-row correction ``sum_t p_t s_t z_t``."""
    ps16, corr = [], []
    for g in range(len(scales)):
        w = (p * scales[g]).astype(CODE_DOT_DTYPE)  # [Gp, T]
        ps16.append(w)
        # Use the rounded weights so the correction matches what the dot summed exactly.
        corr.append(jnp.sum(w.astype(jnp.float32) * zeros[g], axis=1))  # [Gp]
    return [
        _dot_nn(ps16[plane_group[i]], plane) - corr[plane_group[i]][:, None]
        for i, plane in enumerate(planes)
    ]


def tile_softmax_step(
    logits: jax.Array,  # f32[Gp, T] in base-2 units
    valid_row: jax.Array,  # bool[1, T]
    m_prev: jax.Array,  # f32[Gp]
    l_prev: jax.Array,  # f32[Gp]
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One online-softmax step; returns ``(p, m_new, alpha, l_new)``.

    ``p`` is zeroed on invalid tokens with ``where`` (not a multiply), so garbage logits of
    masked slots cannot leak as ``0 * NaN``.
    """
    logits = jnp.where(valid_row, logits, NEG_INF)
    m_new = jnp.maximum(m_prev, jnp.max(logits, axis=1))
    alpha = jnp.exp2(m_prev - m_new)
    p = jnp.where(valid_row, jnp.exp2(logits - m_new[:, None]), 0.0)
    l_new = alpha * l_prev + jnp.sum(p, axis=1)
    return p, m_new, alpha, l_new


# float16 1024.0: exponent 10, empty mantissa. Its ulp is 1, so ``bits | 0x6400`` is
# ``1024 + code`` exactly for any code below 1024.
_F16_1024_BITS = 0x6400


def codes_to_f16(
    codes: jax.Array,  # int[...] small non-negative integers (< 1024)
    int_to_float: str = "convert",
) -> jax.Array:  # f16[...] the same integers, exactly
    """Small integer codes as exact float16 (see `DecodeConfig.int_to_float`).

    ``"exponent"`` works in int16 (pass int16 codes inside kernels: a narrowing cast would
    stop Triton from moving the operand-layout conversion up to the load).
    """
    if int_to_float == "convert":
        return codes.astype(CODE_DOT_DTYPE)
    if int_to_float != "exponent":
        raise ValueError(f"int_to_float={int_to_float!r} must be 'convert' or 'exponent' here")
    half_bits = codes.astype(jnp.int16) | jnp.asarray(_F16_1024_BITS, jnp.int16)
    return lax.bitcast_convert_type(half_bits, CODE_DOT_DTYPE) - jnp.asarray(1024, CODE_DOT_DTYPE)


def unpack_tile_planes(
    packed: jax.Array,  # u8[..., m] packed bytes of a tile (either orientation)
    bits: int,
    int_to_float: str = "convert",
) -> list[jax.Array]:  # n x f16[..., m]
    """Code planes of a tile as exact small-integer float16 (via `layout.unpack_planes`).

    Widening only (u8 -> i32 for ``"convert"``, u8 -> i16 for ``"exponent"``), all elementwise.
    """
    wide = jnp.int32 if int_to_float == "convert" else jnp.int16
    planes = layout.unpack_planes(packed.astype(wide), bits)
    return [codes_to_f16(c, int_to_float) for c in planes]


def split_table(
    table: jax.Array,  # i32[B, n]
    num_splits: int,
    unit: int,
) -> jax.Array:  # i32[B, S, pages_per_split]
    """Pads a page table (with page 0; masked by length) so each split gets whole units."""
    b, n = table.shape
    per = -(-n // (num_splits * unit)) * unit
    table = jnp.pad(table, ((0, 0), (0, num_splits * per - n)))
    return table.reshape(b, num_splits, per)
