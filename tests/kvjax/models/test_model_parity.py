"""Flax ports vs HuggingFace transformers (PyTorch, float32) at small random configs.

Each config keeps a real structural feature: GQA ratio 1/3/4, head_dim 64/128, q/k norm on/off,
q/k/v bias on/off, tied/untied embeddings. The check runs full-sequence prefill and token-by-token
decode through the dense cache.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache.dense import DenseKVCache
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
    # Random init leaves norms at 1 and biases at 0; perturb them so they are actually tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    spec = CASES[request.param]
    hf = make_hf_model(*spec)
    d = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(d, safe_serialization=True)
    cfg, weights = load_hf_checkpoint(d)
    model = Transformer.from_weights(cfg, weights)
    return hf, model, cfg


def _tol(ref):
    return 1e-4 * max(1.0, float(np.abs(ref).max()))


def test_prefill_logits_match(pair):
    hf, model, cfg = pair
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 24))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    out, _ = model(jnp.asarray(tokens, jnp.int32))
    np.testing.assert_allclose(np.asarray(out), ref, atol=_tol(ref), rtol=0)


def test_decode_through_cache_matches(pair):
    hf, model, cfg = pair
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, 12))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    cache = DenseKVCache.create(cfg, batch_size=2, max_len=16)
    step = jax.jit(lambda tok, c: model(tok, c))
    # A 5-token prefill chunk, then one token at a time.
    out, cache = step(jnp.asarray(tokens[:, :5], jnp.int32), cache)
    outs = [np.asarray(out)]
    for t in range(5, tokens.shape[1]):
        out, cache = step(jnp.asarray(tokens[:, t : t + 1], jnp.int32), cache)
        outs.append(np.asarray(out))
    got = np.concatenate(outs, axis=1)
    np.testing.assert_allclose(got, ref, atol=_tol(ref), rtol=0)
    assert np.asarray(cache.lengths).tolist() == [12, 12]


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
