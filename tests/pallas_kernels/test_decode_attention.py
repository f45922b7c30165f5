"""Tests for pallas_kernels.decode_attention (GPU Triton and TPU Mosaic bodies + reference).

Kernel error is kept apart from quantization error (STYLE.md 7): the kernel tests feed the
kernel and `ref_decode_attention` the same codes, scales and pages and compare tightly; a
separate test bounds the error of 2/4-bit attention against full-precision attention.
`TestDecodeAttention` runs on a GPU; `TestDecodeAttentionInterpret` (``INTERPRET = True``)
runs the same cases on CPU through the Pallas interpreter, for both backend bodies.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import decode_attention as da
from pallas_kernels import layout
from pallas_kernels.decode_attention import api as da_api
from pallas_kernels.decode_attention import tiles as da_tiles


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int = 2
    kv_heads: int = 2
    group: int = 4  # query heads per KV head
    head_dim: int = 64
    page: int = 16
    bits: int = 2
    group_size: int | None = None
    fp_lens: tuple[int, ...] = (40, 9)
    lowbit_lens: tuple[int, ...] = (64, 0)  # multiples of page
    fp_dtype: str = "float32"
    transforms: bool = True
    num_splits: int | None = 2
    pages_per_block: int = 2
    lowbit_page: int | None = None  # low-bit page size (None: = page); lowbit_lens multiples of 16
    value_layout: str = "tokens"  # "dims": value codes packed along tokens (layout.py)
    bits_v: int | None = None  # value width when it differs from the keys' (bit allocation)
    meta_dtype: str = "float16"  # "uint8": the 8-bit scale/zero encoding (layout.py)
    gather: str | None = None  # the backend's way of reading low-bit pages (None: its default)
    int_to_float: str | None = None  # codes to float16 operands (None: the backend's default)


def _pages_for(n: int, page: int) -> int:
    return -(-n // page)


def make_inputs(c: Case, seed: int = 0) -> dict:
    """Random paged cache with NaN in every unused page, slot and table target."""
    rng = np.random.default_rng(seed)
    d, page, hkv = c.head_dim, c.page, c.kv_heads
    gsz = d if c.group_size is None else c.group_size
    ng = d // gsz
    fp_need = [_pages_for(x, page) for x in c.fp_lens]
    pq_size = page if c.lowbit_page is None else c.lowbit_page
    q_need = [_pages_for(x, pq_size) for x in c.lowbit_lens]
    assert all(x % 16 == 0 for x in c.lowbit_lens)  # the cache flushes whole 16-token blocks
    max_fp = max(1, max(fp_need) + 1)  # one spare column so tables have unused entries
    max_q = max(1, max(q_need) + 1)
    p_fp = sum(fp_need) + 2  # two never-owned pages, poisoned
    p_q = sum(q_need) + 2
    perm_fp = rng.permutation(p_fp)
    perm_q = rng.permutation(p_q)
    poison_fp, poison_q = perm_fp[-1], perm_q[-1]

    k_fp = rng.standard_normal((p_fp, hkv, page, d)).astype(np.float32)
    v_fp = rng.standard_normal((p_fp, hkv, page, d)).astype(np.float32)
    fp_table = np.full((c.batch, max_fp), poison_fp, np.int32)
    used_fp = np.zeros((p_fp, page), bool)
    nxt = 0
    for b, (ln, need) in enumerate(zip(c.fp_lens, fp_need)):
        for j in range(need):
            pg = perm_fp[nxt]
            nxt += 1
            fp_table[b, j] = pg
            used_fp[pg, : min(page, ln - j * page)] = True
    unused = ~used_fp[:, None, :, None]  # [P, 1, page, 1]
    k_fp = np.where(unused, np.nan, k_fp).astype(np.float32)
    v_fp = np.where(unused, np.nan, v_fp).astype(np.float32)

    pq_size = page if c.lowbit_page is None else c.lowbit_page
    bits_v = c.bits if c.bits_v is None else c.bits_v
    m_k, m_v = layout.packed_dim(d, c.bits), layout.packed_dim(d, bits_v)  # row bytes
    k_codes = rng.integers(0, 256, (p_q, hkv, pq_size, m_k), dtype=np.uint8)
    v_codes = rng.integers(0, 256, (p_q, hkv, pq_size, m_v), dtype=np.uint8)
    meta = (p_q, hkv, pq_size, ng)

    def meta_pool(kind, bits):
        hi = 2**bits - 1
        x = rng.uniform(0.2, 1.0, meta) if kind == "scale" else rng.uniform(0, hi, meta)
        if c.meta_dtype != "uint8":
            return x.astype(c.meta_dtype)
        return np.array(layout.encode_meta(jnp.asarray(x, jnp.float32), "uint8", kind, bits))

    k_scale, v_scale = meta_pool("scale", c.bits), meta_pool("scale", bits_v)
    k_zero, v_zero = meta_pool("zero", c.bits), meta_pool("zero", bits_v)
    q_table = np.full((c.batch, max_q), poison_q, np.int32)
    used_q = np.zeros((p_q, pq_size), bool)  # token slots holding a cached key
    nxt = 0
    for b, (ln, need) in enumerate(zip(c.lowbit_lens, q_need)):
        for j in range(need):
            q_table[b, j] = perm_q[nxt]
            used_q[perm_q[nxt], : min(pq_size, ln - j * pq_size)] = True
            nxt += 1
    for a in (k_scale, v_scale, k_zero, v_zero):  # uint8 has no NaN: the largest byte
        a[~np.broadcast_to(used_q[:, None, :, None], a.shape)] = (
            255 if a.dtype == np.uint8 else np.nan
        )

    hq = hkv * c.group
    q = rng.standard_normal((c.batch, hq, d)).astype(np.float32)
    v_codes_arr = jnp.asarray(v_codes)
    if c.value_layout == "dims":
        v_codes_arr = layout.pack_value_page_dims_major(
            layout.unpack_codes(v_codes_arr, bits_v, d), bits_v
        )
    fp = da.FpPages(
        jnp.asarray(k_fp, c.fp_dtype),
        jnp.asarray(v_fp, c.fp_dtype),
        jnp.asarray(fp_table),
        jnp.asarray(c.fp_lens, jnp.int32),
    )
    lowbit = da.LowbitPages(
        da.QuantizedPages(jnp.asarray(k_codes), jnp.asarray(k_scale), jnp.asarray(k_zero)),
        da.QuantizedPages(v_codes_arr, jnp.asarray(v_scale), jnp.asarray(v_zero)),
        jnp.asarray(q_table),
        jnp.asarray(c.lowbit_lens, jnp.int32),
    )
    transforms = None
    if c.transforms:
        qt = rng.standard_normal((hkv, d, d)) / np.sqrt(d)
        vi = rng.standard_normal((hkv, d, d)) / np.sqrt(d)
        transforms = da.HeadTransforms(jnp.asarray(qt, jnp.float32), jnp.asarray(vi, jnp.float32))
    return dict(q=jnp.asarray(q), fp=fp, lowbit=lowbit, transforms=transforms)


def _rel_err(out: jax.Array, ref: jax.Array) -> float:
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


# Kernel vs reference on identical codes. float32 fp pages leave only the float16 rounding of
# the query / probabilities in the low-bit dots (~5e-4 relative) and TF32 on the GPU; bfloat16
# fp pages add the bfloat16 rounding of the query for those dots (~4e-3).
TOL = {"float32": 2e-3, "bfloat16": 1.5e-2}

_SLOW = pytest.mark.slow
FAST_CASES = [
    pytest.param(Case(), marks=_SLOW),
    pytest.param(
        Case(
            batch=1,
            kv_heads=1,
            group=1,
            head_dim=128,
            bits=4,
            transforms=False,
            num_splits=1,
            pages_per_block=1,
            fp_lens=(21,),
            lowbit_lens=(48,),
        ),
        marks=_SLOW,
    ),
    Case(
        kv_heads=2,
        group=8,
        head_dim=128,
        page=32,
        group_size=64,
        num_splits=3,
        fp_dtype="bfloat16",
        fp_lens=(64, 33),
        lowbit_lens=(96, 32),
    ),
    Case(lowbit_lens=(0, 0), fp_lens=(30, 17)),  # fp only
    Case(batch=3, fp_lens=(0, 5, 0), lowbit_lens=(32, 0, 0)),  # low-bit only; nothing at all
    # empty splits
    Case(bits=4, group_size=32, num_splits=4, fp_lens=(3, 16), lowbit_lens=(16, 48)),
    # GPU default
    Case(pages_per_block=4, num_splits=None, fp_lens=(17, 40), lowbit_lens=(128, 64)),
    pytest.param(
        Case(group=8, num_splits=None, pages_per_block=4, fp_lens=(17, 64), lowbit_lens=(128, 64)),
        marks=_SLOW,
    ),
    # A bit allocation's layers: keys and values of different widths; 8-bit scale/zero.
    Case(bits=2, bits_v=4, fp_lens=(19, 40), lowbit_lens=(64, 32)),
    Case(bits=4, bits_v=2, head_dim=128, group_size=64, meta_dtype="uint8", lowbit_lens=(48, 16)),
    Case(bits=2, meta_dtype="uint8", group=3, fp_lens=(5, 33), lowbit_lens=(96, 16)),
]

SLOW_CASES = [
    Case(
        batch=2,
        kv_heads=hkv,
        group=g,
        head_dim=d,
        page=page,
        bits=bits,
        num_splits=s,
        fp_lens=(page + 3, 2 * page),
        lowbit_lens=(4 * page, 0),
    )
    for page in (16, 32)
    for hkv in (1, 2)
    for g in (1, 4, 8)
    for d in (64, 128)
    for bits in (2, 4)
    for s in (1, 3)
    if not (d == 64 and bits == 2 and page == 32 and s == 3)  # keep the sweep near 90 cases
] + [
    # Bit-allocation layers (key and value widths differ) and 8-bit scale/zero.
    Case(
        kv_heads=hkv,
        group=g,
        head_dim=d,
        bits=bits,
        bits_v=bits_v,
        meta_dtype=meta,
        num_splits=3,
        fp_lens=(19, 32),
        lowbit_lens=(64, 0),
    )
    for hkv, g in ((1, 4), (2, 8))
    for d in (64, 128)
    for bits, bits_v, meta in ((2, 4, "float16"), (4, 2, "uint8"), (2, 2, "uint8"))
]


def test_auto_schedule_frees_registers_only_where_a_third_program_per_sm_has_work():
    from pallas_kernels.decode_attention import gpu_mosaic as gm

    # 8 x 128k: 6 splits x 64 (sequence, KV head) programs; 32 x 32k and batch 1: 256.
    assert gm.auto_overlap(da.lowbit_auto_splits(8, 8, 1024, 1, "gpu_mosaic") * 64) == "copies"
    assert gm.auto_overlap(da.lowbit_auto_splits(32, 8, 256, 1, "gpu_mosaic") * 256) == "values"
    assert gm.auto_overlap(da.lowbit_auto_splits(1, 8, 1024, 1, "gpu_mosaic") * 8) == "values"


@pytest.mark.parametrize(
    "batch, pages, triton, mosaic",
    [
        # Qwen3-8B heads (8 KV heads); pages of 128 tokens for the Mosaic body, 64 for Triton.
        # Triton aims at 1024 programs, the Mosaic body at its own TARGET_PROGRAMS (384, at
        # most: one wave of three programs per SM).
        (1, 256, 128, 32),  # 1 x 32k: the Mosaic body capped at MAX_SPLITS
        (1, 1024, 128, 32),  # 1 x 128k
        (2, 1024, 64, 24),
        (8, 1024, 16, 6),  # 8 x 128k: the program target binds first
        (32, 256, 4, 1),  # 32 x 32k: 256 programs (two splits would be a second wave)
        (64, 32, 2, 1),  # 64 x 4k: past the target, one split
        (1, 8, 8, 8),  # never more splits than pages
    ],
)
def test_auto_splits_fill_the_gpu_within_the_backend_cap(batch, pages, triton, mosaic):
    assert da.lowbit_auto_splits(batch, 8, pages, 1, "gpu") == triton
    assert da.lowbit_auto_splits(batch, 8, pages, 1, "gpu_mosaic") == mosaic
    assert (
        da.lowbit_auto_splits(batch, 8, pages, 1, "gpu_mosaic")
        <= da_api._backend_module("gpu_mosaic").MAX_SPLITS
    )


def test_mosaic_u8_metadata_needs_128_token_pages():
    x = make_inputs(Case(head_dim=128, meta_dtype="uint8", lowbit_page=64, lowbit_lens=(64, 0)))
    with pytest.raises(ValueError, match="8-bit scale/zero needs .* page=64"):
        da.decode_attention_variant(
            **x, bits=2, sm_scale=0.125, backend="gpu_mosaic", pages_per_block=1
        )


def test_value_codes_must_match_bits_v():
    x = make_inputs(Case(bits=2, bits_v=4))
    with pytest.raises(ValueError, match="v_codes"):
        da.ref_decode_attention(**x, bits=2, sm_scale=0.125)


def _has_gpu() -> bool:
    try:
        return any(dev.platform == "gpu" for dev in jax.devices())
    except RuntimeError:
        return False


class TestDecodeAttention:
    """Runs on a GPU (skipped elsewhere). Subclasses with ``INTERPRET = True`` run on CPU."""

    INTERPRET = False
    BACKEND = "gpu"

    def setup_method(self):
        if not self.INTERPRET and not _has_gpu():
            pytest.skip("needs a GPU")

    def _run(self, c: Case, seed: int = 0):
        x = make_inputs(c, seed)
        kw = dict(bits=c.bits, sm_scale=c.head_dim**-0.5, bits_v=c.bits_v)
        ref = da.ref_decode_attention(**x, **kw)
        out = da.decode_attention(
            **x,
            **kw,
            num_splits=c.num_splits,
            pages_per_block=c.pages_per_block,
            backend=self.BACKEND,
            interpret=self.INTERPRET,
        )
        return out, ref

    def _check(self, c: Case, seed: int = 0):
        out, ref = self._run(c, seed)
        assert out.shape == (c.batch, c.kv_heads * c.group, c.head_dim)
        assert bool(jnp.isfinite(out).all()), "NaN from an unused page reached the output"
        for b in range(c.batch):
            if c.fp_lens[b] == 0 and c.lowbit_lens[b] == 0:  # no key: defined as zeros
                np.testing.assert_array_equal(np.asarray(out[b]), 0.0)
        live = [b for b in range(c.batch) if c.fp_lens[b] + c.lowbit_lens[b] > 0]
        err = _rel_err(out[jnp.asarray(live)], ref[jnp.asarray(live)])
        assert err < TOL[c.fp_dtype], f"{c=} rel err {err:.2e}"

    @pytest.mark.parametrize("case", FAST_CASES, ids=str)
    def test_matches_reference(self, case: Case):
        self._check(case)

    @pytest.mark.slow
    @pytest.mark.parametrize("case", SLOW_CASES, ids=str)
    def test_matches_reference_sweep(self, case: Case):
        self._check(case, seed=1)

    @pytest.mark.parametrize("fp_dtype", ["float32", "bfloat16"])
    def test_bf16_baseline_matches_reference(self, fp_dtype: str):
        c = Case(fp_dtype=fp_dtype, fp_lens=(70, 0), group=4)
        x = make_inputs(c)
        args = (x["q"], x["fp"])
        ref = da.ref_decode_attention_bf16(*args, sm_scale=0.125)
        out = da.decode_attention_bf16(
            *args,
            sm_scale=0.125,
            num_splits=2,
            pages_per_block=2,
            backend=self.BACKEND,
            interpret=self.INTERPRET,
        )
        assert bool(jnp.isfinite(out).all())
        np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
        assert _rel_err(out[0], ref[0]) < TOL[fp_dtype]

    def test_split_count_does_not_change_result(self):
        c = Case(batch=1, fp_lens=(40,), lowbit_lens=(96,))
        x = make_inputs(c)
        outs = [
            da.decode_attention(
                **x,
                bits=2,
                sm_scale=0.125,
                num_splits=s,
                pages_per_block=1,
                backend=self.BACKEND,
                interpret=self.INTERPRET,
            )
            for s in (1, 5)
        ]
        # Each split rounds its probabilities to the code-dot dtype against its own running
        # max, so splits move the result by a few of those roundings. 1e-4 held on CPU; the
        # TPU body interpreted by XLA on a GPU measured 1.5e-4 (XLA there keeps f32 where the
        # body rounds to bfloat16 and back: xla_allow_excess_precision).
        np.testing.assert_allclose(np.asarray(outs[0]), np.asarray(outs[1]), atol=3e-4)

    @pytest.mark.parametrize("bits", [2, 4])
    @pytest.mark.parametrize(
        "gather,int_to_float,row_sums",
        [
            ("prefetch", "asm", "deferred"),
            ("prefetch", "asm", "per_step"),
            ("prefetch", "exponent", "deferred"),
            ("rows", "asm", "deferred"),
            ("rows", "exponent", "per_step"),
            ("rows", "convert", "deferred"),
            ("pages", "exponent", "per_step"),
            ("pages", "convert", "deferred"),
        ],
    )
    def test_inner_loop_variants_match_reference(
        self, gather: str, int_to_float: str, row_sums: str, bits
    ):
        mod = da_api._backend_module(self.BACKEND)
        if (
            gather not in mod.GATHER_MODES
            or int_to_float not in mod.INT_TO_FLOAT
            or row_sums not in mod.ROW_SUMS
        ):
            pytest.skip(f"{self.BACKEND} body has no {gather=} / {int_to_float=} / {row_sums=}")
        # Two scale groups, so per-group scales meet the right planes.
        c = Case(head_dim=128, group_size=64, bits=bits, fp_lens=(20, 5), lowbit_lens=(64, 32))
        x = make_inputs(c, seed=2)
        kw = dict(bits=c.bits, sm_scale=c.head_dim**-0.5)
        ref = da.ref_decode_attention(**x, **kw)
        out = da.decode_attention_variant(
            **x,
            **kw,
            num_splits=2,
            pages_per_block=2,
            backend=self.BACKEND,
            interpret=self.INTERPRET,
            gather=gather,
            int_to_float=int_to_float,
            row_sums=row_sums,
        )
        assert _rel_err(out, ref) < TOL[c.fp_dtype]


class TestDecodeAttentionInterpret(TestDecodeAttention):
    INTERPRET = True


class TestDecodeAttentionTpuInterpret(TestDecodeAttention):
    INTERPRET = True
    BACKEND = "tpu"


# ------------------------------------------------------------------------------------------
# Mosaic GPU (Hopper) low-bit body: GPU hardware only; CPU CI checks that it lowers
# ------------------------------------------------------------------------------------------
# The Mosaic body reads 64-token low-bit pages (whole TMA tiles); the fp pages stay at 16.
MOSAIC_CASES = (
    [
        Case(
            batch=2,
            kv_heads=hkv,
            group=g,
            head_dim=d,
            bits=bits,
            page=16,
            lowbit_page=lowbit_page,
            num_splits=s,
            pages_per_block=1,
            fp_lens=(35, 16),
            lowbit_lens=(5 * 64 + 48, 64 + 16),  # ragged: partial last tiles
        )
        for hkv, g in ((1, 1), (2, 4), (8, 4), (2, 8))
        for d, bits in ((128, 2), (128, 4), (64, 4), (256, 2))
        for lowbit_page in (64, 128)
        for s in (1, 3)
        if not (lowbit_page == 128 and s == 3 and hkv == 8)
    ]
    + [
        Case(
            batch=2,
            kv_heads=hkv,
            group=g,
            head_dim=d,
            bits=bits,
            page=16,
            lowbit_page=128,
            value_layout="dims",
            num_splits=s,
            pages_per_block=1,
            fp_lens=(35, 16),
            lowbit_lens=(3 * 128 + 48, 128 + 16),
        )
        for hkv, g in ((1, 1), (2, 4), (8, 4), (2, 8))
        for d, bits in ((128, 2), (128, 4), (64, 4), (256, 2))
        for s in (1, 3)
    ]
    + [
        Case(
            batch=2,
            kv_heads=2,
            group=g,
            head_dim=d,
            bits=bits,
            page=16,
            lowbit_page=128,
            value_layout=vl,
            num_splits=s,
            pages_per_block=1,
            fp_lens=(35, 16),
            lowbit_lens=(3 * 128 + 48, 128 + 16),
            gather="bulk",
        )
        for g in (4, 8)
        for d, bits, vl, s in (
            (128, 2, "dims", 1),
            (128, 2, "dims", 3),
            (128, 2, "tokens", 3),
            (64, 4, "tokens", 1),
        )
    ]  # 32-byte code rows: what the unswizzled bulk tiles support
    + [
        Case(
            batch=2,
            kv_heads=hkv,
            group=g,
            head_dim=d,
            bits=bits,
            page=16,
            lowbit_page=lp,
            value_layout=vl,
            num_splits=3,
            pages_per_block=1,
            fp_lens=(35, 16),
            lowbit_lens=(3 * 128 + 48, 128 + 16),
            int_to_float="exponent",
        )
        for hkv, g in ((1, 1), (2, 4), (2, 8))
        for d, bits in ((128, 2), (128, 4), (64, 4), (256, 2))
        for vl, lp in (("dims", 128), ("tokens", 64))
    ]  # the plane unpack in jnp ops (the default is inline PTX)
    + [
        Case(
            batch=3,
            head_dim=128,
            lowbit_page=64,
            group=4,
            fp_lens=(0, 5, 0),
            lowbit_lens=(128, 0, 0),
            pages_per_block=1,
            num_splits=4,
        ),  # empty splits; a sequence with no key at all
        Case(
            head_dim=128,
            lowbit_page=64,
            group=4,
            fp_dtype="bfloat16",
            fp_lens=(70, 9),
            lowbit_lens=(1024, 256),
            pages_per_block=1,
            num_splits=None,
        ),  # automatic splits
    ]
    + [
        Case(
            batch=2,
            kv_heads=hkv,
            group=g,
            head_dim=d,
            bits=bits,
            bits_v=bits_v,
            meta_dtype=meta,
            page=16,
            lowbit_page=128,
            value_layout=vl,
            num_splits=3,
            pages_per_block=1,
            fp_lens=(35, 16),
            lowbit_lens=(3 * 128 + 48, 128 + 16),
        )
        for hkv, g in ((2, 4), (1, 1))
        for d in (128, 256)
        for bits, bits_v, meta in ((2, 4, "float16"), (4, 2, "uint8"), (2, 2, "uint8"))
        for vl in ("dims", "tokens")
        if not (d == 256 and 4 in (bits, bits_v))  # 128-byte code rows: not supported
    ]  # a bit allocation's layers: key and value widths differ; 8-bit scale/zero
)


class TestDecodeAttentionMosaic:
    """The Mosaic GPU body against the reference on the same codes (GPU hardware only)."""

    def setup_method(self):
        if not _has_gpu():
            pytest.skip("needs a GPU (Mosaic GPU has no interpret mode)")

    @pytest.mark.parametrize("case", MOSAIC_CASES, ids=str)
    def test_matches_reference(self, case: Case):
        x = make_inputs(case, seed=2)
        kw = dict(
            bits=case.bits,
            bits_v=case.bits_v,
            sm_scale=case.head_dim**-0.5,
            value_layout=case.value_layout,
        )
        ref = da.ref_decode_attention(**x, **kw)
        out = da.decode_attention_variant(
            **x,
            **kw,
            num_splits=case.num_splits,
            backend="gpu_mosaic",
            gather=case.gather,
            int_to_float=case.int_to_float,
        )
        assert bool(jnp.isfinite(out).all()), "NaN from an unused page reached the output"
        live = [b for b in range(case.batch) if case.fp_lens[b] + case.lowbit_lens[b] > 0]
        for b in set(range(case.batch)) - set(live):
            np.testing.assert_array_equal(np.asarray(out[b]), 0.0)
        err = _rel_err(out[jnp.asarray(live)], ref[jnp.asarray(live)])
        assert err < TOL[case.fp_dtype], f"{case=} rel err {err:.2e}"

    @pytest.mark.parametrize("per_split", [1, 2, 3])
    def test_full_precision_split_sizes(self, per_split: int):
        # fp_lens span 0 to 5 pages: splits past a sequence's pages are empty.
        case = _OVERLAP_CASES[0]
        if per_split == 3:
            case = dataclasses.replace(case, fp_lens=(80, 0))
        x = make_inputs(case, seed=5)
        kw = dict(bits=case.bits, sm_scale=case.head_dim**-0.5, value_layout=case.value_layout)
        ref = da.ref_decode_attention(**x, **kw)
        out = da.decode_attention_variant(
            **x, **kw, backend="gpu_mosaic", fp_pages_per_split=per_split
        )
        assert _rel_err(out, ref) < TOL[case.fp_dtype]


@pytest.mark.parametrize(
    "batch, pages, want", [(1, 21, 1), (8, 21, 1), (16, 21, 2), (64, 34, 4), (64, 2, 1)]
)
def test_fp_pages_per_split_fill_the_gpu_then_grow(batch, pages, want):
    assert da.fp_auto_pages_per_split(batch, 8, pages, "gpu_mosaic") == want
    assert da.fp_auto_pages_per_split(batch, 8, pages, "gpu") is None


def test_fp_pages_per_split_is_refused_where_the_pages_share_the_splits():
    x = make_inputs(Case(), seed=5)
    with pytest.raises(ValueError, match="fp_pages_per_split=2 needs a backend"):
        da.decode_attention_variant(
            **x, bits=2, sm_scale=0.1, backend="gpu", interpret=True, fp_pages_per_split=2
        )


_DIMS_CASES = [c for c in MOSAIC_CASES if c.value_layout == "dims"]


_OVERLAP_CASES = [
    Case(batch=2, kv_heads=2, group=4, head_dim=128, bits=2, page=16, lowbit_page=128,
         value_layout="dims", fp_lens=(35, 16), lowbit_lens=(3 * 128 + 48, 128 + 16)),
    Case(batch=2, kv_heads=1, group=1, head_dim=256, bits=2, page=16, lowbit_page=128,
         value_layout="dims", meta_dtype="uint8", fp_lens=(3, 16), lowbit_lens=(640, 16)),
    Case(batch=2, kv_heads=2, group=8, head_dim=128, bits=4, bits_v=2, page=16,
         lowbit_page=64, fp_lens=(35, 16), lowbit_lens=(5 * 64 + 48, 64 + 16)),
]  # fmt: skip


@pytest.mark.parametrize("case", _OVERLAP_CASES, ids=str)
def test_mosaic_overlapped_mmas_match_the_serial_step(case: Case):
    _check_schedule(case, dict(overlap="values"), dict(overlap="none"), run=True)
    _check_schedule(case, dict(overlap="copies"), dict(overlap="none"), run=True)


@pytest.mark.parametrize("case", _OVERLAP_CASES, ids=str)
def test_mosaic_masking_only_the_last_step_matches_masking_every_step(case: Case):
    _check_schedule(case, dict(mask="last"), dict(mask="every"), run=True)


@pytest.mark.parametrize("case", _OVERLAP_CASES, ids=str)
def test_mosaic_narrow_mma_columns_match_sixteen(case: Case):
    _check_schedule(case, dict(n_pad=8, streams=1), dict(n_pad=16, streams=1), run=True)


@pytest.mark.parametrize("case", _OVERLAP_CASES[:2], ids=str)
def test_mosaic_two_token_streams_merge_to_one(case: Case):
    _check_schedule(case, dict(n_pad=8, streams=2), dict(n_pad=8, streams=1), run=True)


def _errors_against_float32(case: Case, operands, *, scale_spread: float = 0.0) -> dict:
    """Relative error of the Mosaic split partials (merged) against the float32 attention
    over the same low-bit pages, per ``int_to_float``. ``scale_spread``: value scales times
    2^u, u uniform in [-spread, spread] per token (the reference sees the same scales)."""
    from pallas_kernels.decode_attention import gpu_mosaic as gm
    from pallas_kernels.decode_attention import reference as ref_mod

    x = make_inputs(case, seed=3)
    low = x["lowbit"]
    (kc, ks, kz), (vc, vs, vz) = low.k, low.v
    if scale_spread:
        u = jax.random.uniform(jax.random.PRNGKey(7), vs.shape, minval=-1.0, maxval=1.0)
        vs = (vs.astype(jnp.float32) * jnp.exp2(u * scale_spread)).astype(vs.dtype)
    lowbit_set = (kc, vc, ks, kz, vs, vz, da_api.split_table(low.table, 3, 1), low.length)
    qg = x["q"].reshape(case.batch, case.kv_heads, case.group, case.head_dim)
    bits_v = case.bits if case.bits_v is None else case.bits_v
    v_tok = vc
    if case.value_layout == "dims":
        v_tok = layout.pack_codes(
            layout.unpack_value_page_dims_major(vc, bits_v, case.lowbit_page), bits_v
        )
    kq = ref_mod._dequantize_pages(kc, ks, kz, low.table, case.bits, case.head_dim)
    vq = ref_mod._dequantize_pages(v_tok, vs, vz, low.table, bits_v, case.head_dim)
    valid = ref_mod._token_mask(low.length, kq.shape[2])
    want = np.asarray(ref_mod._ref_attend(qg, [(kq, vq, valid)], 0.1 / np.log2(np.e)))
    live = np.asarray(low.length) > 0
    errs = {}
    for operand in operands:
        got = gm.lowbit_partials(
            qg, lowbit_set, bits=case.bits, bits_v=case.bits_v, scale_log2=0.1,
            group=case.group, value_layout=case.value_layout, int_to_float=operand,
        )  # fmt: skip
        (out,) = _merge_partials(*got)
        assert np.isfinite(out[live]).all(), f"{operand}: non-finite output"
        errs[operand] = _rel_err(jnp.asarray(out[live]), jnp.asarray(want[live]))
    return errs


@pytest.mark.parametrize("case", _OVERLAP_CASES, ids=str)
def test_mosaic_s8_keys_as_accurate_as_f16_keys(case: Case):
    """8-bit key operands against the float32 attention over the low-bit pages, no less
    accurate than the float16 query (their difference is the float16 query's rounding: run 61
    measured 4% of partials more than 2e-3 apart, so a twin comparison cannot be tight)."""
    if not _has_gpu():
        pytest.skip("needs a GPU (Mosaic GPU has no interpret mode)")
    errs = _errors_against_float32(case, ("asm", "s8"))
    assert errs["s8"] <= max(1.5 * errs["asm"], 1e-4), errs


# Dimension-major value pages at 2 and 4 bits, GQA 4 (two token streams) and 1 and 8 (one).
_E4M3_CASES = _OVERLAP_CASES[:2] + [
    Case(batch=2, kv_heads=2, group=8, head_dim=128, bits=4, page=16, lowbit_page=128,
         value_layout="dims", fp_lens=(35, 16), lowbit_lens=(2 * 128 + 96, 128 + 16)),
]  # fmt: skip


@pytest.mark.parametrize("spread", [0.0, 12.0], ids=["scales", "wide_scales"])
@pytest.mark.parametrize("case", _E4M3_CASES, ids=str)
def test_mosaic_e4m3_values_are_as_accurate_as_promised(case: Case, spread: float):
    """e4m3 value operands against the float32 attention: the weights in two e4m3 parts are
    ~2^-8 relative (hi's rounding 2^-4, times lo's 2^-4), one part 2^-4; value scales spread
    over 2^24 must not leave e4m3's range (the softmax's shifted max)."""
    if not _has_gpu():
        pytest.skip("needs a GPU (Mosaic GPU has no interpret mode)")
    errs = _errors_against_float32(case, ("s8", "s8_e4m3x2", "s8_e4m3"), scale_spread=spread)
    print(case, spread, errs)
    assert errs["s8_e4m3x2"] <= max(4.0 * errs["s8"], 2.0**-8), errs
    assert errs["s8_e4m3"] <= 2.0**-4, errs


@pytest.mark.parametrize("case", _E4M3_CASES, ids=str)
def test_mosaic_e4m3_overlapped_value_mmas_match_the_serial_step(case: Case):
    _check_schedule(
        case, dict(int_to_float="s8_e4m3x2"), dict(int_to_float="s8_e4m3x2", overlap="none"),
        run=True,
    )  # fmt: skip


@pytest.mark.parametrize("case", _OVERLAP_CASES, ids=str)
def test_mosaic_s8_keys_lower_for_cuda(case: Case):
    _check_schedule(case, dict(int_to_float="s8"), None, run=False)


def test_split_query_s8_reconstructs_the_query():
    from pallas_kernels.decode_attention import gpu_mosaic as gm

    q = jax.random.normal(jax.random.PRNGKey(0), (3, 2, 4, 128)) * 7.0
    hi, lo, sq, total = gm.split_query_s8(q)
    rec = sq * (hi.astype(jnp.float32) + lo.astype(jnp.float32) / 254.0)
    bound = np.asarray(jnp.max(jnp.abs(q), axis=-1, keepdims=True)) / (127 * 254 * 2)
    assert (np.abs(np.asarray(rec - q)) <= bound * 1.01).all()
    np.testing.assert_allclose(np.asarray(total), np.asarray(rec.sum(-1)), rtol=1e-5, atol=1e-4)


_BF16_MOSAIC_CASES = [
    Case(batch=3, kv_heads=2, group=4, head_dim=128, fp_dtype="bfloat16", fp_lens=(300, 0, 77),
         num_splits=3),
    Case(batch=2, kv_heads=1, group=1, head_dim=256, fp_dtype="bfloat16", fp_lens=(130, 64),
         num_splits=1),
    Case(batch=2, kv_heads=2, group=16, head_dim=64, page=64, fp_dtype="bfloat16",
         fp_lens=(200, 1), num_splits=2),
    Case(batch=1, kv_heads=8, group=8, head_dim=128, page=32, fp_dtype="bfloat16",
         fp_lens=(1000,), num_splits=None),
]  # fmt: skip


@pytest.mark.parametrize("case", _BF16_MOSAIC_CASES, ids=str)
def test_mosaic_bf16_body_matches_reference(case: Case):
    """The Mosaic GPU BF16 body (`gpu_mosaic.fp_partials`) against the BF16 reference: page
    sizes 16-64, head_dim 64-256, groups 1-16, ragged and empty sequences, NaN-poisoned
    unused pages and slots."""
    if not _has_gpu():
        pytest.skip("needs a GPU (Mosaic GPU has no interpret mode)")
    x = make_inputs(case, seed=4)
    sm = case.head_dim**-0.5
    ref = da.ref_decode_attention_bf16(x["q"], x["fp"], sm_scale=sm)
    out = da.decode_attention_bf16(
        x["q"], x["fp"], sm_scale=sm, num_splits=case.num_splits, backend="gpu_mosaic"
    )
    assert bool(jnp.isfinite(out).all()), "NaN from an unused page reached the output"
    live = [b for b in range(case.batch) if case.fp_lens[b] > 0]
    for b in set(range(case.batch)) - set(live):
        np.testing.assert_array_equal(np.asarray(out[b]), 0.0)
    err = _rel_err(out[jnp.asarray(live)], ref[jnp.asarray(live)])
    assert err < TOL[case.fp_dtype], f"{case=} rel err {err:.2e}"


def test_mosaic_bf16_body_rejects_what_it_cannot_read():
    x = make_inputs(Case(fp_dtype="float32", fp_lens=(70, 0)), seed=4)
    with pytest.raises(ValueError, match="float32"):
        da.decode_attention_bf16(x["q"], x["fp"], sm_scale=0.1, backend="gpu_mosaic")
    x = make_inputs(Case(fp_dtype="bfloat16", page=48, fp_lens=(70, 0)), seed=4)
    with pytest.raises(ValueError, match="page=48"):
        da.decode_attention_bf16(x["q"], x["fp"], sm_scale=0.1, backend="gpu_mosaic")


@pytest.mark.parametrize("case", _BF16_MOSAIC_CASES[:3], ids=str)
def test_mosaic_bf16_body_lowers_for_cuda(case: Case):
    x = make_inputs(case, seed=4)
    f = functools.partial(
        da.decode_attention_bf16, sm_scale=0.1, num_splits=case.num_splits, backend="gpu_mosaic"
    )
    lowered = jax.jit(f).trace(x["q"], x["fp"]).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize(
    "schedule",
    [
        dict(overlap="none"),
        dict(overlap="values"),
        dict(overlap="copies"),
        dict(mask="every"),
        dict(n_pad=16),
        dict(streams=1),
        dict(streams=2),
        dict(int_to_float="s8_e4m3x2"),
        dict(int_to_float="s8_e4m3", overlap="none"),
        dict(prologue="triton"),
    ],  # fmt: skip
    ids=str,
)
def test_mosaic_schedules_lower_for_cuda(schedule: dict):
    _check_schedule(_OVERLAP_CASES[0], schedule, None, run=False)


def _check_schedule(case: Case, got_kw: dict, want_kw: dict | None, *, run: bool):
    """A Mosaic body schedule gives its twin's split partials: the overlapped MMA schedule the
    serial one's (the same operations; only where the warpgroup waits for its MMAs moves),
    masking only a split's last step the masking of every step (full steps are all valid),
    N = 8 MMA columns N = 16 (each column's dot and reductions are the same); two token
    streams one after merging (each stream is a split of half the tokens)."""
    if run and not _has_gpu():
        pytest.skip("needs a GPU (Mosaic GPU has no interpret mode)")
    from pallas_kernels.decode_attention import gpu_mosaic as gm

    x = make_inputs(case, seed=3)
    low = x["lowbit"]
    (kc, ks, kz), (vc, vs, vz) = low.k, low.v
    tab = da_api.split_table(low.table, 3, 1)
    lowbit_set = (kc, vc, ks, kz, vs, vz, tab, low.length)
    qg = x["q"].reshape(case.batch, case.kv_heads, case.group, case.head_dim)
    kw = dict(bits=case.bits, bits_v=case.bits_v, scale_log2=0.1, group=case.group,
              value_layout=case.value_layout)  # fmt: skip
    if not run:
        f = functools.partial(gm.lowbit_partials, **kw, **got_kw)
        lowered = jax.jit(f).trace(qg, lowbit_set).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text()
        return
    want = gm.lowbit_partials(qg, lowbit_set, **kw, **want_kw)
    got = gm.lowbit_partials(qg, lowbit_set, **kw, **got_kw)
    tol = dict(rtol=1e-5, atol=1e-5)
    if got[0].shape != want[0].shape:  # streams: other splits, the same merged attention
        got, want = (_merge_partials(*x) for x in (got, want))
        # p goes to the MMA in float16 relative to each stream's own running max (run 56:
        # up to 7.4e-5 apart on outputs of order 1e-2).
        tol = dict(rtol=2e-3, atol=2e-4)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **tol)


def _merge_partials(acc, m, l):
    """Log-sum-exp merge over the split axis of (acc [B,H,S,g,d], m, l [B,H,S,g], base 2)."""
    acc, m, l = (np.asarray(a, np.float64) for a in (acc, m, l))
    top = m.max(axis=2, keepdims=True)
    w = np.exp2(m - top)
    return ((w[..., None] * acc).sum(axis=2) / (w * l).sum(axis=2)[..., None],)


_BULK_CASES = [c for c in MOSAIC_CASES if c.gather == "bulk"]


_JNP_UNPACK_CASES = [c for c in MOSAIC_CASES if c.int_to_float == "exponent"]


_ALLOCATION_CASES = [c for c in MOSAIC_CASES if c.bits_v is not None or c.meta_dtype == "uint8"]


@pytest.mark.parametrize(
    "case",
    [
        MOSAIC_CASES[1],
        MOSAIC_CASES[-1],
        _DIMS_CASES[3],
        _BULK_CASES[0],
        _JNP_UNPACK_CASES[1],
        _JNP_UNPACK_CASES[-2],
        _ALLOCATION_CASES[0],
        _ALLOCATION_CASES[3],
        _ALLOCATION_CASES[5],
        _ALLOCATION_CASES[6],
    ],
    ids=str,
)
def test_mosaic_kernel_lowers_for_cuda(case: Case):
    """CPU CI cannot run Mosaic GPU kernels, but it can lower them for the cuda platform."""
    x = make_inputs(case)

    def f(x):
        return da.decode_attention_variant(
            **x,
            bits=case.bits,
            bits_v=case.bits_v,
            sm_scale=0.1,
            backend="gpu_mosaic",
            value_layout=case.value_layout,
            gather=case.gather,
            int_to_float=case.int_to_float,
        )

    lowered = jax.jit(f).trace(x).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("bits, bits_v", [(2, None), (4, None), (2, 4), (4, 2)])
def test_reference_reads_dims_major_value_pages(bits: int, bits_v: int | None):
    """The dimension-major value layout holds the same codes: the reference gives the
    identical result (it repacks them to the token-major layout, then runs the same ops)."""
    c = Case(
        head_dim=64,
        bits=bits,
        bits_v=bits_v,
        page=16,
        lowbit_page=128,
        lowbit_lens=(256, 144),
        fp_lens=(20, 3),
    )
    x_tok = make_inputs(c)
    x_dims = make_inputs(dataclasses.replace(c, value_layout="dims"))
    kw = dict(bits=bits, bits_v=bits_v, sm_scale=0.125)
    want = da.ref_decode_attention(**x_tok, **kw)
    got = da.ref_decode_attention(**x_dims, **kw, value_layout="dims")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_mosaic_bulk_copies_reject_wide_code_rows():
    """Bulk copies land in unswizzled tiles, read as 32-byte rows only: a 64-byte row (4 bits
    at d = 128) is refused while tracing, with the widths in the message."""
    c = Case(head_dim=128, bits=4, page=16, lowbit_page=128, value_layout="dims",
             lowbit_lens=(128, 0), pages_per_block=1)  # fmt: skip
    x = make_inputs(c)
    with pytest.raises(ValueError, match="32-byte code rows, got 64"):
        jax.jit(
            lambda x: da.decode_attention_variant(
                **x,
                bits=4,
                sm_scale=0.1,
                backend="gpu_mosaic",
                value_layout="dims",
                gather="bulk",
            )  # fmt: skip
        ).trace(x).lower(lowering_platforms=("cuda",))


def test_mosaic_rejects_small_lowbit_pages():
    x = make_inputs(Case(head_dim=128, page=16, lowbit_lens=(64, 16)))
    with pytest.raises(ValueError, match="multiple of 64 for backend='gpu_mosaic'"):
        da.decode_attention(**x, bits=2, sm_scale=0.1, backend="gpu_mosaic")
    with pytest.raises(ValueError, match="must equal the full-precision page size"):
        da.decode_attention(
            **make_inputs(Case(head_dim=128, lowbit_page=64, lowbit_lens=(64, 16))),
            bits=2,
            sm_scale=0.1,
            interpret=True,
        )


# ------------------------------------------------------------------------------------------
# Quantization error budget (separate from kernel error)
# ------------------------------------------------------------------------------------------
def _minmax_quantize(x: np.ndarray, bits: int):
    """Plain per-token asymmetric min/max quantizer over the whole head (test-local)."""
    lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
    scale = np.maximum(hi - lo, 1e-6) / (2**bits - 1)
    zero = -lo / scale
    codes = np.clip(np.round(x / scale + zero), 0, 2**bits - 1).astype(np.uint8)
    return codes, scale.astype(np.float16), zero.astype(np.float16)


# Relative L2 error of the attention output, 2/4-bit min/max keys and values (middle segment
# of 512 tokens, 32 fp sink+recent tokens) vs all-full-precision attention, Gaussian data.
# Per-element noise is about range / (2**b - 1) / sqrt(12); the budgets leave ~1.5x headroom
# over what this setup measures (0.13 at 4 bits, 0.74 at 2 bits: plain min/max with no
# clip and no transform, the "naive INT2" baseline the papers improve on).
ERROR_BUDGET = {4: 0.2, 2: 1.0}


@pytest.mark.parametrize("bits", [2, 4])
def test_quantized_attention_error_budget(bits: int):
    rng = np.random.default_rng(3)
    b, hkv, g, d, page = 2, 2, 4, 64, 16
    n_fp, n_q = 32, 512
    k = rng.standard_normal((b, hkv, n_fp + n_q, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, n_fp + n_q, d)).astype(np.float32)
    q = jnp.asarray(rng.standard_normal((b, hkv * g, d)), jnp.float32)

    def to_pages(x):  # [B, Hkv, T, w] -> pool [B*T/page, Hkv, page, w], table [B, T/page]
        t = x.shape[2]
        pool = x.reshape(b, hkv, t // page, page, -1).transpose(0, 2, 1, 3, 4)
        pool = pool.reshape(b * (t // page), hkv, page, -1)
        return jnp.asarray(pool), jnp.arange(b * (t // page), dtype=jnp.int32).reshape(b, -1)

    kw = dict(bits=bits, sm_scale=d**-0.5, num_splits=2, pages_per_block=2, interpret=True)
    kc, ks, kz = _minmax_quantize(k[:, :, n_fp:], bits)
    vc, vs, vz = _minmax_quantize(v[:, :, n_fp:], bits)
    k_fp, fp_tab = to_pages(k[:, :, :n_fp])
    v_fp, _ = to_pages(v[:, :, :n_fp])
    kc_p, low_tab = to_pages(np.asarray(layout.pack_codes(jnp.asarray(kc), bits)))
    vc_p, _ = to_pages(np.asarray(layout.pack_codes(jnp.asarray(vc), bits)))
    fp = da.FpPages(k_fp, v_fp, fp_tab, jnp.full((b,), n_fp, jnp.int32))
    lowbit = da.LowbitPages(
        da.QuantizedPages(kc_p, to_pages(ks)[0], to_pages(kz)[0]),
        da.QuantizedPages(vc_p, to_pages(vs)[0], to_pages(vz)[0]),
        low_tab,
        jnp.full((b,), n_q, jnp.int32),
    )
    quant = da.decode_attention(q, fp, lowbit, **kw)
    k_all, all_tab = to_pages(k)
    v_all, _ = to_pages(v)
    every = da.FpPages(k_all, v_all, all_tab, jnp.full((b,), n_fp + n_q, jnp.int32))
    full = da.ref_decode_attention_bf16(q, every, sm_scale=d**-0.5)
    err = _rel_err(quant, full)
    assert err < ERROR_BUDGET[bits], f"{bits}-bit attention rel err {err:.3f}"
    assert err > 1e-3  # the low-bit pages were really used


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("int_to_float", ["convert", "exponent", "asm"])
def test_unpack_planes_are_channel_order(bits: int, int_to_float: str):
    from pallas_kernels.decode_attention import gpu_triton as gpu_da

    d, t = 128, 32
    rng = np.random.default_rng(bits)
    codes = jnp.asarray(rng.integers(0, 2**bits, (t, d)), jnp.uint8)
    packed = layout.pack_codes(codes, bits)
    for x, axis in ((packed, 1), (packed.T, 0)):  # row tiles and transposed key tiles
        planes = gpu_da.unpack_planes(x, bits, int_to_float, interpret=True)
        assert all(p.dtype == da.CODE_DOT_DTYPE and p.shape == x.shape for p in planes)
        got = np.concatenate([np.asarray(p, np.float32) for p in planes], axis=axis)
        want = np.asarray(codes, np.float32)
        np.testing.assert_array_equal(got if axis == 1 else got.T, want)


def _emulate_asm_planes(packed: np.ndarray, asm: str) -> list[np.ndarray]:
    """numpy model of the unpack PTX in `_plane_asm` (prmt spread, lop3 0xea, fma.rn.f16x2)
    on 4 bytes; one result per plane the asm writes."""
    import re

    out = []
    for mask, s_bits, c_bits in re.findall(
        r"lop3.b32 t0, lo, (0x[0-9a-f]+).*?mov.b32 s, (0x[0-9a-f]+); mov.b32 c, (0x[0-9a-f]+)",
        asm,
    ):
        mask, s_bits, c_bits = (int(v, 16) & 0xFFFF for v in (mask, s_bits, c_bits))
        half = (packed.astype(np.uint16) & mask) | 0x6400  # each byte in the low byte of a half
        as_f16 = half.view(np.float16).astype(np.float64)
        s = np.asarray(s_bits, np.uint16).view(np.float16).astype(np.float64)
        c = np.asarray(c_bits, np.uint16).view(np.float16).astype(np.float64)
        out.append((as_f16 * s + c).astype(np.float16))  # exact: the result is a small integer
    return out


@pytest.mark.parametrize("bits", [2, 4])
def test_plane_asm_model_recovers_every_code(bits: int):
    from pallas_kernels.decode_attention import gpu_triton as gpu_da

    packed = np.arange(256, dtype=np.uint8)
    for i, want in enumerate(layout.unpack_planes(jnp.asarray(packed), bits)):
        (got,) = _emulate_asm_planes(packed, gpu_da._plane_asm(bits, i))
        np.testing.assert_array_equal(got.astype(np.int32), np.asarray(want, np.int32))


def test_exponent_trick_is_exact_for_every_code():
    codes = jnp.arange(1024, dtype=jnp.int32)
    got = da_tiles.codes_to_f16(codes, "exponent")
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.arange(1024, dtype=np.float32))
    with pytest.raises(ValueError, match="int_to_float"):
        da_tiles.codes_to_f16(codes, "lut")


def test_validation_names_bad_shapes():
    x = make_inputs(Case())
    low = x["lowbit"]
    bad = dict(x, lowbit=low._replace(k=low.k._replace(codes=low.k.codes[..., :-1])))
    with pytest.raises(ValueError, match="k_codes.shape"):
        da.decode_attention(**bad, bits=2, sm_scale=0.1, interpret=True)
    with pytest.raises(ValueError, match="bits=3"):
        da.decode_attention(**make_inputs(Case(bits=3)), bits=3, sm_scale=0.1, interpret=True)
    with pytest.raises(ValueError, match="backend"):
        da.decode_attention(**x, bits=2, sm_scale=0.1, backend="cpu", interpret=True)
    with pytest.raises(ValueError, match="gather='rows'"):
        da.decode_attention_variant(
            **x, bits=2, sm_scale=0.1, backend="tpu", interpret=True, gather="rows"
        )
    with pytest.raises(ValueError, match="int_to_float='asm'"):
        da.decode_attention_variant(
            **x, bits=2, sm_scale=0.1, backend="tpu", interpret=True, int_to_float="asm"
        )
    with pytest.raises(ValueError, match="row_sums='deferred'"):
        da.decode_attention_variant(
            **x, bits=2, sm_scale=0.1, backend="tpu", interpret=True, row_sums="deferred"
        )
    with pytest.raises(ValueError, match="row_sums='lazy'"):
        da.decode_attention_variant(**x, bits=2, sm_scale=0.1, interpret=True, row_sums="lazy")
    with pytest.raises(ValueError, match="lowbit_len.shape"):
        short = low._replace(length=low.length[:1])
        da.decode_attention(**dict(x, lowbit=short), bits=2, sm_scale=0.1)


@pytest.mark.parametrize("splits", [1, 5])
@pytest.mark.parametrize("with_inverse", [True, False])
def test_gpu_merge_kernel_matches_xla_merge(splits: int, with_inverse: bool):
    """The GPU merge kernel (split axis padded to a power of two through masked loads) equals
    the XLA log-sum-exp merge followed by the value inverse, including an empty split and a
    row with no key at all."""
    from pallas_kernels.decode_attention import gpu_triton as gpu_da

    b, hkv, r, d = 2, 2, 4, 64
    ks = jax.random.split(jax.random.key(3), 4)
    acc = jax.random.normal(ks[0], (b, hkv, splits, r, d))
    m = jax.random.normal(ks[1], (b, hkv, splits, r)) * 4
    l = jax.random.uniform(ks[2], (b, hkv, splits, r), minval=0.5, maxval=3.0)
    m = m.at[0, 0, 0].set(da.NEG_INF)  # an empty split (every row)...
    l = l.at[0, 0, 0].set(0.0)
    acc = acc.at[0, 0, 0].set(0.0)
    m = m.at[1, 1, :, 2].set(da.NEG_INF)  # ...and one row that saw no key in any split
    l = l.at[1, 1, :, 2].set(0.0)
    acc = acc.at[1, 1, :, 2].set(0.0)
    vi = jax.random.normal(ks[3], (hkv, d, d)) if with_inverse else None
    got = gpu_da.merge_splits(acc, m, l, vi, interpret=True)
    want = da_api._merge_partials(acc, m, l)
    if vi is not None:
        want = jnp.einsum("bkrd,kde->bkre", want, vi, precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got)[1, 1, 2] == 0)


@pytest.mark.parametrize("split_at", [1, 3])
def test_gpu_merge_kernel_merges_a_second_set(split_at: int):
    """Two partial sets, the second's m/l with padded rows (the Mosaic body's N columns),
    merge to what the one concatenated set gives."""
    from pallas_kernels.decode_attention import gpu_triton as gpu_da

    b, hkv, s, r, d, n = 2, 2, 7, 4, 64, 16
    ks = jax.random.split(jax.random.key(4), 4)
    acc = jax.random.normal(ks[0], (b, hkv, s, r, d))
    m = (jax.random.normal(ks[1], (b, hkv, s, r)) * 4).at[1, 1, :, 2].set(da.NEG_INF)
    l = jax.random.uniform(ks[2], (b, hkv, s, r), minval=0.5, maxval=3.0).at[1, 1, :, 2].set(0)
    acc = acc.at[1, 1, :, 2].set(0.0)  # a row with no key in either set
    vi = jax.random.normal(ks[3], (hkv, d, d))
    want = gpu_da.merge_splits(acc, m, l, vi, interpret=True)

    def padded(x):  # rows past R hold junk the merge must not read
        junk = jnp.full((*x.shape[:3], n - r, *x.shape[4:]), 7.0)
        return jnp.concatenate([x, junk], axis=3)

    second = tuple(padded(x[:, :, split_at:]) for x in (acc, m, l))
    got = gpu_da.merge_splits(
        acc[:, :, :split_at], m[:, :, :split_at], l[:, :, :split_at], vi, interpret=True,
        second=second,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got)[1, 1, 2] == 0)


@pytest.mark.parametrize(
    "d, group, n_pad, streams",
    [(128, 4, 8, 2), (64, 3, 8, 1), (256, 9, 16, 1), (128, 8, 8, 1)],
    ids=str,
)
def test_mosaic_query_prologue_kernel_matches_its_xla_twin(d, group, n_pad, streams):
    """The s8 query operands from one Pallas Triton kernel (interpret mode) match XLA's: the
    8-bit parts within one code (XLA may fuse the division and scaling into other roundings;
    a low part's code is 2^-16 of the row's maximum), scales and reconstruction sums to 1e-6;
    padding rows, other streams' rows and the words past 2N zero as in the twin."""
    from pallas_kernels.decode_attention import gpu_mosaic as gm

    b, hkv, gp = 2, 2, 16 if group > 3 else group  # a group of 3 unpadded: Gp not a power of 2
    qg = jax.random.normal(jax.random.key(6), (b, hkv, gp, d)).at[:, :, group:].set(jnp.nan)
    qg = qg.at[0, 0, 1].set(0.0)  # a query row of zeros
    kw = dict(group=group, scale_log2=0.3, n_pad=n_pad, streams=streams)
    qs, qmeta = gm.query_operands_s8(qg, **kw, interpret=True)
    qs_want, qmeta_want = gm.query_operands(qg, **kw)
    assert qs.shape == qs_want.shape and qs.dtype == jnp.int8
    diff = np.abs(np.asarray(qs, np.int32) - np.asarray(qs_want, np.int32))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01
    unused = np.all(np.asarray(qs_want) == 0, axis=-1)
    assert unused.any() and np.all(np.asarray(qs)[unused] == 0)
    qm, qm_want = np.asarray(qmeta), np.asarray(qmeta_want)
    np.testing.assert_allclose(qm[..., :n_pad], qm_want[..., :n_pad], rtol=1e-6, atol=0)
    assert np.all(qm[..., 2 * n_pad :] == 0)
    # Each column's sum is its own codes' reconstruction (what the zero-point term cancels).
    q8 = np.asarray(qs, np.float64)[:, :, 0]  # stream 0: high rows [0, N), low rows [N, 2N)
    hi, lo = q8[:, :, :group].sum(-1), q8[:, :, n_pad : n_pad + group].sum(-1)
    own = qm[..., :group] * (hi + lo / 254)
    np.testing.assert_allclose(qm[..., n_pad : n_pad + group], own, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(qm, qm_want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="streams"):
        gm.query_operands_s8(qg, group=group, scale_log2=0.3, n_pad=8, streams=3)


@pytest.mark.parametrize(
    "d, group, n_pad, streams, dtype, transform, key_operand",
    [
        (128, 4, 8, 2, "bfloat16", True, "s8"),
        (128, 8, 8, 1, "float32", True, "s8"),
        (64, 3, 8, 1, "bfloat16", True, "s8"),  # a group of 3: padded to 4 rows in XLA
        (128, 4, 8, 2, "bfloat16", False, "s8"),
        (256, 4, 8, 2, "bfloat16", True, "s8"),  # over FUSED_PROLOGUE_MAX_DIM: three kernels
        (128, 4, 8, 2, "bfloat16", True, "f16"),  # float16 key operands: XLA's operands
    ],
    ids=str,
)
def test_mosaic_fused_query_prologue_matches_its_unfused_twin(
    d, group, n_pad, streams, dtype, transform, key_operand
):
    """`query_prologue` (one Pallas Triton kernel, interpret mode: convert, pad, transform,
    8-bit split) against the API's convert and pad, the HIGHEST-precision transform in XLA and
    XLA's `query_operands`: the float32 queries to 1e-5 of their scale (a broadcast sum against
    a dot: another summation order), padding rows zero; each column's 8-bit value within one
    low-part code, scales and sums to 1e-4."""
    from pallas_kernels.decode_attention import gpu_mosaic as gm

    b, hkv, gp = 2, 2, 16
    k1, k2 = jax.random.split(jax.random.key(7))
    q = (jax.random.normal(k1, (b, hkv, group, d)) * 3).astype(dtype)
    q = q.at[1, 0].set(0)  # a head whose queries are all zero
    mat = jax.random.normal(k2, (hkv, d, d)) / np.sqrt(d) if transform else None
    kw = dict(scale_log2=0.3, n_pad=n_pad, streams=streams)
    qg, (qs, qmeta) = gm.query_prologue(
        q, mat, group_pad=gp, **kw, key_operand=key_operand, interpret=True
    )
    want = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, 0), (0, gp - group), (0, 0)))
    if mat is not None:
        want = jnp.einsum("bhgd,hde->bhge", want, mat, precision=jax.lax.Precision.HIGHEST)
    assert qg.shape == (b, hkv, gp, d) and qg.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(qg), np.asarray(want), rtol=0, atol=1e-5 * 3)
    assert np.all(np.asarray(qg)[:, :, group:] == 0)
    qs_want, qmeta_want = gm.query_operands(want, group=group, **kw, key_operand=key_operand)
    assert qs.shape == qs_want.shape and qs.dtype == qs_want.dtype
    if key_operand != "s8":
        np.testing.assert_allclose(
            np.asarray(qs, np.float32), np.asarray(qs_want, np.float32), rtol=2e-3, atol=1e-4
        )
        return

    # Each column's value in units of its scale, hi + lo / 254 (bfloat16 queries meet exact
    # ties, where rounding half up and half to even give (h + 1, -127) against (h, 127)).
    def units(x):
        x = np.asarray(x, np.float64)
        return x[..., :n_pad, :] + x[..., n_pad:, :] / 254

    assert np.abs(units(qs) - units(qs_want)).max() <= 1.01 / 254
    unused = np.all(np.asarray(qs_want) == 0, axis=-1)
    assert np.all(np.asarray(qs)[unused] == 0)
    np.testing.assert_allclose(np.asarray(qmeta), np.asarray(qmeta_want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", _OVERLAP_CASES[:2], ids=str)
def test_mosaic_query_prologue_kernel_gives_the_xla_prologue_s_partials(case: Case):
    _check_schedule(case, dict(prologue="triton"), dict(prologue="xla"), run=True)
