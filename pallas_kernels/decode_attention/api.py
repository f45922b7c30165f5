"""Paged mixed-precision decode attention: split planning, merge and the public wrappers.

One query token per sequence attends over a paged cache holding two key/value sets in the
transformed frame (DESIGN.md section 3): full-precision pages (sink + recent windows) and
low-bit pages (packed codes with a per-token, per-group scale and zero point, see
`pallas_kernels.layout`). Attention is permutation-invariant over keys, so the two sets are
just two segments of one online softmax.

Kernel algebra (DESIGN.md section 5), with ``k_hat = s (c - z)`` per group of channels:

    q . k_hat                = s (q . c) - s z sum(q)
    sum_t p_t s_t (c_t - z_t) = sum_t (p_t s_t) c_t - sum_t p_t s_t z_t

so the inner loops are plain tensor-core dots of the query (or the probabilities) against
small-integer code planes; scales and zero points are applied per token outside the dot.

Backends: ``backend="gpu"`` runs the Pallas Triton body in `gpu_triton`,
``backend="tpu"`` the Mosaic body in `tpu`; both return per-split partial
results, combined by log-sum-exp in the GPU merge kernel (`gpu_triton`
``merge_splits``, with the value inverse) or by `_merge_splits` (XLA, TPU).
``interpret=True`` runs either on CPU.

Example::

    fp = FpPages(k_fp, v_fp, fp_table, fp_len)
    lowbit = LowbitPages(QuantizedPages(k_codes, k_scale, k_zero),
                         QuantizedPages(v_codes, v_scale, v_zero), lowbit_table, lowbit_len)
    out = decode_attention(q, fp, lowbit, HeadTransforms(b_k_t, b_v),
                           bits=2, sm_scale=d**-0.5)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import layout
from pallas_kernels.decode_attention.checks import _check_kernel_shapes, _validate, _validate_fp
from pallas_kernels.decode_attention.pages import (
    FpPages,
    HeadTransforms,
    LowbitPages,
)
from pallas_kernels.decode_attention.tiles import (
    BACKENDS,
    BF16_PAGES_PER_BLOCK,
    LOG2E,
    DecodeConfig,
    split_table,
)

# Programs to launch when choosing splits automatically (132 SMs on H200, a few resident
# programs each). The low-bit kernel: ~1024 (H200 runs 8-12). Run 12 measured 512 level with
# 1024 for 2 bits (0.689 ms at 8 x 128k, 0.086 at 1 x 64k) but 4 bits 25% slower at 8 x 128k
# (1.124 vs 0.899 ms in run 11): fewer, longer programs leave a partial last wave. The BF16
# baseline keeps the 512 it was tuned with.
_TARGET_PROGRAMS = 512
_TARGET_PROGRAMS_LOWBIT = 1024


# ------------------------------------------------------------------------------------------
# Split planning and merge
# ------------------------------------------------------------------------------------------
def _auto_splits(
    batch: int,
    hkv: int,
    max_pages: int,
    pages_per_block: int,
    target: int = _TARGET_PROGRAMS,
    within_target: bool = False,
) -> int:
    """Splits giving ``target`` programs over ``batch * hkv`` (at least that many, or with
    ``within_target`` at most), never more than the blocks of pages."""
    blocks = max(1, -(-max_pages // pages_per_block))
    per = target // (batch * hkv) if within_target else -(-target // (batch * hkv))
    return int(max(1, min(blocks, per)))


def default_pages_per_block(backend: str, bits: int, bits_v: int | None = None) -> int:
    """Low-bit pages per inner step when ``pages_per_block`` is None: the backend's
    ``DEFAULT_PAGES_PER_BLOCK``, or its ``WIDE_PAGES_PER_BLOCK`` when keys or values are 4-bit
    (fewer codes per byte: longer steps measured faster)."""
    mod = _backend_module(backend)
    wide = max(bits, bits if bits_v is None else bits_v) > 2
    return mod.WIDE_PAGES_PER_BLOCK if wide else mod.DEFAULT_PAGES_PER_BLOCK


def lowbit_auto_splits(
    batch: int, hkv: int, max_pages: int, pages_per_block: int, backend: str = "gpu"
) -> int:
    """Splits `decode_attention` picks when ``num_splits`` is None: enough programs to fill
    the GPU (the backend's ``TARGET_PROGRAMS``, else `_TARGET_PROGRAMS_LOWBIT`; no more than
    it where the backend sets ``SPLITS_WITHIN_TARGET``, a wave of resident programs), at most
    the backend's ``MAX_SPLITS`` per sequence and head group (None: no cap)."""
    mod = _backend_module(backend)
    target = getattr(mod, "TARGET_PROGRAMS", _TARGET_PROGRAMS_LOWBIT)
    within = getattr(mod, "SPLITS_WITHIN_TARGET", False)
    splits = _auto_splits(batch, hkv, max_pages, pages_per_block, target, within)
    cap = mod.MAX_SPLITS
    return splits if cap is None else min(splits, cap)


