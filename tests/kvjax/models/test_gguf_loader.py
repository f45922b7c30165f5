"""Tests for kvjax.models.gguf_loader: synthetic GGUFs written with gguf.GGUFWriter, then the real
SmolLM2 file checked against HuggingFace transformers."""

from __future__ import annotations

import dataclasses
import pathlib

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from tokenizers import pre_tokenizers

from kvjax import assets
from kvjax.config import ModelConfig, UnsupportedModelError
from kvjax.models import gguf_loader

TINY = ModelConfig(
    model_type="llama",
    vocab_size=259,  # 1 control token + 256 byte symbols + 2 merges, see _tiny_vocab
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,  # num_heads * head_dim != hidden_size: catches transposed shapes
    rope_theta=50000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=0,
)


def _tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    byte_syms = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = ["<|endoftext|>", *byte_syms, "he", "Ġt"]
    types = [3] + [1] * (len(tokens) - 1)
    return tokens, types, ["h e", "Ġ t"]


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to HF q/k rows: halves -> interleaved pairs."""
    hd = w.shape[0] // n_head
    return w.reshape(n_head, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    shapes = gguf_loader._expected_shapes(cfg)
    names = gguf_loader.gguf_to_hf_names(cfg).values()
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(shapes[n]).astype(np.float32) for n in names}


def _add_shape_keys(w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
    """The architecture-generic shape keys every test GGUF carries."""
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)


def _write_gguf(
    path: pathlib.Path,
    cfg: ModelConfig,
    weights: dict[str, np.ndarray],
    *,
    arch: str = "llama",
    drop: tuple[str, ...] = (),
    extra: dict[str, np.ndarray] | None = None,
    quant: dict[str, QT] | None = None,
) -> None:
    """Writes `weights` (HF layout) as a llama.cpp-style GGUF."""
    w = gguf.GGUFWriter(path, arch)
    _add_shape_keys(w, cfg)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    tokens, types, merges = _tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    quant = quant or {}
    to_gguf = {h: g for g, h in gguf_loader.gguf_to_hf_names(cfg).items()}
    for hname, x in weights.items():
        gname = to_gguf[hname]
        if gname in drop:
            continue
        if ".attn_q." in gname:
            x = _llama_cpp_permute(x, cfg.num_heads)
        elif ".attn_k." in gname:
            x = _llama_cpp_permute(x, cfg.num_kv_heads)
        if gname in quant:
            w.add_tensor(gname, gguf.quants.quantize(x, quant[gname]), raw_dtype=quant[gname])
        else:
            w.add_tensor(gname, np.ascontiguousarray(x))
    for gname, x in (extra or {}).items():
        w.add_tensor(gname, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# --- synthetic files ---------------------------------------------------------------------------


def test_roundtrip_f32_is_exact_and_unpermuted(tmp_path):
    weights = _hf_weights(TINY)
    _write_gguf(tmp_path / "m.gguf", TINY, weights)
    cfg, loaded, tok = gguf_loader.load_gguf(tmp_path / "m.gguf")
    assert cfg == TINY
    assert loaded.keys() == weights.keys()
    for name, x in weights.items():
        assert loaded[name].dtype == np.float32, name
        np.testing.assert_array_equal(loaded[name], x, err_msg=name)
    assert tok.vocab_size == TINY.vocab_size
    assert tok.encode("the") == [tok.token_to_id("t"), tok.token_to_id("he")]


def test_quantized_tensors_dequantize_like_gguf(tmp_path):
    weights = _hf_weights(TINY, seed=1)
    quant = {
        "token_embd.weight": QT.Q8_0,
        "blk.0.attn_q.weight": QT.Q4_1,
        "blk.1.attn_k.weight": QT.Q8_0,
        "blk.1.ffn_down.weight": QT.Q4_1,
    }
    _write_gguf(tmp_path / "m.gguf", TINY, weights, quant=quant)
    _, loaded, _ = gguf_loader.load_gguf(tmp_path / "m.gguf")
    for gname, qt in quant.items():
        hname = gguf_loader.gguf_to_hf_names(TINY)[gname]
        x = weights[hname]
        n_head = {"attn_q": TINY.num_heads, "attn_k": TINY.num_kv_heads}.get(gname.split(".")[-2])
        stored = _llama_cpp_permute(x, n_head) if n_head else x
        want = gguf.quants.dequantize(gguf.quants.quantize(stored, qt), qt)
        want = gguf_loader.unpermute_qk(want, n_head) if n_head else want
        np.testing.assert_array_equal(loaded[hname], want, err_msg=gname)
        # and the quantization error itself stays at the format's scale
        assert np.abs(loaded[hname] - x).max() < 0.5 * np.abs(x).max(), gname


def test_tied_embeddings_have_no_lm_head(tmp_path):
    cfg = dataclasses.replace(TINY, tie_word_embeddings=True)
    weights = _hf_weights(cfg)
    assert "lm_head.weight" not in weights
    _write_gguf(tmp_path / "m.gguf", cfg, weights)
    got_cfg, loaded, _ = gguf_loader.load_gguf(tmp_path / "m.gguf")
    assert got_cfg.tie_word_embeddings
    assert "lm_head.weight" not in loaded


def test_attention_bias_is_loaded_and_unpermuted(tmp_path):
    cfg = dataclasses.replace(TINY, attention_bias=True)
    weights = _hf_weights(cfg, seed=2)
    assert "model.layers.1.self_attn.q_proj.bias" in weights
    _write_gguf(tmp_path / "m.gguf", cfg, weights)
    got_cfg, loaded, _ = gguf_loader.load_gguf(tmp_path / "m.gguf")
    assert got_cfg.attention_bias
    for name in ("q_proj", "k_proj", "v_proj"):
        key = f"model.layers.1.self_attn.{name}.bias"
        np.testing.assert_array_equal(loaded[key], weights[key])


def test_wrong_architecture_raises(tmp_path):
    _write_gguf(tmp_path / "g.gguf", TINY, _hf_weights(TINY), arch="falcon")
    with pytest.raises(UnsupportedModelError, match=r"falcon.*llama, gemma3"):
        gguf_loader.load_gguf(tmp_path / "g.gguf")


# --- synthetic Gemma 3 --------------------------------------------------------------------------

GEMMA = ModelConfig(
    model_type="gemma3_text",
    vocab_size=270,  # see _spm_vocab
    hidden_size=32,
    intermediate_size=64,
    num_layers=6,  # layers 0-4 sliding, 5 global (the default pattern)
    num_heads=4,
    num_kv_heads=1,
    head_dim=16,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    max_position_embeddings=128,
    tie_word_embeddings=True,
    qk_norm=True,
    bos_token_id=2,
    eos_token_id=1,
    sandwich_norms=True,
    hidden_act="gelu_pytorch_tanh",
    norm_style="gemma",
    scale_embeddings=True,
    query_pre_attn_scalar=16.0,
    layer_types=("sliding_attention",) * 5 + ("full_attention",),
    sliding_window=8,
    rope_local_theta=1e4,
)


def _spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece vocabulary laid out like Gemma's: specials, user-defined pieces (a
    newline run, a run of spaces stored as real spaces), 256 byte pieces, then normal pieces
    ranked best first."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "\n\n", "  "]
    types = [3, 3, 3, 3, 4, 4]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    normal = ["▁", "t", "h", "e", "he", "▁t", "▁the", "▁▁▁"]
    tokens += normal
    types += [1] * len(normal)
    scores = [-1000.0] * 6 + [0.0] * 256 + [-float(i) for i in range(len(normal))]
    return tokens, scores, types


def _write_gemma_gguf(path: pathlib.Path, cfg: ModelConfig, weights: dict[str, np.ndarray]):
    """Writes HF-layout Gemma weights as llama.cpp does: norms stored as 1 + w, rows unpermuted."""
    w = gguf.GGUFWriter(path, "gemma3")
    _add_shape_keys(w, cfg)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_sliding_window(cfg.sliding_window)
    tokens, scores, types = _spm_vocab()
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    to_gguf = {h: g for g, h in gguf_loader.gguf_to_hf_names(cfg).items()}
    for hname, x in weights.items():
        if hname.endswith("norm.weight"):
            x = x + 1.0
        w.add_tensor(to_gguf[hname], np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gemma3_roundtrip_config_norms_rows_and_tokenizer(tmp_path):
    weights = _hf_weights(GEMMA, seed=3)
    assert "model.layers.0.pre_feedforward_layernorm.weight" in weights
    assert "lm_head.weight" not in weights
    _write_gemma_gguf(tmp_path / "g.gguf", GEMMA, weights)
    cfg, loaded, tok = gguf_loader.load_gguf(tmp_path / "g.gguf")
    assert cfg == GEMMA
    assert loaded.keys() == weights.keys()
    for name, x in weights.items():  # norms back to HF's w; q/k rows untouched
        np.testing.assert_allclose(loaded[name], x, atol=1e-6, rtol=0, err_msg=name)
    # SentencePiece: spaces become "▁", pieces merge best first, BOS by default, bytes fall back.
    ids = tok.encode("the the")
    assert ids == [2, tok.token_to_id("t"), tok.token_to_id("he"), tok.token_to_id("▁the")]
    assert tok.encode("the", add_bos=False) == ids[1:3]
    # a run of spaces is one piece; "x" is no piece: its byte; "\n\n" is matched whole
    got = tok.encode("   x\n\n", add_bos=False)
    assert got == [tok.token_to_id("▁▁▁"), 6 + ord("x"), 4]
    assert tok.decode(got) == "   x\n\n"
    assert tok.decode(ids, skip_special_tokens=True) == "the the"


def test_gemma3_layer_pattern_key_is_honoured(tmp_path):
    meta = gguf_loader.read_metadata(_gemma_file(tmp_path))
    names = frozenset(gguf_loader.gguf_to_hf_names(GEMMA))
    meta["gemma3.attention.sliding_window_pattern"] = 2
    assert (
        gguf_loader.config_from_gguf_metadata(meta, names).layer_types
        == (
            "sliding_attention",
            "full_attention",
        )
        * 3
    )
    meta["gemma3.attention.sliding_window_pattern"] = [True, False, False, True, True, True]
    cfg = gguf_loader.config_from_gguf_metadata(meta, names)
    assert [w is None for w in cfg.layer_windows] == [False, True, True, False, False, False]
    meta["gemma3.attention.sliding_window_pattern"] = [True]
    with pytest.raises(ValueError, match="1 flags for 6 layers"):
        gguf_loader.config_from_gguf_metadata(meta, names)
    del meta["gemma3.attention.sliding_window"]
    del meta["gemma3.attention.sliding_window_pattern"]
    with pytest.raises(ValueError, match="lacks gemma3.attention.sliding_window"):
        gguf_loader.config_from_gguf_metadata(meta, names)


def _gemma_file(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "g.gguf"
    if not path.exists():
        _write_gemma_gguf(path, GEMMA, _hf_weights(GEMMA, seed=4))
    return path


def test_missing_tensors_are_listed(tmp_path):
    drop = ("blk.1.ffn_up.weight", "output_norm.weight")
    _write_gguf(tmp_path / "m.gguf", TINY, _hf_weights(TINY), drop=drop)
    with pytest.raises(ValueError, match="lacks tensors") as e:
        gguf_loader.load_gguf(tmp_path / "m.gguf")
    for name in drop:
        assert name in str(e.value)


def test_unknown_tensor_and_scaled_rope_are_rejected(tmp_path):
    extra = {"rope_freqs.weight": np.ones(TINY.head_dim // 2, np.float32)}
    _write_gguf(tmp_path / "r.gguf", TINY, _hf_weights(TINY), extra=extra)
    with pytest.raises(UnsupportedModelError, match="RoPE"):
        gguf_loader.load_gguf(tmp_path / "r.gguf")
    extra = {"blk.0.attn_q_norm.weight": np.ones(TINY.head_dim, np.float32)}
    _write_gguf(tmp_path / "n.gguf", TINY, _hf_weights(TINY), extra=extra)
    with pytest.raises(UnsupportedModelError, match="attn_q_norm"):
        gguf_loader.load_gguf(tmp_path / "n.gguf")


def test_bad_paths_raise_value_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        gguf_loader.load_gguf(tmp_path / "nope.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="junk.gguf"):
        gguf_loader.load_gguf(tmp_path / "junk.gguf")


# --- the RoPE layout -------------------------------------------------------------------------


@pytest.mark.parametrize(("n_head", "hd", "cols"), [(1, 2, 3), (3, 8, 5), (4, 64, 1)])
def test_unpermute_inverts_llama_cpp_permute(n_head, hd, cols):
    w = np.random.default_rng(0).standard_normal((n_head * hd, cols))
    p = _llama_cpp_permute(w, n_head)
    assert not np.array_equal(p, w) or hd == 2
    np.testing.assert_array_equal(gguf_loader.unpermute_qk(p, n_head), w)
    np.testing.assert_array_equal(gguf_loader.unpermute_qk(p[:, 0], n_head), w[:, 0])


def test_unpermute_rejects_bad_head_split():
    with pytest.raises(ValueError, match="n_head=4"):
        gguf_loader.unpermute_qk(np.zeros((10, 3)), 4)


def _rope_rotate_half(x: np.ndarray, pos: int, theta: float) -> np.ndarray:
    half = x.shape[-1] // 2
    ang = pos * theta ** (-np.arange(half) / half)
    c, s = np.cos(ang), np.sin(ang)
    a, b = x[:half], x[half:]
    return np.concatenate([a * c - b * s, b * c + a * s])


def _rope_interleaved(x: np.ndarray, pos: int, theta: float) -> np.ndarray:
    half = x.shape[-1] // 2
    ang = pos * theta ** (-np.arange(half) / half)
    c, s = np.cos(ang), np.sin(ang)
    a, b = x[0::2], x[1::2]
    out = np.empty_like(x)
    out[0::2], out[1::2] = a * c - b * s, b * c + a * s
    return out


def test_unpermuted_rows_make_rotate_half_rope_match_llama_cpp_rope():
    """Attention logits are the same whether llama.cpp's interleaved RoPE runs on its stored
    rows or HF rotate-half RoPE runs on the un-permuted rows: the point of un-permuting."""
    rng = np.random.default_rng(3)
    hd, d = 16, 24
    wq_gguf, wk_gguf = rng.standard_normal((hd, d)), rng.standard_normal((hd, d))
    x_q, x_k = rng.standard_normal(d), rng.standard_normal(d)
    wq, wk = gguf_loader.unpermute_qk(wq_gguf, 1), gguf_loader.unpermute_qk(wk_gguf, 1)
    for m, n in [(0, 0), (5, 2), (100, 37)]:
        ref = _rope_interleaved(wq_gguf @ x_q, m, 1e4) @ _rope_interleaved(wk_gguf @ x_k, n, 1e4)
        got = _rope_rotate_half(wq @ x_q, m, 1e4) @ _rope_rotate_half(wk @ x_k, n, 1e4)
        np.testing.assert_allclose(got, ref, rtol=1e-10)


# --- the real SmolLM2 file ----------------------------------------------------------------------


@pytest.fixture(scope="session")
def model_path() -> pathlib.Path:
    return assets.default_model_path()  # shared cache: downloaded once, then offline


@pytest.fixture(scope="module")
def real(model_path):
    return gguf_loader.load_gguf(model_path)


def test_real_config_matches_transformers(model_path, real):
    transformers = pytest.importorskip("transformers")
    cfg, weights, tok = real
    ref = transformers.AutoConfig.from_pretrained(str(model_path.parent), gguf_file=model_path.name)
    rope_theta = getattr(ref, "rope_theta", None) or ref.rope_parameters["rope_theta"]
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (
        ref.vocab_size,
        ref.hidden_size,
        ref.intermediate_size,
    )
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        ref.num_hidden_layers,
        ref.num_attention_heads,
        ref.num_key_value_heads,
        ref.head_dim,
    )
    assert cfg.rope_theta == rope_theta
    assert cfg.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    assert cfg.max_position_embeddings == ref.max_position_embeddings
    assert cfg.tie_word_embeddings == ref.tie_word_embeddings
    assert (cfg.bos_token_id, cfg.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    assert (tok.bos_id, tok.eos_ids) == (cfg.bos_token_id, cfg.eos_token_ids)
    assert weights["model.embed_tokens.weight"].shape == (cfg.vocab_size, cfg.hidden_size)
    assert all(w.dtype == np.float32 for w in weights.values())


def test_real_model_says_paris(real):
    """End to end through HF's reference Llama: names, layouts, un-permuted q/k, tokenizer."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg, weights, tok = real
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
    # Built on the meta device and given our arrays: skips 135M random inits (~10 s on CPU).
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf_cfg).eval()
    state = {k: torch.from_numpy(v) for k, v in weights.items()}
    state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    model.load_state_dict(state, strict=True, assign=True)
    model.model.rotary_emb = LlamaRotaryEmbedding(config=hf_cfg)  # its buffers were on meta
    ids = tok.encode("The capital of France is")
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    assert tok.decode([int(logits.argmax())]) == " Paris"


@pytest.mark.slow
def test_real_weights_equal_transformers_gguf_conversion(model_path, real):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    _, weights, _ = real
    ref_cfg = transformers.AutoConfig.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name
    )
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(ref_cfg)
    ref = load_gguf_checkpoint(str(model_path), return_tensors=True, model_to_load=skeleton)
    ref = ref["tensors"]
    assert set(ref) == set(weights)
    for name, x in weights.items():
        np.testing.assert_array_equal(np.asarray(ref[name], dtype=np.float32), x, err_msg=name)
