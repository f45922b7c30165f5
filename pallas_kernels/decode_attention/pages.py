"""The page sets decode attention reads, as pytrees (jit arguments like any array tuple).

A decode step reads two page sets of one layer: the full-precision pages (sink and recent
tokens, in the transformed frame) and the low-bit pages (the middle of each sequence, packed
codes with per-token scale and zero). Each set carries its own page table and valid-token
count per sequence; unused table entries may point at any valid page and unused pages may hold
NaN (every body masks by length before a value can reach the output).
"""

from __future__ import annotations

from typing import NamedTuple

import jax


class QuantizedPages(NamedTuple):
    """One low-bit pool: what the cache stores per K or V and quantize_pack writes.

    codes: u8[P, Hkv, page, d // n] planar-packed codes (`pallas_kernels.layout`), or
      u8[P, Hkv, d, page // n] for dimension-major value pages (``value_layout="dims"``).
    scale, zero: [P, Hkv, page, d // G] float (float16 / bfloat16 / float32) or uint8 (the
      8-bit encoding of `pallas_kernels.layout`).
    """

    codes: jax.Array
    scale: jax.Array
    zero: jax.Array


class FpPages(NamedTuple):
    """Full-precision pages: k, v bf16|f32[P, Hkv, page, d]; table i32[B, max_pages]; length
    i32[B] valid tokens per sequence."""

    k: jax.Array
    v: jax.Array
    table: jax.Array
    length: jax.Array


class LowbitPages(NamedTuple):
    """Low-bit pages: keys and values as `QuantizedPages`; table i32[B, max_pages]; length
    i32[B] valid tokens per sequence."""

    k: QuantizedPages
    v: QuantizedPages
    table: jax.Array
    length: jax.Array


class HeadTransforms(NamedTuple):
    """Per-KV-head frame changes around the attention (None = identity).

    query: f32[Hkv, d, d] = B_K^T, applied to the query (DESIGN.md section 2).
    value_inverse: f32[Hkv, d, d] = B_V, applied to the output.
    """

    query: jax.Array | None = None
    value_inverse: jax.Array | None = None
