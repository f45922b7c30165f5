"""Pallas Mosaic GPU (Hopper) body of the paged low-bit decode attention: tokens as the M
dimension of the warpgroup MMA.

Grid ``(B, Hkv, S)``: one CTA (one warpgroup) per (sequence, KV head, split) walks its split's
low-bit pages 64 tokens (``TILE`` rows; 128 with 128-token pages) at a time:

* **Keys on the tensor cores, codes as the register operand.** A ``[tile, d/n]`` byte tile of
  planar-packed key codes (`pallas_kernels.layout`) is loaded to registers once; plane ``i``
  is already a ``[tile, d/n]`` array in the MMA's A layout, so
  ``logits^T[tile, N] = sum_i plane_i @ q_i^T`` is ``n`` warpgroup MMAs of K = d/n against the
  matching column block of the transformed query (shared memory, group padded to N = 8, or
  16 for groups over 8; each block is its own TMA box of the float16 query). With a group of
  up to 4 and 128-token steps, the step's two 64-token halves are two **token streams** in one
  ``[64, 8]`` tile (`STREAMS`): each half's codes against a query block holding the query in
  its own four columns, each stream with its own softmax state and partial. ``sum(q)`` per
  column comes from the same float16 values once per CTA, on the tensor cores (a ones tile
  times the planes).
  A plane becomes float16 without an integer-to-float conversion: a mask, an OR under a
  float16 exponent and a subtraction, two codes per 32-bit instruction, written in inline PTX
  (`_planes_asm`, the default) or in jnp ops (`_plane_to_f16`, ``int_to_float="exponent"``,
  which Mosaic lowers to about twice the instructions).
  With ``int_to_float="s8"`` the key codes stay integers: signed 8-bit register operands of
  K = 64 (a shift and a mask per four codes, `_planes_s8`) against the query's high and low
  8-bit parts in an int32 accumulator (`split_query_s8`; run 61: split kernel 0.369 -> 0.304
  ms at 8 x 128k). ``"s8_e4m3x2"`` also reads dimension-major value planes as e4m3 (the same
  shift and mask: the bytes are ``c * 2^-9``) against the weights in two e4m3 parts, half the
  value MMAs (`_kernel`'s ``values_f8``; BENCHMARKS.md "Session 24").
  Scales and zero points are applied per token row afterwards
  (``s_t (q . c_t) - s_t z_t sum(q)``, DESIGN.md section 5); float16 or the 8-bit encoding
  (`layout`, decoded in the kernel with the reference's integer ops). Keys and values may have
  different widths (a bit allocation's layers).
* **Softmax over the token axis** (axis 0 of the accumulator: a cross-warp reduction), base 2,
  the query carrying ``sm_scale * log2(e)``.
* **Values** ``O^T[d, N] = V^T (p s)`` with ``p * s_v`` as the B operand (shared memory,
  stored transposed: ``[N, tile]``, tokens contiguous, each stream's tokens zero outside its
  columns) and
  the zero-point term ``sum_t p_t s_t z_t`` a column sum. With dimension-major value pages
  (`layout.VALUE_LAYOUTS` ``"dims"``, 128-token pages) each plane of the ``[d, tile/n]`` code
  tile is the register A operand over ``tile/n`` tokens. With token-major pages the planes are
  written as float16 into a ``[tile, d]`` shared tile that the MMA reads transposed (their
  contraction runs over tokens, so they cannot be a register operand).
* **Pipeline**: each tile arrives by TMA (key and value codes and the four per-token metadata
  rows: six copies) into a ``STAGES``-deep shared-memory ring, one mbarrier per slot; tile
  ``i + STAGES - 1`` is requested before tile ``i`` is computed. The ring shares its memory
  with the epilogue's output tile. Lane-level TMA copies move multiples of 128 bytes, so a
  tile's float16 metadata row (64 x 2 bytes) must be contiguous: low-bit pages hold a
  multiple of 64 tokens (`layout.PageLayout` with ``page_size=64``); a 16-token page's
  32-byte rows cannot be copied this way. Code tiles come as tensor-map boxes into swizzled
  tiles (``code_copy="tma"``) or as plain bulk copies of their contiguous bytes into
  unswizzled tiles (``"bulk"``: the ring alone reads faster, the kernel measured level;
  BENCHMARKS.md).
* **MMA schedule** (``overlap``): with ``"values"`` a step's value MMAs stay in flight under
  the next step's copies, key unpack and key MMAs; the value accumulator is an MMA accumulator
  across the loop, and reading it for the next rescale waits for both. ``"copies"`` waits for
  them before the next step's key unpack: fewer live registers, three CTAs per SM; the
  default picks it where the grid has programs for a third CTA. ``"none"`` waits after each
  product: the serial twin the tests compare against.

The split partials (``acc`` with the zero-point term folded in, running max ``m`` and
denominator ``l`` in base-2 units) have the layout of the Triton body's, so the Triton merge
kernel combines them with the full-precision segment's partials (each program stores its
``[d, N]`` accumulator transposed, `store_rows`). Supported: scale/zero groups
of the whole head (``group_size == d``), GQA groups up to 16, packed rows of 32 or 64 bytes
(2 bits at d = 128/256, 4 bits at d = 64/128; 128-byte rows, 4 bits at d = 256, gave wrong
results in run 20), low-bit pages of a multiple of 64 tokens (steps of 128 tokens when pages
hold 128; 8-bit scale/zero needs 128).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as plgpu_triton
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm

from pallas_kernels import layout
from pallas_kernels.decode_attention import gpu_triton
from pallas_kernels.decode_attention import tiles as da

TILE = 64  # tokens per step at least: the M of one warpgroup MMA
MAX_TILE = 128  # tokens per step when pages are that large (two M tiles per MMA)
# Attribution: what a step does. "no_value_operand": all but the value codes' load, unpack
# and MMAs (the probabilities are still stored and the accumulator rescaled); "no_pt_store":
# all but the p^T store and its fence (the value MMAs read the tile as it is); "no_rescale":
# all but the accumulator's rescale (and its wait for the MMAs in flight); "half_value_mma":
# every value plane unpacked, the MMAs of only half of them. Wrong results.
STAGES_KINDS = (
    "full", "keys", "loads", "loads_codes", "no_value_operand", "no_pt_store", "no_rescale",
    "half_value_mma",
)  # fmt: skip
# How code tiles reach shared memory: "tma" is a tensor-map copy into a swizzled tile (a box
# of 32-byte rows); "bulk" is one `cp.async.bulk` of the tile's contiguous bytes into an
# unswizzled tile (a [page, d/n] code tile is contiguous in the pool; 32-byte rows only);
# "auto": bulk where the rows allow (run 56: 0.390 vs 0.403 ms at 8 x 128k), else tma.
CODE_COPIES = ("auto", "tma", "bulk")
# What runs under the MMAs in flight: "none" waits after each product (the serial twin);
# "values" leaves a step's value MMAs in flight over the next step's loads, key unpack and
# key MMAs (run 51: split kernel 0.490 -> 0.460 ms at 8 x 128k); "copies" only over the next
# step's copy issue and ring wait, then waits before the key unpack, so the value planes'
# registers (64 a thread at d = 128) are free before the key planes take theirs: ptxas counts
# 151 registers against 174 (run 121), so three one-warpgroup CTAs fit an SM instead of two.
# "auto" (the default) takes "copies" where the grid has more programs than two per SM
# (`RESIDENT_PROGRAMS_VALUES`), else "values": the third CTA is what pays for the lost overlap
# (H100, whole call at 8 x 128k: 384 programs, "copies" 0.2808 / 0.2840 ms against "values"
# at 256 programs 0.2992 / 0.2973, run 124; 256 programs with "copies" 0.3084, run 122).
OVERLAPS = ("none", "values", "copies")
RESIDENT_PROGRAMS_VALUES = 264  # 2 CTAs per SM at 174 registers, 132 SMs (H100 / H200 SXM)
# Which steps mask tokens past the split's count: "last" (only a step that reaches past it)
# or "every" (the twin the tests compare against).
MASKS = ("last", "every")
# How the split kernel's query operands are built (`query_operands`), the first the default:
# "fused", one Pallas Triton kernel from the queries as they come (convert, pad, query
# transform, 8-bit split and layout: `query_prologue`); "triton", the same kernel after the
# API's convert and `head_matmul` (runs 91-92, H100: -3 to -5 us per batch-1 call against
# "xla"); "xla", the operands in XLA ops (five small fusions).
PROLOGUES = ("fused", "triton", "xla")
# int_to_float="s8" keeps key codes integers: signed 8-bit MMA operands, one shift and one mask
# per four codes; the query split into high and low 8-bit parts, q ~ s_q (hi + lo / 254), side
# by side in 2N columns of an int32 accumulator (exact integer sums, ~2^-16 of max|q| against
# float16's 2^-11 of |q|). The value codes still become float16 ("asm").
_LO = 254.0  # weight of the low part of an 8-bit split: its residual spans [-1/2, 1/2]
_S8_K = 64  # K of an 8-bit register-operand MMA group (a 64-byte swizzle; 32 is refused)
# e4m3 value operands (``int_to_float="s8_e4m3x2"``): the weights p * s_v are kept at most
# 2^_F8_HEADROOM by the softmax's shifted max (e4m3's largest normal is 448, its smallest
# 2^-6); scales below _F8_MIN_SCALE count as it in that max; a plane read as e4m3 is c * 2^-9.
_F8_HEADROOM = 8.0
_F8_MIN_SCALE = 2.0**-40
_F8_CODE_INV = 2.0**9
# The low part is stored 2^4 larger (its own accumulator columns, scaled back in the fold):
# at most 2^-4 of its weight, it would otherwise fall under e4m3's normals 4 binades sooner.
_F8_LO_GAIN = 16.0
GROUP_PAD = 16  # N of the MMAs at most: the largest GQA group served
# N of the MMAs for groups of up to 8 query heads (Qwen3-8B's 4): half the softmax, rescale
# and probability-store work of N = 16 per step (the [tile, N] tiles are elementwise).
NARROW_PAD = 8
# Token streams on the MMA columns: with a group of up to 4 a 128-token step's two 64-token
# halves are two streams side by side in one [64, 8] logits tile (stream t's query block in
# columns [4t, 4t + 4), its tokens as the A operand against it), each its own softmax and a
# partial of its own; the elementwise work per token is that of N = 4.
STREAMS = (1, 2)
# The probabilities' shared tile is stored transposed, [N, tile] with tokens contiguous (a
# K-major B operand whatever N is: a [tile, 8] float16 tile's 16-byte rows have no swizzle);
# 64-byte swizzle: a 2-bit value plane's 32 tokens are one swizzle column.
P_SWIZZLE = 64
STAGES = 3
# Lane-level TMA copies move multiples of 128 bytes: a table row (a split's pages, then its
# valid-token count) is padded to 32 int32 entries.
_COPY_WORDS = 32


def supports(*, head_dim: int, bits: int, group_size: int, group: int, page_size: int) -> bool:
    """Whether this body handles a configuration (else the Triton body serves it)."""
    width = head_dim // layout.codes_per_byte(bits)
    return (
        bits in (2, 4)
        and group_size == head_dim
        and group <= GROUP_PAD
        and width in (32, 64)
        and page_size % TILE == 0
        and head_dim % 64 == 0
    )


def _swizzled(rows_bytes: int, bits: int = 16):
    """Tiling + swizzle transforms for a shared tile whose rows are ``rows_bytes`` long."""
    swizzle = min(128, rows_bytes)
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def _plane_to_f16(w: jax.Array, i: int, bits: int) -> jax.Array:
    """Codes of plane ``i`` of zero-extended code bytes ``w`` (int16) as exact float16.

    No integer-to-float conversion (a quarter-rate instruction, 8192 per 64-token tile, the
    largest cost of the first Mosaic body): the plane's bits are masked in place and OR-ed
    under a float16 exponent that makes the mantissa count in units of one code, i.e.
    ``bits(2^(10 - bits*i) + c)``; subtracting ``2^(10 - bits*i)`` leaves ``c`` exactly.
    Two codes per 32-bit register: one LOP3 and one HSUB2 per pair. (Leaving the offset on
    the codes and subtracting it through the zero-point terms saves the HSUB2 but measured
    wrong on the H200: the tensor cores' accumulation loses the codes under the offset,
    BENCHMARKS.md.)
    """
    shift = bits * i
    exponent = 25 - shift  # float16 2^(10 - shift): 15 bias + (10 - shift)
    code_bits = (w & jnp.int16(((1 << bits) - 1) << shift)) | jnp.int16(exponent << 10)
    return lax.bitcast_convert_type(code_bits, jnp.float16) - jnp.float16(2.0 ** (10 - shift))


def _planes_asm(codes: jax.Array, bits: int) -> list[jax.Array]:
    """Every plane of a uint8 code tile (WGMMA layout) as float16, in inline PTX.

    The same float16 bit trick as `_plane_to_f16`, written per 32-bit register: a thread's
    two code bytes (columns ``c, c+1``) are spread into the low bytes of the two halves by
    one PRMT shared by all planes, then each plane is one LOP3 (mask, OR under the float16
    exponent) and one SUB.F16X2 for two codes.
    """
    n = layout.codes_per_byte(bits)
    code_mask = (1 << bits) - 1
    lines = ["{", ".reg .b32 t, m;", f"prmt.b32 t, ${n}, 0, 0x4140;"]
    for i in range(n):
        mask = (code_mask << (bits * i)) * 0x10001
        exponent = ((25 - bits * i) << 10) * 0x10001  # float16 2^(10 - bits*i), both halves
        lines += [
            f"lop3.b32 ${i}, t, {mask:#010x}, {exponent:#010x}, 0xea;",  # (t & mask) | exponent
            f"mov.b32 m, {exponent:#010x};",
            f"sub.f16x2 ${i}, ${i}, m;",
        ]
    asm = "\n".join(lines + ["}"])
    constraints = ",".join(["=r"] * n + ["r"])
    out = tuple(
        plgpu.ShapeDtypeStruct(codes.shape, jnp.float16, layout=plgpu.Layout.WGMMA)
        for _ in range(n)
    )

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,), return_type=out)
    def unpack(_, arr):
        i16 = ir.IntegerType.get_signless(16)
        i32 = ir.IntegerType.get_signless(32)
        f16x2 = ir.VectorType.get((2,), ir.F16Type.get())
        result = llvm.StructType.get_literal([i32] * n)
        planes = [np.empty_like(arr.registers) for _ in range(n)]
        for idx, reg in np.ndenumerate(arr.registers):
            word = arith.extui(i32, mgpu_utils.bitcast(reg, i16))
            res = llvm.inline_asm(result, [word], asm, constraints, has_side_effects=False)
            for i in range(n):
                planes[i][idx] = mgpu_utils.bitcast(llvm.extractvalue(i32, res, [i]), f16x2)
        return tuple(
            mgpu.FragmentedArray(_registers=r, _layout=arr.layout, _is_signed=None) for r in planes
        )

    return list(unpack(codes))


def _planes_s8(codes: jax.Array, bits: int, dtype=jnp.int8) -> list[jax.Array]:
    """The planes of a uint8 code tile (`plgpu.Layout.WGMMA_8BIT`) as 8-bit MMA operands of
    K = 64: a shift and a mask per 32-bit register (four codes), no conversion.

    Plane ``i`` of ``[rows, W]`` bytes holds dims ``[i W, (i + 1) W)`` (keys) or tokens
    ``[i W, (i + 1) W)`` (dimension-major values); with W = 32 two neighbouring planes are
    concatenated along K (their register tiles side by side), so group ``g`` covers
    ``[64 g, 64 g + 64)``. ``dtype`` int8: the codes themselves; float8_e4m3fn: the same bytes
    read as e4m3, which are ``c * 2^-9`` exactly for ``c < 16`` (subnormals below 8, then the
    first binade, whose step is the same ``2^-9``).
    """
    n = layout.codes_per_byte(bits)
    rows, width = codes.shape
    per_group = _S8_K // width
    groups = n // per_group
    out = tuple(
        plgpu.ShapeDtypeStruct((rows, _S8_K), dtype, layout=plgpu.Layout.WGMMA_8BIT)
        for _ in range(groups)
    )
    is_f8 = jnp.dtype(dtype) == jnp.dtype(jnp.float8_e4m3fn)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_8BIT,), return_type=out)
    def unpack(_, arr):
        i32 = ir.IntegerType.get_signless(32)
        vec = arr.registers.flat[0].type
        if is_f8:
            vec = ir.VectorType.get(ir.VectorType(vec).shape, ir.Float8E4M3FNType.get())
        mask = arith.constant(i32, ((1 << bits) - 1) * 0x01010101)
        planes = []
        for i in range(n):
            regs = np.empty_like(arr.registers)
            for idx, reg in np.ndenumerate(arr.registers):
                word = mgpu_utils.bitcast(reg, i32)
                if i:
                    word = arith.shrui(word, arith.constant(i32, bits * i))
                regs[idx] = mgpu_utils.bitcast(arith.andi(word, mask), vec)
            planes.append(regs)
        return tuple(
            mgpu.FragmentedArray(
                _registers=np.concatenate(planes[g * per_group : (g + 1) * per_group], axis=1),
                _layout=arr.layout,
                _is_signed=None if is_f8 else True,
            )
            for g in range(groups)
        )

    return list(unpack(codes))


def _round_half_up(x: jax.Array) -> jax.Array:
    """Nearest integer, ties up (``jnp.round`` sends ties to even): Pallas Triton lowers no
    round, and XLA folds the float32 magic-number form back to ``x``."""
    return jnp.floor(x + 0.5)


def split_query_s8(
    qf: jax.Array, round_fn=jnp.round
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(hi, lo int8, s_q f32[..., 1], sum f32[...]) of f32 queries ``[..., d]``:
    ``q ~ s_q (hi + lo / 254)`` per query row, and the sum of that reconstruction (what the
    zero-point term must cancel against)."""
    sq = jnp.max(jnp.abs(qf), axis=-1, keepdims=True) / 127.0
    sq = jnp.where(sq > 0, sq, 1.0)
    u = qf / sq
    hi = round_fn(u)
    lo = jnp.clip(round_fn((u - hi) * _LO), -127, 127)
    total = sq[..., 0] * (hi.sum(-1) + lo.sum(-1) / _LO)
    return hi.astype(jnp.int8), lo.astype(jnp.int8), sq, total


