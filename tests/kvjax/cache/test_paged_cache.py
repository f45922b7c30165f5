"""Paged mixed-precision cache: policy invariants, page accounting, isolation, exactness."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.cache.allocator import PageManager, PagePoolExhausted
from kvjax.cache.paged import CacheConfig, PagedKVCache
from kvjax.cache.quantizers import QuantConfig
from kvjax.cache.transforms import KVTransforms
from kvjax.config import ModelConfig
from kvjax.models.model import Transformer

CFG = ModelConfig(
    model_type="llama",
    vocab_size=61,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
)
SMALL = CacheConfig(sink=8, keep=8, flush=8, page_size=4, quant=None, max_seq_len=96)


def random_orthogonal_transforms(cfg, seed=0):
    rng = np.random.default_rng(seed)
    a = np.stack(
        [
            np.stack(
                [
                    np.linalg.qr(rng.normal(size=(cfg.head_dim,) * 2))[0]
                    for _ in range(cfg.num_kv_heads)
                ]
            )
            for _ in range(cfg.num_layers)
        ]
    )
    a = jnp.asarray(a, jnp.float32)
    at = jnp.swapaxes(a, -1, -2)
    ones = jnp.ones((cfg.num_layers,))
    return KVTransforms(a, at, a, at, ones, ones)


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def step(model):
    graphdef, params = nnx.split(model)

    @jax.jit
    def run(tokens, cache):
        return nnx.merge(graphdef, params)(tokens, cache)

    return run


def run_chunks(step, cache, mgr, tokens, chunks):
    outs, i = [], 0
    for c in chunks:
        cache = mgr.prepare(cache, c)
        out, cache = step(jnp.asarray(tokens[:, i : i + c]), cache)
        outs.append(np.asarray(out))
        i += c
    return np.concatenate(outs, axis=1), cache


@given(st.lists(st.integers(1, 13), min_size=1, max_size=12))
@settings(max_examples=40, deadline=None)
def test_segment_boundaries_and_page_accounting(chunks):
    """Host bookkeeping alone (no model): segments follow the policy after any call sequence."""
    cc = SMALL
    cache = PagedKVCache.create(
        CFG,
        dataclasses.replace(cc, max_seq_len=200),
        KVTransforms.identity(CFG),
        1,
    )
    mgr = PageManager(cache)
    total = 0
    for c in chunks:
        mgr.prepare(cache, c)
        total += c
        sink, low, recent = mgr.segments(0)
        assert sink == min(total, cc.sink)
        assert low % cc.flush == 0 and low >= 0
        if total > cc.sink:
            assert recent >= min(cc.keep, total - cc.sink)  # at least `keep` stay full precision
            assert recent < cc.keep + cc.flush  # and no more than one flush unit beyond
        s = mgr.seqs[0]
        p = cc.page_size
        assert len(s.low_pages) == low // p
        assert len(s.sink_pages) == -(-sink // p)
        assert len(s.recent_pages) == -(-recent // p)
        # Every page is owned once or free (pending frees are free from the next step on).
        owned = s.sink_pages + list(s.recent_pages.values())
        assert len(set(owned)) == len(owned)
        assert not set(owned) & set(mgr.free_fp)
        assert len(owned) + len(mgr.free_fp) + len(mgr._pending_free_fp) == mgr.num_fp_pages
        assert len(s.low_pages) + len(mgr.free_low) == mgr.num_low_pages


def test_decode_steps_without_a_flush_plan_no_flush_slots():
    """A decode step where no sequence flushes carries zero flush slots (so the device skips
    the gather and the quantize+pack of dropped tokens); a flushing step carries the fixed
    bound, and it moves exactly ``flush`` tokens per flushing sequence."""
    cc = dataclasses.replace(SMALL, max_seq_len=200)
    cache = PagedKVCache.create(CFG, cc, KVTransforms.identity(CFG), 2)
    mgr = PageManager(cache)
    mgr.prepare(cache, [20, 23])  # prompt chunk
    widths, moved = [], []
    for _ in range(20):
        plan = mgr.prepare(cache, 1).plan
        widths.append(plan.flush_src.shape[1])
        moved.append(int((np.asarray(plan.flush_dst) < mgr.num_low_pages * cc.page_size).sum()))
    assert set(widths) == {0, 1 + cc.flush}, widths
    assert all(m == 0 for w, m in zip(widths, moved) if w == 0)
    assert all(m % cc.flush == 0 and m > 0 for w, m in zip(widths, moved) if w)


def test_identity_quantizer_equals_full_precision(model, step):
    """quant=None (identity quantizer), random orthogonal transforms: exactly the dense model."""
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 60))
    full, _ = model(jnp.asarray(tokens))
    cache = PagedKVCache.create(CFG, SMALL, random_orthogonal_transforms(CFG), 2)
    mgr = PageManager(cache)
    got, _ = run_chunks(step, cache, mgr, tokens, [5, 16, 1, 1, 7, 3, 1, 10, 16])
    np.testing.assert_allclose(got, np.asarray(full), atol=2e-5)
    assert mgr.segments(0)[1] > 0  # the low-bit segment was exercised


def test_centred_keys_leave_attention_unchanged(model, step):
    """A key mean subtracted from every stored key (`KVTransforms.key_mean`) moves all of a
    query's logits by the same q . mu: with the identity quantizer, still the dense model."""
    tokens = np.random.default_rng(2).integers(0, CFG.vocab_size, (2, 60))
    full, _ = model(jnp.asarray(tokens))
    mu = np.random.default_rng(3).normal(size=(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim))
    tf = dataclasses.replace(
        random_orthogonal_transforms(CFG), key_mean=jnp.asarray(8.0 * mu, jnp.float32)
    )
    cache = PagedKVCache.create(CFG, SMALL, tf, 2)
    mgr = PageManager(cache)
    got, _ = run_chunks(step, cache, mgr, tokens, [5, 16, 1, 1, 7, 3, 1, 10, 16])
    np.testing.assert_allclose(got, np.asarray(full), atol=1e-4)
    bad = dataclasses.replace(tf, key_mean=jnp.zeros((CFG.num_layers, CFG.head_dim)))
    with pytest.raises(ValueError, match="key_mean has shape"):
        bad.check_matches(CFG)


