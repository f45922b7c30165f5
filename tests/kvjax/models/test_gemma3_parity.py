"""Gemma 3 text decoder vs HuggingFace transformers (`Gemma3ForCausalLM`, PyTorch, float32).

Small random configs keep the structure of the real models: q/k RMSNorm, the four (1 + w) norms
per layer, GeGLU, embeddings scaled by sqrt(hidden), query_pre_attn_scalar different from
head_dim (so the softmax scale is checked), 4 query heads over 1 KV head, sliding-window layers
with their own RoPE base next to global layers, tied and untied heads, final logit soft-capping.
Windows are a few tokens, so every check runs sequences longer than the window: prefill logits,
token-by-token decode through the dense cache, and chunked decode through the paged cache with
its sink / low-bit / recent segments all in play (full precision, so the logits stay exact).
"""

import json

import numpy as np
import pytest

from kvjax.cache.paged import CacheConfig
from kvjax.config import ModelConfig, UnsupportedModelError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
}

CASES = {
    # 270M-like: GQA 4:1, sliding layers around one global layer, tied embeddings.
    "gemma3_gqa4_window5_tied": dict(
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        query_pre_attn_scalar=48,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        tie_word_embeddings=True,
    ),
    # Untied head, soft-capped logits, layer types from a pattern (local, global).
    "gemma3_gqa2_window7_softcap": dict(
        num_hidden_layers=2,
        sliding_window_pattern=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=7,
        tie_word_embeddings=False,
        final_logit_softcapping=3.0,
    ),
}


def make_hf_model(**kw):
    cfg = transformers.Gemma3TextConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_parameters={k: dict(v) for k, v in ROPE.items()},
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        **kw,
    )
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(cfg).float().eval()


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory, parity):
    hf = make_hf_model(**CASES[request.param])
    parity.perturb(hf)  # Gemma norms start at 0 (scale 1): perturb them like any other
    model, cfg, _ = parity.load(hf, tmp_path_factory.mktemp(request.param))
    return hf, model, cfg


def test_config_reads_the_gemma_options(pair):
    hf, _, cfg = pair
    assert cfg.model_type == "gemma3_text"
    assert cfg.layer_types == tuple(hf.config.layer_types)
    assert cfg.sliding_window == hf.config.sliding_window
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    assert cfg.attention_scale == hf.config.query_pre_attn_scalar**-0.5
    assert cfg.final_logit_softcapping == hf.config.final_logit_softcapping
    assert "full_attention" in cfg.layer_types and "sliding_attention" in cfg.layer_types


def test_prefill_logits_match(pair, parity):
    parity.check_prefill(*pair, length=24)  # 24 tokens over windows of 5 and 7


def test_decode_through_dense_cache_matches(pair, parity):
    parity.check_decode(*pair, length=16, prefill=3)


@pytest.mark.parametrize(
    "windows",
    [
        pytest.param((4, 4, 4), id="sink4_keep4"),
        pytest.param((0, 4, 4), id="nosink_keep4", marks=pytest.mark.slow),
        pytest.param((8, 8, 4), id="sink8_keep8", marks=pytest.mark.slow),
    ],
)
def test_decode_through_paged_cache_matches(pair, parity, windows):
    sink, keep, flush = windows
    ccfg = CacheConfig(sink=sink, keep=keep, flush=flush, page_size=4, quant=None, max_seq_len=32)
    parity.check_paged_decode(*pair, ccfg, length=20, prefill=9)


def test_layer_pattern_defaults_like_transformers():
    """No layer_types in config.json: every `sliding_window_pattern`-th layer (default 6) is
    global, as `Gemma3TextConfig` derives it."""
    d = make_hf_model(**CASES["gemma3_gqa4_window5_tied"]).config.to_dict()
    d.pop("layer_types")
    d["num_hidden_layers"] = 12
    cfg = ModelConfig.from_hf_dict(d)
    assert [i for i, w in enumerate(cfg.layer_windows) if w is None] == [5, 11]
    want = transformers.Gemma3TextConfig(num_hidden_layers=12).layer_types
    assert list(cfg.layer_types) == want


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_hf_loader_reads_multimodal_gemma3_checkpoint(tmp_path, prefix):
    """A `gemma3` (image-text) checkpoint: the decoder is its text_config and its tensors under
    either spelling of the language-model prefix; the vision tower is left out."""
    from safetensors.numpy import save_file

    from kvjax.models.hf_loader import load_hf_checkpoint

    hf = make_hf_model(**CASES["gemma3_gqa4_window5_tied"])
    text = hf.config.to_dict()
    want = {k: v.numpy() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    stored = {prefix + k[len("model.") :]: v for k, v in want.items()}
    stored["model.vision_tower.patch_embedding.weight"] = np.zeros((2, 3), np.float32)
    save_file(stored, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text}))
    cfg, weights = load_hf_checkpoint(tmp_path)
    assert cfg == ModelConfig.from_hf_dict(text)
    assert weights.keys() == want.keys()
    for k, v in want.items():
        np.testing.assert_array_equal(weights[k], v)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("hidden_activation", "silu", "hidden_activation='silu'"),
        ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0"),
        ("layer_types", ["sliding_attention", "local"], r"layer_types holds \['local'\]"),
        ("sliding_window", 0, "sliding_window=0"),
        (
            "rope_parameters",
            {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}},
            "only default RoPE",
        ),
    ],
)
def test_unsupported_gemma_options_are_named(key, value, match):
    d = json.loads(make_hf_model(**CASES["gemma3_gqa4_window5_tied"]).config.to_json_string())
    d[key] = value
    if key == "layer_types":
        d["num_hidden_layers"] = 2
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_hf_dict(d)
