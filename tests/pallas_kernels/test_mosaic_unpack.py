"""The Mosaic GPU body's code unpack, checked on CPU: plain integer and float16 arithmetic
(the kernel applies the same jnp ops to register arrays of 16-bit words)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import layout
from pallas_kernels.decode_attention import gpu_mosaic


@pytest.mark.parametrize("bits", [2, 4])
def test_half_planes_are_the_codes_of_every_word(bits):
    words = np.arange(1 << 16, dtype=np.uint32)
    w = jnp.asarray(words.astype(np.uint16).view(np.int16))
    mask = (1 << bits) - 1
    offsets = gpu_mosaic.half_plane_offsets(bits)
    exact = gpu_mosaic._half_planes(w, bits, exact=True)
    shifted = gpu_mosaic._half_planes(w, bits)
    assert len(exact) == 2 * layout.codes_per_byte(bits)
    for e, (hi, i, _, _) in enumerate(gpu_mosaic.half_plane_sources(bits)):
        want = ((words >> (8 * hi + bits * i)) & mask).astype(np.float32)
        assert exact[e].dtype == jnp.float16
        np.testing.assert_array_equal(np.asarray(exact[e], np.float32), want)
        np.testing.assert_array_equal(np.asarray(shifted[e], np.float32), want + offsets[e])
        assert offsets[e] <= 64  # the float32 accumulator keeps the codes' precision


@pytest.mark.parametrize("bits, d", [(2, 128), (4, 128), (2, 256), (4, 64)])
def test_key_half_planes_hold_the_channels_the_query_is_permuted_to(bits, d):
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 1 << bits, (5, d)).astype(np.uint8)
    packed = np.asarray(layout.pack_codes(jnp.asarray(codes), bits))
    words = jnp.asarray(packed.view(np.int16))  # little-endian: byte 2j is the low byte
    dims = gpu_mosaic.key_half_plane_dims(bits, packed.shape[-1])
    assert sorted(dims.reshape(-1).tolist()) == list(range(d))
    for e, plane in enumerate(gpu_mosaic._half_planes(words, bits, exact=True)):
        np.testing.assert_array_equal(np.asarray(plane, np.float32), codes[:, dims[e]])


@pytest.mark.parametrize("bits", [2, 4])
def test_dims_value_half_planes_are_contiguous_token_blocks(bits):
    page, d = 128, 64
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 1 << bits, (page, d)).astype(np.uint8)
    packed = np.asarray(layout.pack_value_page_dims_major(jnp.asarray(codes), bits))  # [d, .]
    np.testing.assert_array_equal(
        np.asarray(layout.unpack_value_page_dims_major(jnp.asarray(packed), bits, page)), codes
    )
    kb = page // (2 * layout.codes_per_byte(bits))
    words = jnp.asarray(packed.view(np.int16))  # [d, kb]
    for e, plane in enumerate(gpu_mosaic._half_planes(words, bits, exact=True)):
        np.testing.assert_array_equal(np.asarray(plane, np.float32), codes[e * kb : (e + 1) * kb].T)
