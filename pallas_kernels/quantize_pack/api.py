"""Fused transform + quantize + pack: ``Q(x @ A)`` written in the shared packed layout.

Per token and KV head: ``y = x @ A[h]`` (float32), then per group of ``G`` channels the
quantizer of :mod:`pallas_kernels.quant_math` (oscar percentile clip with an exact quantile,
quest, or minmax), scale/zero rounded to ``meta_dtype``, round to nearest, and planar packing
to 2 or 4 bits (:mod:`pallas_kernels.layout`). Used at prefill and at each flush.

* :func:`ref_quantize_pack` -- pure jnp, sort-based quantile, whole-array ops.
* :func:`quantize_pack_kernel` -- the Pallas kernel (``backend='gpu'``: Triton, ``'tpu'``: Mosaic),
  radix-select quantile. Same math, so codes are bit-identical to the reference whenever the
  matmul ``x @ A`` rounds identically; where it does not (different summation order on
  hardware), a value within an ulp of a rounding boundary may land one code apart and
  scale/zero differ in the last float32 bit before rounding to ``meta_dtype``.
* :func:`quantize_pack` -- the entry point: the kernel, or the reference under jit for the
  few-token decode flush on GPU, where it is measured faster.
* :func:`quantize_pack_to_pages` -- kernel + write into the page pools at (page, slot). The
  write is a scatter in the wrapper (:func:`pallas_kernels.layout.scatter_tokens`) on donated
  pools, not an in-kernel ``input_output_aliases`` store: tokens of one call may land on
  arbitrary pages and slots, which a blocked output spec cannot express without a per-token
  grid.

Example::

    codes, scale, zero = quantize_pack(x, A, 0.96, bits=2, group_size=64, interpret=True)
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp

from pallas_kernels import layout
from pallas_kernels import quant_math as qm

Backend = Literal["gpu", "tpu"]
_DEFAULT_BLOCK_TOKENS = {"gpu": 16, "tpu": 16}
# At most this many tokens per call, `quantize_pack` on GPU hardware takes the XLA path (the
# per-token flush at decode): measured crossover between 8 and 64 tokens (see `quantize_pack`).
GPU_XLA_MAX_TOKENS = 8


def _validate(
    x: jax.Array,
    a: jax.Array,
    clip: jax.Array | float | None,
    method: str,
    bits: int,
    group_size: int | None,
    meta_dtype: str,
) -> tuple[int, jnp.dtype]:
    """Checks shapes and options; returns the resolved group size and meta dtype."""
    if x.ndim != 3:
        raise ValueError(f"{x.shape=}: expected [N, Hkv, d]")
    n_tok, hkv, d = x.shape
    if a.shape != (hkv, d, d):
        raise ValueError(f"{a.shape=}: expected (Hkv, d, d) = {(hkv, d, d)} for {x.shape=}")
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"{x.dtype=} must be float32, bfloat16 or float16")
    if method not in qm.METHODS:
        raise ValueError(f"method={method!r} is not one of {qm.METHODS}")
    if bits not in layout.PACKED_BITS:
        raise ValueError(f"bits={bits!r}: quantize_pack stores packed codes, bits must be 2 or 4")
    lay = layout.PageLayout(
        page_size=1,
        num_kv_heads=hkv,
        head_dim=d,
        bits=bits,
        group_size=group_size,
        meta_dtype=meta_dtype,
    )
    if clip is not None:
        if method == "minmax":
            raise ValueError("clip given for method='minmax', which never clips")
        shape = jnp.shape(clip)
        if shape not in ((), (hkv,)):
            raise ValueError(f"clip shape {shape} must be () or (Hkv,) = ({hkv},)")
    return lay.group_size, lay.meta_jnp_dtype


def ref_quantize_pack(
    x: jax.Array,  # f32|bf16[N, Hkv, d]
    a: jax.Array,  # f32[Hkv, d, d]
    clip: jax.Array | float | None = None,  # scalar or f32[Hkv]
    *,
    method: qm.Method = "oscar",
    bits: int = 2,
    group_size: int | None = None,
    meta_dtype: str = "float16",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pure-jnp reference of :func:`quantize_pack`.

    Args:
      x: N tokens of Hkv KV heads, untransformed.
      a: per-head transform A (stored vector is ``x @ A``).
      clip: oscar kappa / quest alpha, one value or one per KV head; None = method default.
      method: 'oscar', 'quest' or 'minmax'.
      bits: 2 or 4.
      group_size: channels per (scale, zero); None = d.
      meta_dtype: storage dtype of scale and zero ('uint8': the 8-bit encoding of
        `pallas_kernels.layout`).

    Returns:
      ``codes u8[N, Hkv, d // n]``, ``scale, zero meta_dtype[N, Hkv, d // G]``.
    """
    g, meta = _validate(x, a, clip, method, bits, group_size, meta_dtype)
    n_tok, hkv, d = x.shape
    y = jnp.einsum(
        "NHD,HDE->NHE",
        x.astype(jnp.float32),
        a.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )  # f32[N, Hkv, d]
    yg = y.reshape(n_tok, hkv, d // g, g)  # f32[N, Hkv, d/G, G]
    c = None if clip is None else jnp.broadcast_to(jnp.asarray(clip, jnp.float32), (hkv,))
    c = None if c is None else c[None, :, None, None]  # f32[1, Hkv, 1, 1]
    codes, scale, zero = qm.quantize_groups(
        yg, method, bits, clip=c, meta_dtype=meta, quantile="sort"
    )
    packed = layout.pack_codes(codes.reshape(n_tok, hkv, d).astype(jnp.uint8), bits)
    return (
        packed,
        layout.encode_meta(scale[..., 0], meta, "scale", bits),
        layout.encode_meta(zero[..., 0], meta, "zero", bits),
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "method",
        "bits",
        "group_size",
        "meta_dtype",
        "block_tokens",
        "num_warps",
        "backend",
        "interpret",
    ),
)
def quantize_pack(
    x: jax.Array,  # f32|bf16[N, Hkv, d]
    a: jax.Array,  # f32[Hkv, d, d]
    clip: jax.Array | float | None = None,  # scalar or f32[Hkv]
    *,
    method: qm.Method = "oscar",
    bits: int = 2,
    group_size: int | None = None,
    meta_dtype: str = "float16",
    block_tokens: int | None = None,
    num_warps: int = 4,
    backend: Backend = "gpu",
    interpret: bool | object = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Quantize+pack; same arguments and results as :func:`ref_quantize_pack`.

    Runs :func:`quantize_pack_kernel`, except for few tokens on GPU hardware (the decode-step
    flush, ``N <= GPU_XLA_MAX_TOKENS``), where the XLA-fused reference is used. Measured on an
    H200 (results/bench_decode_h200_run14.md, 8 KV heads x 128, radix-select kernel): 1 token
    53 us in the kernel vs 39 us through XLA, 8 tokens 47 vs 45 us, 64 tokens 46 vs 59 us
    (2 bits; 55 vs 48 us at 4 bits), 1024 tokens 0.094 vs 0.102 ms, 8192 tokens 0.43 vs 0.44
    ms. Both compute the same exact quantile.

    Args and returns: as in :func:`quantize_pack_kernel`.
    """
    if backend == "gpu" and interpret is False and x.shape[0] <= GPU_XLA_MAX_TOKENS:
        return ref_quantize_pack(
            x,
            a,
            clip,
            method=method,
            bits=bits,
            group_size=group_size,
            meta_dtype=meta_dtype,
        )
    return quantize_pack_kernel(
        x,
        a,
        clip,
        method=method,
        bits=bits,
        group_size=group_size,
        meta_dtype=meta_dtype,
        block_tokens=block_tokens,
        num_warps=num_warps,
        backend=backend,
        interpret=interpret,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "method",
        "bits",
        "group_size",
        "meta_dtype",
        "block_tokens",
        "num_warps",
        "backend",
        "interpret",
    ),
)
def quantize_pack_kernel(
    x: jax.Array,  # f32|bf16[N, Hkv, d]
    a: jax.Array,  # f32[Hkv, d, d]
    clip: jax.Array | float | None = None,  # scalar or f32[Hkv]
    *,
    method: qm.Method = "oscar",
    bits: int = 2,
    group_size: int | None = None,
    meta_dtype: str = "float16",
    block_tokens: int | None = None,
    num_warps: int = 4,
    backend: Backend = "gpu",
    interpret: bool | object = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pallas quantize+pack (always the kernel); same results as :func:`ref_quantize_pack`.

    Args:
      x, a, clip, method, bits, group_size, meta_dtype: as in :func:`ref_quantize_pack`.
      block_tokens: tokens per program (power of two for GPU; >= 16 for the Triton dot).
        Default 16. N is zero-padded up to a multiple (padded rows are constant rows, which
        the quantizer handles, and are sliced off).
      num_warps: Triton warps per program (GPU only).
      backend: 'gpu' (Pallas Triton) or 'tpu' (Pallas Mosaic).
      interpret: False on hardware; ``True`` (GPU) or ``pltpu.InterpretParams()`` (TPU) to run
        on CPU.

    Returns:
      ``codes u8[N, Hkv, d // n]``, ``scale, zero meta_dtype[N, Hkv, d // G]``.
    """
    g, meta = _validate(x, a, clip, method, bits, group_size, meta_dtype)
    if backend not in ("gpu", "tpu"):
        raise ValueError(f"backend={backend!r} must be 'gpu' or 'tpu'")
    t = _DEFAULT_BLOCK_TOKENS[backend] if block_tokens is None else block_tokens
    # Triton tensors need power-of-two extents; Mosaic tiles rows in multiples of 8 sublanes.
    if t <= 0 or (backend == "gpu" and t & (t - 1)) or (backend == "tpu" and t % 8):
        raise ValueError(f"block_tokens={t}: need a power of two (gpu) / multiple of 8 (tpu)")
    n_tok, hkv, d = x.shape
    n_pad = -(-n_tok // t) * t
    xh = jnp.swapaxes(x, 0, 1)  # [Hkv, N, d]: head-major so a block is a 2-D [T, d] tile
    if n_pad != n_tok:
        xh = jnp.pad(xh, ((0, 0), (0, n_pad - n_tok), (0, 0)))
    c = None if clip is None else jnp.broadcast_to(jnp.asarray(clip, jnp.float32), (hkv,))
    kw = dict(method=method, bits=bits, group_size=g, meta_dtype=meta, block_tokens=t)
    a32 = a.astype(jnp.float32)
    if backend == "gpu":
        from pallas_kernels.quantize_pack.gpu_triton import quantize_pack_gpu

        cg = None if c is None else c[:, None]
        out = quantize_pack_gpu(xh, a32, cg, num_warps=num_warps, interpret=interpret, **kw)
    else:
        from pallas_kernels.quantize_pack.tpu import quantize_pack_tpu

        out = quantize_pack_tpu(xh, a32, c, interpret=interpret, **kw)
    # [Hkv, N_pad, w] -> [N, Hkv, w]
    return tuple(jnp.swapaxes(o, 0, 1)[:n_tok] for o in out)


@functools.partial(
    jax.jit,
    static_argnames=("method", "bits", "group_size", "backend", "interpret"),
    donate_argnames=("codes_pool", "scale_pool", "zero_pool"),
)
def quantize_pack_to_pages(
    x: jax.Array,  # f32|bf16[N, Hkv, d]
    a: jax.Array,  # f32[Hkv, d, d]
    codes_pool: jax.Array,  # u8[num_pages, Hkv, page_size, d // n]
    scale_pool: jax.Array,  # meta[num_pages, Hkv, page_size, d // G]
    zero_pool: jax.Array,  # meta[num_pages, Hkv, page_size, d // G]
    page_idx: jax.Array,  # i32[N] physical page of each token
    slot: jax.Array,  # i32[N] slot of each token within its page
    clip: jax.Array | float | None = None,  # scalar or f32[Hkv]
    *,
    method: qm.Method = "oscar",
    bits: int = 2,
    group_size: int | None = None,
    backend: Backend = "gpu",
    interpret: bool | object = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Quantizes N tokens and writes them into donated page pools at (page_idx, slot).

    The meta dtype is taken from ``scale_pool``. Out-of-range page indices are dropped (no
    write), so the caller (the cache, which owns allocation) must check capacity first.

    Returns:
      The updated ``(codes_pool, scale_pool, zero_pool)``.
    """
    meta_name = jnp.dtype(scale_pool.dtype).name
    codes, scale, zero = quantize_pack(
        x,
        a,
        clip,
        method=method,
        bits=bits,
        group_size=group_size,
        meta_dtype=meta_name,
        backend=backend,
        interpret=interpret,
    )
    if codes_pool.shape[1:] != (x.shape[1], codes_pool.shape[2], codes.shape[-1]):
        raise ValueError(f"{codes_pool.shape=} does not match codes {codes.shape=}")
    if scale_pool.shape != zero_pool.shape or scale_pool.shape[-1] != scale.shape[-1]:
        raise ValueError(f"{scale_pool.shape=}, {zero_pool.shape=} do not match {scale.shape=}")
    return (
        layout.scatter_tokens(codes_pool, codes, page_idx, slot),
        layout.scatter_tokens(scale_pool, scale, page_idx, slot),
        layout.scatter_tokens(zero_pool, zero, page_idx, slot),
    )
