"""Per-row sampling: filters keep what they promise, greedy rows stay argmax, draws depend on
the row's key and token index only."""

import jax.numpy as jnp
import numpy as np

from kvjax.serving.sampling import base_key, filter_logits, sample_rows


def test_filters_keep_the_top_k_and_the_smallest_top_p_prefix():
    logits = jnp.log(jnp.asarray([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3, jnp.float32))
    out = np.asarray(filter_logits(logits, jnp.asarray([2, 0, 0]), jnp.asarray([1.0, 0.6, 0.7])))
    kept = np.isfinite(out)
    assert kept[0].tolist() == [True, True, False, False, False]  # top-2
    assert kept[1].tolist() == [True, True, False, False, False]  # 0.5 + 0.2 reaches 0.6
    assert kept[2].tolist() == [True, True, False, False, False]  # 0.7 reached with two
    np.testing.assert_array_equal(out[kept], np.asarray(logits)[kept])


def test_greedy_rows_are_argmax_and_draws_are_keyed_by_index():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, 50)), jnp.float32)
    keys = jnp.asarray(np.stack([base_key(s) for s in (1, 1, 2, 3)]))
    temp = jnp.asarray([0.0, 1.0, 1.0, 1.0])
    top_k = jnp.asarray([0, 1, 0, 5], jnp.int32)
    top_p = jnp.ones((4,))
    idx = jnp.asarray([7, 7, 7, 7], jnp.int32)
    a = np.asarray(sample_rows(logits, keys, idx, temp, top_k, top_p))
    assert a[0] == int(jnp.argmax(logits[0]))
    assert a[1] == int(jnp.argmax(logits[1]))  # top_k = 1 is greedy whatever the temperature
    assert a[3] in np.argsort(-np.asarray(logits[3]))[:5]
    b = np.asarray(sample_rows(logits, keys, idx, temp, top_k, top_p))
    np.testing.assert_array_equal(a, b)  # same keys and indices: same draws
    # A row's draw does not depend on the other rows.
    solo = sample_rows(logits[2:3], keys[2:3], idx[2:3], temp[2:3], top_k[2:3], top_p[2:3])
    assert int(solo[0]) == a[2]
    many = sample_rows(
        jnp.repeat(logits[2:3], 16, 0), jnp.repeat(keys[2:3], 16, 0), jnp.arange(16),
        jnp.ones((16,)), jnp.zeros((16,), jnp.int32), jnp.ones((16,)),
    )  # fmt: skip
    assert len(set(np.asarray(many).tolist())) > 1  # the index moves the key