def fp_auto_pages_per_split(batch: int, hkv: int, fp_pages: int, backend: str) -> int | None:
    """Full-precision pages per split of a backend with a kernel of its own for them (``None``
    where they share the low-bit splits): its ``FP_PAGES_PER_SPLIT`` at most, fewer while the
    kernel would have under ``FP_TARGET_PROGRAMS`` programs (batch 1: one page each)."""
    mod = _backend_module(backend)
    if mod.FP_PAGES_PER_SPLIT is None:
        return None
    per = batch * hkv * fp_pages // mod.FP_TARGET_PROGRAMS
    return int(max(1, min(mod.FP_PAGES_PER_SPLIT, per)))


def _merge_partials(
    acc: jax.Array,  # f32[B, Hkv, S, R, d] unnormalised partial outputs (R: Gp or the group)
    m: jax.Array,  # f32[B, Hkv, S, R] running max, base-2 units
    l: jax.Array,  # f32[B, Hkv, S, R] partial softmax denominators
) -> jax.Array:  # f32[B, Hkv, R, d]
    """Flash-decoding log-sum-exp merge of the split partials."""
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp2(m - m_all)  # [B, K, S, Gp]; 0 for empty splits unless all are empty
    l_all = jnp.sum(w * l, axis=2)  # [B, K, Gp]
    o = jnp.sum(w[..., None] * acc, axis=2)  # [B, K, Gp, d]
    return o / jnp.where(l_all > 0, l_all, 1.0)[..., None]  # no key at all -> zeros


def _ungroup(
    o: jax.Array,  # f32[B, Hkv, Gp, d]
    group: int,
) -> jax.Array:  # f32[B, Hkv * group, d]
    b, k, _, d = o.shape
    return o[:, :, :group, :].reshape(b, k * group, d)


def _merge_splits(
    acc: jax.Array,  # f32[B, Hkv, S, Gp, d] unnormalised partial outputs (final frame)
    m: jax.Array,  # f32[B, Hkv, S, Gp]
    l: jax.Array,  # f32[B, Hkv, S, Gp]
    group: int,
) -> jax.Array:  # f32[B, Hkv * group, d]
    return _ungroup(_merge_partials(acc, m, l), group)


def _group_pad(g: int, pad_to: int) -> int:
    return max(pad_to, 1 << (g - 1).bit_length())


def _group_queries(q: jax.Array, hkv: int, pad_to: int) -> tuple[jax.Array, int]:
    b, hq, d = q.shape
    g = hq // hkv
    gp = _group_pad(g, pad_to)
    qg = q.astype(jnp.float32).reshape(b, hkv, g, d)
    return jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0))), g


def _backend_module(backend: str):
    # Imported lazily: the backend bodies import this module's per-tile helpers.
    if backend == "gpu":
        from pallas_kernels.decode_attention import gpu_triton as mod
    elif backend == "gpu_mosaic":
        from pallas_kernels.decode_attention import gpu_mosaic as mod
    else:
        from pallas_kernels.decode_attention import tpu as mod
    return mod


def _hopper() -> bool:
    """A Hopper GPU (compute capability 9.x) runs the Mosaic GPU bodies."""
    if jax.default_backend() != "gpu":
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")