def test_single_token_decode_matches_full_sequence(model, step):
    tokens = np.random.default_rng(1).integers(0, CFG.vocab_size, (1, 40))
    full, _ = model(jnp.asarray(tokens))
    cache = PagedKVCache.create(CFG, SMALL, KVTransforms.identity(CFG), 1)
    mgr = PageManager(cache)
    got, _ = run_chunks(step, cache, mgr, tokens, [1] * 40)
    np.testing.assert_allclose(got, np.asarray(full), atol=2e-5)


def test_value_folding_with_identity_quantizer_reproduces_model(model):
    tf = random_orthogonal_transforms(CFG, seed=3)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, CFG.vocab_size, (1, 30)))
    full, _ = model(tokens)
    folded = nnx.clone(model)
    from kvjax.cache.transforms import fold_value_transforms

    tf_folded = fold_value_transforms(folded, tf)
    assert tf_folded.values_folded
    cache = PagedKVCache.create(CFG, SMALL, tf_folded, 1)
    mgr = PageManager(cache)
    cache = mgr.prepare(cache, 30)
    out, _ = folded(tokens, cache)
    np.testing.assert_allclose(np.asarray(out), np.asarray(full), atol=3e-5)


def test_sequences_of_different_lengths_do_not_leak(model, step):
    """Two sequences advanced by different real-token counts give each its own solo result."""
    rng = np.random.default_rng(4)
    toks = rng.integers(0, CFG.vocab_size, (2, 48))
    cc = dataclasses.replace(SMALL, quant=QuantConfig(bits=2))
    tf = random_orthogonal_transforms(CFG)
    # Together: sequence 1 gets only 6 real tokens per call for the first 4 calls.
    cache = PagedKVCache.create(CFG, cc, tf, 2)
    mgr = PageManager(cache)
    seq1_outs, seq0_outs = [], []
    pos0 = pos1 = 0
    for _ in range(4):
        cache = mgr.prepare(cache, [12, 6])
        batch = np.stack([toks[0, pos0 : pos0 + 12], np.pad(toks[1, pos1 : pos1 + 6], (0, 6))])
        out, cache = step(jnp.asarray(batch), cache)
        seq0_outs.append(np.asarray(out[0]))
        seq1_outs.append(np.asarray(out[1, :6]))
        pos0, pos1 = pos0 + 12, pos1 + 6
    assert mgr.lengths == [48, 24]
    for seq, chunk, outs in ((0, 12, seq0_outs), (1, 6, seq1_outs)):
        solo = PagedKVCache.create(CFG, cc, tf, 1)
        m = PageManager(solo)
        got, _ = run_chunks(step, solo, m, toks[seq : seq + 1], [chunk] * 4)
        np.testing.assert_allclose(np.concatenate(outs), got[0], atol=1e-4)


