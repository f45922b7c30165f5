"""The eval scripts on a tiny random model: engines agree, mains run end to end."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eval import attention_error, common, drift, perplexity, retrieval
from kvjax.cache import attention as kv_attention
from kvjax.cache.paged import CacheConfig
from kvjax.cache.quantizers import QuantConfig
from kvjax.cache.transforms import KVTransforms
from kvjax.config import ModelConfig
from kvjax.models.loading import LoadedModel
from kvjax.models.model import Transformer
from kvjax.serving.drift import DriftReference
from kvjax.storage import TransformsCheckpointError, save_transforms

CFG = ModelConfig(
    model_type="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    tie_word_embeddings=True,
)
FINGERPRINT = "tiny-test-model"


class ByteTokenizer:
    """Bytes folded into the tiny vocabulary; enough for windows and prompts."""

    vocab_size = CFG.vocab_size

    def encode(self, text: str) -> list[int]:
        return [b % CFG.vocab_size for b in text.encode()]


def _random_transforms(seed: int) -> KVTransforms:
    rng = np.random.default_rng(seed)
    shape = (CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, CFG.head_dim)
    qk, _ = np.linalg.qr(rng.normal(size=shape))
    qv, _ = np.linalg.qr(rng.normal(size=shape))
    f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return KVTransforms(
        f(qk),
        f(np.swapaxes(qk, -1, -2)),
        f(qv),
        f(np.swapaxes(qv, -1, -2)),
        f(np.full(CFG.num_layers, 0.9)),
        f(np.full(CFG.num_layers, 0.85)),
    )


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    return LoadedModel(
        model=model, tokenizer=ByteTokenizer(), cfg=CFG, fingerprint=FINGERPRINT, source="tiny"
    )


@pytest.fixture(scope="module")
def calib_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("calib")
    for i, m in enumerate(("identity", "wush")):
        tf = KVTransforms.identity(CFG, 0.96, 0.92) if m == "identity" else _random_transforms(i)
        clips = {
            str(b): dict(k=[0.95 - 0.01 * b] * CFG.num_layers, v=[0.9 - 0.01 * b] * CFG.num_layers)
            for b in (2, 3, 4)
        }
        save_transforms(
            out / m, tf, dict(model_fingerprint=FINGERPRINT, method=m, clips_by_bits=clips)
        )
    return out


@pytest.fixture(scope="module")
def windows() -> np.ndarray:
    return np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 97)).astype(np.int32)


def test_full_precision_chunked_paged_equals_one_forward(lm, windows):
    scorer = common.TokenScorer(lm.model)
    one = scorer.one_pass(windows, None, None, 16)
    ccfg = CacheConfig(sink=16, keep=32, flush=16, page_size=16, quant=None, max_seq_len=128)
    chunked = scorer.chunked(windows, ccfg, _random_transforms(3), 16)
    np.testing.assert_allclose(chunked, one, atol=2e-5, rtol=0)
    assert perplexity.perplexity(chunked) == pytest.approx(perplexity.perplexity(one), rel=1e-5)


@pytest.mark.parametrize(
    "qc, decode_from", [(QuantConfig("oscar", 2), None), (QuantConfig("quest", 3), 90)]
)
@pytest.mark.parametrize(  # one query block, or six (CI: the blocks' own tests, fast)
    "min_block", [256, pytest.param(16, marks=pytest.mark.slow)]
)
def test_simulated_cache_matches_real_paged_cache(lm, windows, qc, decode_from, min_block,
                                                  monkeypatch):  # fmt: skip
    monkeypatch.setattr(kv_attention, "CAUSAL_MIN_BLOCK", min_block)
    scorer = common.TokenScorer(lm.model)
    tf = _random_transforms(7)
    ccfg = CacheConfig(sink=16, keep=32, flush=16, page_size=16, quant=qc, max_seq_len=128)
    sim = scorer.one_pass(windows, ccfg, tf, 16, decode_from=decode_from)
    real = scorer.chunked(windows, ccfg, tf, 16, decode_from=decode_from)
    np.testing.assert_allclose(sim, real, atol=5e-5, rtol=0)
    # The quantized cache must actually change something at 2 bits (the mask is not empty).
    if qc.bits == 2:
        assert np.max(np.abs(sim - scorer.one_pass(windows, None, None, 16))) > 1e-3


@pytest.mark.parametrize("quantized", [False, True])
def test_tail_argmax_is_the_full_argmax_at_the_last_positions(lm, windows, quantized):
    scorer = common.TokenScorer(lm.model)
    tf = _random_transforms(5)
    ccfg = CacheConfig(
        sink=16, keep=32, flush=16, page_size=16, quant=QuantConfig("oscar", 2), max_seq_len=128
    )
    args = (ccfg, tf) if quantized else (None, None)
    _, top = scorer.one_pass(windows, *args, 16, decode_from=90, return_argmax=True)
    tail = scorer.tail_argmax(windows, *args, 16, 90, 7)
    np.testing.assert_array_equal(tail, top[:, -7:])


def test_low_bit_mask_follows_the_cache_policy():
    ccfg = CacheConfig(sink=16, keep=32, flush=16, page_size=16, quant=None)
    pos = jnp.arange(100, dtype=jnp.int32)[None]
    m = np.asarray(common.low_bit_mask(pos, ccfg, 16))[0]
    # Chunk [64, 80) sees 64 stored tokens: quant_end(64) = 16 + 16 * ((64-48)//16) = 32.
    assert m[70, 16:32].all() and not m[70, 32:].any() and not m[70, :16].any()
    assert not m[:64].any()  # quant_end(c) = sink while c <= 48 + 15
    assert not np.any(m & ~np.tril(np.ones((100, 100), bool)))


def test_perplexity_main_writes_json(lm, calib_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(
        common,
        "evaluation_windows",
        lambda tok, n, k, text=None: (
            np.random.default_rng(2).integers(0, CFG.vocab_size, (k, n)).astype(np.int32)
        ),
    )
    cfg = perplexity.PerplexityConfig(
        calib_dir=str(calib_dir),
        methods=("identity", "wush"),
        bits=(2,),
        quantizers=("oscar", "quest"),
        seq_len=80,
        num_windows=2,
        batch_size=2,
        protocol=(16, 32, 16),
        serving=(16, 48, 16),
        out=str(tmp_path),
        crosscheck_tokens=64,
    )
    payload = perplexity.main(cfg, lm)
    data = json.loads((tmp_path / "perplexity.json").read_text())
    assert data["rows"] == json.loads(json.dumps(payload["rows"]))
    rows = data["rows"]
    assert len(rows) == 1 + 2 * 2 * 1 + 2
    for r in rows:
        assert {"transform", "quantizer", "bits", "windows", "metric", "value"} <= set(r)
        assert r["metric"] == "perplexity" and np.isfinite(r["value"]) and r["value"] > 1
    assert data["crosscheck"]["max_abs_logprob_diff"] < 1e-4
    assert (tmp_path / "perplexity.md").read_text().count("\n| wush |") == 1
    assert (tmp_path / "perplexity.png").stat().st_size > 0


def _perplexity_run(path, bits, methods, *, fp=30.0, windows=16, plot=False):
    """A perplexity.json as `eval.perplexity.main` writes it, of made-up rows."""
    cfg = perplexity.PerplexityConfig(
        methods=methods, bits=(bits,), quantizers=("oscar",), num_windows=windows,
        serving=None, plot=plot,
    )  # fmt: skip
    base = dict(num_windows=windows, seq_len=2048, tokens=windows * 2047, metric="perplexity")
    rows = [dict(base, transform="full_precision", quantizer=None, bits=None, windows=None,
                 value=fp, rel_to_fp=0.0, rel_to_fp_se=None, seconds=10.0)]  # fmt: skip
    for i, m in enumerate(methods):
        rel = 0.01 * (i + 1) / bits
        rows.append(dict(base, transform=m, quantizer="oscar", bits=bits, windows="16/128/16",
                         value=fp * (1 + rel), rel_to_fp=rel, rel_to_fp_se=0.001,
                         seconds=20.0))  # fmt: skip
    payload = dict(eval="perplexity", config=dataclasses.asdict(cfg),
                   model=dict(fingerprint="abc"), environment=dict(commit="x"), seconds=30.0,
                   rows=rows)  # fmt: skip
    path.write_text(json.dumps(payload))
    return str(path)


def test_perplexity_merge_joins_runs_on_the_same_windows(tmp_path):
    a = _perplexity_run(tmp_path / "a.json", 2, ("hadamard", "wush"))
    b = _perplexity_run(tmp_path / "b.json", 3, ("wush", "kv_pca"), fp=30.0 * (1 + 1e-7))
    again = _perplexity_run(tmp_path / "again.json", 2, ("wush",))  # a repeat: the first stays
    out = tmp_path / "merged"
    merged = perplexity.main(perplexity.PerplexityConfig(merge=(a, b, again), out=str(out)))
    settings = [(r["transform"], r["bits"]) for r in merged["rows"]]
    assert settings == [("full_precision", None), ("hadamard", 2), ("wush", 2), ("wush", 3),
                        ("kv_pca", 3)]  # fmt: skip
    assert merged["seconds"] == 90.0 and len(merged["merged"]) == 3
    assert merged["config"]["methods"] == ("hadamard", "kv_pca", "wush")  # the house order
    table = (out / "perplexity.md").read_text()
    assert "| transform | oscar 2b | oscar 3b |" in table
    assert "| kv_pca | - | 30.20 (+0.67% ± 0.1) |" in table
    assert json.loads((out / "perplexity.json").read_text())["rows"] == merged["rows"]

    other = _perplexity_run(tmp_path / "w8.json", 4, ("wush",), windows=8)
    with pytest.raises(ValueError, match="w8.json: num_windows=8"):
        perplexity.merge_runs([a, other], str(out))
    shifted = _perplexity_run(tmp_path / "fp.json", 4, ("wush",), fp=30.1)
    with pytest.raises(ValueError, match="fp.json: full precision 30.1"):
        perplexity.merge_runs([a, shifted], str(out))
    (tmp_path / "junk.json").write_text("{")
    with pytest.raises(ValueError, match="junk.json: not a readable"):
        perplexity.merge_runs([a, str(tmp_path / "junk.json")], str(out))


def test_paired_change_se():
    rng = np.random.default_rng(0)
    fp = rng.normal(-3.0, 1.0, size=(4, 50))
    assert perplexity.paired_change_se(fp - 0.1, fp) == pytest.approx(0.0, abs=1e-12)
    shift = np.array([0.0, 0.1, 0.2, 0.3])[:, None]
    se = perplexity.paired_change_se(fp - shift, fp)
    d = shift[:, 0]
    assert se == pytest.approx(np.exp(d.mean()) * d.std(ddof=1) / 2.0)
    assert perplexity.paired_change_se(fp[:1], fp[:1]) is None


def test_method_pairs_compare_neighbouring_methods_paired_over_windows():
    def row(name, nll, bits=2):
        ppl = float(np.exp(np.mean(nll)))
        return dict(transform=name, quantizer="oscar", bits=bits, windows="16/128/16",
                    value=ppl, window_nll=list(nll))  # fmt: skip

    base = np.array([3.0, 3.2, 2.9, 3.1])
    shift = np.array([0.01, 0.03, 0.02, 0.02])
    rows = [
        dict(transform="full_precision", value=1.0, window_nll=list(base)),
        row("kv_pca", base + 0.05 + shift),
        row("wush", base + 0.05),
        row("identity", base + 1.0),  # never paired: not a calibrated method
        row("hadamard", base + 0.2, bits=3),  # alone in its column
        dict(row("oscar", base + 0.3), window_nll=None),  # no per-window values kept
    ]
    pairs = perplexity.method_pairs(rows)
    change, se = perplexity.paired_change(base + 0.05 + shift, base + 0.05)
    assert change == pytest.approx(np.expm1(shift.mean()))
    assert se == pytest.approx(np.exp(shift.mean()) * shift.std(ddof=1) / 2.0)
    assert pairs == [f"oscar 2b 16/128/16: kv_pca vs wush {100 * change:+.2f}% ± {100 * se:.2f}"]


def test_perplexity_data_is_read_before_the_model(lm, tmp_path, monkeypatch):
    def no_model(_):
        raise AssertionError("the model loaded before the text was checked")

    monkeypatch.setattr(perplexity, "load_model", no_model)
    with pytest.raises(ValueError, match="does not exist"):
        perplexity.main(perplexity.PerplexityConfig(data=str(tmp_path / "missing.txt")))
    seen = {}
    (tmp_path / "t.txt").write_text("".join(chr(48 + (i * 7) % 60) for i in range(3000)))

    def windows(tok, n, k, text=None):
        seen["text"] = text
        raise RuntimeError("stop")

    monkeypatch.setattr(common, "evaluation_windows", windows)
    with pytest.raises(RuntimeError, match="stop"):
        perplexity.main(perplexity.PerplexityConfig(data=str(tmp_path / "t.txt")), lm)
    assert seen["text"].startswith("0")


def test_attention_error_main_writes_json(lm, calib_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(
        common,
        "evaluation_windows",
        lambda tok, n, k, text=None: (
            np.random.default_rng(3).integers(0, CFG.vocab_size, (k, n)).astype(np.int32)
        ),
    )
    cfg = attention_error.AttentionErrorConfig(
        calib_dir=str(calib_dir),
        methods=("identity", "wush"),
        seq_len=48,
        num_windows=2,
        out=str(tmp_path),
    )
    attention_error.main(cfg, lm)
    rows = json.loads((tmp_path / "attention_error.json").read_text())["rows"]
    assert len(rows) == 2 * len(attention_error.METRICS) * (CFG.num_layers + 1)
    for r in rows:
        assert {"transform", "quantizer", "bits", "windows", "layer", "metric", "value"} <= set(r)
        assert np.isfinite(r["value"]) and r["value"] >= 0
    out_err = [r["value"] for r in rows if r["metric"] == "output_rel_err" and r["layer"] != "mean"]
    assert max(out_err) > 0  # 2-bit K/V must perturb the module output
    assert (tmp_path / "attention_error.png").stat().st_size > 0


def test_retrieval_main_writes_json(lm, calib_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(
        retrieval.assets,
        "evaluation_text",
        lambda: "".join(chr(97 + (i * 7) % 26) for i in range(4000)),
    )
    cfg = retrieval.RetrievalConfig(
        calib_dir=str(calib_dir),
        methods=("identity", "wush"),
        lengths=(512,),
        trials=2,
        key_digits=3,
        needles=2,
        windows=(16, 64, 16),
        batch_tokens=1024,
        out=str(tmp_path),
    )
    retrieval.main(cfg, lm)
    payload = json.loads((tmp_path / "retrieval.json").read_text())
    rows = payload["rows"]
    assert len(rows) == 2 * 3  # tasks x settings
    assert {r["task"] for r in rows} == {"passkey", "niah"}
    for r in rows:
        assert {"transform", "quantizer", "bits", "windows", "length", "metric", "value"} <= set(r)
        assert 0.0 <= r["value"] <= 1.0 and r["trials"] == 2
        assert r["value_se"] == pytest.approx(retrieval.binomial_se(r["value"], 2))
        assert r["seconds"] >= 0 and r["seconds_per_trial"] == pytest.approx(r["seconds"] / 2)
        fp = (r["transform"] == common.FULL_PRECISION) == (r["change_vs_fp_se"] is None)
        assert fp
    md = (tmp_path / "retrieval.md").read_text()
    assert "Multi-key needle" in md and "Passkey" in md and "Seconds per trial" in md
    # Runs split by task join into the same table.
    for task in retrieval.TASKS:
        (tmp_path / task).mkdir()
        p = dict(payload, rows=[r for r in rows if r["task"] == task])
        (tmp_path / task / "retrieval.json").write_text(json.dumps(p))
    both = [str(tmp_path / t / "retrieval.json") for t in retrieval.TASKS]
    merged = retrieval.main(retrieval.RetrievalConfig(merge=tuple(both), out=str(tmp_path / "m")))
    assert merged["rows"] == rows
    assert (tmp_path / "m" / "retrieval.md").read_text() == md
    # A second run's repeated full-precision rows are dropped; a length one method lacks is "-".
    longer = [dict(r, length=640) for r in rows if r["transform"] != "identity"]
    (tmp_path / "longer.json").write_text(json.dumps(dict(payload, rows=rows + longer)))
    merged = retrieval.merge_runs([both[0], str(tmp_path / "longer.json")], str(tmp_path / "m"))
    assert len(merged["rows"]) == len(rows) + len(longer)
    assert "| identity | " in (tmp_path / "m" / "retrieval.md").read_text()
    assert " | - |" in (tmp_path / "m" / "retrieval.md").read_text()
    four = [dict(r, bits=4, value_bits=4) for r in rows if r["transform"] == "wush"]
    (tmp_path / "four.json").write_text(json.dumps(dict(payload, rows=four)))
    retrieval.merge_runs([both[0], str(tmp_path / "four.json")], str(tmp_path / "m"))
    assert "| wush 4-bit | " in (tmp_path / "m" / "retrieval.md").read_text()
    grouped = [dict(r, group_size=8) for r in rows if r["transform"] == "wush"]
    (tmp_path / "grouped.json").write_text(json.dumps(dict(payload, rows=grouped)))
    merged = retrieval.merge_runs([*both, str(tmp_path / "grouped.json")], str(tmp_path / "m"))
    assert len(merged["rows"]) == len(rows) + len(grouped)  # another setting, not a repeat
    assert "| wush (8 channels per scale) | " in (tmp_path / "m" / "retrieval.md").read_text()
    # A run whose rows predate the field: its config's group size names them.
    legacy = [{k: v for k, v in r.items() if k != "group_size"} for r in grouped]
    conf = dict(payload["config"], group_size=8)
    (tmp_path / "legacy.json").write_text(json.dumps(dict(payload, config=conf, rows=legacy)))
    merged = retrieval.merge_runs([*both, str(tmp_path / "legacy.json")], str(tmp_path / "m"))
    assert len(merged["rows"]) == len(rows) + len(grouped)
    assert "| wush (8 channels per scale) | " in (tmp_path / "m" / "retrieval.md").read_text()
    # Transforms calibrated with centred keys are another setting, named as such.
    centred = [dict(r, center_keys=True) for r in rows if r["transform"] == "wush"]
    (tmp_path / "centred.json").write_text(json.dumps(dict(payload, rows=centred)))
    merged = retrieval.merge_runs([*both, str(tmp_path / "centred.json")], str(tmp_path / "m"))
    assert len(merged["rows"]) == len(rows) + len(centred)
    assert "| wush (centred keys) | " in (tmp_path / "m" / "retrieval.md").read_text()
    quest = [dict(r, quantizer="quest") for r in rows if r["transform"] == "wush"]
    (tmp_path / "quest.json").write_text(json.dumps(dict(payload, rows=quest)))
    merged = retrieval.merge_runs([*both, str(tmp_path / "quest.json")], str(tmp_path / "m"))
    assert len(merged["rows"]) == len(rows) + len(quest)
    assert "| wush (quest quantizer) | " in (tmp_path / "m" / "retrieval.md").read_text()
    # Another model's run, or a file that is not a retrieval run, is named and nothing written.
    other = dict(payload, model=dict(payload["model"], fingerprint="another"))
    (tmp_path / "other.json").write_text(json.dumps(other))
    (tmp_path / "junk.json").write_text("{")
    before = (tmp_path / "m" / "retrieval.md").read_text()
    with pytest.raises(ValueError, match="other.json: another model"):
        retrieval.merge_runs([both[0], str(tmp_path / "other.json")], str(tmp_path / "m"))
    with pytest.raises(ValueError, match="junk.json: not a readable retrieval.json"):
        retrieval.merge_runs([both[0], str(tmp_path / "junk.json")], str(tmp_path / "m"))
    assert (tmp_path / "m" / "retrieval.md").read_text() == before


def test_retrieval_group_size_reaches_the_cache_and_is_checked_first(
    lm, calib_dir, monkeypatch, tmp_path
):
    seen = []

    def record(scorer, ids, a0, ccfg, tf, chunk, batch):
        seen.append(None if ccfg is None else ccfg.quant.group_size)
        return np.ones(len(ids), bool), np.ones(len(ids))

    monkeypatch.setattr(retrieval, "score_trials", record)
    kw = dict(calib_dir=str(calib_dir), methods=("wush",), lengths=(256,), trials=1)
    kw.update(tasks=("passkey",), windows=(16, 64, 16), out=str(tmp_path))
    bad = f"head_dim={CFG.head_dim} is not divisible by group_size=7"
    with pytest.raises(ValueError, match=bad):
        retrieval.main(retrieval.RetrievalConfig(group_size=7, **kw), lm)
    assert seen == [] and not (tmp_path / "retrieval.json").exists()  # nothing scored
    retrieval.main(retrieval.RetrievalConfig(group_size=CFG.head_dim // 2, **kw), lm)
    assert seen == [None, CFG.head_dim // 2]  # full precision, then the low-bit cache
    # 2-bit keys with 4-bit values: each side's width and clips reach the cache.
    seen.clear()
    monkeypatch.setattr(
        retrieval,
        "score_trials",
        lambda scorer, ids, a0, ccfg, tf, *a: (
            seen.append(ccfg and (ccfg.quant.bits, ccfg.quant_v.bits, float(tf.clip_k[0]),
                                  float(tf.clip_v[0]))),
            (np.ones(len(ids), bool), np.ones(len(ids))),
        )[1],
    )  # fmt: skip
    payload = retrieval.main(retrieval.RetrievalConfig(bits=2, value_bits=4, **kw), lm)
    assert seen == [None, (2, 4, pytest.approx(0.93), pytest.approx(0.86))]
    assert [r["value_bits"] for r in payload["rows"]] == [None, 4]
    assert "2-bit keys, 4-bit values" in (tmp_path / "retrieval.md").read_text()


def test_retrieval_batching_does_not_change_the_answers(lm, calib_dir):
    filler = np.arange(5000, dtype=np.int32) % CFG.vocab_size
    ids, a0, _ = retrieval.make_trials(lm.tokenizer, filler, 512, (0.2, 0.5, 0.9), 3, 0, "niah", 3)
    scorer = common.TokenScorer(lm.model)
    tf = common.load_method(calib_dir, "wush", 2, CFG, FINGERPRINT)
    ccfg = CacheConfig(
        sink=16, keep=64, flush=16, page_size=16, quant=QuantConfig("oscar", 2), max_seq_len=512
    )
    one = retrieval.score_trials(scorer, ids, a0, ccfg, tf, 16, 1)
    three = retrieval.score_trials(scorer, ids, a0, ccfg, tf, 16, 3)
    np.testing.assert_array_equal(one[0], three[0])
    np.testing.assert_allclose(one[1], three[1])


class _OracleScorer:
    """argmax = the true next token, except where that token is `wrong_for`."""

    def __init__(self, wrong_for: int | None = None):
        self.wrong_for = wrong_for

    def tail_argmax(self, batch, cache_cfg, transforms, chunk, decode_from, n):
        top = batch[:, 1:].copy()
        top[top == self.wrong_for] += 1
        return top[:, -n:]


def test_score_trials_is_exact_match_on_the_answer_tokens():
    ids = np.arange(40, dtype=np.int32).reshape(2, 20)  # answers: tokens 15-19 and 35-39
    exact, frac = retrieval.score_trials(_OracleScorer(), ids, 15, None, None, 16, 2)
    assert exact.all() and (frac == 1).all()
    # Row 0's first answer token (15) mispredicted: row 0 fails, with 4 of 5 tokens right.
    for batch_size in (1, 2):
        exact, frac = retrieval.score_trials(_OracleScorer(15), ids, 15, None, None, 16, batch_size)
        assert exact.tolist() == [False, True] and frac.tolist() == [0.8, 1.0]
    # The last question token (14) mispredicted does not count.
    exact, _ = retrieval.score_trials(_OracleScorer(14), ids, 15, None, None, 16, 2)
    assert exact.all()


def test_retrieval_standard_errors():
    assert retrieval.binomial_se(0.5, 20) == pytest.approx(math.sqrt(0.25 / 20))
    assert retrieval.binomial_se(1.0, 20) == 0.0
    a = np.array([1, 1, 0, 1], bool)
    b = np.array([1, 0, 0, 0], bool)
    d = np.array([0, 1, 0, 1], float)
    assert retrieval.paired_se(a, b) == pytest.approx(d.std(ddof=1) / 2)
    assert retrieval.paired_se(a[:1], b[:1]) is None
    assert retrieval.default_lengths(8192) == (1024, 2048, 4096, 8192)
    assert retrieval.default_lengths(32768)[-1] == 32768
    assert retrieval.default_lengths(3000) == (1024, 2048, 3000)
    cfg = retrieval.RetrievalConfig(trials=4)
    assert cfg.trial_depths() == [0.125, 0.375, 0.625, 0.875]
    assert retrieval.RetrievalConfig(trials=3, depths=(0.1, 0.9)).trial_depths() == [0.1, 0.9, 0.1]


def test_drift_main_scores_every_text(lm, calib_dir, tmp_path, monkeypatch):
    with pytest.raises(TransformsCheckpointError, match="no drift reference"):
        drift.main(drift.DriftConfig(transforms=str(calib_dir / "wush")), lm)
    shape = (CFG.num_layers, CFG.num_kv_heads, CFG.head_dim)
    ref = DriftReference(np.ones(shape, np.float32), np.ones(shape, np.float32))
    save_transforms(
        tmp_path / "tf", _random_transforms(3), dict(model_fingerprint=FINGERPRINT),
        extras=ref.arrays(),
    )  # fmt: skip
    plays = "".join(chr(48 + (i * 7) % 60) for i in range(3000))
    monkeypatch.setattr(drift.assets, "load_text", lambda p, **kw: plays)
    monkeypatch.setattr(
        drift, "code_text", lambda: "".join(chr(33 + (i * 11) % 90) for i in range(3000))
    )
    cfg = drift.DriftConfig(transforms=str(tmp_path / "tf"), windows=2, seq_len=64,
                            out=str(tmp_path))  # fmt: skip
    drift.main(cfg, lm)
    rows = json.loads((tmp_path / "drift.json").read_text())["rows"]
    assert [r["text"] for r in rows] == ["heldout", "code", "shuffled"]
    for r in rows:
        assert r["tokens"] == 2 * 64 and len(r["k"]) == CFG.num_layers
        assert np.isfinite(r["max"]) and r["max"] >= 0


def test_make_trials_places_key_and_answer(lm):
    filler = np.arange(5000, dtype=np.int32) % CFG.vocab_size
    ids, a0, info = retrieval.make_trials(lm.tokenizer, filler, 256, (0.0, 0.5, 1.0), 5, 0)
    assert ids.shape == (3, 256)
    for row, t in zip(ids, info):
        answer = lm.tokenizer.encode(retrieval.ANSWER.format(key=t["key"]))
        # The byte tokenizer splits the space off: it comes with the question, unscored.
        assert row[a0 - 1 :].tolist() == answer and row[a0:].tolist() == answer[1:]
        needle = lm.tokenizer.encode(retrieval.NEEDLE.format(key=t["key"]))
        p = t["needle_position"]
        assert row[p : p + len(needle)].tolist() == needle


def test_make_trials_niah_plants_every_needle_and_asks_for_one(lm):
    filler = np.arange(9000, dtype=np.int32) % CFG.vocab_size
    depths = (0.05, 0.5, 0.95)
    ids, a0, info = retrieval.make_trials(lm.tokenizer, filler, 600, depths, 4, 3, "niah", 5)
    assert ids.shape == (3, 600)
    enc = lm.tokenizer.encode
    for row, t in zip(ids, info):
        assert row[a0 - 1 :].tolist() == enc(retrieval.ANSWER.format(key=t["key"]))
        asked = enc(retrieval.NIAH_NEEDLE.format(word=t["word"], key=t["key"]))
        p = t["needle_position"]
        assert row[p : p + len(asked)].tolist() == asked
        question = enc(retrieval.NIAH_QUESTION.format(word=t["word"]))
        assert row[a0 - 1 - len(question) : a0 - 1].tolist() == question
        assert len(t["distractors"]) == 4 and t["word"] not in t["distractors"]
        assert t["key"] not in t["distractors"].values()
        text = bytes(row.tolist())  # ids < 64: bytes() gives a searchable string
        for w, k in t["distractors"].items():
            needle = bytes(enc(retrieval.NIAH_NEEDLE.format(word=w, key=k)))
            assert needle in text
    # The asked needle moves with the depth; the same seed gives the same prompts.
    assert info[0]["needle_position"] < info[1]["needle_position"] < info[2]["needle_position"]
    again, _, _ = retrieval.make_trials(lm.tokenizer, filler, 600, depths, 4, 3, "niah", 5)
    np.testing.assert_array_equal(ids, again)


def test_bad_config_values_raise():
    with pytest.raises(ValueError, match="bits=5"):
        perplexity.PerplexityConfig(bits=(5,))
    with pytest.raises(ValueError, match="nope"):
        attention_error.AttentionErrorConfig(methods=("nope",))
    with pytest.raises(ValueError, match="key_digits=0"):
        retrieval.RetrievalConfig(key_digits=0)
    with pytest.raises(ValueError, match="trials=0"):
        retrieval.RetrievalConfig(trials=0)
    with pytest.raises(ValueError, match="needles=0"):
        retrieval.RetrievalConfig(needles=0)
    with pytest.raises(ValueError, match="too short"):
        retrieval.make_trials(ByteTokenizer(), np.zeros(100, np.int32), 40, (0.5,), 5, 0)
    with pytest.raises(ValueError, match="filler text has 100 tokens"):
        retrieval.make_trials(ByteTokenizer(), np.zeros(100, np.int32), 400, (0.5,), 5, 0)
    with pytest.raises(ValueError, match=r"lengths \[16384\] exceed .* 8192"):
        retrieval.resolve_lengths(retrieval.RetrievalConfig(lengths=(4096, 16384)), 8192)


def test_retrieval_cli_rejects_bad_input_before_loading(tmp_path, monkeypatch, capsys):
    from kvjax import cli

    def no_model(_):
        raise AssertionError("the model loaded before the input was checked")

    monkeypatch.setattr(retrieval, "load_model", no_model)
    for argv, needle in [
        (["--trials", "0"], "trials=0"),
        (["--group-size", "0"], "group_size=0"),
        (["--value-bits", "5"], "value_bits=5"),
        (["--tasks", "nope"], "invalid choice: 'nope'"),
        (["--data", str(tmp_path / "missing.txt")], "missing.txt"),
    ]:
        with pytest.raises(SystemExit) as e:
            cli.run(retrieval.main, retrieval.parse_args, argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert needle in err, err


def test_memory_report_counts_pools_and_beats_bf16():
    from eval import report

    long_cfg = ModelConfig(
        model_type="llama",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
    )
    mem = report.memory_report(long_cfg, 8192)
    assert mem["dense_bf16_bytes"] == 2 * 8192 * 2 * 2 * 64 * 2
    # 2-bit codes + fp16 scale/zero per 64 channels: 2.5 bits; full-precision windows add a bit.
    assert mem["lowbit_page_bits_per_element"] == pytest.approx(2.5)
    # Every pool counted: K and V, per layer, low-bit pages at 2.5 bits + bf16 fp pages.
    per_kv_layer = 16 * 2 * 64 * (mem["lowbit_pages"] * 2.5 / 8 + mem["fp_pages"] * 2)
    assert mem["paged_allocated_bytes"] == pytest.approx(2 * 2 * per_kv_layer)
    assert 2.5 < mem["allocated_bits_per_element"] < 4.0
    assert mem["ratio"] == pytest.approx(16 / mem["allocated_bits_per_element"])


@pytest.mark.slow  # CI: bench_serving smoke runs the same engine modes; paged-cache tests check
# the Pallas path against the reference
def test_bench_engine_smoke(tmp_path):
    """Tiny model through three Engine modes; the paged Pallas path (interpret mode here)
    must agree with the paged reference path on a decode step that reads low-bit pages."""
    from eval import bench_engine

    res = bench_engine.main(
        bench_engine.parse_args(
            [
                "--layers", "1", "--hidden-size", "128", "--intermediate-size", "96",
                "--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "64",
                "--vocab-size", "101", "--batch", "2", "--prompt-len", "96", "--new-tokens", "3",
                "--sink", "16", "--keep", "16", "--prefill-chunk", "32", "--decode-steps", "2",
                "--out", str(tmp_path),
            ]
        )
    )  # fmt: skip
    assert [r["mode"] for r in res["rows"]] == ["bf16_dense", "int2_reference", "int2_pallas"]
    assert all(r["decode_steps"] == 2 for r in res["rows"])
    # 96 prompt tokens with 16 sink + 16 recent leave 64 tokens in 2-bit pages, so the two
    # paths differ by the kernel's float16 operands only.
    err = res["checks"]["decode_logits_rel_err_pallas_vs_reference"]
    quant = res["checks"]["decode_logits_rel_err_paged_vs_dense"]
    assert err < 1e-2
    assert quant > 10 * err  # the low-bit pages were read (their error dwarfs the kernel's)
    assert (tmp_path / "bench_engine.json").exists()


def test_bench_serving_smoke(tmp_path):
    """Every mode serves the same small workload under one budget; the 2-bit pool holds more
    sequences at once than the full-precision ones."""
    from eval import bench_serving

    res = bench_serving.main(
        bench_serving.parse_args(
            [
                "--layers", "1", "--hidden-size", "64", "--intermediate-size", "96",
                "--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "64",
                "--vocab-size", "97", "--requests", "24", "--prompt-len", "192",
                "--output-len", "6", "--prefill-chunk", "32", "--prefill-tokens-per-step",
                "128", "--kv-memory-gb", "0.0012", "--sink", "16", "--keep", "16",
                "--decode-steps", "4", "--warmup-tokens", "2",
                "--modes", "int2_reference", "bf16_paged", "bf16_dense", "--out", str(tmp_path),
            ]
        )
    )  # fmt: skip
    rows = {r["mode"]: r for r in res["rows"]}
    assert all(r["output_tokens"] == sum(n for _, _, n in bench_serving.workload(
        bench_serving.BenchServingConfig(requests=24, prompt_len=192, output_len=6, vocab_size=97)
    )) for r in rows.values())  # fmt: skip
    assert rows["int2_reference"]["peak_concurrent"] > rows["bf16_paged"]["peak_concurrent"]
    assert all(r["kv_bytes"] <= 0.0012 * 2**30 for r in rows.values())
    assert (tmp_path / "bench_serving.md").exists()


def test_report_writes_outside_the_tree_and_picks_calibrated_methods(tmp_path):
    from eval import report
    from kvjax import cli

    assert report.report_path(report.ReportConfig()) == pathlib.Path("runs/report/RESULTS.md")
    assert report.report_path(report.ReportConfig(out="results", results_md="RESULTS.md")) == (
        pathlib.Path("RESULTS.md")
    )
    calib = tmp_path / "calib"
    for m in ("hadamard", "wush"):  # what the README's calibrate example leaves (+ oscar)
        (calib / m).mkdir(parents=True)
    quick = report.ReportConfig(quick=True, calib_dir=str(calib))
    assert report.select_methods(quick) == ("hadamard", "wush")
    with pytest.raises(cli.UsageError, match="lacks .*identity.*or use --quick"):
        report.select_methods(report.ReportConfig(calib_dir=str(calib)))
    with pytest.raises(cli.UsageError, match="does not exist; run python -m kvjax.calibrate"):
        report.select_methods(report.ReportConfig(calib_dir=str(tmp_path / "none")))


def test_attention_error_scores_data_text(lm, calib_dir, tmp_path, monkeypatch):
    def no_model(_):
        raise AssertionError("the model loaded before the text was checked")

    monkeypatch.setattr(attention_error, "load_model", no_model)
    with pytest.raises(ValueError, match="does not exist"):
        attention_error.main(attention_error.AttentionErrorConfig(data=str(tmp_path / "no.txt")))
    (tmp_path / "t.txt").write_text("".join(chr(48 + (i * 7) % 60) for i in range(3000)))
    seen = {}

    def windows(tok, n, k, text=None):
        seen["text"] = text
        return np.random.default_rng(3).integers(0, CFG.vocab_size, (k, n)).astype(np.int32)

    monkeypatch.setattr(common, "evaluation_windows", windows)
    cfg = attention_error.AttentionErrorConfig(
        calib_dir=str(calib_dir), methods=("wush",), seq_len=32, num_windows=1,
        data=str(tmp_path / "t.txt"), out=str(tmp_path), plot=False,
    )  # fmt: skip
    attention_error.main(cfg, lm)
    assert seen["text"].startswith("0")
    md = (tmp_path / "attention_error.md").read_text()
    assert "t.txt" in md and "| seconds |" in md


def _fake_retrieval_rows(gaps: dict[str, list[float]], trials: int = 20) -> dict:
    rows = []
    for n, fp in zip((1024, 2048), (0.9, 0.8)):
        rows.append(dict(task="niah", transform=common.FULL_PRECISION, bits=None, length=n,
                         value=fp, change_vs_fp=0.0, trials=trials))  # fmt: skip
        for m, g in gaps.items():
            d = g[(1024, 2048).index(n)]
            rows.append(dict(task="niah", transform=m, bits=2, length=n, value=fp + d,
                             change_vs_fp=d, trials=trials))  # fmt: skip
    return dict(rows=rows)


def test_report_retrieval_target_takes_the_best_method_at_its_worst_length():
    from eval import report

    ret = _fake_retrieval_rows({"wush": [0.0, -0.10], "kv_pca": [-0.05, -0.05]})
    (line,) = report._retrieval_targets(ret)
    assert "kv_pca" in line and "**met**" in line and "-5 points" in line
    (line,) = report._retrieval_targets(_fake_retrieval_rows({"wush": [0.0, -0.10]}))
    assert "**missed**" in line and "-10 points" in line
    (line,) = report._retrieval_targets(_fake_retrieval_rows({"wush": [0.0, 0.0]}, trials=3))
    assert "**missed**" in line and "3 trials per cell" in line
    ret = _fake_retrieval_rows({"wush": [0.0, 0.0], "identity": [-0.5, -0.5]})
    ret["rows"] = [r for r in ret["rows"] if not (r["transform"] == "wush" and r["length"] == 2048)]
    (line,) = report._retrieval_targets(ret)
    assert "identity" in line and "**missed**" in line  # wush lacks 2048 tokens: not certified


def test_report_perplexity_seconds_lists_every_row_and_full_precision():
    from eval import report

    base = dict(num_windows=16, seq_len=2048)
    rows = [dict(transform="full_precision", quantizer=None, bits=None, windows=None,
                 value=30.0, seconds=12.0, **base)]  # fmt: skip
    rows += [
        dict(
            transform=m,
            quantizer="oscar",
            bits=b,
            windows="16/128/16",
            value=31.0,
            seconds=10.0 + b,
            **base,
        )  # fmt: skip
        for m in ("wush", "kv_pca")
        for b in (2, 3)
    ]
    text = report.perplexity_seconds(dict(rows=rows))
    assert "**30.000** in 12 s" in text
    assert "| wush | 12 | 13 |" in text and "| kv_pca | 12 | 13 |" in text
    assert "oscar 2b @ 16/128/16" in text


def test_report_rejects_bad_retrieval_options_before_loading(tmp_path):
    from eval import report

    with pytest.raises(ValueError, match="nope"):
        report.ReportConfig(retrieval_methods=("nope",))
    with pytest.raises(ValueError, match="retrieval_trials=0"):
        report.ReportConfig(retrieval_trials=0)
    calib = tmp_path / "calib"
    for m in ("hadamard", "wush"):
        (calib / m).mkdir(parents=True)
    cfg = report.ReportConfig(quick=True, calib_dir=str(calib), retrieval_methods=("kv_pca",))
    with pytest.raises(ValueError, match=r"--retrieval-methods \['kv_pca'\]"):
        report.main(cfg)
    cfg = report.ReportConfig(quick=True, calib_dir=str(calib), data=str(tmp_path / "no.txt"))
    with pytest.raises(ValueError, match="--data .*no.txt"):
        report.main(cfg)


@pytest.mark.slow  # loads the shipped SmolLM2 (~10 s) and runs 4 prompts of 384 tokens
def test_shipped_model_retrieves_needles_at_full_precision():
    from kvjax import assets
    from kvjax.models.loading import load_model

    lm = load_model(None)
    text = assets.evaluation_text()[:200_000]
    filler = np.asarray(retrieval._encode_no_bos(lm.tokenizer, text), np.int32)
    scorer = common.TokenScorer(lm.model)
    for task in retrieval.TASKS:
        ids, a0, info = retrieval.make_trials(lm.tokenizer, filler, 384, (0.3, 0.7), 5, 0, task, 3)
        exact, _ = retrieval.score_trials(scorer, ids, a0, None, None, 16, 2)
        assert exact.all(), (task, info)


@pytest.mark.slow  # loads Gemma 3 270M (~30 s; skips without the asset)
def test_gemma_prompts_start_with_bos_and_run():
    from kvjax import assets
    from kvjax.models.loading import load_model

    try:
        assets.gemma3_270m_path()
    except assets.AssetError as e:
        pytest.skip(f"Gemma 3 270M asset unavailable: {str(e).splitlines()[0]}")
    lm = load_model("gemma3-270m")
    assert lm.cfg.max_position_embeddings == 32768
    assert retrieval.resolve_lengths(retrieval.RetrievalConfig(), 32768)[-1] == 32768
    filler = np.asarray(
        retrieval._encode_no_bos(lm.tokenizer, assets.evaluation_text()[:100_000]), np.int32
    )
    assert lm.tokenizer.bos_id not in filler.tolist()
    for task in retrieval.TASKS:
        ids, a0, info = retrieval.make_trials(lm.tokenizer, filler, 320, (0.5,), 5, 1, task, 3)
        assert ids[0, 0] == lm.tokenizer.bos_id and (ids[0, 1:] != lm.tokenizer.bos_id).all()
        assert lm.tokenizer.decode(ids[0, a0 - 1 :].tolist()).strip().endswith(info[0]["key"])
        exact, frac = retrieval.score_trials(common.TokenScorer(lm.model), ids, a0, None, None,
                                             16, 1)  # fmt: skip
        assert 0.0 <= frac[0] <= 1.0


@pytest.mark.slow  # every evaluation once on the tiny model (~1 min of compiles)
def test_report_quick_run_writes_every_section(lm, calib_dir, tmp_path, monkeypatch):
    from eval import report

    monkeypatch.setattr(report, "load_model", lambda _: lm)
    monkeypatch.setattr(
        common,
        "evaluation_windows",
        lambda tok, n, k, text=None: (
            np.random.default_rng(3).integers(0, CFG.vocab_size, (k, n)).astype(np.int32)
        ),
    )
    monkeypatch.setattr(
        retrieval.assets,
        "evaluation_text",
        lambda: "".join(chr(97 + (i * 7) % 26) for i in range(4000)),
    )
    cfg = report.ReportConfig(quick=True, calib_dir=str(calib_dir), out=str(tmp_path))
    report.main(cfg)
    text = (tmp_path / "RESULTS.md").read_text()
    for needle in (
        "## Perplexity",
        "Seconds per perplexity row",
        "full precision: perplexity",
        "## Attention error per layer",
        "| seconds |",
        "## Retrieval (passkey, multi-key needle in a haystack)",
        "Seconds per trial",
        "### Issue target (retrieval at 2 bits)",
        "- passkey: best 2-bit method",
        "- niah: best 2-bit method",
        "## Cache memory at 2 bits",
        common.git_commit(),
    ):
        assert needle in text, needle


def test_prose_text_halves_are_disjoint_english():
    from eval import drift

    cal, ev = drift.prose_text("calibration"), drift.prose_text("evaluation")
    assert len(cal) > 100_000 and len(ev) > 100_000
    assert ev[:5000] not in cal and cal[-5000:] not in ev  # different topics
    with pytest.raises(ValueError, match="part='test'"):
        drift.prose_text("test")


def test_recorded_command_carries_xla_flags(monkeypatch):
    """Results record the XLA flags a run was made under (they change its timings)."""
    monkeypatch.setattr("sys.argv", ["bench", "--points", "8x131072"])
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert not common.command_line().startswith("XLA_FLAGS")
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION,WHILE")
    cmd = common.command_line()
    assert cmd.startswith("XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,WHILE python")
    assert cmd.endswith("--points 8x131072")
