"""Bits per element of a low-bit KV cache, and per-layer bit allocations.

The one place the cache's memory is counted for a bit budget. An element is one channel of
one cached key or value of one KV head; its bits are, averaged over every (layer, K/V) cache:

    bpe = f_low * lowbit_bpe + (1 - f_low) * fp_bits

- ``lowbit_bpe`` of a (layer, K or V) cache: its codes (``bits`` per element as stored: 2 and
  4 packed planar, 3 bit-sliced: 3 bits) plus its scale and zero per group of ``G``
  channels (``2 * meta_bits / G``: 0.5 at float16 and G = 64, 0.25 with the 8-bit encoding of
  `pallas_kernels.layout`), exactly `pallas_kernels.layout.PageLayout.bits_per_element`;
- ``f_low`` the fraction of a ``context``-token sequence held in low-bit pages under the
  window policy (`CacheConfig.quant_end`: sink and the recent window stay full precision),
  ``fp_bits`` the full-precision pages' width (16: bfloat16, what a deployment stores).
  ``context=None`` is the long-context limit, ``f_low = 1``: the low-bit pages alone.

Full-precision layers (Gemma 3's sliding layers by default) count at ``fp_bits`` throughout.
Pools are sized for ``max_seq_len`` and pages are whole, so what a device allocates
(`PagedKVCache.allocated_bytes`) is a little more than this count of the stored tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvjax.cache.quantizers import QuantConfig
from pallas_kernels import layout as lay


@dataclasses.dataclass(frozen=True)
class Format:
    """One (layer, K or V) cache's low-bit format: code width and scale/zero storage."""

    bits: int
    meta_dtype: str = "float16"

    def __post_init__(self):
        if self.bits not in lay.SUPPORTED_BITS:
            raise ValueError(f"bits={self.bits!r} is not one of {lay.SUPPORTED_BITS}")
        if self.meta_dtype not in lay.META_DTYPES:
            raise ValueError(f"meta_dtype={self.meta_dtype!r} is not one of {lay.META_DTYPES}")

    @property
    def name(self) -> str:
        """``"2b/float16"``, ``"4b/uint8"``, ..."""
        return f"{self.bits}b/{self.meta_dtype}"

    @classmethod
    def parse(cls, name: str) -> Format:
        """Inverse of `name`."""
        try:
            b, meta = name.split("/")
            return cls(int(b.rstrip("b")), meta)
        except ValueError as e:
            raise ValueError(f"format {name!r}: expected BITSb/META, e.g. '2b/uint8'") from e

    def bits_per_token(self, head_dim: int, group_size: int | None = None) -> int:
        """Stored bits of one token of one KV head (codes + scale + zero): an integer."""
        pl = lay.PageLayout(1, 1, head_dim, self.bits, group_size, self.meta_dtype)
        return 8 * pl.lowbit_bytes_per_token

    def bits_per_element(self, head_dim: int, group_size: int | None = None) -> float:
        """Stored bits per element in low-bit pages, scale and zero included."""
        return self.bits_per_token(head_dim, group_size) / head_dim

    def quant_config(self, method: str = "oscar", group_size: int | None = None) -> QuantConfig:
        return QuantConfig(
            method=method, bits=self.bits, group_size=group_size, meta_dtype=self.meta_dtype
        )


def lowbit_fraction(context: int | None, sink: int, keep: int, flush: int) -> float:
    """Fraction of a ``context``-token sequence in low-bit pages (None: 1, the limit)."""
    if context is None:
        return 1.0
    if context < 1:
        raise ValueError(f"context={context} must be >= 1 (or None for the long-context limit)")
    over = max(0, context - sink - keep)
    return (over // flush) * flush / context


def cache_bpe(
    formats: Sequence[tuple[Format | None, Format | None]],  # per layer (keys, values)
    head_dim: int,
    group_size: int | None = None,
    *,
    context: int | None = None,
    sink: int = 64,
    keep: int = 256,
    flush: int = 16,
    fp_bits: int = 16,
) -> float:
    """Average stored bits per cached element (module docstring); None format = full
    precision throughout (a layer whose middle segment is not quantized)."""
    f_low = lowbit_fraction(context, sink, keep, flush)
    total = 0.0
    for pair in formats:
        for f in pair:
            low = fp_bits if f is None else f.bits_per_element(head_dim, group_size)
            total += f_low * low + (1.0 - f_low) * fp_bits
    return total / (2 * len(formats))


@dataclasses.dataclass(frozen=True)
class BitAllocation:
    """Per-layer (key, value) low-bit formats, chosen under a bits-per-element budget.

    Attributes:
      layers: one (key format, value format) pair per layer.
      budget: the budget it was chosen for (average bits per element, `cache_bpe`).
      context, sink, keep, flush, fp_bits: the accounting the budget was stated in.
    """

    layers: tuple[tuple[Format, Format], ...]
    budget: float | None = None
    context: int | None = None
    sink: int = 64
    keep: int = 256
    flush: int = 16
    fp_bits: int = 16

    def bpe(self, head_dim: int, group_size: int | None = None, **accounting) -> float:
        """`cache_bpe` of this allocation; keyword arguments override its own accounting."""
        acc = dict(
            context=self.context,
            sink=self.sink,
            keep=self.keep,
            flush=self.flush,
            fp_bits=self.fp_bits,
        )
        acc.update(accounting)
        return cache_bpe(self.layers, head_dim, group_size, **acc)

    def layer_quant(
        self, method: str = "oscar", group_size: int | None = None
    ) -> tuple[tuple[QuantConfig, QuantConfig], ...]:
        """`CacheConfig.layer_quant` for this allocation with one quantizer method."""
        return tuple(
            (k.quant_config(method, group_size), v.quant_config(method, group_size))
            for k, v in self.layers
        )

    def clips(self, clips_by_bits: dict) -> tuple[list[float], list[float]]:
        """Per-layer key and value clips, each taken at its layer's width from a checkpoint's
        ``clips_by_bits`` metadata ({"2": {"k": [...], "v": [...]}, ...})."""
        ck, cv = [], []
        for i, (k, v) in enumerate(self.layers):
            for fmt, kind, out in ((k, "k", ck), (v, "v", cv)):
                got = clips_by_bits.get(str(fmt.bits))
                if got is None:
                    raise ValueError(
                        f"layer {i} uses {fmt.bits} bits but the checkpoint has clips for "
                        f"{sorted(clips_by_bits)} only"
                    )
                out.append(float(got[kind][i]))
        return ck, cv

    def counts(self) -> dict[str, int]:
        """How many (layer, K/V) caches use each format."""
        out: dict[str, int] = {}
        for pair in self.layers:
            for f in pair:
                out[f.name] = out.get(f.name, 0) + 1
        return dict(sorted(out.items()))

    def to_dict(self) -> dict:
        return dict(
            layers=[[k.name, v.name] for k, v in self.layers],
            budget=self.budget,
            context=self.context,
            sink=self.sink,
            keep=self.keep,
            flush=self.flush,
            fp_bits=self.fp_bits,
        )

    @classmethod
    def from_dict(cls, d: dict) -> BitAllocation:
        layers = tuple((Format.parse(k), Format.parse(v)) for k, v in d["layers"])
        rest = {
            k: d[k] for k in ("budget", "context", "sink", "keep", "flush", "fp_bits") if k in d
        }
        return cls(layers=layers, **rest)

    @classmethod
    def uniform(cls, fmt: Format, num_layers: int, **accounting) -> BitAllocation:
        return cls(layers=((fmt, fmt),) * num_layers, **accounting)