@pytest.mark.parametrize("lengths", [(19, 20, 20, 20, 21), (20,) * 5])
def test_a_window_plan_packs_its_flushing_rows(lengths):
    """plan_window keeps every step's flush slots but packs the flushing rows first, in the
    smallest of `flush_row_counts` rows that holds each step's: here one or three rows flush per
    step (3 packed rows at flush_rows=3), or all five at once (every row)."""
    b = len(lengths)
    base = dataclasses.replace(SMALL, quant=QuantConfig(bits=2), max_seq_len=64)
    assert dataclasses.replace(base, flush_rows=3).flush_row_counts(b) == (3, 5)
    assert base.flush_row_counts(b) == (5,) and base.flush_row_counts(64) == (32, 64)
    plans = {}
    for rows in (3, b):
        cache = PagedKVCache.create(CFG, dataclasses.replace(base, flush_rows=rows),
                                    KVTransforms.identity(CFG), b)  # fmt: skip
        mgr = PageManager(cache)
        mgr.prepare(cache, list(lengths))
        plans[rows], _ = mgr.plan_window(list(range(b)), np.ones((16, b), np.int32))
    drop = cache.num_lowbit_pages * cache.cfg.low_page
    packed, full = plans[3], plans[b]
    assert full["flush_dst"].shape[1] == b
    assert packed["flush_dst"].shape[1] == (3 if len(set(lengths)) > 1 else b)
    for k in ("fp_table", "low_table", "new_fp_dst", "low_len"):
        np.testing.assert_array_equal(packed[k], full[k])

    def pairs(plan, step):  # the step's (fp slot, low-bit slot) moves, in any row order
        src, dst = plan["flush_src"][step], plan["flush_dst"][step]
        return sorted(zip(src[dst < drop].tolist(), dst[dst < drop].tolist()))

    for step in range(16):
        assert pairs(packed, step) == pairs(full, step)
        rows = (packed["flush_dst"][step] < drop).any(-1)
        assert not rows[rows.argmin() :].any() or rows.all()  # flushing rows come first
    counts = (full["flush_dst"] < drop).any(-1).sum(-1)
    assert set(counts.tolist()) - {0} == ({1, 3} if len(set(lengths)) > 1 else {b})


def test_nan_in_unused_pages_never_reaches_output(model, step):
    """Pools start NaN-filled; poison every free page again mid-run: outputs stay finite."""
    tokens = np.random.default_rng(5).integers(0, CFG.vocab_size, (1, 40))
    cc = dataclasses.replace(SMALL, quant=QuantConfig(bits=2))
    cache = PagedKVCache.create(CFG, cc, KVTransforms.identity(CFG), 1)
    mgr = PageManager(cache)
    out, cache = run_chunks(step, cache, mgr, tokens[:, :24], [8, 8, 8])
    free_fp = np.asarray(mgr.free_fp + mgr._pending_free_fp, np.int32)
    free_low = np.asarray(mgr.free_low, np.int32)
    pools = tuple(
        dataclasses.replace(
            pl,
            k_fp=pl.k_fp.at[free_fp].set(jnp.nan) if len(free_fp) else pl.k_fp,
            v_fp=pl.v_fp.at[free_fp].set(jnp.nan) if len(free_fp) else pl.v_fp,
            k_low=(pl.k_low[0], pl.k_low[1].at[free_low].set(jnp.nan), pl.k_low[2]),
            v_low=(pl.v_low[0], pl.v_low[1].at[free_low].set(jnp.nan), pl.v_low[2]),
        )
        for pl in cache.pools
    )
    cache = cache.replace(pools=pools)
    out2, _ = run_chunks(step, cache, mgr, tokens[:, 24:], [1] * 16)
    assert np.isfinite(out).all() and np.isfinite(out2).all()


