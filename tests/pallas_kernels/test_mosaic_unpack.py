"""The Mosaic GPU body's code-to-float16 unpack, checked on CPU: it is plain integer and
float16 arithmetic (the kernel applies the same jnp ops to register arrays)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention import gpu_mosaic


@pytest.mark.parametrize("bits", [2, 4])
def test_plane_to_f16_is_the_exact_code_of_every_byte(bits):
    w = jnp.arange(256, dtype=jnp.int32).astype(jnp.int16)  # every byte, zero-extended
    for i in range(8 // bits):
        got = gpu_mosaic._plane_to_f16(w, i, bits)
        want = (np.arange(256) >> (bits * i)) & ((1 << bits) - 1)
        assert got.dtype == jnp.float16
        np.testing.assert_array_equal(np.asarray(got, np.float32), want.astype(np.float32))
