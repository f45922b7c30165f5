"""The serving engine on a tiny random model: ragged requests, batch invariance, streaming,
prefix sharing, preemption, memory-budget admission and input checks."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from kvjax.cache.paged import CacheConfig
from kvjax.cache.quantizers import QuantConfig
from kvjax.config import ModelConfig
from kvjax.models.model import Transformer
from kvjax.serving.engine import Engine, EngineConfig
from kvjax.serving.sampling import SamplingParams

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
FP = CacheConfig(sink=8, keep=8, flush=8, page_size=4, quant=None, max_seq_len=128)
LOW = dataclasses.replace(FP, quant=QuantConfig(bits=2))
ECFG = EngineConfig(max_seqs=4, prefill_chunk=16, prefill_tokens_per_step=32, decode_steps=4)


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, rngs=nnx.Rngs(0))


def prompts(seed=0, lens=(5, 40, 77, 13)):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in lens]


def test_ragged_batch_matches_each_request_alone_and_the_dense_cache(model):
    ps = prompts()
    together = Engine(model, cache_kind="paged", cache_cfg=FP, engine_cfg=ECFG).generate(ps, 10)
    dense = Engine(model, cache_kind="dense", cache_cfg=FP, engine_cfg=ECFG).generate(ps, 10)
    assert together.tokens == dense.tokens
    for p, want in zip(ps, together.tokens):
        alone = Engine(model, cache_kind="paged", cache_cfg=FP, engine_cfg=ECFG).generate([p], 10)
        assert alone.tokens == [want]
    assert all(len(t) == 10 for t in together.tokens)


def test_low_bit_greedy_output_does_not_depend_on_the_batch(model):
    ps = prompts(1, (70, 33, 90))
    eng = Engine(model, cache_kind="paged", cache_cfg=LOW, engine_cfg=ECFG)
    together = eng.generate(ps, 8).tokens
    for p, want in zip(ps, together):
        alone = Engine(model, cache_kind="paged", cache_cfg=LOW, engine_cfg=ECFG)
        assert alone.generate([p], 8).tokens == [want]
    # More requests than rows: continuous batching reuses rows as requests finish.
    many = Engine(model, cache_kind="paged", cache_cfg=LOW, engine_cfg=ECFG)
    out = many.generate(ps + prompts(2, (20, 50, 9)), 8).tokens
    assert out[:3] == together
    assert many.peak_running == ECFG.max_seqs


def test_stream_yields_every_token_in_order_and_stops_on_stop_ids(model):
    eng = Engine(model, cache_kind="paged", cache_cfg=LOW, engine_cfg=ECFG)
    free_run = Engine(model, cache_kind="paged", cache_cfg=LOW, engine_cfg=ECFG)
    ref = free_run.generate(prompts()[1:2], 12).tokens[0]
    seen = []
    r1 = eng.submit(prompts()[1], 12, stop_ids=[ref[5]], on_token=lambda r, t: seen.append(t))
    r2 = eng.submit(prompts()[2], 6)
    streamed = {r1.id: [], r2.id: []}
    for req, tok in eng.stream():
        streamed[req.id].append(tok)
    cut = ref.index(ref[5]) + 1
    assert r1.output == ref[:cut] == streamed[r1.id] == seen
    assert r1.finish_reason == "stop" and r2.finish_reason == "length"
    assert streamed[r2.id] == r2.output and len(r2.output) == 6
    assert r1.first_token_at is not None and r1.finished_at >= r1.first_token_at


def test_sampled_output_depends_on_seed_not_on_companions(model):
    sp = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=7)
    outs = []
    for companions in ([], prompts(3, (30, 12))):
        eng = Engine(model, cache_kind="paged", cache_cfg=LOW, engine_cfg=ECFG)
        r = eng.submit(prompts()[1], 10, sampling=sp)
        for p in companions:
            eng.submit(p, 10, sampling=SamplingParams(temperature=0.7, seed=1))
        eng.run()
        outs.append(r.output)
    assert outs[0] == outs[1]
    eng = Engine(model, cache_kind="paged", cache_cfg=LOW, engine_cfg=ECFG)
    other = eng.submit(prompts()[1], 10, sampling=dataclasses.replace(sp, seed=8))
    eng.run()
    assert other.output != outs[0]


def test_prefix_sharing_gives_the_same_tokens_and_cache_as_recomputing(model):
    rng = np.random.default_rng(5)
    system = rng.integers(0, CFG.vocab_size, 48).tolist()
    a = system + rng.integers(0, CFG.vocab_size, 20).tolist()
    b = system + rng.integers(0, CFG.vocab_size, 30).tolist()
    runs = {}
    for sharing in (True, False):
        eng = Engine(
            model,
            cache_kind="paged",
            cache_cfg=LOW,
            engine_cfg=dataclasses.replace(ECFG, prefix_sharing=sharing),
        )
        ra = eng.submit(a, 6)
        eng.run()
        rb = eng.submit(b, 6)
        eng.step()  # b's first chunk from its shared 48 tokens (or from 0)
        while rb.computed < len(b):
            eng.step()
        pages = eng.manager.seqs[rb.seq]
        stored = {
            name: np.asarray(getattr(eng.cache.pools[0], name)[0][np.asarray(pages.low_pages)])
            for name in ("k_low", "v_low")
        }
        eng.run()
        runs[sharing] = (ra.output, rb.output, stored, eng.stats["prefix_tokens_shared"])
    assert runs[True][3] == 48 and runs[False][3] == 0
    assert runs[True][:2] == runs[False][:2]
    for name in ("k_low", "v_low"):
        np.testing.assert_array_equal(runs[True][2][name], runs[False][2][name])


def test_preemption_when_the_pool_runs_dry_keeps_outputs(model):
    ps = prompts(4, (40, 44, 36, 48))
    roomy = Engine(model, cache_kind="paged", cache_cfg=FP, engine_cfg=ECFG).generate(ps, 24)
    # Room for about two of the four sequences at full length.
    tight = dataclasses.replace(FP, num_fp_pages=12, num_lowbit_pages=34)
    eng = Engine(model, cache_kind="paged", cache_cfg=tight, engine_cfg=ECFG)
    out = eng.generate(ps, 24)
    assert eng.stats["preemptions"] > 0
    assert out.tokens == roomy.tokens
    assert eng.manager.pages_in_use() == (0, 0) or eng.manager.prefixes
    while eng.manager.evict_prefix():
        pass
    assert eng.manager.pages_in_use() == (0, 0)


@pytest.mark.slow  # CI: bench_serving's smoke test checks the same ordering
def test_memory_budget_admits_more_low_bit_sequences(model):
    budget = 0.0005  # GiB
    ecfg = dataclasses.replace(ECFG, max_seqs=32, kv_memory_gb=budget, expected_seq_len=64)
    runs = {}
    for name, ccfg, kind in (("fp", FP, "paged"), ("low", LOW, "paged"), ("dense", FP, "dense")):
        eng = Engine(model, cache_kind=kind, cache_cfg=ccfg, engine_cfg=ecfg)
        assert eng.allocated_bytes() <= budget * 2**30
        for p in prompts(6, (60,) * 16):
            eng.submit(p, 4)
        eng.run()
        runs[name] = eng.peak_running
    assert runs["low"] > 2 * runs["fp"] >= 2 * runs["dense"] >= 2


def test_all_full_precision_pool_under_a_budget_runs_sequences_together(model):
    """A paged cache that never quantizes holds one low-bit page; admission must not reserve
    low-bit pages for it (it once ran one sequence at a time: the bf16_paged serving rows)."""
    allfp = CacheConfig(sink=8, keep=128, flush=8, page_size=4, quant=None, max_seq_len=128)
    assert allfp.all_full_precision
    ecfg = dataclasses.replace(ECFG, max_seqs=8, kv_memory_gb=0.0005, expected_seq_len=64)
    eng = Engine(model, cache_kind="paged", cache_cfg=allfp, engine_cfg=ecfg)
    assert eng.cache.num_lowbit_pages == 1
    for p in prompts(6, (40,) * 6):
        eng.submit(p, 8)
    eng.run()
    assert eng.peak_running >= 4


def test_pools_sized_without_a_budget_run_every_slot_together(model):
    """Without a memory budget the pools let all max_seqs sequences reach max_seq_len at
    once, the decode window's reserve included (pools of exactly max_seq_len per slot once
    admitted one row fewer: bench_engine's Mosaic-cache rows ran twice the windows)."""
    cc = CacheConfig(sink=8, keep=8, flush=16, page_size=4, lowbit_page_size=16,
                     quant=QuantConfig(bits=2), max_seq_len=64)  # fmt: skip
    eng = Engine(model, cache_kind="paged", cache_cfg=cc, engine_cfg=ECFG)
    for p in prompts(8, (56,) * ECFG.max_seqs):
        eng.submit(p, 8)
    eng.run()
    assert eng.peak_running == ECFG.max_seqs


