"""quantize+pack on GPU: Pallas kernel lowered through the Triton backend.

Grid ``(Hkv, N / block_tokens)``; each program loads a ``[block_tokens, d]`` tile of one KV
head and that head's ``[d, d]`` transform, and runs
:func:`pallas_kernels.quant_math.transform_quantize_tile` (matmul, radix-select quantile,
clip, scale/zero, round, planar pack) entirely in registers. The radix select replaced a rank
count whose ``[16, 1, 128, 128]`` comparison tensor the sm_90 build spilled to local memory
(17 KB per thread; 212 registers and no spill now, `notes/kernel_sass.py`). Inputs are
head-major (the public wrapper transposes). Triton-specific choices (power-of-two blocks,
``num_warps``) stay in this file.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import layout
from pallas_kernels import quant_math as qm

# Kernel-side quantile implementation (`quant_math.QUANTILE_IMPLS`); "rank" is kept for the
# build comparison in notes/kernel_sass.py.
QUANTILE = "radix"


def _kernel(
    x_ref,  # f32|bf16[T, d]
    a_ref,  # f32[d, d]
    clip_ref,  # f32[1] or None
    codes_ref,  # u8[T, d // n]
    scale_ref,  # meta[T, d // G]
    zero_ref,  # meta[T, d // G]
    *,
    method: str,
    bits: int,
    group_size: int,
    meta_dtype: jnp.dtype,
):
    clip = None if clip_ref is None else clip_ref[...].reshape(1, 1, 1)
    packed, scale, zero = qm.transform_quantize_tile(
        x_ref[...],
        a_ref[...],
        clip,
        method=method,
        bits=bits,
        group_size=group_size,
        meta_dtype=meta_dtype,
        quantile=QUANTILE,
    )
    codes_ref[...] = packed.astype(jnp.uint8)
    scale_ref[...] = scale
    zero_ref[...] = zero


def quantize_pack_gpu(
    x: jax.Array,  # f32|bf16[Hkv, N, d], N a multiple of block_tokens
    a: jax.Array,  # f32[Hkv, d, d]
    clip: jax.Array | None,  # f32[Hkv, 1] or None
    *,
    method: str,
    bits: int,
    group_size: int,
    meta_dtype: jnp.dtype,
    block_tokens: int,
    num_warps: int,
    interpret: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # u8[Hkv, N, d/n], meta[Hkv, N, d/G] x2
    """Builds and calls the Triton pallas_call (inputs already validated and padded)."""
    hkv, n_tok, d = x.shape
    m = layout.packed_dim(d, bits)
    ng = d // group_size
    t = block_tokens
    kernel = functools.partial(
        _kernel, method=method, bits=bits, group_size=group_size, meta_dtype=meta_dtype
    )
    in_specs = [
        pl.BlockSpec((None, t, d), lambda h, i: (h, i, 0)),
        pl.BlockSpec((None, d, d), lambda h, i: (h, 0, 0)),
    ]
    args = [x, a]
    if clip is None:
        kernel = functools.partial(_no_clip, kernel)
    else:
        in_specs.append(pl.BlockSpec((None, 1), lambda h, i: (h, 0)))
        args.append(clip)
    out_shape = (
        jax.ShapeDtypeStruct((hkv, n_tok, m), jnp.uint8),
        jax.ShapeDtypeStruct((hkv, n_tok, ng), meta_dtype),
        jax.ShapeDtypeStruct((hkv, n_tok, ng), meta_dtype),
    )
    out_specs = (
        pl.BlockSpec((None, t, m), lambda h, i: (h, i, 0)),
        pl.BlockSpec((None, t, ng), lambda h, i: (h, i, 0)),
        pl.BlockSpec((None, t, ng), lambda h, i: (h, i, 0)),
    )
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(hkv, n_tok // t),
        in_specs=in_specs,
        out_specs=out_specs,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        name="kvjax_quantize_pack_triton",
    )(*args)


def _no_clip(kernel, x_ref, a_ref, codes_ref, scale_ref, zero_ref):
    kernel(x_ref, a_ref, None, codes_ref, scale_ref, zero_ref)
