"""A hypothesis state machine drives the engine through random submit / step / cancel / preempt
operations with shared prompt prefixes on a small page pool, and after every operation checks
the allocator's books and every live sequence's cache against a from-scratch prefill."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvjax.cache.dense import DenseKVCache
from kvjax.cache.paged import CacheConfig
from kvjax.config import ModelConfig
from kvjax.models.model import Transformer
from kvjax.serving.engine import Engine, EngineConfig

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
# quant=None keeps the middle segment in full precision, so a misplaced page shows as a large
# error against the dense reference instead of hiding in quantization noise.
# Low-bit pages of 8 tokens beside 4-token full-precision pages: the two page sizes are planned
# apart (as the Mosaic GPU body's 128-token low-bit pages beside 16-token ones).
CCFG = CacheConfig(
    sink=8, keep=8, flush=8, page_size=4, lowbit_page_size=8, quant=None, max_seq_len=96,
    num_fp_pages=20, num_lowbit_pages=18,
)  # fmt: skip
ECFG = EngineConfig(max_seqs=3, prefill_chunk=16, prefill_tokens_per_step=32, decode_steps=4)
MODEL = Transformer(CFG, rngs=nnx.Rngs(0))
GRAPHDEF, PARAMS = nnx.split(MODEL)
PREFIXES = [np.random.default_rng(i).integers(0, CFG.vocab_size, 32).tolist() for i in (1, 2)]


@jax.jit
def _dense_kv(tokens):
    """K/V of a from-scratch prefill of one padded sequence (causal: padding cannot leak)."""
    cache = DenseKVCache.create(CFG, 1, CCFG.max_seq_len)
    _, cache = nnx.merge(GRAPHDEF, PARAMS)(tokens[None], cache)
    return cache.k, cache.v


def _stored_kv(eng, seq):
    """Every stored token of `seq`, per layer, in position order (f32[S, Hkv, d])."""
    cfg, p, pl = eng.cache_cfg, eng.cache_cfg.page_size, eng.cache_cfg.low_page
    s = eng.manager.seqs[seq]
    qe = cfg.quant_end(s.length)
    out = []
    for pools in eng.cache.pools:
        ks, vs = [], []
        for pos in range(s.length):
            if pos < cfg.sink:
                k_pool, v_pool, page, slot = pools.k_fp, pools.v_fp, s.sink_pages[pos // p], pos % p
            elif pos < qe:
                k_pool, v_pool = pools.k_low[0], pools.v_low[0]
                page, slot = s.low_pages[(pos - cfg.sink) // pl], (pos - cfg.sink) % pl
            else:
                k_pool, v_pool = pools.k_fp, pools.v_fp
                page, slot = s.recent_pages[(pos - cfg.sink) // p], (pos - cfg.sink) % p
            ks.append(k_pool[page, :, slot])
            vs.append(v_pool[page, :, slot])
        out.append((np.stack(ks), np.stack(vs)))
    return out


class EngineMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.eng = Engine(MODEL, cache_kind="paged", cache_cfg=CCFG, engine_cfg=ECFG)
        self.reqs = []
        self.rng = np.random.default_rng(0)

    @rule(
        prefix=st.sampled_from([None, 0, 1]),
        suffix=st.integers(1, 30),
        max_new=st.integers(1, 12),
    )
    def submit(self, prefix, suffix, max_new):
        head = [] if prefix is None else PREFIXES[prefix]
        tail = self.rng.integers(0, CFG.vocab_size, suffix).tolist()
        self.reqs.append(self.eng.submit(head + tail, max_new))

    @precondition(lambda self: self.eng.has_work)
    @rule()
    def step(self):
        self.eng.step()

    @precondition(lambda self: self.eng.running)
    @rule(i=st.integers(0, 10))
    def preempt(self, i):
        self.eng.preempt(self.eng.running[i % len(self.eng.running)])

    @precondition(lambda self: self.eng.has_work)
    @rule(i=st.integers(0, 10))
    def cancel(self, i):
        live = list(self.eng.waiting) + self.eng.running
        self.eng.cancel(live[i % len(live)])

    @invariant()
    def books_balance(self):
        mgr = self.eng.manager
        holders_fp = np.zeros(mgr.num_fp_pages, np.int32)
        holders_low = np.zeros(mgr.num_low_pages, np.int32)
        for s in list(mgr.seqs.values()) + list(mgr.prefixes.values()):
            for pg in s.sink_pages + list(s.recent_pages.values()):
                holders_fp[pg] += 1
            for pg in s.low_pages:
                holders_low[pg] += 1
        np.testing.assert_array_equal(holders_fp, mgr.ref_fp)
        np.testing.assert_array_equal(holders_low, mgr.ref_low)
        free_fp = mgr.free_fp + mgr._pending_free_fp
        assert len(set(free_fp)) == len(free_fp) and len(set(mgr.free_low)) == len(mgr.free_low)
        assert set(free_fp) == set(np.flatnonzero(mgr.ref_fp == 0))
        assert set(mgr.free_low) == set(np.flatnonzero(mgr.ref_low == 0))
        assert set(mgr.seqs) == {r.seq for r in self.eng.running}

    @invariant()
    def shared_pages_hold_a_common_prefix(self):
        mgr, cfg = self.eng.manager, self.eng.cache_cfg
        owner = {}
        for r in self.eng.running:
            s = mgr.seqs[r.seq]
            slots = [("fp", pg, i * cfg.page_size) for i, pg in enumerate(s.sink_pages)]
            slots += [("low", pg, cfg.sink + i * cfg.page_size) for i, pg in enumerate(s.low_pages)]
            slots += [
                ("fp", pg, cfg.sink + lp * cfg.page_size) for lp, pg in s.recent_pages.items()
            ]
            for kind, pg, start in slots:
                if (kind, pg) in owner:
                    other, other_start = owner[(kind, pg)]
                    end = start + cfg.page_size
                    assert start == other_start, "one page at two positions"
                    assert r.tokens[:end] == other.tokens[:end], "shared page, different tokens"
                else:
                    owner[(kind, pg)] = (r, start)

    @invariant()
    def caches_equal_a_fresh_prefill(self):
        for r in self.eng.running:
            assert self.eng.manager.seqs[r.seq].length == r.computed
            if not r.computed:
                continue
            toks = np.zeros(CCFG.max_seq_len, np.int32)
            toks[: r.computed] = r.tokens[: r.computed]
            k_ref, v_ref = _dense_kv(jnp.asarray(toks))
            for layer, (k, v) in enumerate(_stored_kv(self.eng, r.seq)):
                np.testing.assert_allclose(k, k_ref[layer][0, : r.computed], rtol=1e-4, atol=1e-4)
                np.testing.assert_allclose(v, v_ref[layer][0, : r.computed], rtol=1e-4, atol=1e-4)

    def teardown(self):
        self.eng.run()
        event(f"engine preempted: {self.eng.stats['preemptions'] > 0}")
        event(f"prefix shared: {self.eng.stats['prefix_tokens_shared'] > 0}")
        for r in self.reqs:
            assert r.done
            if r.finish_reason != "cancelled":
                assert len(r.output) == r.max_new_tokens
        while self.eng.manager.evict_prefix():
            pass
        assert self.eng.manager.pages_in_use() == (0, 0)
        assert self.eng.manager.free_pages() == (CCFG.num_fp_pages, CCFG.num_lowbit_pages)


EngineMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=40, deadline=None)
TestEngineMachine = EngineMachine.TestCase
