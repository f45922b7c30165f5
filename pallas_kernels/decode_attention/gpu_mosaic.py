"""Pallas Mosaic GPU (Hopper) body of the paged low-bit decode attention: tokens as the M
dimension of the warpgroup MMA.

Grid ``(B, Hkv, S)``: one CTA (one warpgroup) per (sequence, KV head, split) walks its split's
low-bit pages 64 tokens (``TILE`` rows; 128 with 128-token pages) at a time:

* **Codes as the register operand, read as 16-bit words.** A packed code tile is loaded to
  registers as int16 words (two code bytes each), which is already the layout of a float16
  MMA operand. Each word yields ``2 n`` "half-planes" (the ``n`` codes of its low byte and of
  its high byte, `_half_planes`): a mask and an OR under a float16 exponent turn a code into
  the float16 ``M + c`` (no integer-to-float conversion; two codes per 32-bit instruction),
  after a shift that puts it at mantissa bit 4 or above so that ``M <= 64`` (the float32
  accumulator then carries the offset without losing the codes' precision).
* **Keys** ``logits^T[tile, N] = sum_e half_plane_e @ q_e^T``: ``2 n`` warpgroup MMAs of
  K = d / (2 n), each against the query channels that half-plane holds (the query is permuted
  on the host, `key_half_plane_dims`, shared memory, group padded to N = 16). The
  accumulator starts at ``-sum_e M_e (q_e . 1)``, which removes the offsets; scales and zero
  points apply per token row afterwards (``s_t (q . c_t) - s_t z_t sum(q)``, DESIGN.md
  section 5).
* **Softmax over the token axis** (axis 0 of the accumulator: a cross-warp reduction), base 2,
  the query carrying ``sm_scale * log2(e)``.
* **Values** ``O^T[d, N] = V^T (p s)`` with ``p * s_v`` as the B operand (shared memory)
  and the zero-point term ``sum_t p_t s_t z_t`` a column sum. With dimension-major value
  pages (`layout.VALUE_LAYOUTS` ``"dims"``, 128-token pages) each half-plane of the
  ``[d, tile / n]`` code tile is the register A operand over a contiguous block of
  ``tile / (2 n)`` tokens (the layout places them so); its offset ``M_e`` joins the zero
  point of those tokens. With token-major pages the half-planes are written as exact float16
  into a ``[tile, d]`` shared tile (channels in half-plane order, undone on the host) that the
  MMA reads transposed.
* **Pipeline**: each tile arrives by TMA (key and value codes and the four per-token metadata
  rows: six copies) into a ``STAGES``-deep shared-memory ring, one mbarrier per slot; tile
  ``i + STAGES - 1`` is requested before tile ``i`` is computed. The ring shares its memory
  with the epilogue's output tile. Lane-level TMA copies move multiples of 128 bytes, so a
  tile's float16 metadata row (64 x 2 bytes) must be contiguous: low-bit pages hold a
  multiple of 64 tokens (`layout.PageLayout` with ``page_size=64``); a 16-token page's
  32-byte rows cannot be copied this way.

The split partials (``acc`` with the zero-point term folded in, running max ``m`` and
denominator ``l`` in base-2 units) have the layout of the Triton body's, so the Triton merge
kernel combines them with the full-precision segment's partials. Supported: scale/zero groups
of the whole head (``group_size == d``), GQA groups up to 16, packed rows of 32 or 64 bytes
(2 bits at d = 128/256, 4 bits at d = 64/128), low-bit pages of a multiple of 64 tokens
(steps of 128 tokens when pages hold 128).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import layout
from pallas_kernels.decode_attention import gpu_triton
from pallas_kernels.decode_attention import tiles as da

TILE = 64  # tokens per step at least: the M of one warpgroup MMA
MAX_TILE = 128  # tokens per step when pages are that large (two M tiles per MMA)
STAGES_KINDS = ("full", "keys", "loads", "loads_codes")  # attribution: what a step does
# N of the MMAs (the GQA group, padded): the value product's B operand (p, [tile, N] float16)
# needs 32-byte rows, the narrowest swizzle; Mosaic GPU cannot store p transposed.
GROUP_PAD = 16
STAGES = 3
# Lane-level TMA copies move multiples of 128 bytes: a table row (a split's pages, then its
# valid-token count) is padded to 32 int32 entries, the per-column query sums to 32 floats.
_COPY_WORDS = 32
_LOWEST_BIT = 4  # codes sit at mantissa bit >= 4: float16 offsets M = 2^(10 - bit) <= 64


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


def half_plane_sources(bits: int) -> list[tuple[int, int, int, int]]:
    """Per half-plane ``e = hi * n + i`` of a 16-bit word (code ``i`` of its low byte, then of
    its high byte): ``(hi, i, shift, bit)``. The word is shifted left by ``-shift`` or right by
    ``shift`` so that the code lands at mantissa bit ``bit`` (``_LOWEST_BIT`` .. ``10 - bits``).
    """
    n = layout.codes_per_byte(bits)
    out = []
    for hi in (0, 1):
        for i in range(n):
            at = 8 * hi + bits * i
            shift = next(t for t in (0, -4, 4, 8) if _LOWEST_BIT <= at - t <= 10 - bits)
            out.append((hi, i, shift, at - shift))
    return out


def half_plane_offsets(bits: int) -> list[float]:
    """``M_e``: the float16 value of code 0 in half-plane ``e`` (`_half_planes`)."""
    return [2.0 ** (10 - bit) for *_, bit in half_plane_sources(bits)]


def key_half_plane_dims(bits: int, width: int) -> np.ndarray:
    """``dims[e, j]``: the channel of column ``j`` of key half-plane ``e`` (``width`` packed
    bytes per row, `pallas_kernels.layout` planar packing: byte ``b`` holds channel
    ``b + i * width`` at plane ``i``; word ``j`` is bytes ``2 j`` and ``2 j + 1``)."""
    j = np.arange(width // 2)
    return np.stack([i * width + 2 * j + hi for hi, i, *_ in half_plane_sources(bits)])


def _half_planes(w: jax.Array, bits: int, exact: bool = False) -> list[jax.Array]:
    """The ``2 n`` half-planes of int16 words ``w`` as float16 ``M_e + c`` (``c`` if exact).

    Code bits are masked in place and OR-ed under a float16 exponent that makes the mantissa
    count in units of one code: ``bits(2^(10 - bit) + c)``. One shifted copy of ``w`` per
    distinct shift (three), then one LOP3 per two codes; ``exact`` adds one HSUB2.
    """
    shifted = {}
    out = []
    for _, _, shift, bit in half_plane_sources(bits):
        if shift not in shifted:
            if shift < 0:
                shifted[shift] = lax.shift_left(w, jnp.int16(-shift))
            elif shift > 0:
                shifted[shift] = lax.shift_right_logical(w, jnp.int16(shift))
            else:
                shifted[shift] = w
        src = shifted[shift]
        exponent = 25 - bit  # float16 2^(10 - bit): 15 bias + (10 - bit)
        code_bits = (src & jnp.int16(((1 << bits) - 1) << bit)) | jnp.int16(exponent << 10)
        x = lax.bitcast_convert_type(code_bits, jnp.float16)
        out.append(x - jnp.float16(2.0 ** (10 - bit)) if exact else x)
    return out


_REDUCTION_SCRATCH = 2048  # cross-warp max/sum over the token axis of a [tile, N] f32 tile


def _kernel(
    q_gmem,  # f16[B, Hkv, 2n, N, Wk] query channels of each key half-plane, times scale_log2
    qc_gmem,  # f32[B, Hkv, 2, 32]: sum(q) per column, then -sum_e M_e (q_e . 1)
    vmag_gmem,  # f32[tile]: the dims value half-planes' offset M_e of each token row
    kc_gmem,  # i16[P, Hkv, page, Wk] (two code bytes per word)
    vc_gmem,  # i16[P, Hkv, page, Wk] or [P, Hkv, d, page / 2n] (dims)
    ks_gmem,  # f16[P, Hkv, page]
    kz_gmem,
    vs_gmem,
    vz_gmem,
    tab_gmem,  # i32[B, S, rows, 32]: pages of the split, then its valid-token count
    acc_gmem,  # f32[B, Hkv, S, d, N]
    m_gmem,  # f32[B, Hkv, S, N]
    l_gmem,  # f32[B, Hkv, S, N]
    q_smem,
    qc_smem,
    vmag_smem,
    tab_smem,
    ring,  # the loop's buffers, aliased with the epilogue's f32[d, N] output tile
    v16_smem,
    vec_smem,
    bar_in,
    bars,
    *,
    n: int,
    bits: int,
    page: int,
    pages_per_split: int,
    tile: int,
    stage: str,
    value_layout: str,
):
    # k [STAGES, tile, Wk]; v [STAGES, tile, Wk] or [STAGES, d, tile / 2n]; meta
    # f16[4, STAGES, tile] (k scale, k zero, v scale, v zero); p f16[tile, N].
    (k_smem, v_smem, meta_smem, p_smem), out_smem = ring
    bi = lax.axis_index("b")
    h = lax.axis_index("h")
    si = lax.axis_index("s")
    npad, wk = q_smem.shape[1], q_smem.shape[2]
    d = n * 2 * wk
    tiles_per_page = page // tile
    plgpu.copy_gmem_to_smem(q_gmem.at[bi, h], q_smem, bar_in.at[0])
    plgpu.copy_gmem_to_smem(qc_gmem.at[bi, h], qc_smem, bar_in.at[0])
    plgpu.copy_gmem_to_smem(vmag_gmem, vmag_smem, bar_in.at[0])
    plgpu.copy_gmem_to_smem(tab_gmem.at[bi, si], tab_smem, bar_in.at[0])

    plgpu.barrier_wait(bar_in.at[0])

    def table(i):  # the table row is [rows, 32]: a TMA box is at most 256 wide per dimension
        return tab_smem[i // _COPY_WORDS, lax.rem(i, _COPY_WORDS)]

    count = table(pages_per_split)
    n_steps = (count + tile - 1) // tile

    def issue(step, slot):
        pg = table(step // tiles_per_page)
        rows = pl.ds(lax.rem(step, tiles_per_page) * tile, tile)
        bar = bars.at[slot]
        plgpu.copy_gmem_to_smem(kc_gmem.at[pg, h, rows], k_smem.at[slot], bar)
        if value_layout == "dims":  # one tile per page: the whole [d, page / 2n] block
            plgpu.copy_gmem_to_smem(vc_gmem.at[pg, h], v_smem.at[slot], bar)
        else:
            plgpu.copy_gmem_to_smem(vc_gmem.at[pg, h, rows], v_smem.at[slot], bar)
        if stage == "loads_codes":  # attribution: the code tiles' copies alone
            return
        for r, src in enumerate((ks_gmem, kz_gmem, vs_gmem, vz_gmem)):
            plgpu.copy_gmem_to_smem(src.at[pg, h, rows], meta_smem.at[r, slot], bar)

    for st in range(STAGES - 1):
        pl.when(st < n_steps)(functools.partial(issue, st, st))

    row = plgpu.Layout.WGMMA.reduce(1)  # a value per token row
    col = plgpu.Layout.WGMMA.reduce(0)  # a value per query column
    shape = (tile, npad)
    bcast_row = functools.partial(lax.broadcast_in_dim, shape=shape, broadcast_dimensions=[0])
    bcast_col = functools.partial(lax.broadcast_in_dim, shape=shape, broadcast_dimensions=[1])
    qsum = plgpu.load(qc_smem.at[0, pl.ds(0, npad)], (), layout=col)
    key_start = bcast_col(plgpu.load(qc_smem.at[1, pl.ds(0, npad)], (), layout=col))
    vmag = plgpu.load(vmag_smem, (), layout=row)

    def planes(tile_ref, exact=False):
        w = plgpu.load(tile_ref, (), layout=plgpu.Layout.WGMMA)
        return _half_planes(w, bits, exact)

    def meta(r, slot):
        return plgpu.load(meta_smem.at[r, slot], (), layout=row).astype(jnp.float32)

    def step(i, carry, *, masked: bool):
        acc, m_i, l_i, zc = carry
        slot = lax.rem(i, STAGES)
        nxt = i + STAGES - 1

        @pl.when(nxt < n_steps)
        def _next():
            issue(nxt, lax.rem(nxt, STAGES))

        plgpu.barrier_wait(bars.at[slot])
        if stage in ("loads", "loads_codes"):  # the TMA ring alone: what the copies cost
            return carry

        def keys(acc_ref):
            for e, plane in enumerate(planes(k_smem.at[slot])):
                plgpu.wgmma(acc_ref, plane, plgpu.transpose_ref(q_smem.at[e], (1, 0)))
            plgpu.wgmma_wait(0)

        raw = pl.run_state(keys)(plgpu.ACC.init(key_start))
        ks, kz = meta(0, slot), meta(1, slot)
        logits = bcast_row(ks) * (raw - bcast_row(kz) * bcast_col(qsum))
        if masked:  # the last, partial tile: rows past the count may hold NaN scales
            tok = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
            valid = tok + i * tile < count
            logits = jnp.where(valid, logits, da.NEG_INF)
        m_new = jnp.maximum(m_i, logits.max(axis=0))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(logits - bcast_col(m_new))
        vs, vz = meta(2, slot), meta(3, slot)
        if value_layout == "dims":
            vz = vz + vmag  # the half-planes' float16 offsets join the zero points
        pv = p * bcast_row(vs)
        pvz = pv * bcast_row(vz)
        if masked:
            pv = jnp.where(valid, pv, 0.0)
            pvz = jnp.where(valid, pvz, 0.0)
        # [tile, N] tiles, reduced over tokens once after the loop: a cross-warp reduction
        # per step costs (run 20: 1.28 vs 1.04 ms at 8 x 128k with both sums per step).
        l_i = l_i * bcast_col(alpha) + p
        zc = zc * bcast_col(alpha) + pvz
        if stage == "keys":  # no value product
            return acc, m_new, l_i, zc
        if value_layout == "dims":
            # Half-planes of the [d, tile / 2n] tile are register operands over tokens
            # [e * kb, (e + 1) * kb): nothing goes through shared memory but p.
            v_planes = planes(v_smem.at[slot])
        else:
            for e, plane in enumerate(planes(v_smem.at[slot], exact=True)):
                v16_smem.at[:, pl.ds(e * wk, wk)][...] = plane
        p_smem[...] = pv.astype(jnp.float16)
        plgpu.commit_smem()  # the MMA reads what the warpgroup wrote; the slot may be refilled
        acc = acc * lax.broadcast_in_dim(alpha, (d, npad), [1])

        def values(acc_ref):
            if value_layout == "dims":
                kb = tile // (2 * n)
                for e, plane in enumerate(v_planes):
                    plgpu.wgmma(acc_ref, plane, p_smem.at[pl.ds(e * kb, kb)])
            else:
                plgpu.wgmma(acc_ref, plgpu.transpose_ref(v16_smem, (1, 0)), p_smem)
            plgpu.wgmma_wait(0)

        acc = pl.run_state(values)(plgpu.ACC.init(acc))
        return acc, m_new, l_i, zc

    wgmma_layout = plgpu.Layout.WGMMA
    carry = (
        plgpu.layout_cast(jnp.zeros((d, npad), jnp.float32), wgmma_layout),
        plgpu.layout_cast(jnp.full((npad,), da.NEG_INF, jnp.float32), col),
        plgpu.layout_cast(jnp.zeros(shape, jnp.float32), wgmma_layout),
        plgpu.layout_cast(jnp.zeros(shape, jnp.float32), wgmma_layout),
    )
    # Full tiles without the token mask, then the partial tile (if any) with it.
    n_full = count // tile
    carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
    acc, m_i, l_i, zc = lax.fori_loop(n_full, n_steps, functools.partial(step, masked=True), carry)
    l_i, zc = l_i.sum(axis=0), zc.sum(axis=0)
    # Every TMA write and MMA read of the ring has completed: the output tile may reuse it.
    out_smem[...] = acc - lax.broadcast_in_dim(zc, (d, npad), [1])
    vec_smem.at[0][...] = m_i
    vec_smem.at[1][...] = l_i
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, acc_gmem.at[bi, h, si])
    plgpu.copy_smem_to_gmem(vec_smem.at[0], m_gmem.at[bi, h, si])
    plgpu.copy_smem_to_gmem(vec_smem.at[1], l_gmem.at[bi, h, si])
    plgpu.wait_smem_to_gmem(0)


def _as_words(codes: jax.Array) -> jax.Array:  # u8[..., 2m] -> i16[..., m], little-endian
    return lax.bitcast_convert_type(codes.reshape(*codes.shape[:-1], -1, 2), jnp.int16)


def lowbit_partials(
    qg: jax.Array,  # f32[B, Hkv, Gp, d] transformed-frame queries (any Gp >= group)
    lowbit_set: tuple,  # (kc, vc, ks, kz, vs, vz, table i32[B, S, pps], len i32[B])
    *,
    bits: int,
    scale_log2: float,
    group: int,
    stage: str = "full",
    value_layout: str = "tokens",
    auto_barriers: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Split partials over the low-bit pages: (acc f32[B,Hkv,S,group,d], m, l f32[B,Hkv,S,group]).

    ``acc`` is unnormalised and in the transformed frame; ``m``/``l`` are base-2 running max
    and denominator, as the Triton body returns them.
    """
    kc, vc, ks, kz, vs, vz, tab, lens = lowbit_set
    b, hkv, _, d = qg.shape
    n = layout.codes_per_byte(bits)
    width = d // n
    wk = width // 2
    page = kc.shape[2]
    s, pps = tab.shape[1], tab.shape[2]
    if not supports(
        head_dim=d, bits=bits, group_size=d // ks.shape[-1], group=group, page_size=page
    ):
        raise ValueError(f"unsupported by the Mosaic GPU body: {d=} {bits=} {page=} {group=}")
    if stage not in STAGES_KINDS:
        raise ValueError(f"stage={stage!r} must be one of {STAGES_KINDS}")
    npad = GROUP_PAD
    # Query channels per key half-plane, float16 as the MMA reads them; the sums from the
    # same rounded values.
    qs = (qg[:, :, :group] * scale_log2).astype(jnp.float16)
    qs = jnp.pad(qs, ((0, 0), (0, 0), (0, npad - group), (0, 0)))
    dims = key_half_plane_dims(bits, width)  # [2n, wk]
    q_planes = qs[..., dims].transpose(0, 1, 3, 2, 4)  # [B, Hkv, 2n, N, wk]
    offsets = jnp.asarray(half_plane_offsets(bits), jnp.float32)
    qf = q_planes.astype(jnp.float32)
    key_start = -jnp.einsum("e,bhenj->bhn", offsets, qf)
    qc = jnp.stack([jnp.sum(qf, axis=(2, 4)), key_start], axis=2)  # [B, Hkv, 2, N]
    qc = jnp.pad(qc, ((0, 0), (0, 0), (0, 0), (0, _COPY_WORDS - npad)))
    # Valid tokens of split s: the split owns pages [s*pps, (s+1)*pps).
    start = jnp.arange(s, dtype=jnp.int32)[None, :] * (pps * page)
    count = jnp.clip(lens[:, None] - start, 0, pps * page)  # [B, S]
    row = -(-(pps + 1) // _COPY_WORDS) * _COPY_WORDS
    tab_ext = jnp.zeros((b, s, row), jnp.int32).at[:, :, :pps].set(tab).at[:, :, pps].set(count)
    tab_ext = tab_ext.reshape(b, s, row // _COPY_WORDS, _COPY_WORDS)
    metas = [a.reshape(a.shape[:3]) for a in (ks, kz, vs, vz)]  # [P, Hkv, page]
    if any(a.dtype != jnp.float16 for a in metas):
        metas = [a.astype(jnp.float16) for a in metas]

    tile = MAX_TILE if page % MAX_TILE == 0 else TILE
    if value_layout == "dims":
        if tile != page:
            raise ValueError(f"value_layout='dims' needs {MAX_TILE}-token pages, got {page=}")
        kb = tile // (2 * n)  # tokens per value half-plane
        v_smem = plgpu.SMEM((STAGES, d, kb), jnp.int16, transforms=_swizzled(2 * kb))
        v16_smem = plgpu.SMEM((8, 8), jnp.float16)  # unused
        vmag = jnp.repeat(offsets, kb)  # token rows of half-plane e carry M_e
    else:
        v_smem = plgpu.SMEM((STAGES, tile, wk), jnp.int16, transforms=_swizzled(2 * wk))
        v16_smem = plgpu.SMEM((tile, d), jnp.float16, transforms=_swizzled(32))
        vmag = jnp.zeros((tile,), jnp.float32)
    kernel = functools.partial(
        _kernel,
        n=n,
        bits=bits,
        page=page,
        pages_per_split=pps,
        tile=tile,
        stage=stage,
        value_layout=value_layout,
    )
    # Without auto barriers Pallas puts no warpgroup barrier before each TMA copy (six per
    # step). Safe here: a slot is refilled only in the step after its last reads, and every
    # step ends in `commit_smem` (a warpgroup barrier); no thread reads what it wrote.
    params = plgpu.CompilerParams(
        unsafe_no_auto_barriers=not auto_barriers,
        reduction_scratch_bytes=_REDUCTION_SCRATCH,
        approx_math=True,
    )
    ring = plgpu.RefUnion(
        (
            plgpu.SMEM((STAGES, tile, wk), jnp.int16, transforms=_swizzled(2 * wk)),
            v_smem,
            plgpu.SMEM((4, STAGES, tile), jnp.float16),
            plgpu.SMEM((tile, npad), jnp.float16, transforms=_swizzled(2 * npad)),
        ),
        plgpu.SMEM((d, npad), jnp.float32),
    )
    acc, m, l = plgpu.kernel(
        kernel,
        compiler_params=params,
        out_type=(
            jax.ShapeDtypeStruct((b, hkv, s, d, npad), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, s, npad), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, s, npad), jnp.float32),
        ),
        grid=(b, hkv, s),
        grid_names=("b", "h", "s"),
        scratch_types=dict(
            q_smem=plgpu.SMEM((2 * n, npad, wk), jnp.float16, transforms=_swizzled(2 * wk)),
            qc_smem=plgpu.SMEM((2, _COPY_WORDS), jnp.float32),
            vmag_smem=plgpu.SMEM((tile,), jnp.float32),
            tab_smem=plgpu.SMEM((row // _COPY_WORDS, _COPY_WORDS), jnp.int32),
            ring=ring,
            v16_smem=v16_smem,
            vec_smem=plgpu.SMEM((2, npad), jnp.float32),
            bar_in=plgpu.Barrier(num_arrivals=4, num_barriers=1),
            bars=plgpu.Barrier(
                num_arrivals=2 if stage == "loads_codes" else 6, num_barriers=STAGES
            ),
        ),
    )(q_planes, qc, vmag, _as_words(kc), _as_words(vc), *metas, tab_ext)
    if value_layout == "tokens":  # output rows in half-plane channel order: back to channels
        acc = acc[..., np.argsort(dims.reshape(-1)), :]
    acc = acc[..., :group].transpose(0, 1, 2, 4, 3)  # [B, Hkv, S, group, d]
    return acc, m[..., :group], l[..., :group]


# ------------------------------------------------------------------------------------------
# Backend-module interface (as `gpu_triton`): the full-precision sink/recent pages are served
# by the Triton body's full-precision kernel (one split: a few hundred tokens), the low-bit
# pages by the kernel above, and the Triton merge kernel combines both sets of partials.
# ------------------------------------------------------------------------------------------
MIN_GROUP_PAD = GROUP_PAD
HOISTS_TRANSFORMS = True
HAS_MERGE_KERNEL = True
GATHER_MODES = ("tma",)
INT_TO_FLOAT = ("exponent",)  # `_half_planes`
ROW_SUMS = ("deferred",)
DEFAULT_GATHER = "tma"
DEFAULT_INT_TO_FLOAT = "exponent"
DEFAULT_ROW_SUMS = "deferred"
DEFAULT_PAGES_PER_BLOCK = 1  # split-table unit: a low-bit page is one or more whole tiles


def paged_decode(
    cfg: da.DecodeConfig,
    qg: jax.Array,  # f32[B, Hkv, Gp, d] transformed frame
    query_transform: jax.Array | None,
    value_inverse: jax.Array | None,
    fp_set: tuple,  # (k_fp, v_fp [P, Hkv, page, d], table i32[B, S, pps], len i32[B])
    lowbit_set: tuple,  # (kc, vc, ks, kz, vs, vz, table i32[B, S, pps], len i32[B])
    *,
    interpret: bool,
    num_warps: int | None,
    num_stages: int | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Split partials of both page sets, ``(acc f32[B,Hkv,S+1,g,d], m, l f32[B,Hkv,S+1,g])``."""
    if query_transform is not None or value_inverse is not None:
        raise ValueError("the GPU split kernel takes no transforms; use head_matmul around it")
    if interpret:
        raise ValueError("the Mosaic GPU body has no interpret mode; use backend='gpu'")
    k_fp, v_fp, fp_tab, fp_len = fp_set
    b = fp_tab.shape[0]
    fp_cfg = dataclasses.replace(cfg, n_chunks=1, bits=None, group_size=None, pages_per_block=1)
    fp_one_split = (k_fp, v_fp, fp_tab.reshape(b, 1, -1), fp_len)
    acc_fp, m_fp, l_fp = gpu_triton.paged_decode(
        fp_cfg,
        qg,
        None,
        None,
        fp_one_split,
        None,
        interpret=False,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    group = cfg.group if cfg.group is not None else qg.shape[2]
    acc_q, m_q, l_q = lowbit_partials(
        qg,
        lowbit_set,
        bits=cfg.bits,
        scale_log2=cfg.scale_log2,
        group=group,
        value_layout=cfg.value_layout,
    )
    cat = functools.partial(jnp.concatenate, axis=2)
    return cat([acc_fp, acc_q]), cat([m_fp, m_q]), cat([l_fp, l_q])


# The query-transform prologue and the merge + value-inverse epilogue are the Triton body's.
head_matmul = gpu_triton.head_matmul
merge_splits = gpu_triton.merge_splits
