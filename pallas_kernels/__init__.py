"""Pallas kernels for kvjax and the bit/page layout they share.

`pallas_kernels.layout` owns the packed bit layout and page-pool shapes;
`pallas_kernels.quant_math` holds the per-row quantizer math shared by kernels and references;
`pallas_kernels.quantize_pack` is the fused transform+quantize+pack kernel (GPU Triton bodies in
`gpu/`, TPU Mosaic bodies in `tpu/`).
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
