"""The shipped SmolLM2-135M through the Flax port: logits vs transformers on the same GGUF
weights, and greedy generation through the dense and paged caches."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import assets
from kvjax.cache.paged import CacheConfig
from kvjax.models.gguf_loader import load_gguf
from kvjax.models.loading import load_model
from kvjax.models.model import Transformer
from kvjax.serving.engine import Engine, EngineConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def real():
    return load_gguf(assets.default_model_path())


def _hf_reference(cfg, weights):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf_cfg).eval()
    state = {k: torch.from_numpy(v) for k, v in weights.items()}
    state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    model.load_state_dict(state, strict=True, assign=True)
    model.model.rotary_emb = LlamaRotaryEmbedding(config=hf_cfg)
    return model


def test_flax_logits_match_transformers(real):
    """Tolerance: max |diff| <= 1e-4 x max |logit| (float32 both sides, 40-token prompt)."""
    cfg, weights, tok = real
    ids = tok.encode(
        "Now is the winter of our discontent made glorious summer by this sun of "
        "York; and all the clouds that lour'd upon our house"
    )
    with torch.no_grad():
        ref = _hf_reference(cfg, weights)(torch.tensor([ids])).logits.numpy()
    ours, _ = Transformer.from_weights(cfg, weights)(jnp.asarray([ids], jnp.int32))
    err = np.abs(np.asarray(ours) - ref).max()
    assert err <= 1e-4 * np.abs(ref).max(), (err, np.abs(ref).max())


@pytest.mark.slow  # ~80 s on CI's CPU; the logits parity test above stays in CI
def test_greedy_paris_dense_and_paged():
    lm = load_model()
    ids = lm.tokenizer.encode("The capital of France is")
    # One row, 32 positions: the reference path reads every slot a row's table can hold.
    small = EngineConfig(max_seqs=1, prefill_chunk=16, prefill_tokens_per_step=16, decode_steps=2)
    dense = Engine(lm.model, cache_cfg=CacheConfig(max_seq_len=32), engine_cfg=small)
    dense = dense.generate([ids], max_new_tokens=2)
    assert lm.tokenizer.decode(dense.tokens[0][:1]) == " Paris"
    paged = Engine(
        lm.model,
        cache_kind="paged",
        engine_cfg=small,
        cache_cfg=CacheConfig(sink=0, keep=1, flush=16, quant=None, max_seq_len=32),
    )
    out = paged.generate([ids], max_new_tokens=2)
    assert out.tokens == dense.tokens
