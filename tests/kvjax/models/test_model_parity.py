"""Flax ports vs HuggingFace transformers (PyTorch, float32) at small random configs.

Each config keeps a real structural feature: GQA ratio 1/3/4, head_dim 64/128, q/k norm on/off,
q/k/v bias on/off, tied/untied embeddings. The check runs full-sequence prefill and token-by-token
decode through the dense cache.
"""

import pytest

from kvjax.models.hf_loader import load_hf_checkpoint
from kvjax.models.model import Transformer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CASES = {
    # name: (model_type, heads, kv_heads, head_dim, tied, bias)
    "llama_gqa3_hd64_tied": ("llama", 6, 2, 64, True, False),
    "llama_mha_hd64_bias": ("llama", 2, 2, 64, False, True),
    "qwen3_gqa4_hd128": ("qwen3", 4, 1, 128, False, False),
    "qwen3_gqa3_hd64_tied_bias": ("qwen3", 6, 2, 64, True, True),
    "qwen2_gqa4_hd64": ("qwen2", 8, 2, 64, False, True),
}


def make_hf_model(model_type, heads, kv_heads, head_dim, tied, bias):
    common = dict(
        vocab_size=97,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
    )
    if model_type == "llama":
        cfg = transformers.LlamaConfig(attention_bias=bias, rope_theta=10000.0, **common)
        cls = transformers.LlamaForCausalLM
    elif model_type == "qwen3":
        cfg = transformers.Qwen3Config(attention_bias=bias, rope_theta=1e6, **common)
        cls = transformers.Qwen3ForCausalLM
    else:
        cfg = transformers.Qwen2Config(rope_theta=1e6, **common)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).float().eval()
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory, parity):
    hf = make_hf_model(*CASES[request.param])
    parity.perturb(hf)
    model, cfg, _ = parity.load(hf, tmp_path_factory.mktemp(request.param))
    return hf, model, cfg


def test_prefill_logits_match(pair, parity):
    parity.check_prefill(*pair)


def test_decode_through_cache_matches(pair, parity):
    parity.check_decode(*pair)


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    import json

    from kvjax.config import UnsupportedModelError

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(UnsupportedModelError, match="model_type='gpt2' is not supported.*llama"):
        load_hf_checkpoint(tmp_path)


def test_missing_tensor_is_named(tmp_path):
    from kvjax.models.model import MissingWeightsError

    hf = make_hf_model(*CASES["llama_mha_hd64_bias"])
    hf.save_pretrained(tmp_path, safe_serialization=True)
    cfg, weights = load_hf_checkpoint(tmp_path)
    del weights["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(MissingWeightsError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        Transformer.from_weights(cfg, weights)


def test_truncated_safetensors_is_a_clear_error(tmp_path):
    from kvjax.models.hf_loader import CheckpointError

    hf = make_hf_model(*CASES["qwen2_gqa4_hd64"])
    hf.save_pretrained(tmp_path, safe_serialization=True)
    f = next(tmp_path.glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_hf_checkpoint(tmp_path)
