"""Per-token, per-group low-bit quantizers for KV vectors (oscar, quest, minmax).

The math lives in :mod:`pallas_kernels.quant_math` (shared with the quantize+pack kernel); the
packed bit layout in :mod:`pallas_kernels.layout`. This module is the user-facing API:

>>> cfg = QuantConfig(method="oscar", bits=2, group_size=64, clip=0.96)
>>> qa = quantize(x, cfg)                 # x: f32[..., head_dim]
>>> x_hat = dequantize(qa)                # f32[..., head_dim]
>>> x_hat = fake_quantize(x, cfg)         # same values, no packing (calibration / eval)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import layout
from pallas_kernels import quant_math as qm


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How one K or V cache is quantized.

    Attributes:
      method: 'oscar' (percentile clip + asymmetric min/max), 'quest' (RMS-scaled symmetric
        grid, WUSH-KV Eq. 5) or 'minmax' (asymmetric min/max, no clip).
      bits: 2 or 4 (stored packed planar) or 3 (stored bit-sliced, reference paths only).
      group_size: channels per (scale, zero); None means the whole head_dim.
      clip: oscar: percentile kappa in (0, 1] (None = 1, no clip); quest: clip endpoint in RMS
        units (None = the Gaussian-optimal alpha_b); minmax: must be None.
      meta_dtype: storage dtype of scale and zero ('float16', 'bfloat16', 'float32', or
        'uint8': one byte each, the 8-bit encoding of `pallas_kernels.layout`).
    """

    method: qm.Method = "oscar"
    bits: int = 2
    group_size: int | None = None
    clip: float | None = None
    meta_dtype: str = "float16"

    def __post_init__(self) -> None:
        if self.method not in qm.METHODS:
            raise ValueError(f"method={self.method!r} is not one of {qm.METHODS}")
        if self.bits not in layout.SUPPORTED_BITS:
            raise ValueError(f"bits={self.bits!r} is not one of {layout.SUPPORTED_BITS}")
        if self.group_size is not None and (
            not isinstance(self.group_size, int) or self.group_size <= 0
        ):
            raise ValueError(f"group_size={self.group_size!r} must be a positive int or None")
        if self.clip is not None:
            _check_clip_value(self.method, self.clip)
        name = jnp.dtype(self.meta_dtype).name
        if name not in layout.META_DTYPES:
            raise ValueError(f"meta_dtype={self.meta_dtype!r} is not one of {layout.META_DTYPES}")
        object.__setattr__(self, "meta_dtype", name)

    def resolve_group_size(self, head_dim: int) -> int:
        """The group size for a given head_dim, validating divisibility."""
        g = head_dim if self.group_size is None else self.group_size
        if head_dim % g:
            raise ValueError(f"head_dim={head_dim} is not divisible by group_size={g}")
        return g


