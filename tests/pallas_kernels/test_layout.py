"""Tests for the shared bit/page layout (pallas_kernels.layout)."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import layout

HEAD_DIMS = (64, 128)


@st.composite
def _codes_case(draw):
    bits = draw(st.sampled_from((2, 3, 4)))
    d = draw(st.sampled_from(HEAD_DIMS))
    g = draw(st.sampled_from((32, 64, d)))
    lead = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 2**bits, size=(*lead, d), dtype=np.uint8)
    return bits, d, g, codes


@settings(max_examples=15, deadline=None)
@given(_codes_case())
def test_pack_unpack_round_trip(case):
    bits, d, g, codes = case
    # The layout is per-row, so every group size sees the same packed row; check the group
    # slices of the unpacked row too (what a kernel reading one group's codes gets).
    packed = layout.pack_codes(jnp.asarray(codes), bits)
    assert packed.dtype == jnp.uint8
    assert packed.shape == (*codes.shape[:-1], d * bits // 8)
    out = np.asarray(layout.unpack_codes(packed, bits, d))
    np.testing.assert_array_equal(out, codes)
    for s in range(0, d, g):
        np.testing.assert_array_equal(out[..., s : s + g], codes[..., s : s + g])


@pytest.mark.parametrize("bits", [2, 4])
def test_planar_bit_positions(bits):
    """Byte j holds code j + i*(d/n) at bit offset i*bits (the fixed spec, written out)."""
    d = 64
    n = 8 // bits
    m = d // n
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 2**bits, size=(5, d), dtype=np.uint8)
    packed = np.asarray(layout.pack_codes(jnp.asarray(codes), bits))
    expected = np.zeros((5, m), np.int64)
    for j in range(m):
        for i in range(n):
            expected[:, j] |= codes[:, j + i * m].astype(np.int64) << (i * bits)
    np.testing.assert_array_equal(packed, expected.astype(np.uint8))
    planes = layout.unpack_planes(jnp.asarray(packed), bits)
    assert len(planes) == n
    for i, plane in enumerate(planes):
        np.testing.assert_array_equal(np.asarray(plane), codes[:, i * m : (i + 1) * m])


def test_unpack_planes_on_int32_tiles():
    """Kernels may widen bytes to int32 before shifting; the helper keeps the dtype."""
    codes = np.arange(32, dtype=np.uint8) % 4
    packed = layout.pack_codes(jnp.asarray(codes), 2).astype(jnp.int32)
    planes = layout.unpack_planes(packed, 2)
    assert all(p.dtype == jnp.int32 for p in planes)
    np.testing.assert_array_equal(np.concatenate([np.asarray(p) for p in planes]), codes)


def test_three_bits_is_bit_sliced():
    """3 bits: low two bits in the 2-bit planar layout, then the high bit 1-bit planar."""
    d = 32
    codes = np.random.default_rng(1).integers(0, 8, (3, d), dtype=np.uint8)
    assert layout.codes_per_byte(3) == 1 and not layout.is_packed(3)  # no planar kernel layout
    packed = np.asarray(layout.pack_codes(jnp.asarray(codes), 3))
    assert packed.shape == (3, 12) and layout.packed_dim(d, 3) == 12
    lo = np.asarray(layout.pack_codes(jnp.asarray(codes & 3), 2))
    np.testing.assert_array_equal(packed[:, :8], lo)
    hi = np.zeros((3, 4), np.int64)
    for j in range(4):
        for i in range(8):
            hi[:, j] |= (codes[:, j + 4 * i] >> 2).astype(np.int64) << i
    np.testing.assert_array_equal(packed[:, 8:], hi.astype(np.uint8))
    with pytest.raises(ValueError, match="multiple of 8"):
        layout.packed_dim(36, 3)


def test_codes_per_byte_and_errors():
    assert layout.codes_per_byte(2) == 4
    assert layout.codes_per_byte(4) == 2
    with pytest.raises(ValueError, match="bits=5"):
        layout.codes_per_byte(5)
    with pytest.raises(ValueError, match="d=30"):
        layout.packed_dim(30, 2)
    with pytest.raises(ValueError, match="packed.shape"):
        layout.unpack_codes(jnp.zeros((3, 8), jnp.uint8), 2, 64)


def test_page_layout_shapes_and_bytes():
    lay = layout.PageLayout(page_size=16, num_kv_heads=3, head_dim=64, bits=2, group_size=32)
    assert lay.codes_shape(7) == (7, 3, 16, 16)
    assert lay.meta_shape(7) == (7, 3, 16, 2)
    assert lay.fp_shape(7) == (7, 3, 16, 64)
    assert lay.token_codes_shape(5) == (5, 3, 16)
    assert lay.token_meta_shape(5) == (5, 3, 2)
    # 64 ch * 2 bit = 16 B codes, + 2 groups * (scale + zero) * 2 B f16 = 8 B, times 3 heads.
    assert lay.lowbit_bytes_per_token == 3 * (16 + 8)
    assert lay.fp_bytes_per_token == 3 * 64 * 2
    assert lay.bits_per_element == pytest.approx(2.0 + 2 * 2 * 16 / 64)
    assert lay.lowbit_bytes_per_page == 16 * lay.lowbit_bytes_per_token
    assert lay.num_pages_for(0) == 0
    assert lay.num_pages_for(17) == 2
    page, slot = lay.page_and_slot(jnp.asarray([0, 15, 16, 33]))
    np.testing.assert_array_equal(np.asarray(page), [0, 0, 1, 2])
    np.testing.assert_array_equal(np.asarray(slot), [0, 15, 0, 1])


def test_page_layout_defaults_and_normalisation():
    a = layout.PageLayout(16, 2, 128)
    b = layout.PageLayout(16, 2, 128, bits=2, group_size=128, meta_dtype=jnp.float16)
    assert a == b and hash(a) == hash(b)
    assert a.group_size == 128 and a.num_groups == 1
    assert a.fp_jnp_dtype == jnp.bfloat16
    c = layout.PageLayout(16, 2, 64, bits=3, group_size=32, fp_dtype="float32")
    assert c.codes_shape(2) == (2, 2, 16, 24)
    assert c.bits_per_element == 3.0 + 2 * 16 / 32
    assert c.fp_bytes_per_token == 2 * 64 * 4


@pytest.mark.parametrize(
    ("kwargs", "msg"),
    [
        (dict(page_size=0, num_kv_heads=1, head_dim=64), "page_size=0"),
        (dict(page_size=16, num_kv_heads=1, head_dim=64, group_size=48), "group_size=48"),
        (dict(page_size=16, num_kv_heads=1, head_dim=64, bits=1), "bits=1"),
        (dict(page_size=16, num_kv_heads=1, head_dim=6, bits=2, group_size=6), "head_dim=6"),
        (dict(page_size=16, num_kv_heads=1, head_dim=64, meta_dtype="int8"), "meta_dtype"),
        (dict(page_size=16, num_kv_heads=1, head_dim=64, fp_dtype="float64"), "fp_dtype"),
    ],
)
def test_page_layout_validation(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        layout.PageLayout(**kwargs)


def test_page_layout_bad_num_pages():
    lay = layout.PageLayout(16, 1, 64)
    with pytest.raises(ValueError, match="num_pages=0"):
        lay.codes_shape(0)


@pytest.mark.parametrize("bits", [2, 4])  # the kernels' widths; 3-bit rows are reference-only
@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.int32])
def test_pack_tile_matches_pack_codes(bits, dtype):
    """The kernel-side (reshape + sum) packer produces the same bytes as pack_codes."""
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 2**bits, size=(16, 128)).astype(np.uint8)
    tile = layout.pack_tile(jnp.asarray(codes, dtype), bits)
    assert tile.dtype == dtype
    np.testing.assert_array_equal(
        np.asarray(tile).astype(np.uint8), np.asarray(layout.pack_codes(jnp.asarray(codes), bits))
    )


def test_scatter_tokens_writes_only_addressed_slots():
    lay = layout.PageLayout(page_size=4, num_kv_heads=2, head_dim=64, fp_dtype="float32")
    pool = jnp.full(lay.fp_shape(3), jnp.nan, jnp.float32)
    values = jnp.arange(3 * 2 * 64, dtype=jnp.float32).reshape(3, 2, 64)
    page, slot = jnp.asarray([2, 0, 2]), jnp.asarray([1, 3, 0])
    out = np.asarray(layout.scatter_tokens(pool, values, page, slot))
    for i in range(3):
        np.testing.assert_array_equal(out[int(page[i]), :, int(slot[i])], np.asarray(values[i]))
    assert np.isnan(out).sum() == out.size - 3 * 2 * 64
    with pytest.raises(ValueError, match="values.shape"):
        layout.scatter_tokens(pool, values[:, :, :32], page, slot)


# ---- 8-bit scale and zero (meta_dtype="uint8") ---------------------------------------------
def test_u8_scale_encoding_round_trips_and_rounds_to_nearest():
    rng = np.random.default_rng(0)
    s = jnp.asarray(np.exp(rng.uniform(-9.0, 7.0, 4096)).astype(np.float32))
    r = layout.round_scale_u8(s)
    stored = layout.encode_meta(r, "uint8", "scale", 2)
    assert stored.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(layout.decode_scale(stored)), np.asarray(r))
    lo, hi = layout.scale_u8_range()
    sn, rn = np.asarray(s), np.asarray(r)
    inside = (sn >= lo) & (sn <= hi)
    # 4 mantissa bits: nearest is within half a step, 1/32 relative at most
    assert np.max(np.abs(rn[inside] / sn[inside] - 1)) <= 1 / 32 + 1e-7
    assert np.all(rn[sn < lo] == lo) and np.all(rn[sn > hi] == hi)
    # every byte decodes to a distinct, increasing scale
    all_bytes = layout.decode_scale(jnp.arange(256, dtype=jnp.uint8))
    assert bool(jnp.all(jnp.diff(all_bytes) > 0))
    np.testing.assert_array_equal(
        np.asarray(layout.encode_meta(all_bytes, "uint8", "scale", 2)), np.arange(256)
    )


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_u8_zero_encoding(bits):
    z = jnp.linspace(-30.0, 30.0, 2001)
    r = layout.round_zero_u8(z, bits)
    stored = layout.encode_meta(r, "uint8", "zero", bits)
    np.testing.assert_array_equal(np.asarray(layout.decode_zero(stored, bits)), np.asarray(r))
    lo, hi = layout.zero_u8_range(bits)
    zn = np.asarray(z)
    inside = (zn >= lo) & (zn <= hi)
    step = 1.0 / layout.ZERO_U8_UNITS[bits]
    assert np.max(np.abs(np.asarray(r)[inside] - zn[inside])) <= step / 2 + 1e-6
    # quest's zero point h - 1/2 = qmax / 2 is byte 128, exactly
    h = 1 << (bits - 1)
    mid = layout.encode_meta(jnp.float32(h - 0.5), "uint8", "zero", bits)
    assert int(mid) == 128
    assert float(layout.decode_zero(mid, bits)) == h - 0.5


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_u8_decode_is_the_documented_value_of_every_byte(bits):
    """Both decodes (one integer multiply-add + bitcast; one float multiply-add) give the
    module docstring's values exactly: 2**(e - bias) * (1 + m / 16) and (z - 128) / U + qmax / 2."""
    c = np.arange(256)
    want_scale = 2.0 ** ((c >> 4) - layout.SCALE_U8_BIAS) * (1 + (c & 15) / 16)
    want_zero = (c - 128) / layout.ZERO_U8_UNITS[bits] + ((1 << bits) - 1) / 2
    stored = jnp.arange(256, dtype=jnp.uint8)
    np.testing.assert_array_equal(np.asarray(layout.decode_scale(stored)), want_scale)
    np.testing.assert_array_equal(np.asarray(layout.decode_zero(stored, bits)), want_zero)


def test_u8_meta_layout_bytes():
    c = layout.PageLayout(16, 3, 64, bits=2, meta_dtype="uint8")
    assert c.bits_per_element == 2.25
    assert layout.PageLayout(16, 3, 128, bits=2, meta_dtype="uint8").bits_per_element == 2.125
    assert layout.PageLayout(16, 3, 64, bits=2).bits_per_element == 2.5
