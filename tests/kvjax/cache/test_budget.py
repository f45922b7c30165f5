"""Bits-per-element accounting of `kvjax.cache.budget` and bit allocations' plumbing."""

import dataclasses

import pytest

from kvjax.cache.budget import BitAllocation, Format, cache_bpe, lowbit_fraction
from kvjax.cache.paged import CacheConfig, PagedKVCache
from kvjax.cache.transforms import KVTransforms
from kvjax.config import ModelConfig


@pytest.mark.parametrize(
    ("name", "d", "bpe"),
    [
        ("2b/float16", 64, 2.5),
        ("2b/uint8", 64, 2.25),
        ("2b/float16", 128, 2.25),
        ("2b/uint8", 128, 2.125),
        ("4b/uint8", 64, 4.25),
        ("3b/float16", 64, 3.5),  # 3 bits is stored bit-sliced (2 + 1 bits)
        ("3b/uint8", 64, 3.25),
    ],
)
def test_format_bits_per_element(name, d, bpe):
    assert Format.parse(name).bits_per_element(d) == bpe
    assert Format.parse(name).name == name


def test_cache_bpe_counts_the_full_precision_windows():
    f = Format(2)
    layers = [(f, f)] * 3
    assert cache_bpe(layers, 64) == 2.5  # context None: the low-bit pages alone
    # 2048 tokens at 16/128/16: quant_end = 1920, so 1904 low-bit and 144 bf16 tokens
    got = cache_bpe(layers, 64, context=2048, sink=16, keep=128, flush=16)
    assert got == pytest.approx((1904 * 2.5 + 144 * 16) / 2048)
    assert lowbit_fraction(100, 64, 256, 16) == 0.0
    mixed = [(Format(2, "uint8"), Format(4, "uint8")), (None, None)]  # a full-precision layer
    assert cache_bpe(mixed, 64) == pytest.approx((2.25 + 4.25 + 16 + 16) / 4)


def test_allocation_round_trip_clips_and_cache():
    alloc = BitAllocation(
        ((Format(2, "uint8"), Format(4)), (Format(3), Format(2))), budget=3.0, context=None
    )
    assert BitAllocation.from_dict(alloc.to_dict()) == alloc
    assert alloc.counts() == {"2b/float16": 1, "2b/uint8": 1, "3b/float16": 1, "4b/float16": 1}
    clips = {str(b): dict(k=[b + 0.1, b + 0.2], v=[b + 0.3, b + 0.4]) for b in (2, 3, 4)}
    assert alloc.clips(clips) == ([2.1, 3.2], [4.3, 2.4])
    with pytest.raises(ValueError, match="layer 0 uses 2 bits"):
        alloc.clips({"4": clips["4"]})
    cfg = ModelConfig(
        model_type="llama", vocab_size=11, hidden_size=32, intermediate_size=48, num_layers=2,
        num_heads=2, num_kv_heads=1, head_dim=64,
    )  # fmt: skip
    cc = CacheConfig(
        sink=16, keep=16, page_size=16, max_seq_len=64, layer_quant=alloc.layer_quant("oscar")
    )
    pools = PagedKVCache.create(cfg, cc, KVTransforms.identity(cfg), 1).pools
    # the pools' bytes per token are the accounting's
    for pool, (k, v) in zip(pools, alloc.layers):
        for low, fmt in ((pool.k_low, k), (pool.v_low, v)):
            got = sum(x.shape[-1] * x.dtype.itemsize for x in low) * 8
            assert got == fmt.bits_per_token(64)
    assert dataclasses.replace(cc, layer_quant=None).layer_quant is None
