"""Fused transform + clip + quantize + pack: the public wrappers (`api`) and backend bodies.

- `api`: `quantize_pack` (dispatching), `quantize_pack_kernel`, `quantize_pack_to_pages`
  and the pure-jnp twin `ref_quantize_pack`.
- `gpu_triton`: the Pallas Triton body; `tpu`: the Pallas Mosaic TPU body.
"""

from pallas_kernels.quantize_pack.api import (
    GPU_XLA_MAX_TOKENS,
    quantize_pack,
    quantize_pack_kernel,
    quantize_pack_to_pages,
    ref_quantize_pack,
)

__all__ = [
    "GPU_XLA_MAX_TOKENS",
    "quantize_pack",
    "quantize_pack_kernel",
    "quantize_pack_to_pages",
    "ref_quantize_pack",
]
