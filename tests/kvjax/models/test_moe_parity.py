"""Qwen3-MoE port vs HuggingFace transformers (PyTorch, float32), and config rejection.

Qwen3-MoE keeps: q/k norm, GQA, softmax top-k routing with and without renormalisation,
dense layers from `mlp_only_layers` and `decoder_sparse_step`, optional attention bias.
The second half checks that config values the ports do not implement are refused by name.
"""

import copy
import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.config import ModelConfig, MoEConfig, UnsupportedModelError
from kvjax.models.model import MissingWeightsError, Transformer, expected_weight_names

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

COMMON = dict(
    vocab_size=89,
    hidden_size=64,
    intermediate_size=80,
    moe_intermediate_size=24,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    rope_theta=1e6,
)

CASES = {
    # Dense layer 0 via mlp_only_layers; renormalised top-3 of 6.
    "qwen3_moe_gqa3_norm": dict(
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=6,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        mlp_only_layers=[0],
    ),
    # Every other layer sparse (layers 1 and 3), q/k/v/o bias, raw softmax weights, tied.
    "qwen3_moe_step2_bias_tied": dict(
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        num_experts=5,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        decoder_sparse_step=2,
        attention_bias=True,
        tie_word_embeddings=True,
    ),
}
SPARSE = {"qwen3_moe_gqa3_norm": (1, 2), "qwen3_moe_step2_bias_tied": (1, 3)}


def make_hf_model(kw):
    cfg = transformers.Qwen3MoeConfig(**COMMON, **kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg).float().eval()


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory, parity):
    hf = make_hf_model(CASES[request.param])
    parity.perturb(hf, router_scale=50.0)  # router logits far from top-k ties
    model, cfg, weights = parity.load(hf, tmp_path_factory.mktemp(request.param))
    assert cfg.moe.sparse_layers == SPARSE[request.param]
    return hf, model, cfg, weights


def test_prefill_logits_match(pair, parity):
    parity.check_prefill(*pair[:3])


def test_decode_through_cache_matches(pair, parity):
    parity.check_decode(*pair[:3], length=10, prefill=4)


def test_routed_path_equals_dense_twin(pair):
    _, model, cfg, weights = pair
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (3, 9)), jnp.int32)
    dense = Transformer.from_weights(cfg, weights, moe_impl="dense")
    want, _ = jax.jit(lambda t: dense(t))(tokens)
    got, _ = jax.jit(lambda t: model(t))(tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


def test_missing_expert_is_named(pair):
    _, _, cfg, weights = pair
    layer = cfg.moe.sparse_layers[0]
    name = f"model.layers.{layer}.mlp.experts.1.up_proj.weight"
    assert name in expected_weight_names(cfg)
    partial = {k: v for k, v in weights.items() if k != name}
    with pytest.raises(MissingWeightsError, match=name.replace(".", r"\.")):
        Transformer.from_weights(cfg, partial)


def test_set_moe_impl_rejects_unknown(pair):
    _, model, _, _ = pair
    with pytest.raises(ValueError, match="impl='gather'"):
        model.set_moe_impl("gather")


# ----- config rejection ---------------------------------------------------------------------

GLM4_MOE_HF = {
    "model_type": "glm4_moe",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "partial_rotary_factor": 0.5,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "use_qk_norm": True,
}
QWEN3_MOE_HF = {
    "model_type": "qwen3_moe",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}


def _with(base, **changes):
    d = copy.deepcopy(base)
    d.update(changes)
    return d


def test_glm4_moe_config_fields():
    cfg = ModelConfig.from_hf_dict(GLM4_MOE_HF)
    assert cfg.qk_norm and cfg.rotary_dim == 16 and not cfg.rope_interleaved
    assert cfg.moe == MoEConfig(
        num_experts=8,
        num_experts_per_tok=2,
        intermediate_size=16,
        sparse_layers=(1, 2),
        scoring="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        n_group=2,
        topk_group=1,
        num_shared_experts=1,
        score_correction_bias=True,
    )
    # transformers >= 5 writes the factor under rope_parameters; GLM's default is one half.
    moved = _with(GLM4_MOE_HF, rope_parameters={"rope_theta": 1e6, "partial_rotary_factor": 0.25})
    del moved["partial_rotary_factor"]
    assert ModelConfig.from_hf_dict(moved).rotary_dim == 8
    del moved["rope_parameters"]
    assert ModelConfig.from_hf_dict(moved).rotary_dim == 16
    # Round trip through the dict stored in calibration metadata.
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_fingerprint_of_older_architectures_unchanged_by_new_fields():
    llama = ModelConfig(
        model_type="llama",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
    )
    # The hash of the field set before GLM/MoE (and Gemma 3) support, so stored transforms stay
    # valid.
    d = llama.to_dict()
    gemma_fields = ("hidden_act", "norm_style", "scale_embeddings", "query_pre_attn_scalar")
    gemma_fields += ("final_logit_softcapping", "layer_types", "sliding_window", "rope_local_theta")
    for name in ("rope_interleaved", "sandwich_norms", "moe", *gemma_fields):
        del d[name]
    blob = json.dumps(d, sort_keys=True, default=str).encode()
    assert llama.fingerprint() == hashlib.sha256(blob).hexdigest()[:16]
    glm = ModelConfig.from_hf_dict(GLM4_MOE_HF)
    assert (
        glm.fingerprint() != ModelConfig.from_hf_dict(_with(GLM4_MOE_HF, n_group=1)).fingerprint()
    )


@pytest.mark.parametrize(
    "base,changes,match",
    [
        (GLM4_MOE_HF, dict(topk_method="greedy"), "topk_method='greedy'"),
        (GLM4_MOE_HF, dict(scoring_func="softmax"), "scoring_func='softmax'"),
        (GLM4_MOE_HF, dict(n_group=3), "n_group=3"),
        (GLM4_MOE_HF, dict(topk_group=3), "topk_group=3"),
        (GLM4_MOE_HF, dict(num_experts_per_tok=5), "num_experts_per_tok=5"),
        (GLM4_MOE_HF, dict(first_k_dense_replace=4), "first_k_dense_replace=4"),
        (GLM4_MOE_HF, dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
        (GLM4_MOE_HF, dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4}), "llama3"),
        (GLM4_MOE_HF, dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (QWEN3_MOE_HF, dict(scoring_func="sigmoid"), "scoring_func='sigmoid'"),
        (QWEN3_MOE_HF, dict(topk_method="group_limited_greedy"), "group_limited_greedy"),
        (QWEN3_MOE_HF, dict(use_sliding_window=True), "use_sliding_window=True"),
        (QWEN3_MOE_HF, dict(mlp_only_layers=[5]), r"mlp_only_layers=\[5\]"),
        (QWEN3_MOE_HF, dict(decoder_sparse_step=0), "decoder_sparse_step=0"),
        (QWEN3_MOE_HF, dict(num_experts_per_tok=7), "num_experts_per_tok=7"),
        (_with(QWEN3_MOE_HF, model_type="deepseek_v3"), {}, "model_type='deepseek_v3'"),
    ],
)
def test_unsupported_values_are_named(base, changes, match):
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_hf_dict(_with(base, **changes))


def test_qwen3_moe_without_sparse_layers_is_dense():
    cfg = ModelConfig.from_hf_dict(_with(QWEN3_MOE_HF, mlp_only_layers=[0, 1]))
    assert cfg.moe is None and cfg.qk_norm
