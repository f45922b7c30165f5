"""Paged mixed-precision decode attention: one API over several backend bodies.

- `api`: the public jitted wrappers, split planning and the log-sum-exp merge.
- `reference`: pure-jnp float32 twins with the same signatures.
- `checks`: input validation shared by the two.
- `pages`: the page-set pytrees they take (`FpPages`, `LowbitPages`, `QuantizedPages`,
  `HeadTransforms`).
- `tiles`: the per-tile math (and `DecodeConfig`) every backend body imports.
- `gpu_triton`: the Pallas Triton body (GPU; interpret-mode twin in CPU CI).
- `tpu`: the Pallas Mosaic TPU body.
"""

from pallas_kernels.decode_attention.api import (
    decode_attention,
    decode_attention_bf16,
    decode_attention_variant,
    fp_auto_pages_per_split,
    fp_backend,
    lowbit_auto_splits,
    lowbit_backend,
)
from pallas_kernels.decode_attention.pages import (
    FpPages,
    HeadTransforms,
    LowbitPages,
    QuantizedPages,
)
from pallas_kernels.decode_attention.reference import (
    ref_decode_attention,
    ref_decode_attention_bf16,
)
from pallas_kernels.decode_attention.tiles import BACKENDS, CODE_DOT_DTYPE, NEG_INF, DecodeConfig

__all__ = [
    "BACKENDS",
    "CODE_DOT_DTYPE",
    "NEG_INF",
    "DecodeConfig",
    "FpPages",
    "HeadTransforms",
    "LowbitPages",
    "QuantizedPages",
    "decode_attention",
    "decode_attention_bf16",
    "decode_attention_variant",
    "fp_backend",
    "fp_auto_pages_per_split",
    "lowbit_auto_splits",
    "lowbit_backend",
    "ref_decode_attention",
    "ref_decode_attention_bf16",
]