def fp_backend(dtype, head_dim: int, page_size: int) -> str:
    """The backend `decode_attention_bf16` should take for full-precision pages on this
    machine: ``"tpu"`` on TPU; ``"gpu_mosaic"`` on a Hopper GPU when the Mosaic BF16 body
    reads these pages (bf16/f16, head_dim a multiple of 64 up to 256, pages dividing 64
    tokens; 96% of the read ceiling at 8 x 128k vs the Triton body's 86%, BENCHMARKS.md);
    ``"gpu"`` (Triton) otherwise."""
    if jax.default_backend() == "tpu":
        return "tpu"
    from pallas_kernels.decode_attention import gpu_mosaic

    fits = (
        jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and head_dim % 64 == 0
        and head_dim <= 256
        and gpu_mosaic.TILE % page_size == 0
    )
    return "gpu_mosaic" if fits and _hopper() else "gpu"


def lowbit_backend(
    *,
    head_dim: int,
    bits: int,
    bits_v: int,
    group_size: int,
    group: int,
    page_size: int,
    meta_dtypes: tuple,
    value_layout: str = "tokens",
) -> str:
    """The backend `decode_attention` should take for these low-bit pages on this machine:
    ``"tpu"`` on TPU; ``"gpu_mosaic"`` on a Hopper GPU where the Mosaic body reads them
    (`gpu_mosaic.supports` for both widths; 8-bit metadata only on 128-token pages);
    ``"gpu"`` (Triton) otherwise. Dimension-major values have no Triton or TPU body: a
    ValueError says so where the Mosaic body cannot run."""
    if jax.default_backend() == "tpu":
        backend = "tpu"
    else:
        from pallas_kernels.decode_attention import gpu_mosaic

        fits = all(
            gpu_mosaic.supports(head_dim=head_dim, bits=w, group_size=group_size, group=group,
                                page_size=page_size)
            for w in (bits, bits_v)
        )  # fmt: skip
        u8 = {jnp.dtype(t) == jnp.dtype(jnp.uint8) for t in meta_dtypes}
        fits = fits and (u8 == {False} or (u8 == {True} and page_size % gpu_mosaic.MAX_TILE == 0))
        if value_layout == "dims":
            fits = fits and page_size == gpu_mosaic.MAX_TILE
        backend = "gpu_mosaic" if fits and _hopper() else "gpu"
    if value_layout == "dims" and backend != "gpu_mosaic":
        raise ValueError(
            f"value_layout='dims' decodes only through the Mosaic GPU body (a Hopper GPU, "
            f"{page_size=} must be 128); this machine runs {jax.default_backend()!r}: use "
            f"value_layout='tokens' or the reference attention"
        )
    return backend


# ------------------------------------------------------------------------------------------
# Public wrappers
# ------------------------------------------------------------------------------------------
_LOWBIT_STATIC = (
    "bits",
    "bits_v",
    "value_layout",
    "sm_scale",
    "num_splits",
    "pages_per_block",
    "backend",
    "interpret",
    "num_warps",
    "num_stages",
)