def test_pool_exhaustion_is_clear_and_changes_nothing(model, step):
    cc = dataclasses.replace(SMALL, quant=QuantConfig(bits=2), num_lowbit_pages=5)
    cache = PagedKVCache.create(CFG, cc, KVTransforms.identity(CFG), 1)
    mgr = PageManager(cache)
    tokens = np.random.default_rng(6).integers(0, CFG.vocab_size, (1, 64))
    ref, cache = run_chunks(step, cache, mgr, tokens[:, :32], [16, 16])  # 16 low-bit tokens
    before = (mgr.lengths, mgr.pages_in_use(), list(mgr.free_low), list(mgr.free_fp))
    with pytest.raises(PagePoolExhausted, match="low-bit page pool exhausted"):
        mgr.prepare(cache, 16)  # would need 4 more low-bit pages, 1 is free
    assert (mgr.lengths, mgr.pages_in_use(), list(mgr.free_low), list(mgr.free_fp)) == before
    # The stored sequence is intact: decoding on continues exactly as without the failed call.
    cache = mgr.prepare(cache, 1)
    out, _ = step(jnp.asarray(tokens[:, 32:33]), cache)
    fresh = PagedKVCache.create(CFG, cc, KVTransforms.identity(CFG), 1)
    m2 = PageManager(fresh)
    want, _ = run_chunks(step, fresh, m2, tokens[:, :33], [16, 16, 1])
    np.testing.assert_allclose(np.asarray(out[0, -1]), want[0, -1], atol=1e-5)


def test_memory_accounting_reports_low_bits():
    cfg_big = dataclasses.replace(CFG, num_layers=1)
    q = PagedKVCache.create(
        cfg_big,
        dataclasses.replace(
            SMALL, quant=QuantConfig(bits=2), max_seq_len=4096, fp_dtype="bfloat16"
        ),
        KVTransforms.identity(cfg_big),
        1,
    )
    f = PagedKVCache.create(
        cfg_big,
        dataclasses.replace(SMALL, quant=None, max_seq_len=4096, fp_dtype="bfloat16"),
        KVTransforms.identity(cfg_big),
        1,
    )
    # head_dim 32 at 2 bits: 8 bytes codes + 2x2 bytes fp16 scale/zero per head-token = 12 vs 64.
    assert q.allocated_bytes() < 0.25 * f.allocated_bytes()


def test_pallas_decode_path_matches_reference():
    """Decode through the Pallas kernel (interpret mode on CPU) == the reference path, with
    transforms applied inside the kernel (query transform and value inverse) and centred keys
    (the prefill chunk's tokens that go straight to low bits are centred before the fused
    quantize+pack kernel transforms them)."""
    cfg = dataclasses.replace(CFG, head_dim=64)  # the kernel's 2-bit dots need d // 4 >= 16
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    graphdef, params = nnx.split(model)
    step = jax.jit(lambda t, c: nnx.merge(graphdef, params)(t, c))
    tokens = np.random.default_rng(7).integers(0, cfg.vocab_size, (2, 68))
    mu = np.random.default_rng(10).normal(size=(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim))
    tf = dataclasses.replace(
        random_orthogonal_transforms(cfg, seed=9), key_mean=jnp.asarray(4.0 * mu, jnp.float32)
    )
    outs = {}
    for impl in ("reference", "pallas"):  # Triton tiles need page_size >= 16
        cc = CacheConfig(
            sink=16,
            keep=16,
            flush=16,
            page_size=16,
            quant=QuantConfig(bits=2),
            max_seq_len=96,
            attention=impl,
        )
        cache = PagedKVCache.create(cfg, cc, tf, 2)
        mgr = PageManager(cache)
        outs[impl], _ = run_chunks(step, cache, mgr, tokens, [32, 32, 1, 1, 1, 1])
        assert mgr.segments(0)[1] > 0
    # The kernel feeds its tensor-core dots bf16 queries/probabilities (codes are exact), so the
    # logits agree to bf16 precision, not float32.
    scale = np.abs(outs["reference"]).max()
    np.testing.assert_allclose(outs["pallas"], outs["reference"], atol=2e-3 * scale, rtol=0)


