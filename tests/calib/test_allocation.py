"""The bit allocator: exact against brute force, budgets respected, bad budgets refused."""

import itertools

import numpy as np
import pytest

from calib import allocation
from kvjax.cache.budget import Format


@pytest.mark.parametrize("seed", range(5))
def test_allocate_core_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    e = rng.uniform(0, 1, (4, 3))
    c = rng.integers(1, 6, (4, 3))
    cap = int(c.min(axis=1).sum() + rng.integers(0, 8))
    best = min(
        (sum(e[s, f] for s, f in enumerate(p)), p)
        for p in itertools.product(range(3), repeat=4)
        if sum(c[s, f] for s, f in enumerate(p)) <= cap
    )
    pick = allocation.allocate_core(e, c, cap)
    assert sum(c[s, f] for s, f in enumerate(pick)) <= cap
    assert sum(e[s, f] for s, f in enumerate(pick)) == pytest.approx(best[0])


def test_allocate_spends_the_budget_where_the_error_is():
    # 4 layers; layer 2's keys are 10x worse at 2 bits than anything else
    names = ["2b/float16", "2b/uint8", "4b/uint8"]
    base = np.full((4, 2), 1.0)
    base[2, 0] = 10.0
    errs = {"2b/float16": base * 0.99, "2b/uint8": base, "4b/uint8": base * 0.05}
    alloc = allocation.allocate(errs, 2.5, 64)
    assert alloc.bpe(64) <= 2.5 + 1e-9
    assert alloc.layers[2][0] == Format(4, "uint8")
    # 8 caches: 2.25 each leaves 8 * 0.25 = 2 bits, one upgrade (2 bits per element) fits
    assert alloc.counts() == {"2b/uint8": 7, "4b/uint8": 1}
    assert set(errs) == set(names)
    # with the windows counted at 2048 tokens the same low-bit budget is a higher total
    total = alloc.bpe(64, context=2048, sink=16, keep=128)
    again = allocation.allocate(errs, total, 64, context=2048, sink=16, keep=128)
    assert again.counts() == alloc.counts()


@pytest.mark.parametrize("budget", [2.0, -1.0, float("nan")])
def test_bad_budgets_are_refused_in_one_line(budget):
    with pytest.raises(ValueError, match=f"--bpe-budget {budget}") as e:
        allocation.check_budget(budget, [Format(2, "uint8"), Format(4)], 64)
    assert "\n" not in str(e.value)


def test_budget_below_the_windows_is_refused():
    with pytest.raises(ValueError, match="--bpe-budget 2.5: below the cheapest"):
        allocation.check_budget(2.5, [Format(2)], 64, context=2048, sink=16, keep=128)


def test_layers_without_low_bit_pages_are_outside_the_budget():
    # Gemma 3-like: layers 0-2 sliding (full precision in the cache), layer 3 global. At head_dim
    # 64, 2b/float16 is 2.5 BPE, 2b/uint8 2.25, 4b/uint8 4.25. Counted over all 8 caches, the
    # sliding caches' 2b/uint8 would leave 8 * 0.25 = 2 bits, one 4-bit upgrade of layer 3:
    # bits the global layer never had. Over its own 2 caches 2.5 BPE buys 2b/float16 only.
    base = np.full((4, 2), 1.0)
    base[3] = 10.0
    errs = {"2b/float16": base, "2b/uint8": 1.1 * base, "4b/uint8": 0.05 * base}
    everywhere = allocation.allocate(errs, 2.5, 64)
    assert Format(4, "uint8") in everywhere.layers[3]  # what the old accounting bought
    lowbit = (False, False, False, True)
    alloc = allocation.allocate(errs, 2.5, 64, lowbit=lowbit)
    assert alloc.layers[3] == (Format(2), Format(2))
    cheapest = (Format(2, "uint8"), Format(2, "uint8"))
    assert alloc.layers[:3] == (cheapest,) * 3  # unused placeholders
    part = allocation.lowbit_part(alloc, lowbit)
    assert part.layers == (alloc.layers[3],) and part.bpe(64) <= 2.5 + 1e-9
    assert part.counts() == {"2b/float16": 2}
    assert allocation.lowbit_part(alloc, None) is alloc
    with pytest.raises(ValueError, match="no layer holds low-bit pages"):
        allocation.allocate(errs, 2.5, 64, lowbit=(False,) * 4)
    with pytest.raises(ValueError, match="lowbit has 2 layers"):
        allocation.allocate(errs, 2.5, 64, lowbit=(True, True))


def test_lowbit_layers_follow_the_cache_policy():
    from kvjax.config import ModelConfig

    kw = dict(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32,
              num_layers=3, num_heads=2, num_kv_heads=1, head_dim=8)  # fmt: skip
    assert allocation.lowbit_layers(ModelConfig(**kw)) == (True, True, True)
    types = ("sliding_attention", "full_attention", "sliding_attention")
    cfg = ModelConfig(**kw, layer_types=types, sliding_window=16)
    assert allocation.lowbit_layers(cfg) == (False, True, False)