@functools.partial(jax.jit, static_argnames=_LOWBIT_STATIC)
def decode_attention(
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
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> jax.Array:  # f32[B, Hq, d]
    """Decode attention over a paged cache of full-precision and packed low-bit pages.

    Query head ``j`` reads KV head ``j // (Hq // Hkv)``; each KV head is read once for its
    whole query group. The query transform and the value inverse are applied by Pallas
    kernels: on the GPU by a prologue kernel (once per sequence and KV head, rather than once
    per split program; on the Mosaic path the same kernel also builds the split kernel's 8-bit
    query operands) and an epilogue kernel on the merged output (the inverse is linear, so
    this equals applying it per split); the TPU body applies them inside the split kernel.

    Args:
      q: one query per sequence in the original frame.
      fp, lowbit, transforms: the page sets and frame changes (`pallas_kernels.decode_attention.
        pages`); unused table entries may point at any valid page, unused pages may hold NaN.
      bits: 2 or 4 (packed planar codes, `pallas_kernels.layout`) of the keys, and of the
        values unless ``bits_v`` is given.
      bits_v: the values' width when it differs from the keys' (a layer of a bit
        allocation); ``None`` = ``bits``. Scale/zero pools may be float (``float16``,
        ``bfloat16``, ``float32``) or ``uint8`` (the 8-bit encoding of
        `pallas_kernels.layout`), each pool decoded by its own dtype (Triton and TPU bodies;
        the Mosaic GPU body takes equal widths and float metadata only).
      value_layout: ``"tokens"`` (value codes ``[P_low, Hkv, page, d // n]`` like keys) or
        ``"dims"`` (``[P_low, Hkv, d, page // n]``, packed along tokens; backend
        ``"gpu_mosaic"`` with 128-token low-bit pages), see `pallas_kernels.layout`.
      sm_scale: softmax scale applied to the logits.
      num_splits: sequence splits (flash decoding); ``None`` picks enough to fill the GPU.
      pages_per_block: pages gathered per inner step (GPU; the TPU body takes one page/step);
        ``None``: `default_pages_per_block`.
      backend: ``"gpu"`` (Pallas Triton), ``"gpu_mosaic"`` (Pallas Mosaic GPU, Hopper; low-bit
        pages only, the rest by the Triton body) or ``"tpu"`` (Pallas Mosaic TPU).
      interpret: run the kernel in the Pallas interpreter (CPU tests).
      num_warps, num_stages: GPU launch knobs; ``None`` uses the GPU body's defaults.

    Returns:
      float32 attention output in the original frame, ``[B, Hq, d]``.
    """
    return decode_attention_variant(
        q,
        fp,
        lowbit,
        transforms,
        bits=bits,
        sm_scale=sm_scale,
        bits_v=bits_v,
        value_layout=value_layout,
        num_splits=num_splits,
        pages_per_block=pages_per_block,
        backend=backend,
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
    )


_VARIANT_STATIC = ("gather", "int_to_float", "row_sums", "fp_pages_per_split", "prologue")


@functools.partial(jax.jit, static_argnames=_LOWBIT_STATIC + _VARIANT_STATIC)
def decode_attention_variant(
    q: jax.Array,  # bf16|f32[B, Hq, d]
    fp: FpPages,
    lowbit: LowbitPages,
    transforms: HeadTransforms | None = None,
    *,
    bits: int,
    sm_scale: float,
    bits_v: int | None = None,
    value_layout: str = "tokens",
    num_splits: int | None = None,
    pages_per_block: int | None = None,
    backend: str = "gpu",
    interpret: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
    gather: str | None = None,
    int_to_float: str | None = None,
    row_sums: str | None = None,
    fp_pages_per_split: int | None = None,
    prologue: str | None = None,
) -> jax.Array:  # f32[B, Hq, d]
    """`decode_attention` with the inner-loop strategy chosen explicitly (benchmarks, tests).

    Args:
      gather, int_to_float, row_sums: see `DecodeConfig`; ``None`` takes the backend's
        defaults (``DEFAULT_GATHER`` / ``DEFAULT_INT_TO_FLOAT`` / ``DEFAULT_ROW_SUMS`` of the
        backend module; the modes a backend supports are its ``GATHER_MODES`` /
        ``INT_TO_FLOAT`` / ``ROW_SUMS``).
      fp_pages_per_split: full-precision pages per split of a backend that serves them with
        a kernel of their own (`fp_auto_pages_per_split` when ``None``).
      prologue: how the body builds its query operands (the module's ``PROLOGUES``, default
        its first).
      Others: as in `decode_attention`.
    """
    dims = _validate(q, fp, lowbit, transforms, bits=bits, value_layout=value_layout, bits_v=bits_v)
    (k_codes, k_scale, k_zero), (v_codes, v_scale, v_zero) = lowbit.k, lowbit.v
    query_transform, value_inverse = HeadTransforms() if transforms is None else transforms
    bits_v = bits if bits_v is None else bits_v
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
    mod = _backend_module(backend)
    if pages_per_block is None:
        pages_per_block = default_pages_per_block(backend, bits, bits_v)
    _check_kernel_shapes(dims, bits, pages_per_block, backend, value_layout)
    if bits_v != bits:
        _check_kernel_shapes(
            dict(dims, m=layout.packed_dim(dims["d"], bits_v)),
            bits_v,
            pages_per_block,
            backend,
            value_layout,
        )
    gather = mod.DEFAULT_GATHER if gather is None else gather
    int_to_float = mod.DEFAULT_INT_TO_FLOAT if int_to_float is None else int_to_float
    if gather not in mod.GATHER_MODES:
        raise ValueError(f"gather={gather!r} must be one of {mod.GATHER_MODES} for {backend=}")
    if int_to_float not in mod.INT_TO_FLOAT:
        raise ValueError(
            f"int_to_float={int_to_float!r} must be one of {mod.INT_TO_FLOAT} for {backend=}"
        )
    row_sums = mod.DEFAULT_ROW_SUMS if row_sums is None else row_sums
    if row_sums not in mod.ROW_SUMS:
        raise ValueError(f"row_sums={row_sums!r} must be one of {mod.ROW_SUMS} for {backend=}")
    prologue = mod.PROLOGUES[0] if prologue is None else prologue
    if prologue not in mod.PROLOGUES:
        raise ValueError(f"prologue={prologue!r} must be one of {mod.PROLOGUES} for {backend=}")
    unit = 1 if backend == "tpu" else pages_per_block
    if num_splits is None:
        num_splits = lowbit_auto_splits(
            dims["b"], dims["hkv"], lowbit.table.shape[1], pages_per_block, backend
        )
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    # The "fused" prologue (Mosaic GPU) groups, converts and transforms the queries itself.
    fused = prologue == "fused"
    if fused:
        g = q.shape[1] // dims["hkv"]
        qg = q.reshape(dims["b"], dims["hkv"], g, dims["d"])
    else:
        qg, g = _group_queries(q, dims["hkv"], mod.MIN_GROUP_PAD)
    hoist = mod.HOISTS_TRANSFORMS
    cfg = DecodeConfig(
        head_dim=dims["d"],
        page_size=dims["page"],
        group_pad=_group_pad(g, mod.MIN_GROUP_PAD),
        n_chunks=layout.codes_per_byte(bits_v),
        bits=bits,
        bits_v=None if bits_v == bits else bits_v,
        group_size=dims["group_size"],
        scale_log2=float(sm_scale) * LOG2E,
        pages_per_block=unit,
        has_query_transform=query_transform is not None and not hoist,
        has_value_inverse=value_inverse is not None and not hoist,
        gather=gather,
        int_to_float=int_to_float,
        row_sums=row_sums,
        group=g,
        value_layout=value_layout,
        prologue=prologue,
    )
    f32 = jnp.float32
    qt = None if query_transform is None else query_transform.astype(f32)
    vi = None if value_inverse is None else value_inverse.astype(f32)
    if hoist and qt is not None and not fused:
        qg = mod.head_matmul(qg, qt, interpret=interpret)  # into the transformed frame
    # The full-precision pages share the low-bit splits, or (a backend with its own kernel for
    # them) are split `fp_auto_pages_per_split` pages at a time.
    fp_splits = num_splits
    if fp_pages_per_split is None:
        fp_pages_per_split = fp_auto_pages_per_split(
            dims["b"], dims["hkv"], fp.table.shape[1], backend
        )
    elif mod.FP_PAGES_PER_SPLIT is None or fp_pages_per_split < 1:
        raise ValueError(
            f"fp_pages_per_split={fp_pages_per_split} needs a backend with a full-precision "
            f"kernel of its own (not {backend=}) and must be >= 1"
        )
    if fp_pages_per_split is not None:
        fp_splits = -(-fp.table.shape[1] // fp_pages_per_split)
    acc, m, l = mod.paged_decode(
        cfg,
        qg,
        qt if fused or not hoist else None,
        None if hoist else vi,
        (fp.k, fp.v, split_table(fp.table, fp_splits, unit), fp.length),
        (
            k_codes,
            v_codes,
            k_scale,
            k_zero,
            v_scale,
            v_zero,
            split_table(lowbit.table, num_splits, unit),
            lowbit.length,
        ),
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if mod.HAS_MERGE_KERNEL:  # GPU: merge + value inverse (hoisted) in one kernel
        o = mod.merge_splits(acc, m, l, vi if hoist else None, interpret=interpret)
    else:
        o = _merge_partials(acc, m, l)  # [B, Hkv, Gp, d]
    return _ungroup(o, g)


def _decode_bf16_mosaic(q, fp: FpPages, dims: dict, sm_scale, num_splits, interpret) -> jax.Array:
    """`decode_attention_bf16` on the Mosaic GPU body (`gpu_mosaic.fp_partials`: 64-token
    steps over whole pages) and the Triton merge kernel."""
    from pallas_kernels.decode_attention import gpu_mosaic, gpu_triton

    if interpret:
        raise ValueError("the Mosaic GPU body has no interpret mode; use backend='gpu'")
    per_step = max(1, gpu_mosaic.TILE // dims["page"])
    if num_splits is None:
        num_splits = _auto_splits(dims["b"], dims["hkv"], fp.table.shape[1], per_step)
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    qg, g = _group_queries(q, dims["hkv"], 1)
    table = split_table(fp.table, num_splits, per_step)
    acc, m, l = gpu_mosaic.fp_partials(
        qg, (fp.k, fp.v, table, fp.length), scale_log2=float(sm_scale) * LOG2E, group=g
    )
    return _ungroup(gpu_triton.merge_splits(acc, m, l, None, interpret=False), g)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "num_splits",
        "pages_per_block",
        "backend",
        "interpret",
        "num_warps",
        "num_stages",
    ),
)
def decode_attention_bf16(
    q: jax.Array,  # bf16|f32[B, Hq, d]
    fp: FpPages,  # full-precision pages
    *,
    sm_scale: float,
    num_splits: int | None = None,
    pages_per_block: int | None = None,
    backend: str = "gpu",
    interpret: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> jax.Array:  # f32[B, Hq, d]
    """The BF16 baseline: same kernel structure (GQA group as M, splits, LSE merge) over
    full-precision pages only, no transforms. Arguments as in `decode_attention`
    (``pages_per_block=None`` means 8, the value this baseline was tuned with).
    ``backend="gpu_mosaic"``: the Mosaic GPU body instead (`gpu_mosaic.fp_partials`, tokens
    as the MMA's M; ``pages_per_block``, ``num_warps`` and ``num_stages`` do not apply)."""
    if pages_per_block is None:
        pages_per_block = BF16_PAGES_PER_BLOCK
    dims = _validate_fp(q, fp)
    if backend == "gpu_mosaic":
        return _decode_bf16_mosaic(q, fp, dims, sm_scale, num_splits, interpret)
    _check_kernel_shapes(dims, None, pages_per_block, backend)
    mod = _backend_module(backend)
    unit = pages_per_block if backend == "gpu" else 1
    if num_splits is None:
        num_splits = _auto_splits(dims["b"], dims["hkv"], fp.table.shape[1], pages_per_block)
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    qg, g = _group_queries(q, dims["hkv"], mod.MIN_GROUP_PAD)
    cfg = DecodeConfig(
        head_dim=dims["d"],
        page_size=dims["page"],
        group_pad=qg.shape[2],
        n_chunks=1,
        bits=None,
        group_size=None,
        scale_log2=float(sm_scale) * LOG2E,
        pages_per_block=unit,
        has_query_transform=False,
        has_value_inverse=False,
        group=g,
    )
    acc, m, l = mod.paged_decode(
        cfg,
        qg,
        None,
        None,
        (fp.k, fp.v, split_table(fp.table, num_splits, unit), fp.length),
        None,
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if mod.HAS_MERGE_KERNEL:  # the GPU merge kernel (no value inverse here)
        return _ungroup(mod.merge_splits(acc, m, l, None, interpret=interpret), g)
    return _merge_splits(acc, m, l, g)
