"""Input validation shared by the decode-attention reference and the public wrappers."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import layout
from pallas_kernels.decode_attention.tiles import BACKENDS


# ------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------
def _check_table(table_name, table, len_name, length, b: int) -> None:
    """A page set's table i32[B, >= 1] and valid-token counts i32[B]."""
    if table.ndim != 2 or table.shape[0] != b or table.shape[1] < 1:
        raise ValueError(f"{table_name}.shape={table.shape} must be [B={b}, >=1]")
    if table.dtype != jnp.int32:
        raise ValueError(f"{table_name}.dtype={table.dtype} must be int32")
    if length.shape != (b,) or length.dtype != jnp.int32:
        raise ValueError(f"{len_name}.shape={length.shape} {len_name}.dtype={length.dtype} "
                         f"must be int32[{b}]")  # fmt: skip


def _validate_fp(q, fp) -> dict[str, int]:
    k_pages, v_pages, page_table, lengths = fp
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
    _check_table("page_table", page_table, "lengths", lengths, b)
    return {"b": b, "hq": hq, "d": d, "hkv": hkv, "page": page}


def _validate(q, fp, lowbit, transforms, *, bits, value_layout="tokens", bits_v=None):
    """Shapes, dtypes and widths of one decode call's inputs (the `pages` pytrees); returns
    the dimensions the bodies need. Raises ValueError naming the offending input."""
    (k_codes, k_scale, k_zero), (v_codes, v_scale, v_zero), lowbit_table, lowbit_len = lowbit
    query_transform, value_inverse = (None, None) if transforms is None else transforms
    dims = _validate_fp(q, fp)
    b, d, hkv = dims["b"], dims["d"], dims["hkv"]
    if bits not in layout.SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r} must be one of {layout.SUPPORTED_BITS}")
    bits_v = bits if bits_v is None else bits_v
    if bits_v not in layout.SUPPORTED_BITS:
        raise ValueError(f"bits_v={bits_v!r} must be one of {layout.SUPPORTED_BITS}")
    m = layout.packed_dim(d, bits)
    # Low-bit pages may hold more tokens than full-precision ones (the Mosaic GPU body reads
    # whole 64-token tiles); the Triton and TPU bodies need equal sizes (`_check_kernel_shapes`).
    if k_codes.ndim != 4 or k_codes.shape[1] != hkv or k_codes.shape[3] != m:
        raise ValueError(f"{k_codes.shape=} must be [P_low, Hkv={hkv}, page_lowbit, d//n={m}]")
    if k_codes.dtype != jnp.uint8:
        raise ValueError(f"{k_codes.dtype=} must be uint8")
    if value_layout not in layout.VALUE_LAYOUTS:
        raise ValueError(f"value_layout={value_layout!r} must be one of {layout.VALUE_LAYOUTS}")
    p_low, _, page_lowbit, _ = k_codes.shape
    if value_layout == "tokens":
        v_want = (*k_codes.shape[:3], layout.packed_dim(d, bits_v))
    else:
        n = layout.codes_per_byte(bits_v)
        if page_lowbit % n:
            raise ValueError(f"low-bit page size {page_lowbit} must be a multiple of {n}")
        v_want = (p_low, hkv, d, page_lowbit // n)
    if v_codes.shape != v_want or v_codes.dtype != jnp.uint8:
        raise ValueError(
            f"{v_codes.shape=} {v_codes.dtype=} must be uint8{list(v_want)} ({value_layout=})"
        )
    meta = k_scale.shape
    if len(meta) != 4 or meta[:3] != k_codes.shape[:3] or meta[3] < 1 or d % meta[3]:
        raise ValueError(f"{k_scale.shape=} must be [P_low, Hkv, page, d//G] for {k_codes.shape=}")
    for name, a in (("k_zero", k_zero), ("v_scale", v_scale), ("v_zero", v_zero)):
        if a.shape != meta:
            raise ValueError(f"{name}.shape={a.shape} must equal {k_scale.shape=}")
    for name, a in (("k_scale", k_scale), ("k_zero", k_zero), ("v_scale", v_scale),
                    ("v_zero", v_zero)):  # fmt: skip
        if a.dtype.name not in layout.META_DTYPES:
            raise ValueError(f"{name}.dtype={a.dtype} must be one of {layout.META_DTYPES}")
    _check_table("lowbit_table", lowbit_table, "lowbit_len", lowbit_len, b)
    for name, t in (("query_transform", query_transform), ("value_inverse", value_inverse)):
        if t is not None and t.shape != (hkv, d, d):
            raise ValueError(f"{name}.shape={t.shape} must be (Hkv={hkv}, d={d}, d={d})")
    dims.update(m=m, num_groups=meta[3], group_size=d // meta[3], page_lowbit=k_codes.shape[2])
    return dims


def _check_kernel_shapes(
    dims: dict[str, int],
    bits: int | None,
    pages_per_block: int,
    backend: str,
    value_layout: str = "tokens",
) -> None:
    """Constraints of the kernels (not of the math): tile shapes and group alignment."""
    if value_layout == "dims" and (backend != "gpu_mosaic" or dims["page_lowbit"] != 128):
        raise ValueError(
            f"value_layout='dims' needs backend='gpu_mosaic' and 128-token low-bit pages "
            f"(got {backend=}, page {dims['page_lowbit']})"
        )
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
    if bits is not None and backend != "gpu_mosaic" and dims["page_lowbit"] != dims["page"]:
        raise ValueError(
            f"low-bit page size {dims['page_lowbit']} must equal the full-precision page size "
            f"{dims['page']} for {backend=} (only backend='gpu_mosaic' reads larger ones)"
        )
    if bits is not None and backend == "gpu_mosaic" and dims["page_lowbit"] % 64:
        raise ValueError(
            f"low-bit page size {dims['page_lowbit']} must be a multiple of 64 for "
            "backend='gpu_mosaic'"
        )
    if backend in ("gpu", "gpu_mosaic"):
        for name in ("d", "page"):
            v = dims[name]
            if v & (v - 1) or v < 16:
                raise ValueError(f"{name}={v} must be a power of two >= 16 for Triton tiles")
        if bits is not None and dims["m"] < 16:
            raise ValueError(f"d//n={dims['m']} must be >= 16 for tensor-core dots")
