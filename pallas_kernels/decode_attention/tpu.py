"""Pallas Mosaic (TPU) body of the paged mixed-precision decode attention.

Grid ``(B, Hkv, S, J)`` with ``J = fp pages per split + low-bit pages per split``. Page tables
and lengths are scalar-prefetched into SMEM, and each BlockSpec's index map looks up the page
of step ``j``, so the pipeline DMAs exactly one page of each pool per step (fp pages first,
then low-bit pages; a pool whose block index does not change is not re-fetched). The online
softmax state lives in VMEM scratch across the ``j`` axis; the per-tile math is shared with the
GPU body. Verified on CPU in interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import layout
from pallas_kernels.decode_attention import tiles as da

# A query group is padded to whole sublanes (8 rows of f32).
MIN_GROUP_PAD = 8
FP_PAGES_PER_SPLIT = None  # the full-precision pages share the low-bit splits
MAX_SPLITS = None  # splits per sequence and head group: only the program target
# The Mosaic body applies the transforms per split program and dots one code plane at a time.
HOISTS_TRANSFORMS = False
# Split partials merged by a Pallas kernel (GPU: `merge_splits`) or by XLA ops (TPU).
HAS_MERGE_KERNEL = False
GATHER_MODES = ("pages",)  # one page per grid step through BlockSpecs
INT_TO_FLOAT = ("convert", "exponent")
DEFAULT_GATHER = "pages"
# The Mosaic body reads one page per grid step; pages_per_block is a GPU knob.
DEFAULT_PAGES_PER_BLOCK = 1
WIDE_PAGES_PER_BLOCK = 1  # (4-bit widths: the same)
DEFAULT_INT_TO_FLOAT = "convert"
ROW_SUMS = ("per_step",)
DEFAULT_ROW_SUMS = "per_step"
PROLOGUES = ("xla",)  # the query operands in XLA ops (`DecodeConfig.prologue`)


def _kernel(
    fptab_ref,  # SMEM i32[B * S * fp_pps]
    fplen_ref,  # SMEM i32[B]
    lowtab_ref,  # SMEM i32[B * S * low_pps] (dummy when there is no low-bit set)
    lowlen_ref,  # SMEM i32[B]
    *refs,
    cfg: da.DecodeConfig,
    has_lowbit: bool,
    fp_pps: int,
    low_pps: int,
):
    del fptab_ref, lowtab_ref  # only the index maps read the tables
    it = iter(refs)
    q_ref = next(it)  # f32[Gp, d]
    qt_ref = next(it) if cfg.has_query_transform else None
    vi_ref = next(it) if cfg.has_value_inverse else None
    kfp_ref, vfp_ref = next(it), next(it)  # [page, d]
    if has_lowbit:
        kc_ref, vc_ref, ks_ref, kz_ref, vs_ref, vz_ref = (next(it) for _ in range(6))
    o_ref, m_out, l_out = next(it), next(it), next(it)
    m_sc, l_sc, acc_sc = next(it), next(it), next(it)  # [Gp], [Gp], [n, Gp, w]

    b, split, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    n, w, page = cfg.n_chunks, cfg.chunk, cfg.page_size

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, da.NEG_INF, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    nk, wk = cfg.key_chunks, cfg.key_chunk  # query chunks meet the key code planes

    def query_chunks():
        q = q_ref[...]
        if qt_ref is None:
            return q, [q_ref[:, pl.ds(i * wk, wk)] for i in range(nk)]
        q_full = da._dot_nn(q, qt_ref[...], precision=jax.lax.Precision.HIGHEST)
        cols = [qt_ref[:, pl.ds(i * wk, wk)] for i in range(nk)]
        return q_full, da.tile_query_chunks(q, cols, None)

    def valid(tok0, length):
        idx = tok0 + jax.lax.broadcasted_iota(jnp.int32, (1, page), 1)
        return idx < length, (tok0 + jax.lax.broadcasted_iota(jnp.int32, (page, 1), 0)) < length

    def update(p, alpha, ups, m_new, l_new):
        for i in range(n):
            acc_sc[i] = acc_sc[i] * alpha[:, None] + ups[i]
        m_sc[...] = m_new
        l_sc[...] = l_new

    fp_tok0 = (split * fp_pps + j) * page
    fp_len = fplen_ref[b]

    @pl.when((j < fp_pps) & (fp_tok0 < fp_len))
    def _fp_page():
        q_full, _ = query_chunks()
        vrow, vcol = valid(fp_tok0, fp_len)
        k = jnp.where(vcol, kfp_ref[...], 0)  # unused slots may hold NaN
        logits = da._dot_nt(q_full.astype(kfp_ref.dtype), k) * cfg.scale_log2
        p, m_new, alpha, l_new = da.tile_softmax_step(logits, vrow, m_sc[...], l_sc[...])
        p_lo = p.astype(vfp_ref.dtype)
        ups = []
        for i in range(n):
            v = jnp.where(vcol, vfp_ref[:, pl.ds(i * w, w)], 0)
            ups.append(da._dot_nn(p_lo, v))
        update(p, alpha, ups, m_new, l_new)

    if has_lowbit:
        low_tok0 = (split * low_pps + (j - fp_pps)) * page
        low_len = lowlen_ref[b]

        @pl.when((j >= fp_pps) & (low_tok0 < low_len))
        def _lowbit_page():
            _, q_chunks = query_chunks()
            ng, pg, kpg = cfg.num_groups, cfg.plane_group, cfg.key_plane_group
            q16 = [c.astype(da.CODE_DOT_DTYPE) for c in q_chunks]
            q_sums = da.tile_group_sums(q16, kpg, ng)
            vrow, _ = valid(low_tok0, low_len)

            def meta(ref, decode):
                x = decode(ref[...]).T  # f32[ng, page]: a cast, or the 8-bit decode (`layout`)
                return [jnp.where(vrow, x[g : g + 1, :], 0.0) for g in range(ng)]

            def zeros_of(bits):
                return lambda x: layout.decode_zero(x, bits)

            kplanes = da.unpack_tile_planes(kc_ref[...], cfg.bits, cfg.int_to_float)
            ks, kz = meta(ks_ref, layout.decode_scale), meta(kz_ref, zeros_of(cfg.bits))
            logits = da.tile_lowbit_logits(q16, q_sums, kplanes, ks, kz, kpg)
            p, m_new, alpha, l_new = da.tile_softmax_step(
                logits * cfg.scale_log2, vrow, m_sc[...], l_sc[...]
            )
            vplanes = da.unpack_tile_planes(vc_ref[...], cfg.value_bits, cfg.int_to_float)
            vs, vz = meta(vs_ref, layout.decode_scale), meta(vz_ref, zeros_of(cfg.value_bits))
            ups = da.tile_lowbit_values(p, vplanes, vs, vz, pg)
            update(p, alpha, ups, m_new, l_new)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        if vi_ref is not None:
            out = None
            for i in range(n):
                part = da._dot_nn(
                    acc_sc[i], vi_ref[pl.ds(i * w, w), :], precision=jax.lax.Precision.HIGHEST
                )
                out = part if out is None else out + part
            o_ref[...] = out
        else:
            for i in range(n):
                o_ref[:, pl.ds(i * w, w)] = acc_sc[i]
        m_out[...] = m_sc[...]
        l_out[...] = l_sc[...]


def paged_decode(
    cfg: da.DecodeConfig,
    qg: jax.Array,  # f32[B, Hkv, Gp, d]
    query_transform: jax.Array | None,  # f32[Hkv, d, d]
    value_inverse: jax.Array | None,  # f32[Hkv, d, d]
    fp_set: tuple,  # (k_fp, v_fp [P, Hkv, page, d], table i32[B, S, pps], len i32[B])
    lowbit_set: tuple | None,  # (kc, vc, ks, kz, vs, vz, table i32[B, S, pps], len i32[B])
    *,
    interpret: bool,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Runs the split kernel; returns (acc f32[B,Hkv,S,Gp,d], m, l f32[B,Hkv,S,Gp])."""
    del num_warps, num_stages  # GPU launch knobs
    b, hkv, gp, d = qg.shape
    k_fp, v_fp, fp_tab, fp_len = fp_set
    s, fp_pps = fp_tab.shape[1], fp_tab.shape[2]
    if lowbit_set is not None:
        low_tab, low_len = lowbit_set[6], lowbit_set[7]
        low_pps = low_tab.shape[2]
    else:
        low_tab, low_len, low_pps = jnp.zeros((b, s, 1), jnp.int32), jnp.zeros((b,), jnp.int32), 0
    n_steps = fp_pps + low_pps

    def fp_page(bi, si, j, fpt):
        jj = jnp.minimum(j, fp_pps - 1)
        return fpt[(bi * s + si) * fp_pps + jj]

    def lowbit_page(bi, si, j, qt):
        jj = jnp.clip(j - fp_pps, 0, max(low_pps - 1, 0))
        return qt[(bi * s + si) * max(low_pps, 1) + jj]

    def fp_spec(a):
        return pl.BlockSpec(
            (None, None, a.shape[2], a.shape[3]),
            lambda bi, h, si, j, fpt, fl, qt, ql: (fp_page(bi, si, j, fpt), h, 0, 0),
        )

    def q_spec(a):
        return pl.BlockSpec(
            (None, None, a.shape[2], a.shape[3]),
            lambda bi, h, si, j, fpt, fl, qt, ql: (lowbit_page(bi, si, j, qt), h, 0, 0),
        )

    mat_spec = pl.BlockSpec((None, d, d), lambda bi, h, si, j, *_: (h, 0, 0))
    args = [qg]
    specs = [pl.BlockSpec((None, None, gp, d), lambda bi, h, si, j, *_: (bi, h, 0, 0))]
    for mat in (query_transform, value_inverse):
        if mat is not None:
            args.append(mat)
            specs.append(mat_spec)
    args += [k_fp, v_fp]
    specs += [fp_spec(k_fp), fp_spec(v_fp)]
    if lowbit_set is not None:
        pools = lowbit_set[:6]
        args += list(pools)
        specs += [q_spec(a) for a in pools]

    n, w = cfg.n_chunks, cfg.chunk
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(b, hkv, s, n_steps),
        in_specs=specs,
        out_specs=[
            pl.BlockSpec((None, None, None, gp, d), lambda bi, h, si, j, *_: (bi, h, si, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda bi, h, si, j, *_: (bi, h, si, 0)),
            pl.BlockSpec((None, None, None, gp), lambda bi, h, si, j, *_: (bi, h, si, 0)),
        ],
        scratch_shapes=[
            pltpu.VMEM((gp,), jnp.float32),
            pltpu.VMEM((gp,), jnp.float32),
            pltpu.VMEM((n, gp, w), jnp.float32),
        ],
    )
    kernel = functools.partial(
        _kernel, cfg=cfg, has_lowbit=lowbit_set is not None, fp_pps=fp_pps, low_pps=low_pps
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, s, gp, d), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, s, gp), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, s, gp), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
    )(fp_tab.reshape(-1), fp_len, low_tab.reshape(-1), low_len, *args)
