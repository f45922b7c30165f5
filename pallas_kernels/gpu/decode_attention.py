"""Pallas Triton-backend body of the paged mixed-precision decode attention.

Grid ``(B, Hkv, S)``: one program per (sequence, KV head, split). The program reads its KV
head's pages once for the whole (padded) query group, which is the M dimension of every
tensor-core dot. Pages are gathered ``pages_per_block`` at a time straight from the pools
through the page table (a pointer gather), so packed codes are unpacked in registers and never
materialised as BF16 in device memory. Triton specifics (gathers, launch knobs, the 16-row
minimum of a dot) live here; the per-tile math is shared with the TPU body.

The query transform and the value inverse are not applied per split program: `head_matmul`
runs them once per (sequence, KV head) as a small prologue kernel on the query and an epilogue
kernel on the merged output (measured: 0.1-0.2 ms of float32 dots per call when each of the
~512 split programs repeated them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import decode_attention as da

# Triton's tensor-core dot needs M >= 16, so the query group is padded to at least 16 rows.
MIN_GROUP_PAD = 16
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 2
HOISTS_TRANSFORMS = True
UNPACK_MODES = ("planes", "full")
# Measured on an H200 (results/bench_decode_h200_run4.json, 8 x 128k, int2): planes+exponent
# 1.19 ms, planes+convert 1.24 ms, full+convert 1.52 ms, full+exponent 1.58 ms. Building the
# full [T, d] tile costs more (the reshape of the stacked planes is a layout conversion) than
# the n-1 extra narrow dots it saves.
DEFAULT_UNPACK = "planes"
DEFAULT_INT_TO_FLOAT = "exponent"


def _valid(tok0, length, t: int):
    """(valid_row bool[1, T], valid_col bool[T, 1]) for tokens ``tok0 .. tok0 + T``."""
    idx = tok0 + jnp.arange(t, dtype=jnp.int32)
    ok = idx < length
    return ok[None, :], ok[:, None]


def _n_blocks(length, start, tokens_per_block: int, max_blocks: int):
    """Blocks of this split holding at least one valid token (dynamic loop bound)."""
    n = (length - start + tokens_per_block - 1) // tokens_per_block
    return jnp.clip(n, 0, max_blocks)


def _kernel(*refs, cfg: da.DecodeConfig, has_lowbit: bool):
    it = iter(refs)
    q_ref = next(it)  # f32[Gp, d]
    qt_ref = next(it) if cfg.has_query_transform else None  # f32[d, d]
    vi_ref = next(it) if cfg.has_value_inverse else None  # f32[d, d]
    kfp_ref, vfp_ref, fptab_ref, fplen_ref = (next(it) for _ in range(4))
    if has_lowbit:
        kc_ref, vc_ref, ks_ref, kz_ref, vs_ref, vz_ref, qtab_ref, qlen_ref = (
            next(it) for _ in range(8)
        )
    o_ref, m_ref, l_ref = (next(it) for _ in range(3))

    d, n, w = cfg.head_dim, cfg.n_chunks, cfg.chunk
    ppb, page = cfg.pages_per_block, cfg.page_size
    t = ppb * page
    gp = cfg.group_pad
    split = pl.program_id(2)

    q = q_ref[...]  # f32[Gp, d]
    if qt_ref is not None:
        q_full = da._dot_nn(q, qt_ref[...], precision=jax.lax.Precision.HIGHEST)
        cols = [qt_ref[:, pl.ds(i * w, w)] for i in range(n)]  # n x [d, w]
        q_chunks = da.tile_query_chunks(q, cols, None)
    else:
        q_full = q
        q_chunks = [q_ref[:, pl.ds(i * w, w)] for i in range(n)]

    m_i = jnp.full((gp,), da.NEG_INF, jnp.float32)
    l_i = jnp.zeros((gp,), jnp.float32)
    accs = tuple(jnp.zeros((gp, w), jnp.float32) for _ in range(n))

    # ---- full-precision pages (sink + recent; the whole cache for the BF16 baseline) -------
    fp_len = fplen_ref[0]
    fp_pps = fptab_ref.shape[0]
    fp_start = split * fp_pps * page
    q_fp = q_full.astype(kfp_ref.dtype)

    def fp_body(j, carry):
        m_prev, l_prev, acc = carry
        pages = fptab_ref[pl.ds(j * ppb, ppb)]  # i32[ppb]
        tok0 = fp_start + j * t
        vrow, vcol = _valid(tok0, fp_len, t)
        k = kfp_ref[pages].reshape(t, d)
        k = jnp.where(vcol, k, 0)  # unused slots may hold NaN
        logits = da._dot_nt(q_fp, k) * cfg.scale_log2  # [Gp, T]
        p, m_new, alpha, l_new = da.tile_softmax_step(logits, vrow, m_prev, l_prev)
        p_lo = p.astype(vfp_ref.dtype)
        new = []
        for i in range(n):
            v = vfp_ref[pages, :, pl.ds(i * w, w)].reshape(t, w)
            v = jnp.where(vcol, v, 0)
            new.append(acc[i] * alpha[:, None] + da._dot_nn(p_lo, v))
        return m_new, l_new, tuple(new)

    nb = _n_blocks(fp_len, fp_start, t, fp_pps // ppb)
    m_i, l_i, accs = jax.lax.fori_loop(0, nb, fp_body, (m_i, l_i, accs))

    # ---- low-bit pages ----------------------------------------------------------------------
    if has_lowbit:
        ng = cfg.num_groups
        q16 = q_full.astype(da.CODE_DOT_DTYPE)
        q_len = qlen_ref[0]
        q_pps = qtab_ref.shape[0]
        q_start = split * q_pps * page
        mw = cfg.packed_width
        full = cfg.unpack == "full"
        if full:
            masks = da.group_masks(d, cfg.group_size)
            q_groups, q_sums = da.tile_full_query(q16, masks)
        else:
            pg = cfg.plane_group
            q_chunks16 = [c.astype(da.CODE_DOT_DTYPE) for c in q_chunks]
            q_sums = da.tile_group_sums(q_chunks16, pg, ng)

        def meta(ref, pages, vrow):
            # Per-group [1, T] rows; masked with where so NaN in unused slots cannot leak.
            out = []
            for g in range(ng):
                x = ref[pages, :, g].reshape(1, t).astype(jnp.float32)
                out.append(jnp.where(vrow, x, 0.0))
            return out

        def q_body(j, carry):
            m_prev, l_prev, acc = carry
            pages = qtab_ref[pl.ds(j * ppb, ppb)]
            tok0 = q_start + j * t
            vrow, _ = _valid(tok0, q_len, t)
            ks, kz = meta(ks_ref, pages, vrow), meta(kz_ref, pages, vrow)
            kpacked = kc_ref[pages].reshape(t, mw)
            if full:
                kcodes = da.unpack_tile_full(kpacked, cfg.bits, cfg.int_to_float)
                logits = da.tile_lowbit_logits_full(q_groups, q_sums, kcodes, ks, kz)
            else:
                kplanes = da.unpack_tile_planes(kpacked, cfg.bits, cfg.int_to_float)
                logits = da.tile_lowbit_logits(q_chunks16, q_sums, kplanes, ks, kz, pg)
            p, m_new, alpha, l_new = da.tile_softmax_step(
                logits * cfg.scale_log2, vrow, m_prev, l_prev
            )
            vs, vz = meta(vs_ref, pages, vrow), meta(vz_ref, pages, vrow)
            vpacked = vc_ref[pages].reshape(t, mw)
            if full:
                vcodes = da.unpack_tile_full(vpacked, cfg.bits, cfg.int_to_float)
                ups = [da.tile_lowbit_values_full(p, vcodes, vs, vz, masks)]
            else:
                vplanes = da.unpack_tile_planes(vpacked, cfg.bits, cfg.int_to_float)
                ups = da.tile_lowbit_values(p, vplanes, vs, vz, pg)
            new = tuple(acc[i] * alpha[:, None] + ups[i] for i in range(n))
            return m_new, l_new, new

        nb = _n_blocks(q_len, q_start, t, q_pps // ppb)
        m_i, l_i, accs = jax.lax.fori_loop(0, nb, q_body, (m_i, l_i, accs))

    # ---- value inverse on the partial output (linear, so it commutes with the merge) -------
    if vi_ref is not None:
        out = None
        for i in range(n):
            part = da._dot_nn(
                accs[i], vi_ref[pl.ds(i * w, w), :], precision=jax.lax.Precision.HIGHEST
            )
            out = part if out is None else out + part
        o_ref[...] = out
    else:
        for i in range(n):
            o_ref[:, pl.ds(i * w, w)] = accs[i]
    m_ref[...] = m_i
    l_ref[...] = l_i


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
    """Runs the split kernel; returns (acc f32[B,Hkv,S,Gp,d], m, l f32[B,Hkv,S,Gp])."""
    b, hkv, gp, d = qg.shape
    k_fp, v_fp, fp_tab, fp_len = fp_set
    s = fp_tab.shape[1]

    def pool_spec(a):
        p_, _, page, x = a.shape
        return pl.BlockSpec((p_, None, page, x), lambda bi, h, si: (0, h, 0, 0))

    def table_spec(tab):
        return pl.BlockSpec((None, None, tab.shape[2]), lambda bi, h, si: (bi, si, 0))

    len_spec = pl.BlockSpec((None, 1), lambda bi, h, si: (bi, 0))
    mat_spec = pl.BlockSpec((None, d, d), lambda bi, h, si: (h, 0, 0))

    args = [qg]
    specs = [pl.BlockSpec((None, None, gp, d), lambda bi, h, si: (bi, h, 0, 0))]
    for mat in (query_transform, value_inverse):
        if mat is not None:
            args.append(mat)
            specs.append(mat_spec)
    args += [k_fp, v_fp, fp_tab, fp_len.reshape(b, 1)]
    specs += [pool_spec(k_fp), pool_spec(v_fp), table_spec(fp_tab), len_spec]
    if lowbit_set is not None:
        kc, vc, ks, kz, vs, vz, q_tab, q_len = lowbit_set
        args += [kc, vc, ks, kz, vs, vz, q_tab, q_len.reshape(b, 1)]
        specs += [pool_spec(a) for a in (kc, vc, ks, kz, vs, vz)]
        specs += [table_spec(q_tab), len_spec]

    kernel = functools.partial(_kernel, cfg=cfg, has_lowbit=lowbit_set is not None)
    name = "paged_decode_" + ("bf16" if lowbit_set is None else f"int{cfg.bits}")
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
            jax.ShapeDtypeStruct((b, hkv, s, gp, d), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, s, gp), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, s, gp), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(
            num_warps=num_warps or DEFAULT_NUM_WARPS,
            num_stages=num_stages or DEFAULT_NUM_STAGES,
        ),
        interpret=interpret,
        name=name,
    )(*args)


def _head_matmul_kernel(x_ref, mat_ref, o_ref):
    o_ref[...] = da._dot_nn(x_ref[...], mat_ref[...], precision=jax.lax.Precision.HIGHEST)


def head_matmul(
    x: jax.Array,  # f32[B, Hkv, Gp, d]
    mat: jax.Array,  # f32[Hkv, d, d]
    *,
    interpret: bool,
) -> jax.Array:  # f32[B, Hkv, Gp, d] = x[b, h] @ mat[h]
    """Per-KV-head float32 matmul (query transform prologue / value inverse epilogue).

    One program per (sequence, KV head), float32 at HIGHEST precision: B * Hkv programs of a
    [Gp, d] x [d, d] dot, a few microseconds in all.
    """
    b, hkv, gp, d = x.shape
    return pl.pallas_call(
        _head_matmul_kernel,
        grid=(b, hkv),
        in_specs=[
            pl.BlockSpec((None, None, gp, d), lambda bi, h: (bi, h, 0, 0)),
            pl.BlockSpec((None, d, d), lambda bi, h: (h, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, gp, d), lambda bi, h: (bi, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, hkv, gp, d), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="paged_decode_head_matmul",
    )(x, mat)
