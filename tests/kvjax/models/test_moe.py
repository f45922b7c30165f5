"""kvjax.models.moe: routers vs the HF PyTorch routers, routed implementations vs the dense twin."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.config import MoEConfig
from kvjax.models.moe import MOE_IMPLS, route, routed_experts, routed_experts_dense, tile_plan

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

GLM_MOE = MoEConfig(
    num_experts=12,
    num_experts_per_tok=3,
    intermediate_size=8,
    sparse_layers=(0,),
    scoring="sigmoid",
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    n_group=4,
    topk_group=2,
    num_shared_experts=1,
    score_correction_bias=True,
)


def _hf_glm_router(moe: MoEConfig, hidden: int, seed: int):
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    cfg = transformers.Glm4MoeConfig(
        hidden_size=hidden,
        n_routed_experts=moe.num_experts,
        num_experts_per_tok=moe.num_experts_per_tok,
        n_group=moe.n_group,
        topk_group=moe.topk_group,
        norm_topk_prob=moe.norm_topk_prob,
        routed_scaling_factor=moe.routed_scaling_factor,
        pad_token_id=0,
    )
    router = Glm4MoeTopkRouter(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.copy_(0.3 * torch.randn(moe.num_experts, generator=g))
    return router


def _as_dense(weights, idx, num_experts):
    """[N, k] (weights, indices) -> [N, E] with zeros off the chosen experts."""
    out = np.zeros((weights.shape[0], num_experts))
    np.put_along_axis(out, np.asarray(idx), np.asarray(weights), axis=1)
    return out


@pytest.mark.parametrize(
    "changes",
    [
        {},
        dict(n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0),
        dict(n_group=3, topk_group=3, num_experts_per_tok=5),
    ],
    ids=["grouped", "ungrouped_unnormalised", "all_groups"],
)
def test_sigmoid_router_matches_glm4_moe(changes):
    moe = dataclasses.replace(GLM_MOE, **changes)
    router = _hf_glm_router(moe, hidden=16, seed=1)
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, ref_w, ref_idx = router(x)
    w, idx = route(
        jnp.asarray(logits.numpy()), moe, jnp.asarray(router.e_score_correction_bias.numpy())
    )
    # Selection sets and weights must agree; the order inside the k is arbitrary.
    got = _as_dense(w, idx, moe.num_experts)
    ref = _as_dense(ref_w.numpy(), ref_idx.numpy(), moe.num_experts)
    np.testing.assert_array_equal(got != 0, ref != 0)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)


def test_group_limit_restricts_choice():
    """With topk_group=1 every token's experts come from one group of num_experts/n_group."""
    moe = dataclasses.replace(GLM_MOE, topk_group=1, num_experts_per_tok=2)
    logits = jax.random.normal(jax.random.key(0), (64, moe.num_experts))
    _, idx = route(logits, moe, jnp.zeros((moe.num_experts,)))
    groups = np.asarray(idx) // (moe.num_experts // moe.n_group)
    assert (groups == groups[:, :1]).all()


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_router_matches_qwen3_moe(norm):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = transformers.Qwen3MoeConfig(
        hidden_size=16, num_experts=10, num_experts_per_tok=4, norm_topk_prob=norm, pad_token_id=0
    )
    router = Qwen3MoeTopKRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape))
    x = torch.randn(33, 16)
    with torch.no_grad():
        logits, ref_w, ref_idx = router(x)
    moe = MoEConfig(
        num_experts=10,
        num_experts_per_tok=4,
        intermediate_size=8,
        sparse_layers=(0,),
        norm_topk_prob=norm,
    )
    w, idx = route(jnp.asarray(logits.numpy()), moe)
    np.testing.assert_array_equal(np.asarray(idx), ref_idx.numpy())  # both sorted by score
    np.testing.assert_allclose(np.asarray(w), ref_w.numpy(), rtol=1e-6)


def test_route_rejects_bad_input():
    with pytest.raises(ValueError, match="logits.shape"):
        route(jnp.zeros((4, 5)), GLM_MOE, jnp.zeros((12,)))
    with pytest.raises(ValueError, match="correction_bias"):
        route(jnp.zeros((4, 12)), GLM_MOE)
    with pytest.raises(ValueError, match="correction_bias.shape"):
        route(jnp.zeros((4, 12)), GLM_MOE, jnp.zeros((11,)))


