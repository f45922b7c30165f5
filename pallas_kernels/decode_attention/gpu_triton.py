"""Pallas Triton-backend body of the paged mixed-precision decode attention.

Grid ``(B, Hkv, S)``: one program per (sequence, KV head, split). The program reads its KV
head's pages once for the whole (padded) query group, which is the M dimension of every
tensor-core dot. Pages are gathered ``pages_per_block`` at a time straight from the pools
through the page table (a pointer gather), so packed codes are unpacked in registers and never
materialised as BF16 in device memory. Triton specifics (gathers, inline PTX, launch knobs,
the 16-row minimum of a dot) live here; the per-tile math is shared with the TPU body.

The low-bit loop (defaults ``gather="rows"``, ``int_to_float="asm"``, ``row_sums="deferred"``;
H200 numbers from BENCHMARKS.md, runs 7-13, 8 x 128k):

* Inline PTX turns 4 packed bytes into one plane's 4 float16 codes with 2 ``prmt`` (shared
  by the planes), 2 ``lop3`` and 2 ``fma.f16x2``: two codes per 32-bit instruction instead
  of one shift/mask/convert chain per code. ``lop3`` leaves plane ``i`` in place as
  ``1024 + 2**(i*bits) * c`` (float16 bits ``0x6400 | field``) and the ``fma`` scales it back
  to ``c`` exactly. Measured: 1.22 -> 1.02 ms.
* One 2-D pointer gather per tile, keys loaded already transposed (``[d/n, T]``), values
  ``[T, d/n]``: nothing but elementwise ops between a load and its dot, so Triton loads the
  packed bytes (cp.async, pipelined) and converts *them* to the tensor-core operand layout;
  the unpacked float16 planes never cross shared memory (confirmed in the sm_90 build of
  `notes/kernel_sass.py`). ``"prefetch"`` (the next block's tiles carried through the loop
  in registers) defeats that conversion and measured 0.79 vs 0.71 ms (run 11).
* ``row_sums="deferred"``: the softmax denominator and the zero-point correction are
  ``[Gp, T]`` tiles reduced once after the loop, so the row max is the only cross-warp
  reduction per step; the query carries ``scale_log2``. Measured 0.726 -> 0.713 ms with the
  row gather, 0.855 -> 0.775 with the prefetch (run 10).

`ncu` (run 11): 128 registers, 16 KB shared memory, 4 programs per SM, issue slots ~53% busy:
the loop is about half issue-bound, half latency-bound. BENCHMARKS.md lists what would close
the gap to the bandwidth targets.

The query transform and the value inverse are not applied per split program (measured
0.1-0.2 ms of float32 dots per call when each of ~512 programs repeated them): `head_matmul`
applies the query transform in a small prologue kernel, and `merge_splits` merges the split
partials (which hold only the real query rows) and applies the value inverse in one epilogue
kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import layout
from pallas_kernels.decode_attention import tiles as da

# Triton's tensor-core dot needs M >= 16, so the query group is padded to at least 16 rows.
MIN_GROUP_PAD = 16
FP_PAGES_PER_SPLIT = None  # the full-precision pages share the low-bit splits
MAX_SPLITS = None  # splits per sequence and head group: only the program target
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 2
HOISTS_TRANSFORMS = True
# Split partials merged by a Pallas kernel (GPU: `merge_splits`) or by XLA ops (TPU).
HAS_MERGE_KERNEL = True
# One inner loop: per-row gathers, inline-PTX unpack, deferred row sums. The other modes
# measured slower on the H200 and were deleted (their numbers: BENCHMARKS.md and
# notes/benchmarks_history.md): page gathers + reshape, hand prefetch of the next block,
# convert/exponent unpack, row sums reduced every step.
GATHER_MODES = ("rows",)
INT_TO_FLOAT = ("asm",)
DEFAULT_GATHER = "rows"
# Pages per inner step of the low-bit kernel: 4 (64 tokens at page 16) at 2 bits (at 8 x 128k
# on the H200: 0.68 vs 0.69 ms for 8, run 45); 8 when keys or values are 4-bit (0.76 vs 0.86
# ms uniform 4-bit, 2-bit keys + 4-bit values 0.75 vs 0.90, runs 44-45).
DEFAULT_PAGES_PER_BLOCK = 4
WIDE_PAGES_PER_BLOCK = 8
# Pages per step of the full-precision loop when the kernel also has a low-bit segment.
MIXED_FP_PAGES_PER_BLOCK = 1
DEFAULT_INT_TO_FLOAT = "asm"
ROW_SUMS = ("deferred",)
DEFAULT_ROW_SUMS = "deferred"
PROLOGUES = ("xla",)  # the query operands in XLA ops (`DecodeConfig.prologue`)


def _f16_bits(x: float) -> int:
    return int(np.asarray(x, np.float16).view(np.uint16))


def _plane_asm(bits: int, plane: int) -> str:
    """PTX for one code plane of 4 packed bytes ($2) -> 4 float16 codes ($0: bytes 0-1,
    $1: bytes 2-3; the low half of a register is the lower-numbered element).

    One input and one output: Triton can move a dot-operand layout conversion above it
    (``gather="rows"``, whose packed tiles are loaded straight into that layout).
    """
    shift = plane * bits
    mask = ((1 << bits) - 1) << shift
    scale, bias = _f16_bits(2.0**-shift), _f16_bits(-1024.0 * 2.0**-shift)
    pair = lambda v: f"0x{(v << 16) | v:08x}"  # noqa: E731
    return (
        "{ .reg .b32 lo, hi, t0, t1, s, c; "
        "prmt.b32 lo, $2, 0, 0x4140; "  # bytes 0, 1 -> low byte of each 16-bit half
        "prmt.b32 hi, $2, 0, 0x4342; "  # bytes 2, 3
        f"lop3.b32 t0, lo, {pair(mask)}, 0x64006400, 0xea; "  # (x & mask) | 0x6400
        f"lop3.b32 t1, hi, {pair(mask)}, 0x64006400, 0xea; "
        f"mov.b32 s, {pair(scale)}; "
        f"mov.b32 c, {pair(bias)}; "
        "fma.rn.f16x2 $0, t0, s, c; "  # (1024 + 2^shift c) 2^-shift - 1024 2^-shift = c
        "fma.rn.f16x2 $1, t1, s, c; }"
    )


def unpack_planes(
    packed: jax.Array,  # u8[..., m] a tile of packed bytes
    bits: int,
    int_to_float: str,
    interpret: bool,
) -> list[jax.Array]:  # n x f16[..., m]
    """`da.unpack_tile_planes`, with the inline-PTX ``"asm"`` mode for the GPU.

    One asm per plane: ptxas shares the planes' identical ``prmt`` (SASS of the H200 build
    shows 2 per 4 bytes, not 2 per plane), and a one-input one-output asm lets Triton move a
    dot-operand layout conversion above it (``gather="rows"``). In interpret mode ``"asm"``
    runs the ``"exponent"`` twin (PTX cannot run on the CPU); both produce the same exact
    float16 integers.
    """
    if int_to_float != "asm":
        return da.unpack_tile_planes(packed, bits, int_to_float)
    if interpret:
        return da.unpack_tile_planes(packed, bits, "exponent")
    out = jax.ShapeDtypeStruct(packed.shape, da.CODE_DOT_DTYPE)
    return [
        plgpu.elementwise_inline_asm(
            _plane_asm(bits, i),
            args=[packed],
            constraints="=r,=r,r",
            pack=4,
            result_shape_dtypes=[out],
        )[0]
        for i in range(layout.codes_per_byte(bits))
    ]


def _valid(tok0, length, t: int):
    """(valid_row bool[1, T], valid_col bool[T, 1]) for tokens ``tok0 .. tok0 + T``."""
    idx = tok0 + jnp.arange(t, dtype=jnp.int32)
    ok = idx < length
    return ok[None, :], ok[:, None]


def _n_blocks(length, start, tokens_per_block: int, max_blocks: int):
    """Blocks of this split holding at least one valid token (dynamic loop bound)."""
    n = (length - start + tokens_per_block - 1) // tokens_per_block
    return jnp.clip(n, 0, max_blocks)


def _kernel(*refs, cfg: da.DecodeConfig, has_lowbit: bool, interpret: bool):
    it = iter(refs)
    q_ref = next(it)  # f32[Gp, d], already in the transformed frame (see `head_matmul`)
    kfp_ref, vfp_ref, fptab_ref, fplen_ref = (next(it) for _ in range(4))
    if has_lowbit:
        kc_ref, vc_ref, ks_ref, kz_ref, vs_ref, vz_ref, lowtab_ref, lowlen_ref = (
            next(it) for _ in range(8)
        )
    o_ref, m_ref, l_ref = (next(it) for _ in range(3))

    d, n, w = cfg.head_dim, cfg.n_chunks, cfg.chunk
    ppb, page = cfg.pages_per_block, cfg.page_size
    t = ppb * page
    gp = cfg.group_pad
    split = pl.program_id(2)

    q_full = q_ref[...]  # f32[Gp, d]
    # Query chunks meet the key code planes; the output (n chunks of w) follows the values'.
    nk, wk = cfg.key_chunks, cfg.key_chunk
    q_chunks = [q_ref[:, pl.ds(i * wk, wk)] for i in range(nk)]

    m_i = jnp.full((gp,), da.NEG_INF, jnp.float32)
    l_i = jnp.zeros((gp,), jnp.float32)
    accs = tuple(jnp.zeros((gp, w), jnp.float32) for _ in range(n))

    # ---- full-precision pages (sink + recent; the whole cache for the BF16 baseline) -------
    fp_len = fplen_ref[0]
    fp_pps = fptab_ref.shape[0]
    fp_start = split * fp_pps * page
    q_fp = q_full.astype(kfp_ref.dtype)
    # Beside a low-bit segment the full-precision tiles stay small: Triton sizes shared memory
    # for the whole kernel, and [T, d] BF16 tiles (32 KB each at T = d = 128, multi-buffered)
    # held the mixed kernel to 2 programs per SM (H200 run 8: 102 KB per program) although
    # this loop only covers the few hundred sink + recent tokens.
    fp_ppb = min(ppb, MIXED_FP_PAGES_PER_BLOCK) if has_lowbit else ppb
    fp_t = fp_ppb * page

    def fp_body(j, carry):
        m_prev, l_prev, acc = carry
        pages = fptab_ref[pl.ds(j * fp_ppb, fp_ppb)]  # i32[fp_ppb]
        tok0 = fp_start + j * fp_t
        vrow, vcol = _valid(tok0, fp_len, fp_t)
        k = kfp_ref[pages].reshape(fp_t, d)
        k = jnp.where(vcol, k, 0)  # unused slots may hold NaN
        logits = da._dot_nt(q_fp, k) * cfg.scale_log2  # [Gp, T]
        p, m_new, alpha, l_new = da.tile_softmax_step(logits, vrow, m_prev, l_prev)
        p_lo = p.astype(vfp_ref.dtype)
        new = []
        for i in range(n):
            v = vfp_ref[pages, :, pl.ds(i * w, w)].reshape(fp_t, w)
            v = jnp.where(vcol, v, 0)
            new.append(acc[i] * alpha[:, None] + da._dot_nn(p_lo, v))
        return m_new, l_new, tuple(new)

    nb = _n_blocks(fp_len, fp_start, fp_t, fp_pps // fp_ppb)
    m_i, l_i, accs = jax.lax.fori_loop(0, nb, fp_body, (m_i, l_i, accs))

    # ---- low-bit pages ----------------------------------------------------------------------
    if has_lowbit:
        ng = cfg.num_groups
        pg, kpg = cfg.plane_group, cfg.key_plane_group  # value planes', key planes' groups
        bits_k, bits_v = cfg.bits, cfg.value_bits
        low_len = lowlen_ref[0]
        low_pps = lowtab_ref.shape[0]
        low_start = split * low_pps * page
        mw, mwv = cfg.packed_width, cfg.value_packed_width
        # Logits in base-2 units straight out of the dots: scale_log2 rides on the query.
        q_chunks16 = [(c * cfg.scale_log2).astype(da.CODE_DOT_DTYPE) for c in q_chunks]
        q_sums = da.tile_group_sums(q_chunks16, kpg, ng)
        rows = jnp.arange(t, dtype=jnp.int32)
        row_page, row_slot = rows // page, rows % page  # block-relative page, slot in page
        cols = jnp.arange(mw, dtype=jnp.int32)
        cols_v = cols if mwv == mw else jnp.arange(mwv, dtype=jnp.int32)
        # Stored scale/zero to float32: a cast, or the 8-bit decode (`layout`), per pool.
        decoders = (
            layout.decode_scale,
            lambda x: layout.decode_zero(x, bits_k),
            layout.decode_scale,
            lambda x: layout.decode_zero(x, bits_v),
        )

        def phys_of(j):  # i32[T] physical page of each row of block j
            return lowtab_ref[j * ppb + row_page]

        def load_block(phys):
            """Raw tiles of a block: packed K [mw, T] (gathered transposed, per row), packed
            V [T, mw], and per-group [1, T] scale/zero rows (unmasked)."""
            kp = kc_ref[phys[None, :], row_slot[None, :], cols[:, None]]  # u8[mw, T]
            vp = vc_ref[phys[:, None], row_slot[:, None], cols_v[None, :]]  # u8[T, mwv]
            metas = tuple(
                tuple(ref[phys, row_slot, g].reshape(1, t) for g in range(ng))
                for ref in (ks_ref, kz_ref, vs_ref, vz_ref)
            )
            return kp, vp, metas

        def attend_block(j, blk, carry):
            m_prev, acc, l_t, corr_t = carry
            kp, vp, metas = blk
            vrow, _ = _valid(low_start + j * t, low_len, t)
            # Masked with where so NaN in unused slots' scales/zeros cannot leak.
            ks, kz, vs, vz = (
                [jnp.where(vrow, dec(x), 0.0) for x in rows_of]
                for dec, rows_of in zip(decoders, metas)
            )
            planes = unpack_planes(kp, bits_k, cfg.int_to_float, interpret)
            logits = da.tile_lowbit_logits(
                q_chunks16, q_sums, planes, ks, kz, kpg, keys_transposed=True
            )  # base-2 units: the query chunks carry scale_log2
            # Invalid slots get a finite -inf, so exp2 makes them exactly 0 without a second
            # select (m_new is finite: every visited block holds a valid token).
            logits = jnp.where(vrow, logits, da.NEG_INF)
            m_new = jnp.maximum(m_prev, jnp.max(logits, axis=1))
            alpha = jnp.exp2(m_prev - m_new)
            p = jnp.exp2(logits - m_new[:, None])
            planes = unpack_planes(vp, bits_v, cfg.int_to_float, interpret)
            w16 = [(p * vs[g]).astype(da.CODE_DOT_DTYPE) for g in range(ng)]
            # Rounded weights in the correction, so it matches what the dot summed exactly.
            wz = [w16[g].astype(jnp.float32) * vz[g] for g in range(ng)]
            # l and the zero-point correction stay [Gp, T] tiles, rescaled like the
            # accumulators and reduced once after the loop: the row max is the only cross-warp
            # reduction per step.
            l_t = l_t * alpha[:, None] + p
            corr_t = tuple(corr_t[g] * alpha[:, None] + wz[g] for g in range(ng))
            ups = [da._dot_nn(w16[pg[i]], planes[i]) for i in range(n)]
            acc = tuple(acc[i] * alpha[:, None] + ups[i] for i in range(n))
            return m_new, acc, l_t, corr_t

        nb = _n_blocks(low_len, low_start, t, low_pps // ppb)
        l_t0 = jnp.zeros((gp, t), jnp.float32)
        zero_corr = tuple(jnp.zeros((gp, t), jnp.float32) for _ in range(ng))

        def lowbit_body(j, carry):
            return attend_block(j, load_block(phys_of(j)), carry)

        state = jax.lax.fori_loop(0, nb, lowbit_body, (m_i, accs, l_t0, zero_corr))
        m_q, accs, l_t, corr_t = state
        # The full-precision part's l_i and the deferred tiles, both at the final max.
        l_i = l_i * jnp.exp2(m_i - m_q) + jnp.sum(l_t, axis=1)
        corr = [jnp.sum(c, axis=1)[:, None] for c in corr_t]
        accs = tuple(accs[i] - corr[pg[i]] for i in range(n))
        m_i = m_q

    # Only the real query rows leave the kernel: the partial arrays hold `cfg.group` rows, the
    # [Gp, ...] blocks overhang them, and the masked stores keep the padding rows out.
    if cfg.group is None or cfg.group == gp:
        for i in range(n):
            o_ref[:, pl.ds(i * w, w)] = accs[i]
        m_ref[...] = m_i
        l_ref[...] = l_i
    else:
        real = jnp.arange(gp, dtype=jnp.int32) < cfg.group
        for i in range(n):
            plgpu.store(o_ref.at[:, pl.ds(i * w, w)], accs[i], mask=real[:, None])
        plgpu.store(m_ref, m_i, mask=real)
        plgpu.store(l_ref, l_i, mask=real)


def paged_decode(
    cfg: da.DecodeConfig,
    qg: jax.Array,  # f32[B, Hkv, Gp, d]
    query_transform: jax.Array | None,  # f32[Hkv, d, d]
    value_inverse: jax.Array | None,  # f32[Hkv, d, d]
    fp_set: tuple,  # (k_fp, v_fp [P, Hkv, page, d], table i32[B, S, pps], len i32[B])
    lowbit_set: tuple | None,  # (kc, vc, ks, kz, vs, vz, table i32[B, S, pps], len i32[B])
    *,
    interpret: bool,
    num_warps: int | None,
    num_stages: int | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Runs the split kernel; returns (acc f32[B,Hkv,S,R,d], m, l f32[B,Hkv,S,R]) with
    ``R = cfg.group`` real query rows (``Gp`` when ``cfg.group`` is None).

    The transforms are applied by `head_matmul` around this kernel (``HOISTS_TRANSFORMS``),
    so ``query_transform`` and ``value_inverse`` must be None here.
    """
    if query_transform is not None or value_inverse is not None:
        raise ValueError("the GPU split kernel takes no transforms; use head_matmul around it")
    b, hkv, gp, d = qg.shape
    rows = gp if cfg.group is None else cfg.group  # partial rows written (see `_kernel`)
    k_fp, v_fp, fp_tab, fp_len = fp_set
    s = fp_tab.shape[1]

    def pool_spec(a):
        p_, _, page, x = a.shape
        return pl.BlockSpec((p_, None, page, x), lambda bi, h, si: (0, h, 0, 0))

    def table_spec(tab):
        return pl.BlockSpec((None, None, tab.shape[2]), lambda bi, h, si: (bi, si, 0))

    len_spec = pl.BlockSpec((None, 1), lambda bi, h, si: (bi, 0))

    args = [qg]
    specs = [pl.BlockSpec((None, None, gp, d), lambda bi, h, si: (bi, h, 0, 0))]
    args += [k_fp, v_fp, fp_tab, fp_len.reshape(b, 1)]
    specs += [pool_spec(k_fp), pool_spec(v_fp), table_spec(fp_tab), len_spec]
    if lowbit_set is not None:
        kc, vc, ks, kz, vs, vz, low_tab, low_len = lowbit_set
        args += [kc, vc, ks, kz, vs, vz, low_tab, low_len.reshape(b, 1)]
        specs += [pool_spec(a) for a in (kc, vc, ks, kz, vs, vz)]
        specs += [table_spec(low_tab), len_spec]

    kernel = functools.partial(
        _kernel, cfg=cfg, has_lowbit=lowbit_set is not None, interpret=interpret
    )
    name = "paged_decode_" + ("bf16" if lowbit_set is None else f"int{cfg.bits}")
    if lowbit_set is not None and cfg.value_bits != cfg.bits:
        name += f"_v{cfg.value_bits}"
    return pl.pallas_call(
        kernel,
        grid=(b, hkv, s),
        in_specs=specs,
        out_specs=[
            pl.BlockSpec((None, None, None, gp, d), lambda bi, h, si: (bi, h, si, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda bi, h, si: (bi, h, si, 0)),
            pl.BlockSpec((None, None, None, gp), lambda bi, h, si: (bi, h, si, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, s, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, s, rows), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, s, rows), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(
            num_warps=num_warps or DEFAULT_NUM_WARPS,
            num_stages=num_stages or DEFAULT_NUM_STAGES,
        ),
        interpret=interpret,
        name=name,
    )(*args)


# Output columns per `head_matmul` program: 4 programs per (sequence, KV head) at d = 128, so
# the float32 [Gp, d] x [d, d] product is not one program's serial chain.
HEAD_MATMUL_COLS = 32


def _head_matmul_kernel(x_ref, mat_ref, o_ref):
    o_ref[...] = da._dot_nn(x_ref[...], mat_ref[...], precision=jax.lax.Precision.HIGHEST)


def head_matmul(
    x: jax.Array,  # f32[B, Hkv, Gp, d]
    mat: jax.Array,  # f32[Hkv, d, d]
    *,
    interpret: bool,
) -> jax.Array:  # f32[B, Hkv, Gp, d] = x[b, h] @ mat[h]
    """Per-KV-head float32 matmul: the query-transform prologue.

    Programs per (sequence, KV head, block of `HEAD_MATMUL_COLS` output columns), float32 at
    HIGHEST precision.
    """
    b, hkv, gp, d = x.shape
    cols = min(d, HEAD_MATMUL_COLS)
    return pl.pallas_call(
        _head_matmul_kernel,
        grid=(b, hkv, d // cols),
        in_specs=[
            pl.BlockSpec((None, None, gp, d), lambda bi, h, c: (bi, h, 0, 0)),
            pl.BlockSpec((None, d, cols), lambda bi, h, c: (h, 0, c)),
        ],
        out_specs=pl.BlockSpec((None, None, gp, cols), lambda bi, h, c: (bi, h, 0, c)),
        out_shape=jax.ShapeDtypeStruct((b, hkv, gp, d), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="paged_decode_head_matmul",
    )(x, mat)


# Warps of the merge kernel: its [d, d] value-inverse tile is 64 KB of float32 registers.
MERGE_NUM_WARPS = 8


def _merge_kernel(*refs, splits: tuple[int, ...], splits_pad: tuple[int, ...], has_vi: bool):
    """One (sequence, KV head, query row): ``(acc, m, l)`` refs of each partial set, then the
    value inverse (``has_vi``), then the output."""
    sets = [refs[3 * i : 3 * i + 3] for i in range(len(splits))]
    vi_ref = refs[3 * len(splits)] if has_vi else None
    o_ref = refs[-1]
    accs, ms, ls = [], [], []
    for (acc_ref, m_ref, l_ref), s, s_pad in zip(sets, splits, splits_pad):
        ok = jnp.arange(s_pad, dtype=jnp.int32) < s  # the block overhangs the splits
        accs.append(plgpu.load(acc_ref, mask=ok[:, None], other=0.0))  # [S_pad, d]
        ms.append(plgpu.load(m_ref, mask=ok, other=da.NEG_INF))  # [S_pad]
        ls.append(plgpu.load(l_ref, mask=ok, other=0.0))
    # The log-sum-exp merge of `da._merge_partials` over every set's splits.
    m_all = functools.reduce(jnp.maximum, [jnp.max(m) for m in ms])
    ws = [jnp.exp2(m - m_all) for m in ms]  # 0 for padding and empty splits unless all are
    l_all = sum(jnp.sum(w * l) for w, l in zip(ws, ls))
    o = sum(jnp.sum(w[:, None] * acc, axis=0) for w, acc in zip(ws, accs))
    o = o / jnp.where(l_all > 0, l_all, 1.0)  # [d]
    if vi_ref is not None:
        # o @ B_V as a broadcast multiply and column sum: exact float32 products (what
        # HIGHEST asks of the dot) without the 16-row minimum of a tensor-core dot.
        o = jnp.sum(o[:, None] * vi_ref[...], axis=0)
    o_ref[...] = o


def merge_splits(
    acc: jax.Array,  # f32[B, Hkv, S, R, d] unnormalised split partials
    m: jax.Array,  # f32[B, Hkv, S, R]
    l: jax.Array,  # f32[B, Hkv, S, R]
    value_inverse: jax.Array | None,  # f32[Hkv, d, d] or None
    *,
    interpret: bool,
    second: tuple[jax.Array, jax.Array, jax.Array] | None = None,
) -> jax.Array:  # f32[B, Hkv, R, d]
    """Log-sum-exp merge of the split partials and the value-inverse epilogue in one kernel.

    One program per (sequence, KV head, query row) reads that row's ``[S, d]`` partials (the
    split axis padded to a power of two through masked loads) and, when given, its head's
    ``B_V``. Replaces the XLA merge (four fusions) and the `head_matmul` epilogue: at 1 x 64k
    those were ~17 us of ~30 us fixed cost on the H200 (run 11, ncu kernel listing).

    ``second``: another set of partials merged with the first (``acc f32[B, Hkv, S2, R2, d]``,
    ``m, l f32[B, Hkv, S2, R3]``, ``R2, R3 >= R``: rows past ``R`` are not read), so two
    kernels' partials need no concatenation before the merge.
    """
    b, hkv, s, r, d = acc.shape
    s_pad = 1 << (s - 1).bit_length()
    specs = [
        pl.BlockSpec((None, None, s_pad, None, d), lambda bi, h, ri: (bi, h, 0, ri, 0)),
        pl.BlockSpec((None, None, s_pad, None), lambda bi, h, ri: (bi, h, 0, ri)),
        pl.BlockSpec((None, None, s_pad, None), lambda bi, h, ri: (bi, h, 0, ri)),
    ]
    args = [acc, m, l]
    splits, splits_pad = [s], [s_pad]
    if second is not None:
        acc2, m2, l2 = second
        s2 = acc2.shape[2]
        s2_pad = 1 << (s2 - 1).bit_length()
        if acc2.shape[:2] != (b, hkv) or acc2.shape[3] < r or acc2.shape[4] != d:
            raise ValueError(f"{acc2.shape=} must be [B={b}, Hkv={hkv}, S2, >={r}, d={d}]")
        specs += [
            pl.BlockSpec((None, None, s2_pad, None, d), lambda bi, h, ri: (bi, h, 0, ri, 0)),
            pl.BlockSpec((None, None, s2_pad, None), lambda bi, h, ri: (bi, h, 0, ri)),
            pl.BlockSpec((None, None, s2_pad, None), lambda bi, h, ri: (bi, h, 0, ri)),
        ]
        args += [acc2, m2, l2]
        splits.append(s2)
        splits_pad.append(s2_pad)
    if value_inverse is not None:
        specs.append(pl.BlockSpec((None, d, d), lambda bi, h, ri: (h, 0, 0)))
        args.append(value_inverse)
    kernel = functools.partial(
        _merge_kernel,
        splits=tuple(splits),
        splits_pad=tuple(splits_pad),
        has_vi=value_inverse is not None,
    )
    return pl.pallas_call(
        kernel,
        grid=(b, hkv, r),
        in_specs=specs,
        out_specs=pl.BlockSpec((None, None, None, d), lambda bi, h, ri: (bi, h, ri, 0)),
        out_shape=jax.ShapeDtypeStruct((b, hkv, r, d), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=MERGE_NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="paged_decode_merge",
    )(*args)