def _check_clip_value(method: str, clip: object) -> None:
    """Validates a concrete clip value; traced values are clamped by the math instead."""
    if method == "minmax":
        raise ValueError(f"clip={clip!r} given for method='minmax', which never clips")
    if isinstance(clip, jax.core.Tracer):
        return
    arr = np.asarray(clip, np.float32)
    if method == "oscar" and bool(np.any((arr <= 0.0) | (arr > 1.0))):
        raise ValueError(f"clip={clip!r}: oscar percentile kappa must be in (0, 1]")
    if method == "quest" and bool(np.any(arr <= 0.0)):
        raise ValueError(f"clip={clip!r}: quest clip endpoint (RMS units) must be > 0")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """Low-bit codes plus per-group scale and zero point.

    Reconstruction invariant, per group of ``group_size`` consecutive channels::

        x_hat[..., c] = (code[..., c] - zero[..., c // group_size]) * scale[..., c // group_size]

    ``codes`` are stored in the planar packed layout of :mod:`pallas_kernels.layout` when
    ``packed`` (bits 2 and 4), else bit-sliced (bits 3, `layout`). ``zero`` is real-valued.
    ``scale`` and ``zero`` hold their stored form: floats, or bytes of the 8-bit encoding
    (``layout.decode_scale`` / ``decode_zero`` give the float32 values).

    Attributes:
      codes: u8[..., d // codes_per_byte(bits)].
      scale: meta_dtype[..., d // group_size].
      zero: meta_dtype[..., d // group_size].
      bits: code width (static).
      group_size: channels per group (static).
      d: channels per row, i.e. head_dim (static).
      packed: whether ``codes`` are bit-packed (static).
    """

    codes: jax.Array
    scale: jax.Array
    zero: jax.Array
    bits: int = dataclasses.field(metadata=dict(static=True))
    group_size: int = dataclasses.field(metadata=dict(static=True))
    d: int = dataclasses.field(metadata=dict(static=True))
    packed: bool = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the dequantized array."""
        return (*self.codes.shape[:-1], self.d)

    def unpacked_codes(self) -> jax.Array:  # u8[..., d]
        """Codes one per channel."""
        return layout.unpack_codes(self.codes, self.bits, self.d)


def _grouped_codes_scale_zero(
    x: jax.Array,  # float[..., d]
    cfg: QuantConfig,
    clip: jax.Array | float | None,
) -> tuple[jax.Array, jax.Array, jax.Array, int]:
    """Shared front half of quantize / fake_quantize: group view, clip broadcast, the math."""
    if x.ndim < 1:
        raise ValueError(f"{x.shape=}: need at least one axis (head_dim last)")
    d = x.shape[-1]
    g = cfg.resolve_group_size(d)
    clip = cfg.clip if clip is None else clip
    if clip is not None:
        _check_clip_value(cfg.method, clip)
        clip = jnp.asarray(clip, jnp.float32)
        lead = x.shape[:-1]
        if clip.ndim > len(lead):
            raise ValueError(f"clip shape {clip.shape} has more axes than x's leading {lead}")
        try:
            clip = jnp.broadcast_to(clip, lead)
        except ValueError as e:
            raise ValueError(f"clip shape {clip.shape} does not broadcast to {lead}") from e
        clip = clip[..., None, None]  # [..., 1 group axis, 1]
    xg = x.astype(jnp.float32).reshape(*x.shape[:-1], d // g, g)  # f32[..., d/G, G]
    codes, scale, zero = qm.quantize_groups(
        xg, cfg.method, cfg.bits, clip=clip, meta_dtype=jnp.dtype(cfg.meta_dtype)
    )
    return codes, scale, zero, g


def quantize(
    x: jax.Array,  # f32|bf16[..., d]
    cfg: QuantConfig,
    clip: jax.Array | float | None = None,  # scalar or broadcastable to x.shape[:-1]
) -> QuantizedArray:
    """Quantizes the last axis of ``x`` per group; packs codes for 2 and 4 bits.

    Args:
      x: values; any leading axes, last axis = head_dim.
      cfg: quantizer configuration.
      clip: overrides ``cfg.clip``; a scalar or an array broadcastable to ``x.shape[:-1]``
        (e.g. per-layer / per-head kappa).

    Returns:
      A :class:`QuantizedArray`.
    """
    codes, scale, zero, g = _grouped_codes_scale_zero(x, cfg, clip)
    d = x.shape[-1]
    meta = jnp.dtype(cfg.meta_dtype)
    flat = codes.reshape(*x.shape[:-1], d).astype(jnp.uint8)
    return QuantizedArray(
        codes=layout.pack_codes(flat, cfg.bits),
        scale=layout.encode_meta(scale[..., 0], meta, "scale", cfg.bits),
        zero=layout.encode_meta(zero[..., 0], meta, "zero", cfg.bits),
        bits=cfg.bits,
        group_size=g,
        d=d,
        packed=layout.is_packed(cfg.bits),
    )


def dequantize(qa: QuantizedArray) -> jax.Array:  # f32[..., d]
    """Applies the reconstruction invariant; returns float32."""
    codes = qa.unpacked_codes()
    ng = qa.d // qa.group_size
    cg = codes.reshape(*codes.shape[:-1], ng, qa.group_size)  # u8[..., d/G, G]
    scale = layout.decode_scale(qa.scale)[..., None]
    zero = layout.decode_zero(qa.zero, qa.bits)[..., None]
    out = qm.dequantize_groups(cg, scale, zero)
    return out.reshape(*codes.shape[:-1], qa.d)


def fake_quantize(
    x: jax.Array,  # f32|bf16[..., d]
    cfg: QuantConfig,
    clip: jax.Array | float | None = None,  # scalar or broadcastable to x.shape[:-1]
) -> jax.Array:  # f32[..., d]
    """``dequantize(quantize(x, cfg, clip))`` without packing; supports 3 bits."""
    codes, scale, zero, _ = _grouped_codes_scale_zero(x, cfg, clip)
    return qm.dequantize_groups(codes, scale, zero).reshape(x.shape)
