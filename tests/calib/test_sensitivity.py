"""The kl allocation objectives (`calib.sensitivity`): the single-cache simulation, KL errors,
allocations within budget, and bad input refused before the model loads."""

import types

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from calib import allocation, sensitivity
from calib import calibrate as cal
from kvjax import assets
from kvjax.cache.budget import Format
from kvjax.cache.paged import CacheConfig
from kvjax.cache.quantizers import QuantConfig
from kvjax.config import ModelConfig
from kvjax.models.loading import LoadedModel
from kvjax.models.model import Transformer

CFG = ModelConfig(
    model_type="llama",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    tie_word_embeddings=True,
)
WINDOWS = (16, 32, 16)  # sink, keep, flush of the simulated cache


class ByteTokenizer:
    vocab_size = CFG.vocab_size
    add_bos_default = False

    def encode(self, text: str) -> list[int]:
        return [b % CFG.vocab_size for b in text.encode()]


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    return LoadedModel(
        model=model, tokenizer=ByteTokenizer(), cfg=CFG, fingerprint="tiny", source="tiny"
    )


def _pairs(seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(CFG.num_layers):
        shape = (CFG.num_kv_heads, CFG.head_dim, CFG.head_dim)
        qk, _ = np.linalg.qr(rng.normal(size=shape))
        qv, _ = np.linalg.qr(rng.normal(size=shape))
        out.append(
            types.SimpleNamespace(
                A_K=qk, B_K=np.swapaxes(qk, -1, -2), A_V=qv, B_V=np.swapaxes(qv, -1, -2)
            )
        )
    return out


def _clips():
    n = CFG.num_layers
    return {b: (np.full(n, 0.95), np.full(n, 0.9)) for b in (2, 3, 4)}


def _cache(target: int, t: int, bits: int = 2):
    pairs = _pairs()
    st = lambda n: jnp.asarray(np.stack([getattr(p, n) for p in pairs]), jnp.float32)  # noqa
    ck, cv = _clips()[bits]
    sink, keep, flush = WINDOWS
    return sensitivity.SingleCacheQuant(
        st("A_K"), st("B_K"), st("A_V"), st("B_V"),
        jnp.asarray(ck, jnp.float32), jnp.asarray(cv, jnp.float32),
        jnp.asarray(target, jnp.int32), jnp.zeros((1,), jnp.int32),
        qc=QuantConfig(bits=bits),
        windows=CacheConfig(sink=sink, keep=keep, flush=flush, page_size=1, quant=None),
        sm_scale=CFG.attention_scale,
    )  # fmt: skip


def _tokens(t: int, seed: int = 1) -> jnp.ndarray:
    return jnp.asarray(np.random.default_rng(seed).integers(0, CFG.vocab_size, (1, t)), jnp.int32)


def test_no_target_is_the_plain_forward(lm):
    x = _tokens(96)
    want, _ = lm.model(x)
    got, _ = lm.model(x, _cache(-1, 96))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


@pytest.mark.parametrize("target", [0, 1, 2, 3])
def test_one_cache_changes_only_positions_that_read_low_bit_tokens(lm, target):
    x = _tokens(96)
    want, _ = lm.model(x)
    got, _ = lm.model(x, _cache(target, 96))
    sink, keep, flush = WINDOWS
    first = sink + keep + flush  # the first query whose cache holds a low-bit token
    np.testing.assert_allclose(np.asarray(got[:, :first]), np.asarray(want[:, :first]), atol=1e-5)
    assert float(jnp.max(jnp.abs(got[:, first:] - want[:, first:]))) > 1e-4


def test_kl_errors_are_per_layer_and_kv_and_fall_with_width(lm):
    w = np.asarray(np.concatenate([_tokens(97, 1), _tokens(97, 2)]))
    fmts = [Format(2, "uint8"), Format(4, "float16")]
    e = sensitivity.kl_bit_errors(lm, w, _pairs(), _clips(), fmts, WINDOWS, progress=False)
    assert set(e) == {"2b/uint8", "4b/float16"}
    assert all(v.shape == (2, 2) and np.all(v >= 0) for v in e.values())
    assert np.all(e["2b/uint8"] > e["4b/float16"])


def test_kl_errors_refuse_windows_with_no_low_bit_read(lm):
    w = np.asarray(_tokens(40))
    with pytest.raises(ValueError, match="too short"):
        sensitivity.kl_bit_errors(lm, w, _pairs(), _clips(), [Format(2)], WINDOWS)


def test_scaled_errors_keep_each_caches_kl_per_unit_attention_error():
    attn = {"2b/uint8": np.array([[1.0, 2.0], [0.0, 4.0]]), "4b/uint8": np.full((2, 2), 0.1)}
    kl = np.array([[0.5, 0.2], [0.3, 0.8]])
    got = sensitivity.scaled_errors(kl, attn, "2b/uint8")
    np.testing.assert_allclose(got["2b/uint8"], [[0.5, 0.2], [0.0, 0.8]])
    np.testing.assert_allclose(got["4b/uint8"], [[0.05, 0.01], [0.0, 0.02]])
    fmts = allocation.candidate_formats((2, 3, 4), ("float16", "uint8"))
    assert sensitivity.cheapest(fmts, 64) == Format(2, "uint8")


def test_kl_objective_allocates_within_budget(lm):
    w = np.asarray(np.concatenate([_tokens(97, 1), _tokens(97, 2)]))
    fmts = allocation.candidate_formats((2, 3, 4), ("float16", "uint8"))
    errs = sensitivity.kl_bit_errors(lm, w, _pairs(), _clips(), fmts, WINDOWS, progress=False)
    for budget in (2.5, 3.0, 4.0):  # head_dim 16: 2b/uint8 is 3.0, the cheapest at 2.5 fails
        if budget < 3.0:
            with pytest.raises(ValueError, match="below the cheapest"):
                allocation.allocate(errs, budget, CFG.head_dim)
            continue
        alloc = allocation.allocate(errs, budget, CFG.head_dim)
        assert alloc.bpe(CFG.head_dim) <= budget + 1e-9
        total = sum(errs[f.name][i][j] for i, p in enumerate(alloc.layers)
                    for j, f in enumerate(p))  # fmt: skip
        uniform = errs["2b/uint8"].sum()
        assert total <= uniform + 1e-12  # never worse than the cheapest uniform cache


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        (dict(allocation_objective="bogus"), "--allocation-objective 'bogus': one of attention"),
        (
            dict(bpe_budget=2.5, allocation_objective="loss"),
            "--allocation-objective 'loss': one of attention, kl, kl_scaled",
        ),
        (
            dict(bpe_budget=2.5, allocation_objective="kl", alloc_kl_windows=(-1, 8, 16)),
            "--alloc-kl-windows",
        ),
        (
            dict(bpe_budget=2.5, allocation_objective="kl_scaled", alloc_kl_tokens=100),
            "--alloc-kl-tokens 100",
        ),
    ],
)
def test_bad_objective_options_fail_in_one_line_before_the_model_loads(kw, msg, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(cal, "load_model", no_load)
    with pytest.raises(ValueError, match=msg) as e:
        cal.main(cal.CalibrateConfig(data=None, progress=False, **kw))
    assert "\n" not in str(e.value)


def test_cli_names_the_bad_objective(capsys):
    from kvjax import cli

    with pytest.raises(SystemExit) as e:
        cli.run(cal.main, cal.parse_args, ["--allocation-objective", "nope"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    want = "error: --allocation-objective 'nope': one of attention, kl, kl_scaled"
    assert err.splitlines()[0] == want


def test_calibrate_stores_the_kl_allocation(lm, tmp_path, monkeypatch):
    from kvjax.storage import load_allocation, read_metadata

    monkeypatch.setattr(cal, "load_model", lambda path: lm)
    text = tmp_path / "calib.txt"
    text.write_text(assets.load_play("tempest")[:20000])
    cfg = cal.CalibrateConfig(
        data=str(text), methods=("wush",), tokens=256, seq_len=128, holdout=1, bits=(2,),
        out=str(tmp_path / "o"), progress=False, bpe_budget=3.5,
        allocation_objective="kl_scaled", alloc_kl_windows=WINDOWS,
    )  # fmt: skip
    cal.main(cfg)
    meta = read_metadata(tmp_path / "o" / "wush")
    alloc = load_allocation(tmp_path / "o" / "wush")
    assert alloc.bpe(CFG.head_dim) <= 3.5 + 1e-9
    how = meta["allocation_objective"]
    assert how["objective"] == "kl_scaled" and how["measured_formats"] == ["2b/uint8"]
    assert how["tokens_per_window"] == 128 and how["cache_windows"] == list(WINDOWS)
    kl, attn = meta["bit_errors"], meta["bit_errors_attention"]
    assert set(kl) == set(attn) == {f"{b}b/{m}" for b in (2, 3, 4) for m in ("float16", "uint8")}
    # every format keeps the attention errors' proportions within a cache
    r = np.asarray(kl["4b/float16"]) * np.asarray(attn["2b/uint8"])
    np.testing.assert_allclose(r, np.asarray(kl["2b/uint8"]) * np.asarray(attn["4b/float16"]))


def test_kl_errors_measure_only_the_given_layers(lm):
    w = np.asarray(np.concatenate([_tokens(97, 1), _tokens(97, 2)]))
    fmts = [Format(2, "uint8")]
    full = sensitivity.kl_bit_errors(lm, w, _pairs(), _clips(), fmts, WINDOWS, progress=False)
    one = sensitivity.kl_bit_errors(
        lm, w, _pairs(), _clips(), fmts, WINDOWS, progress=False, layers=[1]
    )
    np.testing.assert_array_equal(one["2b/uint8"][0], [0.0, 0.0])
    np.testing.assert_allclose(one["2b/uint8"][1], full["2b/uint8"][1], rtol=1e-6)


def test_calibrate_allocates_only_layers_with_low_bit_pages(tmp_path, monkeypatch):
    """A sliding-window model (Gemma 3's layout): the sliding layer keeps full precision in the
    cache, so the budget is spent on, and counted over, the global layer alone."""
    import dataclasses

    from kvjax.storage import load_allocation, read_metadata

    scfg = dataclasses.replace(
        CFG, layer_types=("sliding_attention", "full_attention"), sliding_window=32
    )
    model = Transformer(scfg, rngs=nnx.Rngs(0))
    slm = LoadedModel(model=model, tokenizer=ByteTokenizer(), cfg=scfg, fingerprint="tiny-swa",
                      source="tiny-swa")  # fmt: skip
    monkeypatch.setattr(cal, "load_model", lambda path: slm)
    text = tmp_path / "calib.txt"
    text.write_text(assets.load_play("tempest")[:20000])
    # head_dim 16: 2b/uint8 is 3.0 BPE, 2b/float16 4.0, 3b/uint8 4.0, 4b/uint8 5.0
    cfg = cal.CalibrateConfig(
        data=str(text), methods=("wush",), tokens=256, seq_len=128, holdout=1, bits=(2,),
        out=str(tmp_path / "o"), progress=False, bpe_budget=3.5,
        allocation_objective="kl_scaled", alloc_kl_windows=WINDOWS,
    )  # fmt: skip
    cal.main(cfg)
    meta = read_metadata(tmp_path / "o" / "wush")
    alloc = load_allocation(tmp_path / "o" / "wush")
    assert meta["allocation_objective"]["lowbit_layers"] == [1]
    kl = np.asarray(meta["bit_errors"]["2b/uint8"])
    assert np.all(kl[0] == 0.0) and np.all(kl[1] > 0)  # the sliding layer: no forward
    part = allocation.lowbit_part(alloc, allocation.lowbit_layers(scfg))
    assert part.bpe(CFG.head_dim) <= 3.5 + 1e-9  # over the global layer's caches alone
    # 3.5 over the 2 caches that count: one 3b/uint8 (4.0) and one 2b/uint8 (3.0)
    assert part.counts() == {"2b/uint8": 1, "3b/uint8": 1}
    assert alloc.layers[0] == (Format(2, "uint8"),) * 2  # the sliding layer's placeholder