def _experts(key, e, d, i):
    k1, k2, k3 = jax.random.split(key, 3)
    return (
        jax.random.normal(k1, (e, d, i)) / np.sqrt(d),
        jax.random.normal(k2, (e, d, i)) / np.sqrt(d),
        jax.random.normal(k3, (e, i, d)) / np.sqrt(i),
    )


@pytest.mark.parametrize(
    "n,e,k,skew",
    [(37, 8, 3, False), (1, 64, 4, False), (50, 6, 2, True), (200, 5, 5, False)],
    ids=["uneven", "one_token_many_experts", "all_on_two_experts", "every_expert_chosen"],
)
@pytest.mark.parametrize("impl", [i for i in MOE_IMPLS if i != "dense"])
def test_routed_impls_equal_dense_twin(impl, n, e, k, skew):
    key = jax.random.key(n * 131 + e)
    kx, kw, ki, kp = jax.random.split(key, 4)
    x = jax.random.normal(kx, (n, 24))
    wg, wu, wd = _experts(kp, e, 24, 16)
    if skew:  # every token on experts 1 and 4: most experts idle, two overfull
        idx = jnp.tile(jnp.array([[4, 1]], jnp.int32), (n, 1))
    else:
        idx = jnp.argsort(jax.random.uniform(ki, (n, e)), axis=1)[:, :k].astype(jnp.int32)
    w = jax.random.uniform(kw, idx.shape)
    want = routed_experts_dense(x, idx, w, wg, wu, wd)
    got = jax.jit(lambda *a: routed_experts(*a, impl=impl))(x, idx, w, wg, wu, wd)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_dense_twin_matches_per_token_loop():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 8))
    wg, wu, wd = (rng.standard_normal(s) / 3 for s in [(4, 8, 6), (4, 8, 6), (4, 6, 8)])
    idx = np.array([[0, 2], [1, 3], [2, 2], [3, 0], [1, 1]])
    w = np.array([[0.5, 0.25], [1.0, 2.0], [0.1, 0.2], [0.3, 0.7], [1.0, 0.5]])
    want = np.zeros((5, 8))
    for t in range(5):
        for j in range(2):
            e = idx[t, j]
            g = x[t] @ wg[e]
            want[t] += w[t, j] * ((g / (1 + np.exp(-g)) * (x[t] @ wu[e])) @ wd[e])
    f32 = [jnp.asarray(a, jnp.float32) for a in (x, w, wg, wu, wd)]
    got = routed_experts_dense(f32[0], jnp.asarray(idx, jnp.int32), *f32[1:])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [1, 7, 64, 1000, 16384])
@pytest.mark.parametrize("e", [1, 8, 160, 512])
def test_tile_plan_work_does_not_grow_with_experts(m, e):
    b, tiles = tile_plan(m, e, 64)
    assert 1 <= b <= 64
    assert b * tiles <= 2 * m  # rows computed: at most twice the assignments, for any E
    # The static tile count covers the worst placement: every used expert's run padded.
    used = min(e, m)
    assert tiles * b >= m and tiles >= -(-(m - used + 1) // b) + used - 1


def test_routed_experts_rejects_bad_shapes():
    x = jnp.zeros((4, 8))
    wg, wu, wd = _experts(jax.random.key(0), 3, 8, 5)
    idx, w = jnp.zeros((4, 2), jnp.int32), jnp.zeros((4, 2))
    with pytest.raises(ValueError, match="w_down.shape"):
        routed_experts(x, idx, w, wg, wu, wd[:, :, :4])
    with pytest.raises(ValueError, match="idx.shape"):
        routed_experts(x, idx[:3], w[:3], wg, wu, wd)
    with pytest.raises(ValueError, match="impl='gather'"):
        routed_experts(x, idx, w, wg, wu, wd, impl="gather")
    with pytest.raises(ValueError, match="num_rows=0"):
        tile_plan(0, 4, 64)
