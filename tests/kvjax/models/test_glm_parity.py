"""GLM-4 and GLM-4-MoE ports vs HuggingFace transformers (PyTorch, float32), small random configs.

Structure kept from the real models: partial RoPE on half of head_dim (interleaved in GLM-4,
rotate-half in GLM-4-MoE), q/k/v bias, GLM-4's post-attention/post-MLP norms, GQA, q/k norm on
and off, a dense first layer, several routed experts with top-k > 1 and group-limited choice,
shared experts and the routed scaling factor. Checks: full-sequence logits, token-by-token
decode through the dense cache, and the routed MoE paths against the dense all-experts twin.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax.models.model import Transformer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)

CASES = {
    "glm4_gqa2_bias": (
        "glm4",
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            attention_bias=True,
            partial_rotary_factor=0.5,
        ),
    ),
    "glm4_mha_tied_hd64": (
        "glm4",
        dict(
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=64,
            attention_bias=True,
            partial_rotary_factor=0.5,
            tie_word_embeddings=True,
        ),
    ),
    # GLM-4.5-like: q/k norm, attention bias, dense layer 0, grouped sigmoid routing.
    "glm4_moe_qknorm_grouped": (
        "glm4_moe",
        dict(
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=32,
            attention_bias=True,
            use_qk_norm=True,
            partial_rotary_factor=0.5,
            moe_intermediate_size=24,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        ),
    ),
    "glm4_moe_plain_ungrouped": (
        "glm4_moe",
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            attention_bias=False,
            use_qk_norm=False,
            partial_rotary_factor=0.5,
            moe_intermediate_size=16,
            n_routed_experts=6,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=2,
            first_k_dense_replace=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            tie_word_embeddings=True,
        ),
    ),
}


def make_hf_model(model_type, kw):
    if model_type == "glm4":
        cfg, cls = transformers.Glm4Config(**COMMON, **kw), transformers.Glm4ForCausalLM
    else:
        cfg, cls = transformers.Glm4MoeConfig(**COMMON, **kw), transformers.Glm4MoeForCausalLM
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(cfg).float().eval()
    with torch.no_grad():  # norms, biases and router logits: `parity.perturb` in `pair`
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.2 * torch.randn_like(buf))
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory, parity):
    model_type, kw = CASES[request.param]
    hf = make_hf_model(model_type, kw)
    parity.perturb(hf, router_scale=50.0)
    model, cfg, weights = parity.load(hf, tmp_path_factory.mktemp(request.param))
    assert cfg.model_type == model_type and cfg.rotary_dim == cfg.head_dim // 2
    return hf, model, cfg, weights


def test_prefill_logits_match(pair, parity):
    parity.check_prefill(*pair[:3])


def test_decode_through_cache_matches(pair, parity):
    parity.check_decode(*pair[:3])


def test_routed_paths_equal_dense_twin(pair):
    _, model, cfg, weights = pair
    if cfg.moe is None:
        pytest.skip("dense architecture")
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 16)), jnp.int32)
    got, _ = jax.jit(lambda t: model(t))(tokens)  # default: sorted tiles
    for impl in ("dense", "ragged"):
        twin = Transformer.from_weights(cfg, weights, moe_impl=impl)
        want, _ = jax.jit(lambda t, twin=twin: twin(t))(tokens)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    assert cfg.moe.sparse_layers == tuple(range(1, cfg.num_layers))  # first layer dense


def test_glm4_rope_is_interleaved_and_moe_rope_is_not(pair):
    """The two GLM generations pair RoPE channels differently; the config must say which."""
    _, _, cfg, _ = pair
    assert cfg.rope_interleaved == (cfg.model_type == "glm4")
    assert cfg.sandwich_norms == (cfg.model_type == "glm4")


def test_fused_expert_layout_loads_the_same(pair):
    """transformers' stacked `experts.gate_up_proj` [E, 2I, D] layout gives the same model."""
    _, model, cfg, weights = pair
    if cfg.moe is None:
        pytest.skip("dense architecture")
    fused = {}
    for name, w in weights.items():
        if ".experts." not in name:
            fused[name] = w
    for i in cfg.moe.sparse_layers:
        ex = f"model.layers.{i}.mlp.experts."

        def stack(proj, ex=ex):
            return np.stack([weights[f"{ex}{e}.{proj}.weight"] for e in range(cfg.moe.num_experts)])

        fused[ex + "gate_up_proj"] = np.concatenate([stack("gate_proj"), stack("up_proj")], axis=1)
        fused[ex + "down_proj"] = stack("down_proj")
    other = Transformer.from_weights(cfg, fused)
    want = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    got = dict(nnx.to_flat_state(nnx.state(other, nnx.Param)))
    assert got.keys() == want.keys()
    for path, var in want.items():
        np.testing.assert_array_equal(
            np.asarray(got[path].get_value()), np.asarray(var.get_value())
        )