def query_operands(
    qg: jax.Array,  # f32[B, Hkv, Gp, d] transformed-frame queries
    *,
    group: int,
    scale_log2: float,
    n_pad: int,
    streams: int,
    key_operand: str = "s8",
) -> tuple[jax.Array, jax.Array]:
    """The split kernel's query operands in XLA ops: ``qs``, the query times ``scale_log2``
    once per token stream in that stream's MMA columns (s8 keys: int8[B, Hkv, streams, 2N, d],
    high parts in rows ``t N/streams + g``, low parts N rows further; float16 keys:
    f16[B, Hkv, streams, N, d]), and ``qmeta`` f32[B, Hkv, 32] (s8 keys: each column's query
    scale, then its reconstruction's sum; zeros otherwise)."""
    b, hkv, _, d = qg.shape
    gcol = n_pad // streams
    eye = jnp.eye(streams, dtype=jnp.float32)
    qmeta = jnp.zeros((b, hkv, _COPY_WORDS), jnp.float32)
    if key_operand == "s8":
        hi, lo, sq, total = split_query_s8(qg[:, :, :group] * scale_log2)
        parts = jnp.stack([hi, lo], axis=2).astype(jnp.float32)  # [B, Hkv, 2, group, d]
        parts = jnp.pad(parts, ((0, 0), (0, 0), (0, 0), (0, gcol - group), (0, 0)))
        qs = jnp.einsum("bhjgd,tu->bhtjugd", parts, eye).astype(jnp.int8)
        qs = qs.reshape(b, hkv, streams, 2 * n_pad, d)
        cols = [
            jnp.tile(jnp.pad(v, ((0, 0), (0, 0), (0, gcol - group))), streams)
            for v in (sq[..., 0], total)
        ]  # [B, Hkv, N] each
        qmeta = qmeta.at[..., : 2 * n_pad].set(jnp.concatenate(cols, axis=-1))
    else:
        qs = (qg[:, :, :group] * scale_log2).astype(jnp.float16)
        qs = jnp.pad(qs, ((0, 0), (0, 0), (0, gcol - group), (0, 0)))
        qs = jnp.einsum("bhgd,tu->bhtugd", qs, eye.astype(qs.dtype))
        qs = qs.reshape(b, hkv, streams, n_pad, d)
    return qs, qmeta


