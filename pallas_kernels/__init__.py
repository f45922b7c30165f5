"""Pallas kernels for kvjax and the bit/page layout they share.

`pallas_kernels.layout` owns the packed bit layout and page-pool shapes;
`pallas_kernels.quant_math` holds the per-row quantizer math shared by kernels and references;
`pallas_kernels.quantize_pack` is the fused transform+quantize+pack kernel and
`pallas_kernels.decode_attention` the paged mixed-precision decode attention; each is a package
holding its API, its pure-jnp reference and one module per backend body.
"""

from pallas_kernels.layout import (
    PageLayout,
    codes_per_byte,
    is_packed,
    pack_codes,
    packed_dim,
    unpack_codes,
    unpack_planes,
)

__all__ = [
    "PageLayout",
    "codes_per_byte",
    "is_packed",
    "pack_codes",
    "packed_dim",
    "unpack_codes",
    "unpack_planes",
]
