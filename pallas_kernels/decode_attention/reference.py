"""Pure-jnp float32 twins of the decode-attention kernels (same signatures, no tuning)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import layout
from pallas_kernels.decode_attention.checks import _validate, _validate_fp
from pallas_kernels.decode_attention.pages import FpPages, HeadTransforms, LowbitPages


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
    s = layout.decode_scale(_gather_pages(scale, table))  # f32[B, Hkv, S, ng]
    z = layout.decode_zero(_gather_pages(zero, table), bits)
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
    fp: FpPages,  # full-precision pages (transformed frame)
    lowbit: LowbitPages,  # packed low-bit pages
    transforms: HeadTransforms | None = None,  # None = identity frames
    *,
    bits: int,
    sm_scale: float,
    bits_v: int | None = None,
    value_layout: str = "tokens",
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
    dims = _validate(q, fp, lowbit, transforms, bits=bits, value_layout=value_layout, bits_v=bits_v)
    (k_codes, k_scale, k_zero), (v_codes, v_scale, v_zero) = lowbit.k, lowbit.v
    query_transform, value_inverse = HeadTransforms() if transforms is None else transforms
    d = dims["d"]
    bits_v = bits if bits_v is None else bits_v
    if value_layout == "dims":  # to the token-major packing of keys (same codes)
        v_codes = layout.pack_codes(
            layout.unpack_value_page_dims_major(v_codes, bits_v, dims["page_lowbit"]), bits_v
        )
    qf = _apply_transforms_ref(q, query_transform, dims["hkv"])
    kf = _gather_pages(fp.k, fp.table).astype(jnp.float32)
    vf = _gather_pages(fp.v, fp.table).astype(jnp.float32)
    kq = _dequantize_pages(k_codes, k_scale, k_zero, lowbit.table, bits, d)
    vq = _dequantize_pages(v_codes, v_scale, v_zero, lowbit.table, bits_v, d)
    o = _ref_attend(
        qf,
        [
            (kf, vf, _token_mask(fp.length, kf.shape[2])),
            (kq, vq, _token_mask(lowbit.length, kq.shape[2])),
        ],
        sm_scale,
    )
    return _output_ref(o, value_inverse, q.shape[1])


def ref_decode_attention_bf16(
    q: jax.Array,  # bf16|f32[B, Hq, d]
    fp: FpPages,  # full-precision pages
    *,
    sm_scale: float,
    num_splits: int | None = None,
    pages_per_block: int | None = None,
    backend: str = "gpu",
    interpret: bool = False,
) -> jax.Array:  # f32[B, Hq, d]
    """Pure-jnp float32 twin of `decode_attention_bf16`; tuning arguments are ignored."""
    del num_splits, pages_per_block, backend, interpret
    dims = _validate_fp(q, fp)
    qf = _apply_transforms_ref(q, None, dims["hkv"])
    k = _gather_pages(fp.k, fp.table).astype(jnp.float32)
    v = _gather_pages(fp.v, fp.table).astype(jnp.float32)
    o = _ref_attend(qf, [(k, v, _token_mask(fp.length, k.shape[2]))], sm_scale)
    return _output_ref(o, None, q.shape[1])