def test_packed_flush_rows_give_the_tokens_and_cache_of_every_row(model):
    """Decode windows whose flushing rows are packed into one row where one flushes
    (flush_rows=1) write the same pools and draw the same tokens as windows carrying every
    row's slots (flush_rows=max_seqs): each token is quantized by the same ops either way."""
    ps = prompts(9, (37, 38, 39, 44))
    runs = []
    for rows in (1, ECFG.max_seqs):
        eng = Engine(model, cache_kind="paged", engine_cfg=ECFG,
                     cache_cfg=dataclasses.replace(LOW, flush_rows=rows))  # fmt: skip
        runs.append((eng.generate(ps, 24).tokens, eng.cache.pools))
    (t1, p1), (tb, pb) = runs
    assert t1 == tb
    for x, y in zip(jax.tree.leaves(p1), jax.tree.leaves(pb)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("value_layout", ["tokens", "dims"])
def test_a_flushing_decode_window_compiles_without_copies_of_the_pools(model, value_layout):
    """XLA copies a whole pool where a step reads it out of order with its update, or where
    control flow around the flush does not alias its branches (a 3-way switch did: 6 pool
    copies per layer per step). The compiled decode window of a flushing batch holds none."""
    import re

    from kvjax.serving import engine as engine_mod

    cc = dataclasses.replace(LOW, value_layout=value_layout)
    eng = Engine(model, cache_kind="paged", cache_cfg=cc, engine_cfg=ECFG)
    captured, real = [], engine_mod._decode_window_call

    def spy(*args):
        if (args[4]["plan"]["flush_dst"] < eng.cache.num_lowbit_pages * cc.low_page).any():
            captured.append(args)  # a window in which some row flushes
        return real(*args)

    engine_mod._decode_window_call = spy
    try:
        eng.generate(prompts(10, (30, 35, 40, 45)), 12)
    finally:
        engine_mod._decode_window_call = real
    assert captured
    txt = real.lower(*captured[0]).compile().as_text()
    pools = {tuple(x.shape) for x in jax.tree.leaves(eng.cache.pools)}
    copies = [
        line.strip()[:120]
        for line in txt.splitlines()
        if (m := re.search(r"= \S+\[([^\]]*)\]\S* copy(-start)?\(", line))
        and tuple(int(d) for d in m.group(1).split(",") if d) in pools
    ]
    assert not copies, copies


def test_submit_refuses_bad_requests_before_running(model):
    eng = Engine(model, cache_kind="paged", cache_cfg=LOW, engine_cfg=ECFG)
    with pytest.raises(ValueError, match="empty prompt"):
        eng.submit([], 4)
    with pytest.raises(ValueError, match="token id 61 outside"):
        eng.submit([1, 61], 4)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        eng.submit([1, 2], 0)
    with pytest.raises(ValueError, match="exceeds max_seq_len=128"):
        eng.submit([1] * 100, 40)
    with pytest.raises(ValueError, match="text prompt needs"):
        eng.submit("hello", 4)
    small = dataclasses.replace(LOW, num_fp_pages=40, num_lowbit_pages=3)
    with pytest.raises(ValueError, match="needs .* low-bit pages; the pools hold 40 and 3"):
        Engine(model, cache_kind="paged", cache_cfg=small, engine_cfg=ECFG).submit([1] * 60, 4)
    with pytest.raises(ValueError, match="top_p=0"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="prefill_tokens_per_step=40 must be a multiple"):
        EngineConfig(prefill_chunk=16, prefill_tokens_per_step=40)
    assert not eng.has_work


@pytest.mark.slow  # CI: the state machine cancels and preempts at random
def test_cancel_and_preempt_free_pages(model):
    eng = Engine(
        model,
        cache_kind="paged",
        cache_cfg=LOW,
        engine_cfg=dataclasses.replace(ECFG, prefix_sharing=False),
    )
    r1, r2 = eng.submit(prompts()[2], 20), eng.submit(prompts()[1], 20)
    eng.step()
    eng.preempt(r2)
    assert r2.status == "waiting" and r2.seq is None
    eng.cancel(r1)
    assert r1.finish_reason == "cancelled"
    eng.run()
    assert len(r2.output) == 20 and r2.preemptions == 1
    assert eng.manager.pages_in_use() == (0, 0)


def test_all_full_precision_pages_through_the_bf16_kernel_match_the_reference():
    """quant=None with the recent window covering max_seq_len: decode reads every token through
    the BF16 paged kernel (interpret mode here), the transforms applied around it."""
    cfg = dataclasses.replace(CFG, head_dim=64, num_heads=4, num_kv_heads=2)
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    base = CacheConfig(sink=16, keep=128, flush=16, page_size=16, quant=None, max_seq_len=128)
    assert base.all_full_precision
    ecfg = dataclasses.replace(ECFG, prefill_chunk=32, prefill_tokens_per_step=64)
    ps = prompts(7, (40, 70))
    outs = [
        Engine(model, cache_kind="paged", cache_cfg=dataclasses.replace(base, attention=a),
               engine_cfg=ecfg).generate(ps, 6).tokens
        for a in ("reference", "pallas")
    ]  # fmt: skip
    assert outs[0] == outs[1]