def test_all_full_precision_bf16_pallas_path_matches_reference():
    """An all-BF16 cache (no low-bit pages) decodes through `decode_attention_bf16` on the
    backend `fp_backend` picks (the Mosaic GPU body on Hopper, Triton interpret mode here);
    both paths read the same bf16 pages, the kernel's dots take bf16 queries/probabilities."""
    from pallas_kernels.decode_attention import fp_backend

    cfg = dataclasses.replace(CFG, head_dim=64)
    tokens = np.random.default_rng(8).integers(0, cfg.vocab_size, (2, 84))
    tf = random_orthogonal_transforms(cfg, seed=3)
    outs = {}
    for impl in ("reference", "pallas"):
        cc = CacheConfig(sink=16, keep=128, flush=16, page_size=16, quant=None,
                         fp_dtype="bfloat16", max_seq_len=128, attention=impl)  # fmt: skip
        assert cc.all_full_precision
        outs[impl], _, _ = _run_cfg(cfg, cc, tokens, [64, 16, 1, 1, 1, 1], tf)
    if jax.default_backend() == "cpu":
        assert fp_backend(jnp.bfloat16, 64, 16) == "gpu"  # the Triton body, interpret mode
    elif jax.default_backend() == "gpu":
        hopper = str(jax.devices()[0].compute_capability).startswith("9")
        assert fp_backend(jnp.bfloat16, 64, 16) == ("gpu_mosaic" if hopper else "gpu")
    assert fp_backend(jnp.float32, 64, 16) in ("gpu", "tpu")  # Mosaic GPU reads 16-bit pages
    scale = np.abs(outs["reference"]).max()
    np.testing.assert_allclose(outs["pallas"], outs["reference"], atol=1e-2 * scale, rtol=0)


def _run_cfg(cfg, cc, tokens, chunks, tf):
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    graphdef, params = nnx.split(model)
    step = jax.jit(lambda t, c: nnx.merge(graphdef, params)(t, c))
    cache = PagedKVCache.create(cfg, cc, tf, tokens.shape[0])
    mgr = PageManager(cache)
    out, cache = run_chunks(step, cache, mgr, tokens, chunks)
    return out, cache, mgr


@pytest.mark.slow  # ~85 s on CI's CPU; the 128-token pages are in the Mosaic decode test
def test_lowbit_pages_of_their_own_size_and_dims_major_values():
    """128-token low-bit pages beside 16-token fp pages give the outputs of 16-token low-bit
    pages (same codes, same token order), and dimension-major value pages hold the same codes
    as token-major ones, so the reference path's outputs are identical. A decode step flushes
    128 tokens (the last chunk crosses length 288)."""
    from pallas_kernels import layout as lay

    cfg = dataclasses.replace(CFG, head_dim=64)
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 294))
    tf = random_orthogonal_transforms(cfg, seed=5)
    chunks = [64, 130, 80] + [1] * 20
    base = CacheConfig(sink=16, keep=16, flush=128, page_size=16, quant=QuantConfig(bits=2),
                       max_seq_len=320)  # fmt: skip
    runs = {
        name: _run_cfg(cfg, dataclasses.replace(base, **kw), tokens, chunks, tf)
        for name, kw in (
            ("p16", {}),
            ("p128", dict(lowbit_page_size=128)),
            ("dims", dict(lowbit_page_size=128, value_layout="dims")),
        )
    }
    (o16, _, _), (o128, c128, m128), (od, cd, md) = runs["p16"], runs["p128"], runs["dims"]
    assert m128.segments(0) == (16, 256, 22) and c128.num_lowbit_pages == 2 * 2
    np.testing.assert_allclose(o128, o16, rtol=0, atol=1e-5 * np.abs(o16).max())
    np.testing.assert_array_equal(od, o128)
    used = sorted({pg for s in m128.seqs.values() for pg in s.low_pages})
    assert used == sorted({pg for s in md.seqs.values() for pg in s.low_pages})
    for pools_t, pools_d in zip(c128.pools, cd.pools):
        assert pools_d.v_low[0].shape == (4, cfg.num_kv_heads, 64, 32)
        tok = lay.unpack_codes(pools_t.v_low[0][np.asarray(used)], 2, 64)
        dim = lay.unpack_value_page_dims_major(pools_d.v_low[0][np.asarray(used)], 2, 128)
        np.testing.assert_array_equal(dim, tok)
        np.testing.assert_array_equal(pools_d.k_low[0], pools_t.k_low[0])


