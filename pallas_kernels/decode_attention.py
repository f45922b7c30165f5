"""Paged mixed-precision decode attention: reference, validation, per-tile math, public wrappers.

One query token per sequence attends over a paged cache holding two key/value sets in the
transformed frame (DESIGN.md section 3): full-precision pages (sink + recent windows) and
low-bit pages (packed codes with a per-token, per-group scale and zero point, see
`pallas_kernels.layout`). Attention is permutation-invariant over keys, so the two sets are
just two segments of one online softmax.

Kernel algebra (DESIGN.md section 5), with ``k_hat = s (c - z)`` per group of channels:

    q . k_hat                = s (q . c) - s z sum(q)
    sum_t p_t s_t (c_t - z_t) = sum_t (p_t s_t) c_t - sum_t p_t s_t z_t

so the inner loops are plain tensor-core dots of the query (or the probabilities) against
small-integer code planes; scales and zero points are applied per token outside the dot.

Backends: ``backend="gpu"`` runs the Pallas Triton body in `pallas_kernels.gpu`,
``backend="tpu"`` the Mosaic body in `pallas_kernels.tpu`; both return per-split partial
results, combined by log-sum-exp in the GPU merge kernel (`pallas_kernels.gpu`
``merge_splits``, with the value inverse) or by `_merge_splits` (XLA, TPU).
``interpret=True`` runs either on CPU.

Example::

    out = decode_attention(q, k_fp, v_fp, fp_table, fp_len, k_codes, v_codes,
                           k_scale, k_zero, v_scale, v_zero, q_table, q_len, bkt, bv,
                           bits=2, sm_scale=d**-0.5)
"""

from __future__ import annotations

import dataclasses
import functools
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
BACKENDS = ("gpu", "tpu")
# Programs to launch when choosing splits automatically (132 SMs on H200, a few resident
# programs each). The low-bit kernel: ~1024 (H200 runs 8-12). Run 12 measured 512 level with
# 1024 for 2 bits (0.689 ms at 8 x 128k, 0.086 at 1 x 64k) but 4 bits 25% slower at 8 x 128k
# (1.124 vs 0.899 ms in run 11): fewer, longer programs leave a partial last wave. The BF16
# baseline keeps the 512 it was tuned with.
_TARGET_PROGRAMS = 512
_TARGET_PROGRAMS_LOWBIT = 1024
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
      n_chunks: channel chunks the output is accumulated in (``codes_per_byte`` for the
        mixed kernel, 1 for the BF16 baseline); chunk ``i`` covers channels
        ``[i*d/n, (i+1)*d/n)``, matching planar code plane ``i``.
      bits: low-bit code width, or ``None`` for the BF16-only baseline (no low-bit set).
      group_size: channels sharing one scale/zero (``None`` for the baseline).
      scale_log2: ``sm_scale * log2(e)``; logits are kept in base-2 units so the softmax uses
        ``exp2``.
      pages_per_block: pages gathered per inner-loop step.
      has_query_transform / has_value_inverse: whether the optional matrices are given to
        the split body (the GPU path applies them in separate prologue/epilogue kernels and
        passes ``False`` here).
      gather: how the GPU body reads a block of low-bit pages. ``"prefetch"``: as ``"rows"``,
        with the next block's tiles (and the page numbers of the one after) loaded into
        registers before the current block is computed. ``"rows"``: one 2-D pointer
        gather per tile (keys loaded already transposed, ``[d/n, T]``), so no reshape or
        transpose sits between the load and the dot and Triton can load the packed bytes
        straight into the tensor-core operand layout and unpack them there. ``"pages"``:
        gather ``[pages, page, d/n]`` and reshape (the first kernel; the reshape and the key
        transpose force each unpacked float16 plane through shared memory). The TPU body
        reads one page per grid step and takes ``"pages"`` only.
      int_to_float: how codes become float16 dot operands. ``"convert"``: an int->float
        convert. ``"exponent"``: OR the code into the mantissa of float16 1024.0
        (``0x6400 | c`` is ``1024 + c`` exactly) and subtract 1024, in 16-bit integer and
        half-precision ops. ``"asm"`` (GPU only): the same trick two codes per 32-bit
        instruction in inline PTX (`pallas_kernels.gpu.decode_attention`); in interpret mode it
        runs the ``"exponent"`` twin, which yields the identical float16 values.
      row_sums: how the GPU low-bit loop keeps the softmax denominator and the value
        zero-point correction. ``"deferred"``: as ``[Gp, T]`` tiles rescaled like the
        accumulators and reduced once after the loop, so the row max is the only cross-warp
        reduction per step (fewer barriers, more registers). ``"per_step"``: reduced every
        step. The TPU body reduces per step.
      group: real query heads per KV head (``<= group_pad``); the GPU body writes only these
        rows of its split partials (a quarter of the bytes at GQA 4), ``None`` = all.
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
        """Scale/zero group of each code plane (every plane lies inside one group)."""
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