def _query_prologue_kernel(*refs, group, scale_log2, n_pad, streams, has_mat, has_qg):
    """One (sequence, KV head): its group's query rows (times the head's query transform where
    given: a broadcast multiply and column sum, exact float32 products as HIGHEST asks, with no
    16-row minimum), then `query_operands`' s8 rows and metadata, each output row selected from
    the query row that feeds it and split in the twin's operations; with ``has_qg`` also the
    transformed rows as float32, zero past the group (the sink/recent kernel's query)."""
    it = iter(refs)
    x_ref = next(it)
    mat = next(it)[...] if has_mat else None
    qg_ref = next(it) if has_qg else None
    qs_ref, qmeta_ref = next(it), next(it)
    d = x_ref.shape[-1]
    query = []
    for g in range(group):
        x = x_ref[g, :].astype(jnp.float32)
        query.append(jnp.sum(x[:, None] * mat, axis=0) if has_mat else x)

    def select(idx, valid):  # i32[R] -> f32[R, d]: row idx[r]'s query, zeros where not valid
        out = jnp.zeros((idx.shape[0], d), jnp.float32)
        for g, row in enumerate(query):
            out = jnp.where(((idx == g) & valid)[:, None], row[None, :], out)
        return out

    if qg_ref is not None:
        r = jnp.arange(qg_ref.shape[0], dtype=jnp.int32)
        qg_ref[...] = select(r, r < group)
    gcol = n_pad // streams
    rows = qs_ref.shape[0]  # streams * 2N: stream t's block, high parts then low parts
    r = jnp.arange(rows, dtype=jnp.int32)
    i = r % (2 * n_pad)
    g = i % n_pad - (r // (2 * n_pad)) * gcol
    valid = (g >= 0) & (g < group)
    hi, lo, _, _ = split_query_s8(select(g, valid) * scale_log2, _round_half_up)
    qs_ref[...] = jnp.where(valid[:, None], jnp.where((i < n_pad)[:, None], hi, lo), 0)
    # Word c < N: column c's scale; word N + c: its reconstruction's sum; zeros after 2N.
    w = jnp.arange(qmeta_ref.shape[0], dtype=jnp.int32)
    g = jnp.where(w < n_pad, w, w - n_pad) % gcol
    valid = (w < 2 * n_pad) & (g < group)
    _, _, sq, total = split_query_s8(select(g, valid) * scale_log2, _round_half_up)
    qmeta_ref[...] = jnp.where(valid, jnp.where(w < n_pad, sq[:, 0], total), 0.0)


def _prologue_call(
    x: jax.Array,  # [B, Hkv, R, d] query rows per KV head (rows >= group never read)
    mat: jax.Array | None,  # f32[Hkv, d, d] or None
    *,
    group: int,
    group_pad: int | None,  # rows of the float32 query output, None: no such output
    scale_log2: float,
    n_pad: int,
    streams: int,
    interpret: bool,
) -> tuple[jax.Array, ...]:
    b, hkv, r, d = x.shape
    rows = streams * 2 * n_pad
    if rows & (rows - 1) or group > min(r, n_pad // streams):
        raise ValueError(f"streams*2N={rows} must be a power of two and {group=} <= rows, N")
    if r & (r - 1):  # Triton blocks are powers of two; rows past `group` are never read
        x = jnp.pad(x, ((0, 0), (0, 0), (0, (1 << (r - 1).bit_length()) - r), (0, 0)))
        r = x.shape[2]
    kernel = functools.partial(
        _query_prologue_kernel, group=group, scale_log2=float(scale_log2), n_pad=n_pad,
        streams=streams, has_mat=mat is not None, has_qg=group_pad is not None,
    )  # fmt: skip
    in_specs = [pl.BlockSpec((None, None, r, d), lambda bi, h: (bi, h, 0, 0))]
    operands = [x]
    if mat is not None:
        in_specs.append(pl.BlockSpec((None, d, d), lambda bi, h: (h, 0, 0)))
        operands.append(mat)
    out_specs = [
        pl.BlockSpec((None, None, rows, d), lambda bi, h: (bi, h, 0, 0)),
        pl.BlockSpec((None, None, _COPY_WORDS), lambda bi, h: (bi, h, 0)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((b, hkv, rows, d), jnp.int8),
        jax.ShapeDtypeStruct((b, hkv, _COPY_WORDS), jnp.float32),
    ]
    if group_pad is not None:
        out_specs.insert(0, pl.BlockSpec((None, None, group_pad, d), lambda bi, h: (bi, h, 0, 0)))
        out_shape.insert(0, jax.ShapeDtypeStruct((b, hkv, group_pad, d), jnp.float32))
    return pl.pallas_call(
        kernel,
        grid=(b, hkv),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        # 8 warps: a [d, d] float32 transform is 64 registers a thread at d = 128.
        compiler_params=plgpu_triton.CompilerParams(
            num_warps=8 if mat is not None else 4, num_stages=1
        ),
        interpret=interpret,
        name="paged_decode_query_prologue" if mat is not None else "paged_decode_query_operands",
    )(*operands)


def query_operands_s8(
    qg: jax.Array,  # f32[B, Hkv, Gp, d] transformed-frame queries
    *,
    group: int,
    scale_log2: float,
    n_pad: int,
    streams: int,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """`query_operands` (s8 keys) as one Pallas Triton kernel, one program per (sequence, KV
    head): at batch 1 XLA spends five small kernels on it (run 90: ~7 us of a 43.5 us call at
    1 x 64k)."""
    b, hkv = qg.shape[:2]
    qs, qmeta = _prologue_call(
        qg, None, group=group, group_pad=None, scale_log2=scale_log2, n_pad=n_pad,
        streams=streams, interpret=interpret,
    )  # fmt: skip
    return qs.reshape(b, hkv, streams, 2 * n_pad, qg.shape[-1]), qmeta


# The fused prologue's program holds the whole [d, d] float32 transform in registers: at most
# this head size (64 registers a thread at d = 128 with 8 warps). Run 105 measured the transform
# and row picks as float32 Triton dots at HIGHEST instead: 142 us at 8 x 32k against 7.8.
FUSED_PROLOGUE_MAX_DIM = 128


def query_prologue(
    q: jax.Array,  # [B, Hkv, group, d] one query row per query head, original frame, any float
    query_transform: jax.Array | None,  # f32[Hkv, d, d] or None (identity)
    *,
    group_pad: int,
    scale_log2: float,
    n_pad: int,
    streams: int,
    key_operand: str = "s8",
    interpret: bool = False,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """The transformed-frame queries ``qg`` f32[B, Hkv, group_pad, d] (rows past the group
    zero; the sink/recent kernel's operand) and the split kernel's ``(qs, qmeta)``
    (`query_operands`) from the queries as they come. With s8 keys and ``d`` up to
    `FUSED_PROLOGUE_MAX_DIM`, one Pallas Triton kernel per (sequence, KV head) does the
    float32 convert, the padding, the query transform and the 8-bit split (`prologue`
    ``"fused"``: at 8 x 32k on the H100 these were three kernels, 8.6 us of a ~100 us call,
    run 102); otherwise the same in XLA ops, `gpu_triton.head_matmul` and
    `query_operands_s8`/`query_operands`."""
    b, hkv, group, d = q.shape
    if key_operand == "s8" and d <= FUSED_PROLOGUE_MAX_DIM:
        qg, qs, qmeta = _prologue_call(
            q, query_transform, group=group, group_pad=group_pad, scale_log2=scale_log2,
            n_pad=n_pad, streams=streams, interpret=interpret,
        )  # fmt: skip
        return qg, (qs.reshape(b, hkv, streams, 2 * n_pad, d), qmeta)
    qg = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, 0), (0, group_pad - group), (0, 0)))
    if query_transform is not None:
        qg = gpu_triton.head_matmul(qg, query_transform, interpret=interpret)
    kw = dict(group=group, scale_log2=scale_log2, n_pad=n_pad, streams=streams)
    if key_operand == "s8":
        return qg, query_operands_s8(qg, **kw, interpret=interpret)
    return qg, query_operands(qg, **kw, key_operand=key_operand)


_REDUCTION_SCRATCH = 2048  # cross-warp max/sum over the token axis of a [tile, N] f32 tile


def _kernel(
    q_gmem,  # f16[B, Hkv, streams, N, d] transformed query, times scale_log2, per stream
    # (s8 keys: int8[B, Hkv, streams, 2N, d], the high parts in rows [0, N), the low in [N, 2N))
    qmeta_gmem,  # f32[B, Hkv, 32]: s8 keys' query scale per column, then sum(q) per column
    kc_gmem,  # u8[P, Hkv, page, W]
    vc_gmem,  # u8[P, Hkv, page, W] or [P, Hkv, d, page / n] (dims)
    ks_gmem,  # f16[P, Hkv, page]
    kz_gmem,
    vs_gmem,
    vz_gmem,
    tab_gmem,  # i32[B, S, rows, 32]: pages of the split, then its valid-token count
    acc_gmem,  # f32[B, Hkv, S, N, d]
    m_gmem,  # f32[B, Hkv, S, N]
    l_gmem,  # f32[B, Hkv, S, N]
    q_smem,
    qmeta_smem,
    tab_smem,
    ring,  # the loop's buffers, aliased with the epilogue's f32[N, d] output tile
    v16_smem,
    vec_smem,
    bar_in,
    bars,
    *,
    k_bits: int,
    v_bits: int,
    meta_u8: bool,
    page: int,
    pages_per_split: int,
    tile: int,
    stage: str,
    value_layout: str,
    code_copy: str,
    asm: bool,
    overlap: str,
    mask: str,
    key_operand: str,
    value_operand: str,
):
    # k [STAGES, tile, W]; v [STAGES, tile, d / n_v] or [STAGES, d, tile / n_v]; meta
    # f16|u8[4, STAGES, tile] (k scale, k zero, v scale, v zero); p^T f16[N, tile] (e4m3
    # values: f8[parts * N, tile], the high parts of the weights in rows [0, N), the low
    # parts' in [N, 2N)).
    (k_smem, v_smem, meta_smem, pt_smem), out_smem = ring
    bi = lax.axis_index("b")
    h = lax.axis_index("h")
    si = lax.axis_index("s")
    # q_smem [n, streams, N, W]: per plane and token stream, the query block whose rows are
    # the stream's columns (the other rows zero).
    # s8 keys: q_smem [d / 64, streams, 2N, 64], each K = 64 dims block of the high and low
    # parts of every stream's query.
    s8 = key_operand == "s8"
    f8v = value_operand != "f16"
    width = k_smem.shape[-1]  # code bytes per key row
    if s8:
        n_blocks, streams, npad, _ = q_smem.shape
        npad //= 2
        d = n_blocks * _S8_K
    else:
        n_planes, streams, npad, width = q_smem.shape
        d = n_planes * width
    rows = tile // streams  # accumulator rows: token r of every stream
    gcol = npad // streams  # columns of one stream
    v_width = d // layout.codes_per_byte(v_bits)
    tiles_per_page = page // tile
    block = _S8_K if s8 else width
    for p in range(q_smem.shape[0]):  # plane (or s8 block) p: the query's dims [p W, (p + 1) W)
        for t in range(streams):
            plgpu.copy_gmem_to_smem(
                q_gmem.at[bi, h, t, :, pl.ds(p * block, block)], q_smem.at[p, t], bar_in.at[0]
            )
    plgpu.copy_gmem_to_smem(qmeta_gmem.at[bi, h], qmeta_smem, bar_in.at[0])
    plgpu.copy_gmem_to_smem(tab_gmem.at[bi, si], tab_smem, bar_in.at[0])

    plgpu.barrier_wait(bar_in.at[0])

    def table(i):  # the table row is [rows, 32]: a TMA box is at most 256 wide per dimension
        return tab_smem[i // _COPY_WORDS, lax.rem(i, _COPY_WORDS)]

    count = table(pages_per_split)
    n_steps = (count + tile - 1) // tile

    # A copy that promises in-bounds slices of contiguous bytes into an unswizzled tile is a
    # plain bulk copy (no tensor map); the default zero-fill needs the tensor-map copy.
    copy = plgpu.copy_gmem_to_smem
    if code_copy == "bulk":
        copy = functools.partial(copy, oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)

    def issue(step, slot):
        pg = table(step // tiles_per_page)
        rows = pl.ds(lax.rem(step, tiles_per_page) * tile, tile)
        bar = bars.at[slot]
        copy(kc_gmem.at[pg, h, rows], k_smem.at[slot], bar)
        if value_layout == "dims":  # one tile per page: the whole [d, page / n] block
            copy(vc_gmem.at[pg, h], v_smem.at[slot], bar)
        else:
            copy(vc_gmem.at[pg, h, rows], v_smem.at[slot], bar)
        if stage == "loads_codes":  # attribution: the code tiles' copies alone
            return
        for r, src in enumerate((ks_gmem, kz_gmem, vs_gmem, vz_gmem)):
            copy(src.at[pg, h, rows], meta_smem.at[r, slot], bar)

    for st in range(STAGES - 1):
        pl.when(st < n_steps)(functools.partial(issue, st, st))

    row = plgpu.Layout.WGMMA.reduce(1)  # a value per token row
    col = plgpu.Layout.WGMMA.reduce(0)  # a value per query column

    def query_sums(acc_ref):  # sum(q) per column on the tensor cores: a ones tile @ q^T
        ones = plgpu.layout_cast(jnp.full((TILE, width), 1.0, jnp.float16), plgpu.Layout.WGMMA)
        for p in range(n_planes):
            for t in range(streams):
                plgpu.wgmma(acc_ref, ones, plgpu.transpose_ref(q_smem.at[p, t], (1, 0)))
        return acc_ref[...]

    if s8:  # the wrapper's sums of the reconstructed query (`split_query_s8`)
        q_scale = plgpu.load(qmeta_smem.at[pl.ds(0, npad)], (), layout=col)
        qsum = plgpu.load(qmeta_smem.at[pl.ds(npad, npad)], (), layout=col)
    else:  # every row holds the same sums of the float16 query the key MMAs read
        qsum = pl.run_scoped(query_sums, plgpu.ACC((TILE, npad), jnp.float32)).max(axis=0)
    shape = (rows, npad)
    bcast_row = functools.partial(lax.broadcast_in_dim, shape=shape, broadcast_dimensions=[0])
    bcast_col = functools.partial(lax.broadcast_in_dim, shape=shape, broadcast_dimensions=[1])
    # Which stream a column belongs to (a function of the lane: no per-step cost).
    col_stream = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA) // gcol
    row_tok = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
    tok_in_step = row_tok + col_stream * rows  # the token of element (r, c) within a step

    def per_element(vectors):  # one [rows] vector per stream -> [rows, N]
        out = bcast_row(vectors[0])
        for t in range(1, streams):
            out = jnp.where(col_stream == t, bcast_row(vectors[t]), out)
        return out

    def planes(tile_ref, bits):
        w = plgpu.load(tile_ref, (), layout=plgpu.Layout.WGMMA)
        if asm:
            return _planes_asm(w, bits)
        n = layout.codes_per_byte(bits)
        return [_plane_to_f16(w.astype(jnp.int16), i, bits) for i in range(n)]

    def meta(r, slot, fn=None):  # r: 0 k scale, 1 k zero, 2 v scale, 3 v zero; [rows, N]
        vectors = []
        for t in range(streams):
            stored = plgpu.load(meta_smem.at[r, slot, pl.ds(t * rows, rows)], (), layout=row)
            if not meta_u8:
                vectors.append(stored.astype(jnp.float32))
            # The 8-bit encoding decodes with integer ops and a bitcast (layout.py): the
            # same float32 the reference reconstructs.
            elif r % 2 == 0:
                vectors.append(layout.decode_scale(stored))
            else:
                vectors.append(layout.decode_zero(stored, k_bits if r < 2 else v_bits))
        if fn is not None:  # per token, before the broadcast to [rows, N]
            vectors = [fn(v) for v in vectors]
        return per_element(vectors)

    def step(i, carry, acc_ref, masked):
        m_i, l_i, zc, pending = carry
        slot = lax.rem(i, STAGES)
        nxt = i + STAGES - 1

        @pl.when(nxt < n_steps)
        def _next():
            issue(nxt, lax.rem(nxt, STAGES))

        plgpu.barrier_wait(bars.at[slot])
        if stage in ("loads", "loads_codes"):  # the TMA ring alone: what the copies cost
            return carry
        if overlap == "copies":  # the previous step's value MMAs, before the key planes
            plgpu.wgmma_wait(0)

        def keys(acc_ref):  # stream t's tokens against its query block
            for t in range(streams):
                tokens = k_smem.at[slot, pl.ds(t * rows, rows)]
                for p, plane in enumerate(planes(tokens, k_bits)):
                    plgpu.wgmma(acc_ref, plane, plgpu.transpose_ref(q_smem.at[p, t], (1, 0)))
            return acc_ref[...]  # waits for every MMA in flight

        def keys_s8(acc_ref):  # [rows, 2N] int32: high parts' sums, then the low parts'
            for t in range(streams):
                tokens = k_smem.at[slot, pl.ds(t * rows, rows)]
                codes = plgpu.load(tokens, (), layout=plgpu.Layout.WGMMA_8BIT)
                for g, plane in enumerate(_planes_s8(codes, k_bits)):
                    plgpu.wgmma(acc_ref, plane, plgpu.transpose_ref(q_smem.at[g, t], (1, 0)))
            return acc_ref[...]

        if s8:
            sums = pl.run_scoped(keys_s8, plgpu.ACC((rows, 2 * npad), jnp.int32))
            sums = sums.astype(jnp.float32)
            hi, lo = sums[:, :npad], sums[:, npad:]
            raw = (hi + lo * (1.0 / _LO)) * bcast_col(q_scale)
        else:
            raw = pl.run_scoped(keys, plgpu.ACC(shape, jnp.float32))
        ks, kz = meta(0, slot), meta(1, slot)
        logits = ks * (raw - kz * bcast_col(qsum))
        if masked:  # the split's last step: tokens past `count` (their pages may hold NaN)
            valid = tok_in_step + i * tile < count
            logits = jnp.where(valid, logits, da.NEG_INF)
        vs, vz = meta(2, slot), meta(3, slot)
        if f8v:
            # The running max of logits + log2(s_v), 8 below: every weight p * s_v is then
            # at most 2^8, inside e4m3's normal range (max 448), with no reduction of its own.
            # p itself may exceed 1 (the denominator is float32).
            lvs = meta(2, slot, lambda v: jnp.log2(jnp.maximum(v, _F8_MIN_SCALE)))
            shifted = logits + lvs
            if masked:
                shifted = jnp.where(valid, shifted, da.NEG_INF)
            m_new = jnp.maximum(m_i, shifted.max(axis=0) - _F8_HEADROOM)
        else:
            m_new = jnp.maximum(m_i, logits.max(axis=0))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(logits - bcast_col(m_new))
        pv = p * vs
        if masked:
            pv = jnp.where(valid, pv, 0.0)
        pvz = pv * vz
        if masked:
            pvz = jnp.where(valid, pvz, 0.0)
        # [tile, N] tiles, reduced over tokens once after the loop: a cross-warp reduction
        # per step costs (run 20: 1.28 vs 1.04 ms at 8 x 128k with both sums per step).
        l_i = l_i * bcast_col(alpha) + p
        zc = zc * bcast_col(alpha) + pvz
        if stage == "keys":  # no value product
            return m_new, l_i, zc, pending
        if f8v:
            return m_new, l_i, zc, values_f8(slot, pv, alpha, pending, acc_ref)
        if stage == "no_value_operand":
            pass
        elif value_layout == "dims":
            # Planes of the [d, tile / n] tile are [d, tile / n] register operands over
            # tokens [c * tile / n, (c + 1) * tile / n): nothing goes through shared memory
            # but the probabilities.
            v_planes = planes(v_smem.at[slot], v_bits)
        else:
            for c, plane in enumerate(planes(v_smem.at[slot], v_bits)):
                v16_smem.at[:, pl.ds(c * v_width, v_width)][...] = plane
        # Stream t's tokens are columns [t rows, (t + 1) rows) of p^T, nonzero only in the
        # stream's rows. Two lanes swap halves of their 2x2 blocks (one shuffle per
        # register) so the tile stores transposed.
        for t in range(streams if stage != "no_pt_store" else 0):
            part = pv if streams == 1 else jnp.where(col_stream == t, pv, 0.0)
            pt = plgpu.layout_cast(part.astype(jnp.float16), plgpu.Layout.WGMMA_TRANSPOSED)
            plgpu.transpose_ref(pt_smem.at[:, pl.ds(t * rows, rows)], (1, 0))[...] = pt
        if stage != "no_pt_store":
            plgpu.commit_smem()  # the MMA reads what the warpgroup wrote; the slot may be refilled
        # Reading the accumulator waits for every MMA in flight: with overlap="values" the
        # previous step's value MMAs ran under this step's loads, key unpack and key MMAs.
        if stage != "no_rescale":
            acc_ref[...] = acc_ref[...] * lax.broadcast_in_dim(alpha, (d, npad), [1])
        p_ref = plgpu.transpose_ref(pt_smem, (1, 0))  # [tile, N]
        if stage == "no_value_operand":
            pass
        elif value_layout == "dims":
            kb = tile // len(v_planes)
            if stage == "half_value_mma":  # every plane stays live: pairs summed
                half = len(v_planes) // 2
                v_planes = [v_planes[j] + v_planes[j + half] for j in range(half)]
            for c, plane in enumerate(v_planes):
                plgpu.wgmma(acc_ref, plane, p_ref.at[pl.ds(c * kb, kb)])
        else:
            plgpu.wgmma(acc_ref, plgpu.transpose_ref(v16_smem, (1, 0)), p_ref)
        if overlap == "none":
            plgpu.wgmma_wait(0)
        return m_new, l_i, zc, pending

    parts = 2 if value_operand == "e4m3x2" else 1

    def fold(acc_f, acc_ref):  # acc_f + one step's sums (its high and low parts' columns)
        sums = acc_ref[...]  # waits for the value MMAs in flight
        acc_f = acc_f + sums[:, :npad]
        if parts == 2:
            acc_f = acc_f + sums[:, npad:] * (1.0 / _F8_LO_GAIN)
        return acc_f

    def values_f8(slot, pv, alpha, pending, acc_ref):
        """e4m3 values: the step's weights ``p * s_v`` (at most 2^8) as e4m3 high parts and,
        with ``"e4m3x2"``, the e4m3 rounding of what the high part leaves (times
        `_F8_LO_GAIN`; ~2^-10 relative RMS together), stored transposed; the value code
        planes read as e4m3 (``c * 2^-9``) are the register A operand of K = 64 tokens, half
        the MMAs of float16 planes. Each step's products go to a fresh MMA accumulator that
        the next step folds into the float32 one (``pending``) after its key MMAs, so the
        value MMAs still run under them and the sum over a split never rests on the tensor
        cores' FP8 accumulation."""
        w16 = pv.astype(jnp.float16)
        hi16 = w16.astype(jnp.float8_e4m3fn).astype(jnp.float16)  # exact in float16
        split = [hi16, (w16 - hi16) * jnp.float16(_F8_LO_GAIN)][:parts]
        for j, part in enumerate(split):
            for t in range(streams):
                part_t = part if streams == 1 else jnp.where(col_stream == t, part, 0.0)
                # Mosaic GPU casts 8-bit arrays to no other layout: transpose in float16.
                pt = plgpu.layout_cast(part_t, plgpu.Layout.WGMMA_TRANSPOSED)
                dst = pt_smem.at[pl.ds(j * npad, npad), pl.ds(t * rows, rows)]
                plgpu.transpose_ref(dst, (1, 0))[...] = pt.astype(jnp.float8_e4m3fn)
        plgpu.commit_smem()
        pending = fold(pending, acc_ref) * lax.broadcast_in_dim(alpha, (d, npad), [1])
        acc_ref[...] = plgpu.layout_cast(
            jnp.zeros((d, parts * npad), jnp.float32), plgpu.Layout.WGMMA
        )
        codes = plgpu.load(v_smem.at[slot], (), layout=plgpu.Layout.WGMMA_8BIT)
        for g, plane in enumerate(_planes_s8(codes, v_bits, jnp.float8_e4m3fn)):
            p_ref = plgpu.transpose_ref(pt_smem.at[:, pl.ds(g * _S8_K, _S8_K)], (1, 0))
            plgpu.wgmma(acc_ref, plane, p_ref)
        if overlap == "none":
            plgpu.wgmma_wait(0)
        return pending

    wgmma_layout = plgpu.Layout.WGMMA
    carry = (
        plgpu.layout_cast(jnp.full((npad,), da.NEG_INF, jnp.float32), col),
        plgpu.layout_cast(jnp.zeros(shape, jnp.float32), wgmma_layout),
        plgpu.layout_cast(jnp.zeros(shape, jnp.float32), wgmma_layout),
        plgpu.layout_cast(jnp.zeros((d, npad), jnp.float32), wgmma_layout) if f8v else (),
    )

    # Only a step that reaches past `count` masks its tokens (mask="last"): the others skip
    # the iota, compare and three selects per element. mask="every" is the twin that masks all.
    n_full = n_steps if mask == "every" else count // tile

    def loop(acc_ref):  # the value accumulator stays an MMA accumulator across steps
        body = functools.partial(step, acc_ref=acc_ref)
        out = lax.fori_loop(0, n_full, functools.partial(body, masked=mask == "every"), carry)
        out = lax.fori_loop(n_full, n_steps, functools.partial(body, masked=True), out)
        m_i, l_i, zc, pending = out
        if f8v:  # the last step's sums; the planes' 2^-9
            return fold(pending, acc_ref) * _F8_CODE_INV, m_i, l_i, zc
        return acc_ref[...], m_i, l_i, zc

    acc_cols = (2 if value_operand == "e4m3x2" else 1) * npad if f8v else npad
    acc, m_i, l_i, zc = pl.run_scoped(loop, plgpu.ACC((d, acc_cols), jnp.float32))
    l_i, zc = l_i.sum(axis=0), zc.sum(axis=0)
    # Every TMA write and MMA read of the ring has completed: the output tile may reuse it.
    store_rows(out_smem, acc - lax.broadcast_in_dim(zc, (d, npad), [1]))
    vec_smem.at[0][...] = m_i
    vec_smem.at[1][...] = l_i
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, acc_gmem.at[bi, h, si])
    plgpu.copy_smem_to_gmem(vec_smem.at[0], m_gmem.at[bi, h, si])
    plgpu.copy_smem_to_gmem(vec_smem.at[1], l_gmem.at[bi, h, si])
    plgpu.wait_smem_to_gmem(0)


def auto_overlap(programs: int) -> str:
    """The MMA schedule ``overlap="auto"`` picks for a grid of ``programs``: "copies" (three
    resident CTAs per SM) where there are programs for a third, else "values"."""
    return "copies" if programs > RESIDENT_PROGRAMS_VALUES else "values"


def _split_rows(tab: jax.Array, lens: jax.Array, page: int, row_pages: int) -> jax.Array:
    """i32[B, S, rows, 32] table rows for the kernels: split s's pages (``tab`` i32[B, S,
    pps], zero-padded to ``row_pages``), then its valid-token count at index ``row_pages``."""
    b, s, pps = tab.shape
    start = jnp.arange(s, dtype=jnp.int32)[None, :] * (pps * page)
    count = jnp.clip(lens[:, None] - start, 0, pps * page)  # [B, S]
    row = -(-(row_pages + 1) // _COPY_WORDS) * _COPY_WORDS
    parts = [tab, jnp.zeros((b, s, row_pages - pps), jnp.int32), count[..., None]]
    parts.append(jnp.zeros((b, s, row - row_pages - 1), jnp.int32))
    return jnp.concatenate(parts, axis=-1).reshape(b, s, row // _COPY_WORDS, _COPY_WORDS)


def store_rows(out_smem, acc: jax.Array) -> None:
    """Stores a split's f32[d, N] accumulator (MMA layout) as its f32[N, d] output tile: one
    query column per row, so with token streams the partial arrays are already split rows
    (`rows_of_columns`) and no transpose runs after the kernel (2.2 us at 8 x 32k, run 104).
    Lanes swap halves of their 2x2 blocks first, as for the probabilities' tile."""
    acc = plgpu.layout_cast(acc, plgpu.Layout.WGMMA_TRANSPOSED)
    plgpu.transpose_ref(out_smem, (1, 0))[...] = acc


def _split_call(kernel, scratch: dict, shape: tuple[int, ...], *, auto_barriers: bool = False):
    """The `plgpu.kernel` of a split kernel: grid (B, Hkv, S), outputs acc f32[B, Hkv, S, N, d]
    and m, l f32[B, Hkv, S, N] (``shape`` = (B, Hkv, S, N, d)).

    Without auto barriers Pallas puts no warpgroup barrier before each TMA copy. Safe in both
    kernels: a slot is refilled only after its last reads, and every step ends in
    `commit_smem` (a warpgroup barrier); no thread reads what it wrote."""
    b, hkv, s, n_pad, d = shape
    params = plgpu.CompilerParams(
        unsafe_no_auto_barriers=not auto_barriers,
        reduction_scratch_bytes=_REDUCTION_SCRATCH,
        approx_math=True,
    )
    vec = jax.ShapeDtypeStruct((b, hkv, s, n_pad), jnp.float32)
    return plgpu.kernel(
        kernel,
        compiler_params=params,
        out_type=(jax.ShapeDtypeStruct(shape, jnp.float32), vec, vec),
        grid=(b, hkv, s),
        grid_names=("b", "h", "s"),
        scratch_types=scratch,
    )


def lowbit_partials(
    qg: jax.Array,  # f32[B, Hkv, Gp, d] transformed-frame queries (any Gp <= GROUP_PAD)
    lowbit_set: tuple,  # (kc, vc, ks, kz, vs, vz, table i32[B, S, pps], len i32[B])
    *,
    bits: int,
    scale_log2: float,
    group: int,
    bits_v: int | None = None,
    stage: str = "full",
    value_layout: str = "tokens",
    auto_barriers: bool = False,
    code_copy: str = "auto",
    int_to_float: str = "s8",
    overlap: str = "auto",
    mask: str = "last",
    n_pad: int | None = None,
    streams: int | None = None,
    columns: bool = False,
    prologue: str = PROLOGUES[0],
    operands: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Split partials over the low-bit pages: (acc f32[B,Hkv,S',group,d], m, l f32[B,Hkv,S',group]),
    ``S' = S * streams``.

    ``acc`` is unnormalised and in the transformed frame; ``m``/``l`` are base-2 running max
    and denominator, as the Triton body returns them. ``bits`` is the keys' width, ``bits_v``
    the values' (default: the same); scale/zero may be float16 or the 8-bit encoding
    (`layout.META_U8`, decoded in the kernel; 128-token pages). ``columns``: the kernel's own
    layout instead, the query rows padded to ``N`` (acc f32[B,Hkv,S,N,d], m, l
    f32[B,Hkv,S,N]). ``n_pad``: that ``N`` (default `NARROW_PAD` for groups of up to 8, else
    `GROUP_PAD`; 16 is the twin the tests compare the narrow tiles against). ``streams``:
    token streams on the MMA columns (`STREAMS`; default 2 where a step holds 128 tokens and
    the group fits half of ``N``), each with its own softmax state: a partial of its own,
    split ``s`` stream ``t`` is row ``s * streams + t`` of ``S'``; in the ``columns`` layout
    column ``t * N / streams + g``.
    ``int_to_float``: `INT_TO_FLOAT` ("s8": keys as 8-bit integer MMA operands).
    ``prologue``: `PROLOGUES` (how the query operands are built from ``qg``: XLA ops, or with
    s8 keys the `query_operands_s8` kernel; ``"fused"`` takes the latter here).
    ``operands``: ``(qs, qmeta)`` already built from ``qg`` (`query_prologue`), or None.
    """
    kc, vc, ks, kz, vs, vz, tab, lens = lowbit_set
    b, hkv, gp, d = qg.shape
    bits_v = bits if bits_v is None else bits_v
    n = layout.codes_per_byte(bits)
    width = d // n
    page = kc.shape[2]
    s, pps = tab.shape[1], tab.shape[2]
    for name, w in (("bits", bits), ("bits_v", bits_v)):
        if not supports(
            head_dim=d, bits=w, group_size=d // ks.shape[-1], group=group, page_size=page
        ):
            raise ValueError(
                f"unsupported by the Mosaic GPU body: {d=} {name}={w} {page=} {group=}"
            )
    meta_dtypes = {a.dtype for a in (ks, kz, vs, vz)}
    meta_u8 = jnp.dtype(jnp.uint8) in meta_dtypes
    if meta_u8 and (len(meta_dtypes) > 1 or page % MAX_TILE):
        # A tile's metadata row is one TMA copy of a multiple of 128 bytes.
        raise ValueError(
            f"8-bit scale/zero needs all four in uint8 and {MAX_TILE}-token pages, got "
            f"{sorted(str(t) for t in meta_dtypes)} and {page=}"
        )
    if stage not in STAGES_KINDS:
        raise ValueError(f"stage={stage!r} must be one of {STAGES_KINDS}")
    if code_copy not in CODE_COPIES:
        raise ValueError(f"code_copy={code_copy!r} must be one of {CODE_COPIES}")
    if int_to_float not in INT_TO_FLOAT:
        raise ValueError(f"int_to_float={int_to_float!r} must be one of {INT_TO_FLOAT}")
    if overlap not in (*OVERLAPS, "auto"):
        raise ValueError(f"overlap={overlap!r} must be 'auto' or one of {OVERLAPS}")
    if mask not in MASKS:
        raise ValueError(f"mask={mask!r} must be one of {MASKS}")
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue={prologue!r} must be one of {PROLOGUES}")
    key_operand = "s8" if int_to_float.startswith("s8") else "f16"
    # Value codes become e4m3 operands where they are dimension-major (a register operand).
    value_operand = "f16"
    if int_to_float in ("s8_e4m3x2", "s8_e4m3") and value_layout == "dims":
        value_operand = int_to_float[3:]
    if value_operand != "f16" and stage not in ("full", "keys", "loads", "loads_codes"):
        raise ValueError(f"stage={stage!r} is a float16-value attribution row; {int_to_float=}")
    n_pad, streams = mma_columns(group, page, n_pad, streams)
    if overlap == "auto":
        overlap = auto_overlap(b * hkv * s)
    tile = MAX_TILE if page % MAX_TILE == 0 else TILE
    if operands is not None:
        qs, qmeta = operands
    elif prologue != "xla" and key_operand == "s8":
        qs, qmeta = query_operands_s8(
            qg, group=group, scale_log2=scale_log2, n_pad=n_pad, streams=streams
        )
    else:
        qs, qmeta = query_operands(
            qg, group=group, scale_log2=scale_log2, n_pad=n_pad, streams=streams,
            key_operand=key_operand,
        )  # fmt: skip
    # Valid tokens of split s: the split owns pages [s*pps, (s+1)*pps).
    tab_ext = _split_rows(tab, lens, page, pps)
    metas = [a.reshape(a.shape[:3]) for a in (ks, kz, vs, vz)]  # [P, Hkv, page]
    meta_dtype = jnp.uint8 if meta_u8 else jnp.float16
    if any(a.dtype != meta_dtype for a in metas):
        metas = [a.astype(meta_dtype) for a in metas]

    n_v = layout.codes_per_byte(bits_v)
    v_cols = tile // n_v if value_layout == "dims" else d // n_v
    if code_copy == "auto":
        code_copy = "bulk" if (width, v_cols) == (32, 32) else "tma"
    if code_copy == "bulk" and (width, v_cols) != (32, 32):
        # jax 0.10.2 finds no bank-conflict-free register load of wider unswizzled rows
        # (0.11.2 ran 64-byte rows correctly in run 42; 32-byte rows are what was timed).
        raise ValueError(f"code_copy='bulk' needs 32-byte code rows, got {width} and {v_cols}")
    if value_layout == "dims" and tile != page:
        raise ValueError(f"value_layout='dims' needs {MAX_TILE}-token pages, got {page=}")

    def code_tiles(rows, cols):
        tf = _swizzled(cols, 8) if code_copy == "tma" else ()
        return plgpu.SMEM((STAGES, rows, cols), jnp.uint8, transforms=tf)

    if value_layout == "dims":
        v_smem = code_tiles(d, v_cols)
        v16_smem = plgpu.SMEM((8, 8), jnp.float16)  # unused
    else:
        v_smem = code_tiles(tile, v_cols)
        # Read transposed by the MMA beside the probabilities: the same swizzle.
        v16_smem = plgpu.SMEM((tile, d), jnp.float16, transforms=_swizzled(P_SWIZZLE))
    kernel = functools.partial(
        _kernel,
        k_bits=bits,
        v_bits=bits_v,
        meta_u8=meta_u8,
        page=page,
        pages_per_split=pps,
        tile=tile,
        stage=stage,
        value_layout=value_layout,
        code_copy=code_copy,
        asm=int_to_float != "exponent",
        overlap=overlap,
        mask=mask,
        key_operand=key_operand,
        value_operand=value_operand,
    )
    ring = plgpu.RefUnion(
        (
            code_tiles(tile, width),
            v_smem,
            plgpu.SMEM((4, STAGES, tile), meta_dtype),
            (
                plgpu.SMEM(
                    ((2 if value_operand == "e4m3x2" else 1) * n_pad, tile),
                    jnp.float8_e4m3fn,
                    transforms=_swizzled(_S8_K, 8),
                )
                if value_operand != "f16"
                else plgpu.SMEM((n_pad, tile), jnp.float16, transforms=_swizzled(P_SWIZZLE))
            ),
        ),
        plgpu.SMEM((n_pad, d), jnp.float32),
    )
    scratch = dict(
        q_smem=(
            plgpu.SMEM(
                (d // _S8_K, streams, 2 * n_pad, _S8_K), jnp.int8, transforms=_swizzled(_S8_K, 8)
            )
            if key_operand == "s8"
            else plgpu.SMEM(
                (n, streams, n_pad, width), jnp.float16, transforms=_swizzled(2 * width)
            )
        ),
        qmeta_smem=plgpu.SMEM((_COPY_WORDS,), jnp.float32),
        tab_smem=plgpu.SMEM(tab_ext.shape[2:], jnp.int32),
        ring=ring,
        v16_smem=v16_smem,
        vec_smem=plgpu.SMEM((2, n_pad), jnp.float32),
        bar_in=plgpu.Barrier(
            num_arrivals=(d // _S8_K if key_operand == "s8" else n) * streams + 2, num_barriers=1
        ),
        bars=plgpu.Barrier(num_arrivals=2 if stage == "loads_codes" else 6, num_barriers=STAGES),
    )
    acc, m, l = _split_call(kernel, scratch, (b, hkv, s, n_pad, d), auto_barriers=auto_barriers)(
        qs, qmeta, kc, vc, *metas, tab_ext
    )
    if columns:
        return acc, m, l
    acc, m, l = rows_of_columns(acc, m, l, streams=streams, group=group)
    return acc, m[..., :group], l[..., :group]


# ------------------------------------------------------------------------------------------
# Full-precision (BF16) pages on the same design: tokens as the MMA's M, the key tile the
# shared-memory A operand against the query, the value tile read transposed as the A operand
# of O^T = V^T p. No scales, zero points or transforms.
# ------------------------------------------------------------------------------------------
FP_STAGES = 3  # ring depth of the BF16 body (two [64, d] tiles per slot: 32 KB at d = 128)


def _fp_kernel(
    q_gmem,  # bf16[B, Hkv, N, d] query, times scale_log2, group padded to N
    k_gmem,  # bf16[P, Hkv, page, d]
    v_gmem,
    tab_gmem,  # i32[B, S, rows, 32]: pages of the split (padded to whole steps), then its count
    acc_gmem,  # f32[B, Hkv, S, N, d]
    m_gmem,  # f32[B, Hkv, S, N]
    l_gmem,
    q_smem,
    tab_smem,
    ring,  # ((k, v [STAGES, TILE, d], p^T [N, TILE]), the epilogue's f32[N, d] tile)
    vec_smem,
    bar_in,
    bars,
    *,
    page: int,
    pages_per_split: int,
    stages: int,
):
    (k_smem, v_smem, pt_smem), out_smem = ring
    bi = lax.axis_index("b")
    h = lax.axis_index("h")
    si = lax.axis_index("s")
    npad, d = q_smem.shape
    per_step = TILE // page  # pages per 64-token step
    plgpu.copy_gmem_to_smem(q_gmem.at[bi, h], q_smem, bar_in.at[0])
    plgpu.copy_gmem_to_smem(tab_gmem.at[bi, si], tab_smem, bar_in.at[0])
    plgpu.barrier_wait(bar_in.at[0])

    def table(i):
        return tab_smem[i // _COPY_WORDS, lax.rem(i, _COPY_WORDS)]

    count = table(pages_per_split)
    n_steps = (count + TILE - 1) // TILE

    def issue(step, slot):
        for j in range(per_step):
            pg = table(step * per_step + j)
            rows = pl.ds(j * page, page)
            plgpu.copy_gmem_to_smem(k_gmem.at[pg, h], k_smem.at[slot, rows], bars.at[slot])
            plgpu.copy_gmem_to_smem(v_gmem.at[pg, h], v_smem.at[slot, rows], bars.at[slot])

    for st in range(stages - 1):
        pl.when(st < n_steps)(functools.partial(issue, st, st))

    col = plgpu.Layout.WGMMA.reduce(0)
    shape = (TILE, npad)
    bcast_col = functools.partial(lax.broadcast_in_dim, shape=shape, broadcast_dimensions=[1])
    row_tok = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)

    def step(i, carry, acc_ref, masked):
        m_i, l_i = carry
        slot = lax.rem(i, stages)
        plgpu.barrier_wait(bars.at[slot])

        def keys(ref):
            plgpu.wgmma(ref, k_smem.at[slot], plgpu.transpose_ref(q_smem, (1, 0)))
            return ref[...]  # waits for every MMA in flight, the previous step's value MMAs too

        logits = pl.run_scoped(keys, plgpu.ACC(shape, jnp.float32))
        # Only now is the slot the previous step's value MMAs read free: refill it.
        nxt = i + stages - 1

        @pl.when(nxt < n_steps)
        def _next():
            issue(nxt, lax.rem(nxt, stages))

        if masked:  # tokens past `count`: unused slots may hold NaN, in keys and values
            valid = row_tok + i * TILE < count
            logits = jnp.where(valid, logits, da.NEG_INF)
            vt = plgpu.load(v_smem.at[slot], (), layout=plgpu.Layout.WGMMA)
            tok = plgpu.broadcasted_iota(jnp.int32, vt.shape, 0, layout=plgpu.Layout.WGMMA)
            v_smem.at[slot][...] = jnp.where(tok + i * TILE < count, vt, jnp.zeros_like(vt))
        m_new = jnp.maximum(m_i, logits.max(axis=0))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(logits - bcast_col(m_new))
        if masked:
            p = jnp.where(valid, p, 0.0)
        l_i = l_i * bcast_col(alpha) + p
        pt = plgpu.layout_cast(p.astype(pt_smem.dtype), plgpu.Layout.WGMMA_TRANSPOSED)
        plgpu.transpose_ref(pt_smem, (1, 0))[...] = pt
        plgpu.commit_smem()
        acc_ref[...] = acc_ref[...] * lax.broadcast_in_dim(alpha, (d, npad), [1])
        v_t = plgpu.transpose_ref(v_smem.at[slot], (1, 0))  # [d, TILE]
        plgpu.wgmma(acc_ref, v_t, plgpu.transpose_ref(pt_smem, (1, 0)))
        return m_new, l_i

    carry = (
        plgpu.layout_cast(jnp.full((npad,), da.NEG_INF, jnp.float32), col),
        plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA),
    )
    n_full = count // TILE

    def loop(acc_ref):
        body = functools.partial(step, acc_ref=acc_ref)
        out = lax.fori_loop(0, n_full, functools.partial(body, masked=False), carry)
        out = lax.fori_loop(n_full, n_steps, functools.partial(body, masked=True), out)
        return acc_ref[...], *out

    acc, m_i, l_i = pl.run_scoped(loop, plgpu.ACC((d, npad), jnp.float32))
    store_rows(out_smem, acc)
    vec_smem.at[0][...] = m_i
    vec_smem.at[1][...] = l_i.sum(axis=0)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, acc_gmem.at[bi, h, si])
    plgpu.copy_smem_to_gmem(vec_smem.at[0], m_gmem.at[bi, h, si])
    plgpu.copy_smem_to_gmem(vec_smem.at[1], l_gmem.at[bi, h, si])
    plgpu.wait_smem_to_gmem(0)


def fp_partials(
    qg: jax.Array,  # f32|bf16[B, Hkv, Gp, d] queries (any Gp <= GROUP_PAD)
    fp_set: tuple,  # (k, v [P, Hkv, page, d] bf16|f16, table i32[B, S, pps], len i32[B])
    *,
    scale_log2: float,
    group: int,
    stages: int = FP_STAGES,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Split partials over full-precision pages, in split rows as `lowbit_partials` returns
    them: (acc f32[B,Hkv,S,group,d], m, l f32[B,Hkv,S,N]; base 2, unnormalised)."""
    k, v, tab, lens = fp_set
    b, hkv, _, d = qg.shape
    page = k.shape[2]
    if k.dtype not in (jnp.bfloat16, jnp.float16) or v.dtype != k.dtype:
        raise ValueError(f"full-precision pages must be bfloat16 or float16, got {k.dtype}")
    if TILE % page or d % 64 or d > 256:
        raise ValueError(
            f"the Mosaic GPU BF16 body needs pages dividing {TILE} tokens and head_dim a "
            f"multiple of 64 up to 256, got {page=} {d=}"
        )
    if stages < 2:
        raise ValueError(f"stages={stages} must be >= 2")
    n_pad, _ = mma_columns(group, TILE, None, 1)
    s, pps = tab.shape[1], tab.shape[2]
    per_step = TILE // page
    pps_pad = -(-pps // per_step) * per_step  # a step reads whole groups of table entries
    qs = (qg[:, :, :group] * scale_log2).astype(k.dtype)
    qs = jnp.pad(qs, ((0, 0), (0, 0), (0, n_pad - group), (0, 0)))
    tab_ext = _split_rows(tab, lens, page, pps_pad)
    tiles = functools.partial(plgpu.SMEM, dtype=k.dtype, transforms=_swizzled(2 * d))
    ring = plgpu.RefUnion(
        (
            tiles((stages, TILE, d)),
            tiles((stages, TILE, d)),
            # The value MMA's operands share a swizzle: 128 bytes, as the value tile's.
            plgpu.SMEM((n_pad, TILE), k.dtype, transforms=_swizzled(2 * TILE)),
        ),
        plgpu.SMEM((n_pad, d), jnp.float32),
    )
    scratch = dict(
        q_smem=tiles((n_pad, d)),
        tab_smem=plgpu.SMEM(tab_ext.shape[2:], jnp.int32),
        ring=ring,
        vec_smem=plgpu.SMEM((2, n_pad), jnp.float32),
        bar_in=plgpu.Barrier(num_arrivals=2, num_barriers=1),
        bars=plgpu.Barrier(num_arrivals=2 * per_step, num_barriers=stages),
    )
    kernel = functools.partial(_fp_kernel, page=page, pages_per_split=pps_pad, stages=stages)
    acc, m, l = _split_call(kernel, scratch, (b, hkv, s, n_pad, d))(qs, k, v, tab_ext)
    return rows_of_columns(acc, m, l, streams=1, group=group)


def mma_columns(
    group: int, page: int, n_pad: int | None = None, streams: int | None = None
) -> tuple[int, int]:
    """(N, token streams) of the kernel for a group and low-bit page size: the given values
    checked, or the defaults (`NARROW_PAD` for groups of up to 8; two streams where a step
    holds 128 tokens and the group fits half of N)."""
    if n_pad is None:
        n_pad = NARROW_PAD if group <= NARROW_PAD else GROUP_PAD
    if n_pad not in (NARROW_PAD, GROUP_PAD) or group > n_pad:
        raise ValueError(f"n_pad={n_pad} must be {NARROW_PAD} or {GROUP_PAD} and >= {group=}")
    tile = MAX_TILE if page % MAX_TILE == 0 else TILE
    if streams is None:
        streams = STREAMS[-1] if tile == MAX_TILE and group <= n_pad // STREAMS[-1] else 1
    if streams not in STREAMS or tile // streams < TILE or group > n_pad // streams:
        raise ValueError(
            f"streams={streams} must be one of {STREAMS} with {tile // TILE} MMA row tiles "
            f"per step and {group=} <= n_pad/streams={n_pad // streams}"
        )
    return n_pad, streams


def rows_of_columns(
    acc: jax.Array, m: jax.Array, l: jax.Array, *, streams: int, group: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The kernel's column layout (acc f32[B,Hkv,S,N,d], m, l f32[B,Hkv,S,N]: column
    ``t N/streams + g`` is stream ``t``'s query row ``g``) as split rows: acc
    f32[B,Hkv,S*streams,group,d], m, l f32[B,Hkv,S*streams,N/streams] (reshapes; a copy only
    where ``group < N/streams``: rows of m, l past ``group`` are padding the merge kernel
    does not read)."""
    b, hkv, s, n_pad, d = acc.shape
    gcol = n_pad // streams
    acc = acc.reshape(b, hkv, s * streams, gcol, d)[:, :, :, :group]
    m, l = (a.reshape(b, hkv, s * streams, gcol) for a in (m, l))
    return acc, m, l


# ------------------------------------------------------------------------------------------
# Backend-module interface (as `gpu_triton`): the full-precision sink/recent pages are served
# by the Triton body's full-precision kernel (one split: a few hundred tokens), the low-bit
# pages by the kernel above, and the Triton merge kernel combines both sets of partials.
# ------------------------------------------------------------------------------------------
MIN_GROUP_PAD = GROUP_PAD
# The sink/recent pages (a few hundred tokens) go to their own kernel in splits of at most this
# many pages, fewer where the kernel would have under FP_TARGET_PROGRAMS programs: at batch 1
# a program walking several pages is a serial chain the call waits for (run 91, H100, 1 x 64k:
# that kernel 6.8 us with 4 pages per split, 3.9 with 1), while with many rows each split's
# partial is bytes written and merged (a 1-page split writes as much as it reads).
FP_PAGES_PER_SPLIT = 4
FP_TARGET_PROGRAMS = 1024
# Splits per sequence and head group at most. Below batch 4 the program target alone gives
# 64-128 splits of a few pages each, and the per-split start-up and the partials' transpose and
# merge outweigh the parallelism: run 87 (H100) measured 32 splits best at 1 x 32k, 64k and
# 128k (0.080 / 0.075 / 0.078 ms against 0.135 / 0.080 / 0.098 at 128 splits).
MAX_SPLITS = 32
# Programs the automatic split count aims for (the API's default 1024 where a backend names
# none), at most (`SPLITS_WITHIN_TARGET`: rounded down): one wave of this kernel with three
# resident programs per SM ("copies" schedule, 132 SMs: 396). Every extra wave repeats the
# per-program start-up (query load, barriers, the partials' stores): run 98 (H100) measured
# 256 against 1024 (8 x 32k 0.1080 vs 0.1203 ms, 8 x 128k 0.3304 vs 0.3488); run 122 measured
# 384 against 256 and 512 (8 x 128k 0.2609 / 0.2974 / 0.3130 ms, with "copies" at 384 / 512).
TARGET_PROGRAMS = 384
SPLITS_WITHIN_TARGET = True
HOISTS_TRANSFORMS = True
HAS_MERGE_KERNEL = True
GATHER_MODES = CODE_COPIES
# `_plane_to_f16`, `_planes_asm`, `_planes_s8` keys; "s8_e4m3x2" / "s8_e4m3": s8 keys and
# dimension-major value codes as e4m3 operands against the weights in two e4m3 parts / one.
INT_TO_FLOAT = ("exponent", "asm", "s8", "s8_e4m3x2", "s8_e4m3")
ROW_SUMS = ("deferred",)
DEFAULT_GATHER = "auto"
DEFAULT_INT_TO_FLOAT = "s8"  # run 61: split kernel 0.304 vs 0.369 ms (asm) at 8 x 128k, 2 bits
DEFAULT_ROW_SUMS = "deferred"
DEFAULT_PAGES_PER_BLOCK = 1  # split-table unit: a low-bit page is one or more whole tiles
WIDE_PAGES_PER_BLOCK = 1  # (4-bit widths: the same)


def paged_decode(
    cfg: da.DecodeConfig,
    qg: jax.Array,  # f32[B, Hkv, Gp, d] transformed frame; "fused": [B, Hkv, group, d] as is
    query_transform: jax.Array | None,  # "fused" prologue only (`query_prologue`)
    value_inverse: jax.Array | None,
    fp_set: tuple,  # (k_fp, v_fp [P, Hkv, page, d], table i32[B, S, pps], len i32[B])
    lowbit_set: tuple,  # (kc, vc, ks, kz, vs, vz, table i32[B, S, pps], len i32[B])
    *,
    interpret: bool,
    num_warps: int | None,
    num_stages: int | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Split partials of both page sets as pairs ``(acc_fp, acc_q), (m_fp, m_q), (l_fp, l_q)``:
    the full-precision set as the Triton body returns it (``fp_set``'s table holds its own
    splits, `FP_PAGES_PER_SPLIT`); the low-bit set in split rows (`rows_of_columns`: each
    token stream a split of its own).
    `merge_splits` takes the pairs: no concatenation."""
    if value_inverse is not None or (query_transform is not None and cfg.prologue != "fused"):
        raise ValueError(
            "the GPU split kernel takes no transforms but the fused prologue's query "
            "transform; use head_matmul and the merge kernel around it"
        )
    if interpret:
        raise ValueError("the Mosaic GPU body has no interpret mode; use backend='gpu'")
    group = cfg.group if cfg.group is not None else qg.shape[2]
    n_pad, streams = mma_columns(group, lowbit_set[0].shape[2])
    operands = None
    if cfg.prologue == "fused":  # qg: [B, Hkv, group, d] as the queries come
        qg, operands = query_prologue(
            qg, query_transform, group_pad=cfg.group_pad, scale_log2=cfg.scale_log2,
            n_pad=n_pad, streams=streams,
            key_operand="s8" if cfg.int_to_float.startswith("s8") else "f16",
        )  # fmt: skip
    fp_cfg = dataclasses.replace(cfg, n_chunks=1, bits=None, group_size=None, pages_per_block=1)
    acc_fp, m_fp, l_fp = gpu_triton.paged_decode(
        fp_cfg,
        qg,
        None,
        None,
        fp_set,
        None,
        interpret=False,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    acc_q, m_q, l_q = lowbit_partials(
        qg,
        lowbit_set,
        bits=cfg.bits,
        bits_v=cfg.value_bits,
        scale_log2=cfg.scale_log2,
        group=group,
        value_layout=cfg.value_layout,
        code_copy=cfg.gather,
        int_to_float=cfg.int_to_float,
        columns=True,
        prologue=cfg.prologue,
        operands=operands,
    )
    # Split rows (`rows_of_columns`, reshapes): the merge reads each row's splits contiguously.
    acc_q, m_q, l_q = rows_of_columns(acc_q, m_q, l_q, streams=streams, group=group)
    return (acc_fp, acc_q), (m_fp, m_q), (l_fp, l_q)


def merge_splits(
    acc: tuple[jax.Array, jax.Array],
    m: tuple[jax.Array, jax.Array],
    l: tuple[jax.Array, jax.Array],
    value_inverse: jax.Array | None,
    *,
    interpret: bool,
) -> jax.Array:  # f32[B, Hkv, g, d]
    """The Triton merge kernel over `paged_decode`'s two partial sets (no concatenation)."""
    return gpu_triton.merge_splits(
        acc[0], m[0], l[0], value_inverse, interpret=interpret, second=(acc[1], m[1], l[1])
    )


# The query-transform prologue is the Triton body's.
head_matmul = gpu_triton.head_matmul