def test_lowbit_page_and_value_layout_are_checked_up_front():
    with pytest.raises(ValueError, match="lowbit_page_size=128 must be positive and divide"):
        CacheConfig(lowbit_page_size=128)
    with pytest.raises(ValueError, match="value_layout='rows'"):
        CacheConfig(value_layout="rows")
    with pytest.raises(ValueError, match=r"value widths \[3\]"):
        CacheConfig(flush=128, lowbit_page_size=128, value_layout="dims",
                    quant=QuantConfig(bits=3))  # fmt: skip
    with pytest.raises(ValueError, match="value widths None"):
        CacheConfig(value_layout="dims", quant=None)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the GPU may run the Mosaic body")
def test_dims_values_with_the_pallas_path_off_hopper_name_the_layout():
    """Dimension-major values have only a Mosaic GPU (Hopper) decode body: elsewhere the
    pallas path's first decode step says so instead of reading the pages wrongly."""
    cfg = dataclasses.replace(CFG, head_dim=64)
    cc = CacheConfig(sink=16, keep=16, flush=128, page_size=16, lowbit_page_size=128,
                     value_layout="dims", quant=QuantConfig(bits=2), max_seq_len=320,
                     attention="pallas")  # fmt: skip
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 170))
    with pytest.raises(ValueError, match="value_layout='dims' decodes only through the Mosaic"):
        _run_cfg(cfg, cc, tokens, [169, 1], random_orthogonal_transforms(cfg))


@pytest.mark.skipif(
    jax.default_backend() != "gpu"
    or not str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9"),
    reason="the Mosaic GPU decode body needs a Hopper GPU",
)
@pytest.mark.parametrize("value_layout", ["tokens", "dims"])
def test_mosaic_decode_of_128_token_lowbit_pages_matches_reference(value_layout):
    """The cache's pallas path on 128-token low-bit pages runs the Mosaic GPU body (keys as
    8-bit MMA operands, values token- or dimension-major) and matches the reference path."""
    from pallas_kernels.decode_attention import lowbit_backend

    cfg = dataclasses.replace(CFG, head_dim=128, num_heads=8, num_kv_heads=2)
    assert lowbit_backend(head_dim=128, bits=2, bits_v=2, group_size=128, group=4,
                          page_size=128, meta_dtypes=("float16",) * 4,
                          value_layout=value_layout) == "gpu_mosaic"  # fmt: skip
    tokens = np.random.default_rng(4).integers(0, cfg.vocab_size, (3, 420))
    tf = random_orthogonal_transforms(cfg, seed=6)
    outs = {}
    for impl in ("reference", "pallas"):
        cc = CacheConfig(sink=64, keep=64, flush=128, page_size=16, lowbit_page_size=128,
                         value_layout=value_layout, quant=QuantConfig(bits=2),
                         max_seq_len=512, fp_dtype="bfloat16", attention=impl)  # fmt: skip
        outs[impl], _, mgr = _run_cfg(cfg, cc, tokens, [256, 150, 1, 1, 1, 1, 1, 1], tf)
        assert mgr.segments(0)[1] == 256
    scale = np.abs(outs["reference"]).max()
    np.testing.assert_allclose(outs["pallas"], outs["reference"], atol=1e-2 * scale, rtol=0)


# ---- bit allocations: per-layer (key, value) widths and scale/zero encodings ---------------
def _alloc(*pairs):
    return tuple(
        (QuantConfig(bits=kb, meta_dtype=km), QuantConfig(bits=vb, meta_dtype=vm))
        for (kb, km), (vb, vm) in pairs
    )