# ------------------------------------------------------------------------------------------
# Reference
# ------------------------------------------------------------------------------------------
def _gather_pages(
    pool: jax.Array,  # X[P, Hkv, page, w]
    table: jax.Array,  # i32[B, n_pages]
) -> jax.Array:  # X[B, Hkv, n_pages * page, w]
    g = pool[table]  # [B, n, Hkv, page, w]
    b, n, h, page, w = g.shape
    return g.transpose(0, 2, 1, 3, 4).reshape(b, h, n * page, w)


def _dequantize_pages(
    codes: jax.Array,  # u8[P, Hkv, page, d/n]
    scale: jax.Array,  # f[P, Hkv, page, d/G]
    zero: jax.Array,  # f[P, Hkv, page, d/G]
    table: jax.Array,  # i32[B, n]
    bits: int,
    head_dim: int,
) -> jax.Array:  # f32[B, Hkv, n*page, d]
    c = layout.unpack_codes(_gather_pages(codes, table), bits, head_dim).astype(jnp.float32)
    s = _gather_pages(scale, table).astype(jnp.float32)  # [B, Hkv, S, ng]
    z = _gather_pages(zero, table).astype(jnp.float32)
    ng = s.shape[-1]
    cg = c.reshape(*c.shape[:-1], ng, head_dim // ng)
    return ((cg - z[..., None]) * s[..., None]).reshape(c.shape)


def _ref_attend(
    q_frame: jax.Array,  # f32[B, Hkv, G, d]
    keys: list[tuple[jax.Array, jax.Array, jax.Array]],  # (k f32[B,Hkv,S,d], v, valid[B,S])
    sm_scale: float,
) -> jax.Array:  # f32[B, Hkv, G, d] in the transformed frame
    hi = lax.Precision.HIGHEST
    logits, vals, masks = [], [], []
    for k, v, valid in keys:
        vm = valid[:, None, :, None]
        k = jnp.where(vm, k, 0.0)  # NaN in unused slots must not survive even 0 * NaN
        v = jnp.where(vm, v, 0.0)
        logits.append(jnp.einsum("BKGH,BKSH->BKGS", q_frame, k, precision=hi) * sm_scale)
        vals.append(v)
        masks.append(valid)
    s = jnp.concatenate(logits, axis=-1)  # [B, K, G, S_all]
    v = jnp.concatenate(vals, axis=2)  # [B, K, S_all, H]
    mask = jnp.concatenate(masks, axis=-1)[:, None, None, :]  # [B, 1, 1, S_all]
    s = jnp.where(mask, s, -jnp.inf)
    s_max = jnp.max(s, axis=-1, keepdims=True)
    s_max = jnp.where(jnp.isfinite(s_max), s_max, 0.0)  # sequences with no key at all
    p = jnp.where(mask, jnp.exp(s - s_max), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    return jnp.einsum("BKGS,BKSH->BKGH", p, v, precision=hi)


def _token_mask(length: jax.Array, n_tokens: int) -> jax.Array:  # bool[B, n_tokens]
    return jnp.arange(n_tokens)[None, :] < length[:, None]


def _apply_transforms_ref(q, query_transform, hkv):
    b, hq, d = q.shape
    qg = q.astype(jnp.float32).reshape(b, hkv, hq // hkv, d)
    if query_transform is None:
        return qg
    qt = query_transform.astype(jnp.float32)
    return jnp.einsum("BKGH,KHE->BKGE", qg, qt, precision=lax.Precision.HIGHEST)


def _output_ref(o_frame, value_inverse, hq):
    if value_inverse is not None:
        vi = value_inverse.astype(jnp.float32)
        o_frame = jnp.einsum("BKGH,KHE->BKGE", o_frame, vi, precision=lax.Precision.HIGHEST)
    b, _, _, d = o_frame.shape
    return o_frame.reshape(b, hq, d)


def ref_decode_attention(
    q: jax.Array,  # bf16|f32[B, Hq, d] one query per sequence, original frame
    k_fp: jax.Array,  # bf16|f32[P_fp, Hkv, page, d] full-precision pages (transformed frame)
    v_fp: jax.Array,  # bf16|f32[P_fp, Hkv, page, d]
    fp_page_table: jax.Array,  # i32[B, max_fp_pages]
    fp_len: jax.Array,  # i32[B]
    k_codes: jax.Array,  # u8[P_q, Hkv, page, d // n]
    v_codes: jax.Array,  # u8[P_q, Hkv, page, d // n]
    k_scale: jax.Array,  # f16[P_q, Hkv, page, d // G]
    k_zero: jax.Array,  # f16[P_q, Hkv, page, d // G]
    v_scale: jax.Array,  # f16[P_q, Hkv, page, d // G]
    v_zero: jax.Array,  # f16[P_q, Hkv, page, d // G]
    q_page_table: jax.Array,  # i32[B, max_q_pages]
    q_len: jax.Array,  # i32[B]
    query_transform: jax.Array | None = None,  # f32[Hkv, d, d] = B_K^T
    value_inverse: jax.Array | None = None,  # f32[Hkv, d, d] = B_V
    *,
    bits: int,
    sm_scale: float,
    num_splits: int | None = None,
    pages_per_block: int | None = None,
    backend: str = "gpu",
    interpret: bool = False,
) -> jax.Array:  # f32[B, Hq, d]
    """Pure-jnp float32 twin of `decode_attention` (dequantize everything, plain softmax).

    Tuning arguments (``num_splits``, ``pages_per_block``, ``backend``, ``interpret``) are
    accepted for signature parity and ignored.
    """
    del num_splits, pages_per_block, backend, interpret
    dims = _validate(
        q,
        k_fp,
        v_fp,
        fp_page_table,
        fp_len,
        k_codes,
        v_codes,
        k_scale,
        k_zero,
        v_scale,
        v_zero,
        q_page_table,
        q_len,
        query_transform,
        value_inverse,
        bits=bits,
    )
    d = dims["d"]
    qf = _apply_transforms_ref(q, query_transform, dims["hkv"])
    kf = _gather_pages(k_fp, fp_page_table).astype(jnp.float32)
    vf = _gather_pages(v_fp, fp_page_table).astype(jnp.float32)
    kq = _dequantize_pages(k_codes, k_scale, k_zero, q_page_table, bits, d)
    vq = _dequantize_pages(v_codes, v_scale, v_zero, q_page_table, bits, d)
    o = _ref_attend(
        qf,
        [
            (kf, vf, _token_mask(fp_len, kf.shape[2])),
            (kq, vq, _token_mask(q_len, kq.shape[2])),
        ],
        sm_scale,
    )
    return _output_ref(o, value_inverse, q.shape[1])


def ref_decode_attention_bf16(
    q: jax.Array,  # bf16|f32[B, Hq, d]
    k_pages: jax.Array,  # bf16|f32[P, Hkv, page, d]
    v_pages: jax.Array,  # bf16|f32[P, Hkv, page, d]
    page_table: jax.Array,  # i32[B, max_pages]
    lengths: jax.Array,  # i32[B]
    *,
    sm_scale: float,
    num_splits: int | None = None,
    pages_per_block: int | None = None,
    backend: str = "gpu",
    interpret: bool = False,
) -> jax.Array:  # f32[B, Hq, d]
    """Pure-jnp float32 twin of `decode_attention_bf16`; tuning arguments are ignored."""
    del num_splits, pages_per_block, backend, interpret
    dims = _validate_fp(q, k_pages, v_pages, page_table, lengths)
    qf = _apply_transforms_ref(q, None, dims["hkv"])
    k = _gather_pages(k_pages, page_table).astype(jnp.float32)
    v = _gather_pages(v_pages, page_table).astype(jnp.float32)
    o = _ref_attend(qf, [(k, v, _token_mask(lengths, k.shape[2]))], sm_scale)
    return _output_ref(o, None, q.shape[1])


# ------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------
def _validate_fp(q, k_pages, v_pages, page_table, lengths) -> dict[str, int]:
    if q.ndim != 3:
        raise ValueError(f"{q.shape=} must be [B, Hq, d]")
    b, hq, d = q.shape
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"{q.dtype=} must be floating")
    if k_pages.ndim != 4 or k_pages.shape[-1] != d:
        raise ValueError(f"{k_pages.shape=} must be [P, Hkv, page, d={d}]")
    if v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"{v_pages.shape=} {v_pages.dtype=} must match {k_pages.shape=}")
    _, hkv, page, _ = k_pages.shape
    if hq % hkv:
        raise ValueError(f"{q.shape=}: Hq={hq} is not a multiple of Hkv={hkv}")
    if page_table.ndim != 2 or page_table.shape[0] != b or page_table.shape[1] < 1:
        raise ValueError(f"{page_table.shape=} must be [B={b}, >=1]")
    if page_table.dtype != jnp.int32:
        raise ValueError(f"{page_table.dtype=} must be int32")
    if lengths.shape != (b,) or lengths.dtype != jnp.int32:
        raise ValueError(f"{lengths.shape=} {lengths.dtype=} must be int32[{b}]")
    return {"b": b, "hq": hq, "d": d, "hkv": hkv, "page": page}


def _validate(
    q,
    k_fp,
    v_fp,
    fp_page_table,
    fp_len,
    k_codes,
    v_codes,
    k_scale,
    k_zero,
    v_scale,
    v_zero,
    q_page_table,
    q_len,
    query_transform,
    value_inverse,
    *,
    bits,
) -> dict[str, int]:
    dims = _validate_fp(q, k_fp, v_fp, fp_page_table, fp_len)
    b, d, hkv, page = dims["b"], dims["d"], dims["hkv"], dims["page"]
    if bits not in layout.SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r} must be one of {layout.SUPPORTED_BITS}")
    m = layout.packed_dim(d, bits)
    if k_codes.ndim != 4 or k_codes.shape[1:] != (hkv, page, m):
        raise ValueError(f"{k_codes.shape=} must be [P_q, Hkv={hkv}, page={page}, d//n={m}]")
    if k_codes.dtype != jnp.uint8:
        raise ValueError(f"{k_codes.dtype=} must be uint8")
    if v_codes.shape != k_codes.shape or v_codes.dtype != jnp.uint8:
        raise ValueError(f"{v_codes.shape=} {v_codes.dtype=} must match {k_codes.shape=}")
    meta = k_scale.shape
    if len(meta) != 4 or meta[:3] != k_codes.shape[:3] or meta[3] < 1 or d % meta[3]:
        raise ValueError(f"{k_scale.shape=} must be [P_q, Hkv, page, d//G] for {k_codes.shape=}")
    for name, a in (("k_zero", k_zero), ("v_scale", v_scale), ("v_zero", v_zero)):
        if a.shape != meta:
            raise ValueError(f"{name}.shape={a.shape} must equal {k_scale.shape=}")
    if q_page_table.ndim != 2 or q_page_table.shape[0] != b or q_page_table.shape[1] < 1:
        raise ValueError(f"{q_page_table.shape=} must be [B={b}, >=1]")
    if q_page_table.dtype != jnp.int32:
        raise ValueError(f"{q_page_table.dtype=} must be int32")
    if q_len.shape != (b,) or q_len.dtype != jnp.int32:
        raise ValueError(f"{q_len.shape=} {q_len.dtype=} must be int32[{b}]")
    for name, t in (("query_transform", query_transform), ("value_inverse", value_inverse)):
        if t is not None and t.shape != (hkv, d, d):
            raise ValueError(f"{name}.shape={t.shape} must be (Hkv={hkv}, d={d}, d={d})")
    dims.update(m=m, num_groups=meta[3], group_size=d // meta[3])
    return dims


def _check_kernel_shapes(
    dims: dict[str, int], bits: int | None, pages_per_block: int, backend: str
) -> None:
    """Constraints of the kernels (not of the math): tile shapes and group alignment."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
    if pages_per_block < 1 or pages_per_block & (pages_per_block - 1):
        raise ValueError(f"pages_per_block={pages_per_block} must be a power of two")
    if bits is not None:
        if bits not in layout.PACKED_BITS:
            raise ValueError(f"bits={bits} is simulated only; kernels take {layout.PACKED_BITS}")
        if dims["group_size"] % dims["m"]:
            # Each code plane must lie inside one scale group so the scale can be applied
            # after the plane's dot.
            raise ValueError(
                f"group_size={dims['group_size']} must be a multiple of d//n={dims['m']}"
            )
    if backend == "gpu":
        for name in ("d", "page"):
            v = dims[name]
            if v & (v - 1) or v < 16:
                raise ValueError(f"{name}={v} must be a power of two >= 16 for Triton tiles")
        if bits is not None and dims["m"] < 16:
            raise ValueError(f"d//n={dims['m']} must be >= 16 for tensor-core dots")


# ------------------------------------------------------------------------------------------
# Split planning and merge
# ------------------------------------------------------------------------------------------
def _auto_splits(
    batch: int, hkv: int, max_pages: int, pages_per_block: int, target: int = _TARGET_PROGRAMS
) -> int:
    blocks = max(1, -(-max_pages // pages_per_block))
    return int(max(1, min(blocks, -(-target // (batch * hkv)))))


def lowbit_auto_splits(batch: int, hkv: int, max_pages: int, pages_per_block: int) -> int:
    """Splits `decode_attention` picks when ``num_splits`` is None."""
    return _auto_splits(batch, hkv, max_pages, pages_per_block, _TARGET_PROGRAMS_LOWBIT)


def _split_table(
    table: jax.Array,  # i32[B, n]
    num_splits: int,
    unit: int,
) -> jax.Array:  # i32[B, S, pages_per_split]
    """Pads the table (with page 0; masked by length) so each split gets whole units."""
    b, n = table.shape
    per = -(-n // (num_splits * unit)) * unit
    table = jnp.pad(table, ((0, 0), (0, num_splits * per - n)))
    return table.reshape(b, num_splits, per)


def _merge_partials(
    acc: jax.Array,  # f32[B, Hkv, S, R, d] unnormalised partial outputs (R: Gp or the group)
    m: jax.Array,  # f32[B, Hkv, S, R] running max, base-2 units
    l: jax.Array,  # f32[B, Hkv, S, R] partial softmax denominators
) -> jax.Array:  # f32[B, Hkv, R, d]
    """Flash-decoding log-sum-exp merge of the split partials."""
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp2(m - m_all)  # [B, K, S, Gp]; 0 for empty splits unless all are empty
    l_all = jnp.sum(w * l, axis=2)  # [B, K, Gp]
    o = jnp.sum(w[..., None] * acc, axis=2)  # [B, K, Gp, d]
    return o / jnp.where(l_all > 0, l_all, 1.0)[..., None]  # no key at all -> zeros


def _ungroup(
    o: jax.Array,  # f32[B, Hkv, Gp, d]
    group: int,
) -> jax.Array:  # f32[B, Hkv * group, d]
    b, k, _, d = o.shape
    return o[:, :, :group, :].reshape(b, k * group, d)


def _merge_splits(
    acc: jax.Array,  # f32[B, Hkv, S, Gp, d] unnormalised partial outputs (final frame)
    m: jax.Array,  # f32[B, Hkv, S, Gp]
    l: jax.Array,  # f32[B, Hkv, S, Gp]
    group: int,
) -> jax.Array:  # f32[B, Hkv * group, d]
    return _ungroup(_merge_partials(acc, m, l), group)


def _group_queries(q: jax.Array, hkv: int, pad_to: int) -> tuple[jax.Array, int]:
    b, hq, d = q.shape
    g = hq // hkv
    gp = max(pad_to, 1 << (g - 1).bit_length())
    qg = q.astype(jnp.float32).reshape(b, hkv, g, d)
    return jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0))), g


def _backend_module(backend: str):
    # Imported lazily: the backend bodies import this module's per-tile helpers.
    if backend == "gpu":
        from pallas_kernels.gpu import decode_attention as mod
    else:
        from pallas_kernels.tpu import decode_attention as mod
    return mod


# ------------------------------------------------------------------------------------------
# Public wrappers
# ------------------------------------------------------------------------------------------
_LOWBIT_STATIC = (
    "bits",
    "sm_scale",
    "num_splits",
    "pages_per_block",
    "backend",
    "interpret",
    "num_warps",
    "num_stages",
)


@functools.partial(jax.jit, static_argnames=_LOWBIT_STATIC)
def decode_attention(
    q: jax.Array,  # bf16|f32[B, Hq, d] one query per sequence, original frame
    k_fp: jax.Array,  # bf16|f32[P_fp, Hkv, page, d] full-precision pages (transformed frame)
    v_fp: jax.Array,  # bf16|f32[P_fp, Hkv, page, d]
    fp_page_table: jax.Array,  # i32[B, max_fp_pages]
    fp_len: jax.Array,  # i32[B] valid full-precision tokens
    k_codes: jax.Array,  # u8[P_q, Hkv, page, d // n]
    v_codes: jax.Array,  # u8[P_q, Hkv, page, d // n]
    k_scale: jax.Array,  # f16[P_q, Hkv, page, d // G]
    k_zero: jax.Array,  # f16[P_q, Hkv, page, d // G]
    v_scale: jax.Array,  # f16[P_q, Hkv, page, d // G]
    v_zero: jax.Array,  # f16[P_q, Hkv, page, d // G]
    q_page_table: jax.Array,  # i32[B, max_q_pages]
    q_len: jax.Array,  # i32[B] valid low-bit tokens (multiple of page)
    query_transform: jax.Array | None = None,  # f32[Hkv, d, d] = B_K^T, None = identity
    value_inverse: jax.Array | None = None,  # f32[Hkv, d, d] = B_V, None = identity
    *,
    bits: int,
    sm_scale: float,
    num_splits: int | None = None,
    pages_per_block: int | None = None,
    backend: str = "gpu",
    interpret: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> jax.Array:  # f32[B, Hq, d]
    """Decode attention over a paged cache of full-precision and packed low-bit pages.

    Query head ``j`` reads KV head ``j // (Hq // Hkv)``; each KV head is read once for its
    whole query group. The query transform and the value inverse are applied by Pallas
    kernels: on the GPU by a prologue kernel (once per sequence and KV head, rather than once
    per split program) and an epilogue kernel on the merged output (the inverse is linear, so
    this equals applying it per split); the TPU body applies them inside the split kernel.

    Args:
      q, k_fp, ..., value_inverse: see the shape comments; unused table entries may point at
        any valid page, and unused pages may hold NaN.
      bits: 2 or 4 (packed planar codes, `pallas_kernels.layout`).
      sm_scale: softmax scale applied to the logits.
      num_splits: sequence splits (flash decoding); ``None`` picks enough to fill the GPU.
      pages_per_block: pages gathered per inner step (GPU; the TPU body takes one page/step);
        ``None`` uses the backend's ``DEFAULT_PAGES_PER_BLOCK``.
      backend: ``"gpu"`` (Pallas Triton) or ``"tpu"`` (Pallas Mosaic).
      interpret: run the kernel in the Pallas interpreter (CPU tests).
      num_warps, num_stages: GPU launch knobs; ``None`` uses the GPU body's defaults.

    Returns:
      float32 attention output in the original frame, ``[B, Hq, d]``.
    """
    return decode_attention_variant(
        q,
        k_fp,
        v_fp,
        fp_page_table,
        fp_len,
        k_codes,
        v_codes,
        k_scale,
        k_zero,
        v_scale,
        v_zero,
        q_page_table,
        q_len,
        query_transform,
        value_inverse,
        bits=bits,
        sm_scale=sm_scale,
        num_splits=num_splits,
        pages_per_block=pages_per_block,
        backend=backend,
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
    )


@functools.partial(jax.jit, static_argnames=_LOWBIT_STATIC + ("gather", "int_to_float", "row_sums"))
def decode_attention_variant(
    q: jax.Array,  # bf16|f32[B, Hq, d]
    k_fp: jax.Array,  # bf16|f32[P_fp, Hkv, page, d]
    v_fp: jax.Array,  # bf16|f32[P_fp, Hkv, page, d]
    fp_page_table: jax.Array,  # i32[B, max_fp_pages]
    fp_len: jax.Array,  # i32[B]
    k_codes: jax.Array,  # u8[P_q, Hkv, page, d // n]
    v_codes: jax.Array,  # u8[P_q, Hkv, page, d // n]
    k_scale: jax.Array,  # f16[P_q, Hkv, page, d // G]
    k_zero: jax.Array,  # f16[P_q, Hkv, page, d // G]
    v_scale: jax.Array,  # f16[P_q, Hkv, page, d // G]
    v_zero: jax.Array,  # f16[P_q, Hkv, page, d // G]
    q_page_table: jax.Array,  # i32[B, max_q_pages]
    q_len: jax.Array,  # i32[B]
    query_transform: jax.Array | None = None,  # f32[Hkv, d, d]
    value_inverse: jax.Array | None = None,  # f32[Hkv, d, d]
    *,
    bits: int,
    sm_scale: float,
    num_splits: int | None = None,
    pages_per_block: int | None = None,
    backend: str = "gpu",
    interpret: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
    gather: str | None = None,
    int_to_float: str | None = None,
    row_sums: str | None = None,
) -> jax.Array:  # f32[B, Hq, d]
    """`decode_attention` with the inner-loop strategy chosen explicitly (benchmarks, tests).

    Args:
      gather, int_to_float, row_sums: see `DecodeConfig`; ``None`` takes the backend's
        defaults (``DEFAULT_GATHER`` / ``DEFAULT_INT_TO_FLOAT`` / ``DEFAULT_ROW_SUMS`` of the
        backend module; the modes a backend supports are its ``GATHER_MODES`` /
        ``INT_TO_FLOAT`` / ``ROW_SUMS``).
      Others: as in `decode_attention`.
    """
    dims = _validate(
        q,
        k_fp,
        v_fp,
        fp_page_table,
        fp_len,
        k_codes,
        v_codes,
        k_scale,
        k_zero,
        v_scale,
        v_zero,
        q_page_table,
        q_len,
        query_transform,
        value_inverse,
        bits=bits,
    )
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
    mod = _backend_module(backend)
    if pages_per_block is None:
        pages_per_block = mod.DEFAULT_PAGES_PER_BLOCK
    _check_kernel_shapes(dims, bits, pages_per_block, backend)
    gather = mod.DEFAULT_GATHER if gather is None else gather
    int_to_float = mod.DEFAULT_INT_TO_FLOAT if int_to_float is None else int_to_float
    if gather not in mod.GATHER_MODES:
        raise ValueError(f"gather={gather!r} must be one of {mod.GATHER_MODES} for {backend=}")
    if int_to_float not in mod.INT_TO_FLOAT:
        raise ValueError(
            f"int_to_float={int_to_float!r} must be one of {mod.INT_TO_FLOAT} for {backend=}"
        )
    row_sums = mod.DEFAULT_ROW_SUMS if row_sums is None else row_sums
    if row_sums not in mod.ROW_SUMS:
        raise ValueError(f"row_sums={row_sums!r} must be one of {mod.ROW_SUMS} for {backend=}")
    unit = pages_per_block if backend == "gpu" else 1
    if num_splits is None:
        num_splits = lowbit_auto_splits(
            dims["b"], dims["hkv"], q_page_table.shape[1], pages_per_block
        )
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    qg, g = _group_queries(q, dims["hkv"], mod.MIN_GROUP_PAD)
    hoist = mod.HOISTS_TRANSFORMS
    cfg = DecodeConfig(
        head_dim=dims["d"],
        page_size=dims["page"],
        group_pad=qg.shape[2],
        n_chunks=layout.codes_per_byte(bits),
        bits=bits,
        group_size=dims["group_size"],
        scale_log2=float(sm_scale) * LOG2E,
        pages_per_block=unit,
        has_query_transform=query_transform is not None and not hoist,
        has_value_inverse=value_inverse is not None and not hoist,
        gather=gather,
        int_to_float=int_to_float,
        row_sums=row_sums,
        group=g,
    )
    f32 = jnp.float32
    qt = None if query_transform is None else query_transform.astype(f32)
    vi = None if value_inverse is None else value_inverse.astype(f32)
    if hoist and qt is not None:
        qg = mod.head_matmul(qg, qt, interpret=interpret)  # into the transformed frame
    acc, m, l = mod.paged_decode(
        cfg,
        qg,
        None if hoist else qt,
        None if hoist else vi,
        (k_fp, v_fp, _split_table(fp_page_table, num_splits, unit), fp_len),
        (
            k_codes,
            v_codes,
            k_scale,
            k_zero,
            v_scale,
            v_zero,
            _split_table(q_page_table, num_splits, unit),
            q_len,
        ),
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if mod.HAS_MERGE_KERNEL:  # GPU: merge + value inverse (hoisted) in one kernel
        o = mod.merge_splits(acc, m, l, vi if hoist else None, interpret=interpret)
    else:
        o = _merge_partials(acc, m, l)  # [B, Hkv, Gp, d]
    return _ungroup(o, g)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "num_splits",
        "pages_per_block",
        "backend",
        "interpret",
        "num_warps",
        "num_stages",
    ),
)
def decode_attention_bf16(
    q: jax.Array,  # bf16|f32[B, Hq, d]
    k_pages: jax.Array,  # bf16|f32[P, Hkv, page, d]
    v_pages: jax.Array,  # bf16|f32[P, Hkv, page, d]
    page_table: jax.Array,  # i32[B, max_pages]
    lengths: jax.Array,  # i32[B]
    *,
    sm_scale: float,
    num_splits: int | None = None,
    pages_per_block: int | None = None,
    backend: str = "gpu",
    interpret: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> jax.Array:  # f32[B, Hq, d]
    """The BF16 baseline: same kernel structure (GQA group as M, splits, LSE merge) over
    full-precision pages only, no transforms. Arguments as in `decode_attention`
    (``pages_per_block=None`` means 8, the value this baseline was tuned with)."""
    if pages_per_block is None:
        pages_per_block = BF16_PAGES_PER_BLOCK
    dims = _validate_fp(q, k_pages, v_pages, page_table, lengths)
    _check_kernel_shapes(dims, None, pages_per_block, backend)
    mod = _backend_module(backend)
    unit = pages_per_block if backend == "gpu" else 1
    if num_splits is None:
        num_splits = _auto_splits(dims["b"], dims["hkv"], page_table.shape[1], pages_per_block)
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    qg, g = _group_queries(q, dims["hkv"], mod.MIN_GROUP_PAD)
    cfg = DecodeConfig(
        head_dim=dims["d"],
        page_size=dims["page"],
        group_pad=qg.shape[2],
        n_chunks=1,
        bits=None,
        group_size=None,
        scale_log2=float(sm_scale) * LOG2E,
        pages_per_block=unit,
        has_query_transform=False,
        has_value_inverse=False,
        group=g,
    )
    acc, m, l = mod.paged_decode(
        cfg,
        qg,
        None,
        None,
        (k_pages, v_pages, _split_table(page_table, num_splits, unit), lengths),
        None,
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if mod.HAS_MERGE_KERNEL:  # the GPU merge kernel (no value inverse here)
        return _ungroup(mod.merge_splits(acc, m, l, None, interpret=interpret), g)
    return _merge_splits(acc, m, l, g)
