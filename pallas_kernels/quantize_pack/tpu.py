"""quantize+pack on TPU: Pallas Mosaic kernel.

Grid ``(Hkv, N / block_tokens)``, both axes parallel. Each step gets a ``[block_tokens, d]``
VMEM tile of one KV head plus that head's ``[d, d]`` transform (resident across the token
axis, its block index does not change) and the head's clip value from SMEM, and runs
:func:`pallas_kernels.quant_math.transform_quantize_tile`.

Exact quantile on TPU: the radix select of `quant_math.quantile_radix` -- 33 compare +
last-axis count passes over the ``[T, d/G, G]`` tile (exact selection, no approximation),
within Mosaic's 32-bit vector ops. (The rank count it replaced built a ``[T, d/G, G, G]``
intermediate.) Lowers for the TPU platform from a CPU machine.
The group view ``[T, d] -> [T, d/G, G]`` splits the lane axis; for G < 128 Mosaic relayouts it.
Verified on CPU with ``interpret=pltpu.InterpretParams()``; not yet run on TPU hardware.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import layout
from pallas_kernels import quant_math as qm


def _kernel(
    clip_ref,  # SMEM f32[Hkv] or None
    x_ref,  # f32|bf16[T, d]
    a_ref,  # f32[d, d]
    codes_ref,  # u8[T, d // n]
    scale_ref,  # meta[T, d // G]
    zero_ref,  # meta[T, d // G]
    *,
    method: str,
    bits: int,
    group_size: int,
    meta_dtype: jnp.dtype,
):
    clip = None
    if clip_ref is not None:
        clip = jnp.full((1, 1, 1), clip_ref[pl.program_id(0)], jnp.float32)
    packed, scale, zero = qm.transform_quantize_tile(
        x_ref[...],
        a_ref[...],
        clip,
        method=method,
        bits=bits,
        group_size=group_size,
        meta_dtype=meta_dtype,
        quantile="radix",
    )
    codes_ref[...] = packed.astype(jnp.uint8)
    scale_ref[...] = scale
    zero_ref[...] = zero


def quantize_pack_tpu(
    x: jax.Array,  # f32|bf16[Hkv, N, d], N a multiple of block_tokens
    a: jax.Array,  # f32[Hkv, d, d]
    clip: jax.Array | None,  # f32[Hkv] or None
    *,
    method: str,
    bits: int,
    group_size: int,
    meta_dtype: jnp.dtype,
    block_tokens: int,
    interpret: bool | pltpu.InterpretParams,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # u8[Hkv, N, d/n], meta[Hkv, N, d/G] x2
    """Builds and calls the Mosaic pallas_call (inputs already validated and padded)."""
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
        kernel = functools.partial(kernel, None)
    else:
        in_specs.insert(0, pl.BlockSpec(memory_space=pltpu.SMEM))
        args.insert(0, clip)
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
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        name="kvjax_quantize_pack_mosaic",
    )(*args)
