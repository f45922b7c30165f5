"""quantize+pack kernel vs its pure-jnp reference (interpret mode on CPU).

Kernel error is tested apart from quantization error: both paths get identical inputs and must
agree exactly (codes, scale, zero). On CPU interpret mode the matmul rounds identically in both,
so there are no ties to excuse; quantization quality is tested in tests/kvjax/test_quantizers.py.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import layout
from pallas_kernels.quantize_pack import quantize_pack, quantize_pack_to_pages, ref_quantize_pack


def _inputs(n, hkv, d, *, dist="t", dtype=jnp.float32, seed=0):
    kx, ka = jax.random.split(jax.random.key(seed))
    if dist == "t":
        x = jax.random.t(kx, 5.0, (n, hkv, d))
    else:  # integer-valued: many ties in |x A| when A is a permutation-like transform
        x = jax.random.randint(kx, (n, hkv, d), -3, 4).astype(jnp.float32)
    if dist == "ties":
        a = jnp.broadcast_to(jnp.eye(d)[::-1], (hkv, d, d))
    else:
        a = jnp.linalg.qr(jax.random.normal(ka, (hkv, d, d)))[0]
    return x.astype(dtype), a.astype(jnp.float32)


def assert_quantized_close(out, ref, *, bits, d, group_size, err_msg=""):
    """Kernel vs reference at the precision the contract promises, on any x86-64 CPU.

    The kernel computes ``x @ A`` with another blocking than XLA's matmul (its last partial
    block is padded), so the float32 transformed values may differ by a few float32 ulps (seen
    on AVX2 machines), and so may the min/max they yield. Hence: scale and zero equal within
    one ulp of their stored dtype or 16 float32 ulps, whichever is larger; codes equal wherever
    the group's scale and zero are bit-equal, except a handful (an unrounded value within an
    ulp of a rounding boundary) that differ by one; elsewhere codes differ by at most one.
    """
    codes_o, scale_o, zero_o = (np.asarray(a) for a in out)
    codes_r, scale_r, zero_r = (np.asarray(a) for a in ref)
    for name, o, r in (("scale", scale_o, scale_r), ("zero", zero_o, zero_r)):
        assert o.shape == r.shape and o.dtype == r.dtype, name
        if r.dtype == np.uint8:  # the 8-bit encoding: one step of the byte at most
            step = np.abs(o.astype(np.int32) - r.astype(np.int32))
            assert step.max(initial=0) <= 1, f"{err_msg} {name}: bytes differ by {step.max()}"
            continue
        rf = r.astype(np.float32)
        ulp = np.maximum(np.abs(np.spacing(r).astype(np.float32)), 16 * np.spacing(np.abs(rf)))
        diff = np.abs(o.astype(np.float32) - r.astype(np.float32))
        bad = ~(diff <= ulp)
        assert not bad.any(), (
            f"{err_msg} {name}: {int(bad.sum())} values off by more than the tolerance"
        )
    co = np.asarray(layout.unpack_codes(jnp.asarray(codes_o), bits, d)).astype(np.int32)
    cr = np.asarray(layout.unpack_codes(jnp.asarray(codes_r), bits, d)).astype(np.int32)
    delta = np.abs(co - cr)
    assert delta.max(initial=0) <= 1, f"{err_msg} codes differ by {delta.max()}"
    same_meta = (scale_o == scale_r) & (zero_o == zero_r)  # [..., d // G]
    same_meta = np.repeat(same_meta, group_size, axis=-1)  # [..., d]
    n_boundary = int((delta[same_meta] > 0).sum())
    assert n_boundary <= max(2, delta.size // 1000), (
        f"{err_msg} {n_boundary} of {delta.size} codes differ where scale and zero agree"
    )


# (bits, head_dim, group_size, Hkv, method, clip kind, input dist, meta dtype). Cases 0-2 and
# cases 3-5 each cover every value of bits {2,4}, d {64,128}, G {32,64,d}, Hkv {1,3,8}; each
# backend runs one covering half by default and the other half (and the full product) as slow.
CASES = [
    (2, 64, 32, 1, "oscar", "scalar", "t", "float16"),
    (4, 128, 64, 3, "oscar", "per_head", "ties", "bfloat16"),
    (2, 128, 128, 8, "quest", None, "t", "float16"),
    (4, 64, 64, 8, "minmax", None, "t", "float32"),
    (2, 128, 32, 3, "oscar", "per_head", "t", "float16"),
    (4, 128, 128, 1, "oscar", None, "ties", "float16"),
    # 8-bit scale/zero (layout's uint8 encoding), one case per backend by default.
    (2, 64, 64, 3, "oscar", "per_head", "t", "uint8"),
    (4, 128, 32, 8, "quest", None, "t", "uint8"),
]


def _case_params(fast):
    return [
        pytest.param(c, id="-".join(map(str, c)), marks=() if i in fast else pytest.mark.slow)
        for i, c in enumerate(CASES)
    ]


def _clip(kind, hkv):
    if kind == "scalar":
        return 0.92
    if kind == "per_head":
        return jnp.linspace(0.8, 1.0, hkv)
    return None


class QuantizePackTest:
    BACKEND = "gpu"

    @staticmethod
    def interpret():
        return True

    def _check(self, bits, d, g, hkv, method, clip_kind, dist, meta, *, n=19, dtype=jnp.float32):
        x, a = _inputs(n, hkv, d, dist=dist, dtype=dtype)
        clip = _clip(clip_kind, hkv)
        kw = dict(method=method, bits=bits, group_size=g, meta_dtype=meta)
        ref = ref_quantize_pack(x, a, clip, **kw)
        out = quantize_pack(x, a, clip, backend=self.BACKEND, interpret=self.interpret(), **kw)
        lay = layout.PageLayout(1, hkv, d, bits, g, meta)
        assert out[0].shape == lay.token_codes_shape(n) and out[0].dtype == jnp.uint8
        assert out[1].shape == lay.token_meta_shape(n) and out[1].dtype == lay.meta_jnp_dtype
        for name, r, o in zip(("codes", "scale", "zero"), ref, out):
            assert r.shape == o.shape and r.dtype == o.dtype, name
        assert_quantized_close(out, ref, bits=bits, d=d, group_size=g)
        return ref, out

    @pytest.mark.slow
    @pytest.mark.parametrize(
        ("bits", "d", "g", "hkv"),
        [
            (b, d, g, h)
            for b, d, g, h in itertools.product((2, 4), (64, 128), (32, 64, None), (1, 3, 8))
        ],
    )
    def test_full_sweep(self, bits, d, g, hkv):
        self._check(bits, d, g or d, hkv, "oscar", "per_head", "t", "float16")


class TestQuantizePackGpuInterpret(QuantizePackTest):
    @pytest.mark.parametrize("case", _case_params(fast=(3, 4, 5, 6)))
    def test_matches_reference(self, case):
        self._check(*case)

    def test_bf16_input_and_partial_block(self):
        self._check(2, 64, 32, 3, "oscar", "scalar", "t", "float16", n=5, dtype=jnp.bfloat16)

    # The page write is a scatter in the wrapper, identical for both backends: test it once.
    def test_write_into_nan_pages(self):
        n, hkv, d, g, page = 5, 3, 64, 32, 4
        x, a = _inputs(n, hkv, d)
        lay = layout.PageLayout(page, hkv, d, 2, g)
        codes_pool = jnp.full(lay.codes_shape(6), 0xFF, jnp.uint8)
        scale_pool = jnp.full(lay.meta_shape(6), jnp.nan, lay.meta_jnp_dtype)
        zero_pool = jnp.full(lay.meta_shape(6), jnp.nan, lay.meta_jnp_dtype)
        page_idx = jnp.asarray([2, 2, 2, 2, 5], jnp.int32)
        slot = jnp.asarray([0, 1, 2, 3, 0], jnp.int32)
        cp, sp, zp = quantize_pack_to_pages(
            x,
            a,
            codes_pool,
            scale_pool,
            zero_pool,
            page_idx,
            slot,
            0.96,
            bits=2,
            group_size=g,
            backend=self.BACKEND,
            interpret=self.interpret(),
        )
        ref = ref_quantize_pack(x, a, 0.96, bits=2, group_size=g)
        got = [pool[page_idx, :, slot] for pool in (cp, sp, zp)]  # [N, Hkv, w] each
        assert_quantized_close(got, ref, bits=2, d=d, group_size=g)
        # Untouched pages keep their poison values.
        assert bool(jnp.all(cp[0] == 0xFF)) and bool(jnp.all(jnp.isnan(sp[3])))
        assert bool(jnp.all(jnp.isnan(zp[5, :, 1:])))


class TestQuantizePackTpuInterpret(QuantizePackTest):
    BACKEND = "tpu"

    @staticmethod
    def interpret():
        return pltpu.InterpretParams()

    @pytest.mark.parametrize("case", _case_params(fast=(0, 1, 2, 7)))
    def test_matches_reference(self, case):
        self._check(*case, n=16)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize(
    ("kwargs", "msg"),
    [
        (dict(bits=3), "bits=3"),
        (dict(group_size=48), "group_size=48"),
        (dict(clip=jnp.ones((2,))), "clip shape"),
        (dict(method="minmax", clip=0.9), "method=.minmax."),
        (dict(block_tokens=12), "block_tokens=12"),
    ],
)
def test_validation(backend, kwargs, msg):
    x, a = jnp.ones((4, 3, 64)), jnp.ones((3, 64, 64))
    kwargs = dict(kwargs)
    clip = kwargs.pop("clip", None)
    with pytest.raises(ValueError, match=msg):
        quantize_pack(x, a, clip, backend=backend, interpret=True, **kwargs)


def test_shape_validation():
    x, a = jnp.ones((4, 3, 64)), jnp.ones((3, 64, 64))
    with pytest.raises(ValueError, match="a.shape"):
        quantize_pack(x, a[:2], interpret=True)
    with pytest.raises(ValueError, match="x.shape"):
        ref_quantize_pack(x[0], a)


def test_few_token_gpu_flush_takes_the_xla_path():
    # On GPU hardware a decode flush of <= GPU_XLA_MAX_TOKENS tokens is routed to the jitted
    # reference (measured faster than the kernel); it must return the reference's codes.
    # Runs anywhere: that path has no Pallas call, so it needs no GPU.
    from pallas_kernels import quantize_pack as qp

    x, a = _inputs(qp.GPU_XLA_MAX_TOKENS, 8, 128)
    got = quantize_pack(x, a, 0.95, bits=2, backend="gpu", interpret=False)
    want = ref_quantize_pack(x, a, 0.95, bits=2)
    # Jitted vs eager reference: XLA may fuse the matmul differently, so not bit-exact.
    assert_quantized_close(got, want, bits=2, d=128, group_size=128)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (Triton kernel)")
@pytest.mark.parametrize("bits", [2, 4])
def test_gpu_kernel_matches_reference_on_hardware(bits):
    """The compiled Triton kernel (prefill-sized: 64 tokens, past the few-token XLA routing)
    against the reference. The in-kernel float32 matmul may sum in another order than XLA's,
    so a value within an ulp of a rounding boundary may land one code apart."""
    x, a = _inputs(64, 8, 128, dist="t", dtype=jnp.bfloat16)
    kw = dict(method="oscar", bits=bits, group_size=128, meta_dtype="float16")
    ref = ref_quantize_pack(x, a, 0.95, **kw)
    out = quantize_pack(x, a, 0.95, backend="gpu", **kw)
    codes_r = np.asarray(layout.unpack_codes(ref[0], bits, 128), np.int32)
    codes_o = np.asarray(layout.unpack_codes(out[0], bits, 128), np.int32)
    diff = np.abs(codes_r - codes_o)
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-3, f"{(diff > 0).mean():.2e} codes differ"
    for r, o in zip(ref[1:], out[1:]):
        np.testing.assert_allclose(
            np.asarray(o, np.float32), np.asarray(r, np.float32), rtol=2e-3, atol=1e-3
        )


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (Triton kernel)")
@pytest.mark.parametrize("bits", [2, 4])
def test_gpu_kernel_uint8_meta_on_hardware(bits):
    """The compiled kernel with the 8-bit scale/zero encoding: stored bytes one step apart at
    most, codes as `assert_quantized_close` allows (the encoding's contract on any backend)."""
    x, a = _inputs(64, 8, 128, dist="t", dtype=jnp.bfloat16)
    kw = dict(method="oscar", bits=bits, group_size=128, meta_dtype="uint8")
    ref = ref_quantize_pack(x, a, 0.95, **kw)
    out = quantize_pack(x, a, 0.95, backend="gpu", **kw)
    assert_quantized_close(out, ref, bits=bits, d=128, group_size=128)