def test_layer_quant_pools_and_validation():
    lq = _alloc(((2, "uint8"), (4, "float16")), ((3, "float16"), (2, "uint8")))
    cc = dataclasses.replace(SMALL, quant=QuantConfig(bits=2), layer_quant=lq)
    cache = PagedKVCache.create(CFG, cc, KVTransforms.identity(CFG), 1)
    d = CFG.head_dim
    shapes = [(p.k_low[0].shape[-1], p.k_low[1].dtype, p.v_low[0].shape[-1], p.v_low[1].dtype)
              for p in cache.pools]  # fmt: skip
    want = [(d // 4, jnp.uint8, d // 2, jnp.float16), (3 * d // 8, jnp.float16, d // 4, jnp.uint8)]
    assert shapes == want  # 3 bits: bit-sliced rows
    assert [cache.policy(i).quant.bits for i in range(2)] == [2, 3]
    with pytest.raises(ValueError, match="layer_quant has 1 layers, the model 2"):
        PagedKVCache.create(CFG, dataclasses.replace(cc, layer_quant=lq[:1]), cache.transforms, 1)
    with pytest.raises(ValueError, match="layer_quant given with quant=None"):
        dataclasses.replace(SMALL, quant=None, layer_quant=lq)
    with pytest.raises(ValueError, match="pairs"):
        dataclasses.replace(cc, layer_quant=(QuantConfig(), QuantConfig()))


def test_decode_backend_is_the_choosers_pick_and_names_a_layer_it_cannot_run():
    """`decode_backend` (what the pallas path runs, and what benchmarks report) is the
    chooser's answer for the layer's pools; a 3-bit layer has no Pallas body and says so."""
    from pallas_kernels.decode_attention import fp_backend, lowbit_backend

    cfg = dataclasses.replace(CFG, head_dim=64)
    lq = _alloc(((2, "float16"), (2, "float16")), ((3, "float16"), (2, "float16")))
    cc = dataclasses.replace(SMALL, quant=QuantConfig(bits=2), layer_quant=lq, attention="pallas")
    cache = PagedKVCache.create(cfg, cc, KVTransforms.identity(cfg), 1)
    group_size = 64 // cache.pools[0].k_low[1].shape[-1]  # one scale per group of channels
    want = lowbit_backend(head_dim=64, bits=2, bits_v=2, group_size=group_size,
                          group=cfg.num_heads // cfg.num_kv_heads, page_size=cc.low_page,
                          meta_dtypes=("float16",) * 4, value_layout="tokens")  # fmt: skip
    assert cache.decode_backend(0, cfg.num_heads) == want
    with pytest.raises(ValueError, match="layer 1 has keys"):
        cache.decode_backend(1, cfg.num_heads)
    fp = CacheConfig(sink=16, keep=128, flush=16, page_size=16, quant=None,
                     fp_dtype="bfloat16", max_seq_len=128, attention="pallas")  # fmt: skip
    cache = PagedKVCache.create(cfg, fp, KVTransforms.identity(cfg), 1)
    assert cache.decode_backend(0, cfg.num_heads) == fp_backend(jnp.bfloat16, 64, 16)


@pytest.mark.slow
def test_bit_allocation_pallas_path_matches_reference():
    """Mixed widths across layers and between K and V, 8-bit scale/zero, and a 3-bit layer
    (reference path inside the pallas cache): the kernels (interpret mode) == reference."""
    cfg = dataclasses.replace(CFG, head_dim=64, num_layers=3)
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    graphdef, params = nnx.split(model)
    step = jax.jit(lambda t, c: nnx.merge(graphdef, params)(t, c))
    tokens = np.random.default_rng(7).integers(0, cfg.vocab_size, (2, 52))
    tf = random_orthogonal_transforms(cfg, seed=9)
    lq = _alloc(
        ((2, "uint8"), (4, "float16")),
        ((4, "uint8"), (2, "uint8")),
        ((3, "float16"), (2, "float16")),
    )
    outs = {}
    for impl in ("reference", "pallas"):
        cc = CacheConfig(
            sink=16,
            keep=16,
            flush=16,
            page_size=16,
            quant=QuantConfig(bits=2),
            layer_quant=lq,
            max_seq_len=64,
            attention=impl,
        )
        cache = PagedKVCache.create(cfg, cc, tf, 2)
        mgr = PageManager(cache)
        outs[impl], _ = run_chunks(step, cache, mgr, tokens, [32, 16, 1, 1, 1, 1])
        assert mgr.segments(0)[1] > 0
    scale = np.abs(outs["reference"]).max()
    np.testing.assert_allclose(outs["pallas"], outs["reference"], atol=2e-3 * scale, rtol=0)
