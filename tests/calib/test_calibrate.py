"""The calibration pipeline end to end: checkpoints, resume, storage checks, bad input, and the
directional result on real activations of the shipped model."""

import dataclasses
import json
import pathlib
import shutil

import numpy as np
import pytest

from calib import calibrate as cal
from kvjax import assets
from kvjax.models.tokenizer import Tokenizer
from kvjax.storage import TransformsCheckpointError, load_transforms, read_metadata

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama saved as a local HF checkpoint with the real SmolLM2 tokenizer."""
    d = tmp_path_factory.mktemp("tiny_llama")
    tok = Tokenizer.from_gguf(assets.default_model_path())
    cfg = transformers.LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_hf_dir(d)
    return d


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("text") / "calib.txt"
    f.write_text(assets.load_play("tempest")[:60000])
    return f


def _cfg(model, data, out, **kw):
    base = dict(
        model=str(model),
        data=str(data),
        methods=("wush", "oscar"),
        tokens=1024,
        seq_len=128,
        batch_size=2,
        bits=(2, 4),
        holdout=1,
        out=str(out),
        progress=False,
    )
    base.update(kw)
    return cal.CalibrateConfig(**base)


def test_end_to_end_tiny(tiny_dir, text_file, tmp_path):
    summary = cal.main(_cfg(tiny_dir, text_file, tmp_path))
    assert set(summary["methods"]) == {"identity", "hadamard", "wush", "oscar"}
    for m in ("wush", "oscar"):
        tf, meta = load_transforms(tmp_path / m)
        assert meta["method"] == m and meta["tokens"] == 1024
        assert set(meta["clips_by_bits"]) == {"2", "4"}
        eye = np.eye(32)
        np.testing.assert_allclose(
            np.asarray(tf.a_k @ tf.b_k), np.broadcast_to(eye, tf.a_k.shape), atol=1e-4
        )
        assert np.all((np.asarray(tf.clip_k) > 0) & (np.asarray(tf.clip_k) <= 1))
    assert not (tmp_path / "identity").exists()  # baselines are scored, not saved


def test_interrupted_run_resumes_to_the_same_result(tiny_dir, text_file, tmp_path, monkeypatch):
    clean = tmp_path / "clean"
    cal.main(_cfg(tiny_dir, text_file, clean, methods=("wush",), bits=(2,)))

    resumed = tmp_path / "resumed"
    real_save = cal._save_resume
    calls = {"n": 0}

    def save_then_die(*args):
        real_save(*args)
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(cal, "_save_resume", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        cal.main(_cfg(tiny_dir, text_file, resumed, methods=("wush",), bits=(2,)))
    assert not (resumed / "wush").exists()  # no checkpoint that looks valid
    monkeypatch.setattr(cal, "_save_resume", real_save)
    saved = np.load(resumed / "stats.npz")
    assert int(saved["batches_done"]) == 2
    cal.main(_cfg(tiny_dir, text_file, resumed, methods=("wush",), bits=(2,)))
    a, _ = load_transforms(clean / "wush")
    b, _ = load_transforms(resumed / "wush")
    np.testing.assert_allclose(np.asarray(a.a_k), np.asarray(b.a_k), rtol=1e-5, atol=1e-5)


def test_storage_refuses_wrong_or_damaged_checkpoints(tiny_dir, text_file, tmp_path):
    cal.main(_cfg(tiny_dir, text_file, tmp_path, methods=("wush",), bits=(2,), tokens=512))
    ck = tmp_path / "wush"
    meta = read_metadata(ck)
    load_transforms(ck, fingerprint=meta["model_fingerprint"])  # the right model loads
    with pytest.raises(TransformsCheckpointError, match="calibrated for model"):
        load_transforms(ck, fingerprint="0" * 32)
    bad_version = tmp_path / "v"
    shutil.copytree(ck, bad_version)
    m = json.loads((bad_version / "metadata.json").read_text())
    m["format_version"] = 99
    (bad_version / "metadata.json").write_text(json.dumps(m))
    with pytest.raises(TransformsCheckpointError, match="format_version=99"):
        load_transforms(bad_version)
    corrupt = tmp_path / "c"
    shutil.copytree(ck, corrupt)
    m = json.loads((corrupt / "metadata.json").read_text())
    m["digests"]["a_k"] = "0" * 64  # as if the array bytes had changed
    (corrupt / "metadata.json").write_text(json.dumps(m))
    with pytest.raises(TransformsCheckpointError, match="a_k"):
        load_transforms(corrupt)
    truncated = tmp_path / "t"
    shutil.copytree(ck, truncated)
    for f in (truncated / "arrays").rglob("*"):
        if f.is_file() and f.stat().st_size > 1000:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(TransformsCheckpointError):
        load_transforms(truncated)
    from kvjax.config import ModelConfig

    other = ModelConfig(
        model_type="llama",
        vocab_size=10,
        hidden_size=64,
        intermediate_size=8,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
    )
    with pytest.raises(TransformsCheckpointError, match="made for another model"):
        load_transforms(ck, cfg=other)


def test_bad_input(tiny_dir, text_file, tmp_path):
    with pytest.raises(ValueError, match="unknown method"):
        cal.main(_cfg(tiny_dir, text_file, tmp_path, methods=("oscarr",)))
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    with pytest.raises(ValueError, match="empty"):
        cal.main(_cfg(tiny_dir, empty, tmp_path / "o2"))
    with pytest.raises(ValueError, match="--bits 8"):
        cal.main(_cfg(tiny_dir, text_file, tmp_path / "o3", bits=(8,)))
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"\0" * 200_000)
    with pytest.raises(ValueError, match="nul.txt' is not natural-language text"):
        cal.main(_cfg(tiny_dir, nul, tmp_path / "o4"))
    binary = tmp_path / "bin.txt"
    binary.write_bytes(bytes(range(128, 256)) * 100)
    with pytest.raises(ValueError, match="bin.txt' is not UTF-8 text"):
        cal.main(_cfg(tiny_dir, binary, tmp_path / "o5"))
    repetitive = tmp_path / "cat.txt"
    repetitive.write_text("the cat " * 5000)
    with pytest.raises(ValueError, match="distinct tokens"):
        cal.main(_cfg(tiny_dir, repetitive, tmp_path / "o6"))
    with pytest.raises(ValueError, match="--group-size 48 must divide the model's head_dim=32"):
        cal.main(_cfg(tiny_dir, text_file, tmp_path / "o7", group_size=48))
    assert not list(pathlib.Path(tmp_path).glob("**/metadata.json"))
    assert not list(pathlib.Path(tmp_path).glob("**/stats.npz"))  # failed before any work


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        (dict(tokens=0), "--tokens 0"),
        (dict(seq_len=3), "--seq-len 3"),
        (dict(batch_size=0), "--batch-size 0"),
        (dict(holdout=0), "--holdout 0"),
        (dict(group_size=0), "--group-size 0"),
        (dict(gamma=0.0), "--gamma 0.0"),
        (dict(clips="some"), "--clips 'some'"),
        (dict(data="/no/such/file.txt"), "--data '/no/such/file.txt' does not exist"),
        (dict(batch_size=3, data_parallel=2), "multiple of --data-parallel 2"),
        (dict(bpe_budget=-1.0), "--bpe-budget -1.0"),
        (dict(bpe_budget=2.5, alloc_widths=(5,)), "--alloc-widths 5"),
        (dict(bpe_budget=2.5, alloc_meta=("int4",)), "--alloc-meta 'int4'"),
        (dict(bpe_budget=2.5, clips="paper"), "--bpe-budget needs --clips calibrated"),
    ],
)
def test_options_are_checked_before_the_model_loads(kw, msg, tmp_path, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(cal, "load_model", no_load)
    base = dict(data=None, out=str(tmp_path / "o"), progress=False)
    with pytest.raises(ValueError, match=msg):
        cal.main(cal.CalibrateConfig(**{**base, **kw}))


@pytest.mark.slow
def test_bit_allocation_is_stored_with_the_transforms(tiny_dir, text_file, tmp_path):
    from eval import common
    from kvjax.models.loading import load_model
    from kvjax.storage import load_allocation

    # head_dim 32: 2 bits with 8-bit scale/zero is 2.5 BPE, float16 3.0
    with pytest.raises(ValueError, match="--bpe-budget 2.4: below the cheapest"):
        cal.main(_cfg(tiny_dir, text_file, tmp_path / "bad", methods=("wush",), bpe_budget=2.4,
                      allocation_objective="attention"))  # fmt: skip
    assert not (tmp_path / "bad" / "stats.npz").exists()  # refused before the statistics
    cal.main(_cfg(tiny_dir, text_file, tmp_path, methods=("wush",), bpe_budget=3.0,
                  allocation_objective="attention"))  # fmt: skip
    meta = read_metadata(tmp_path / "wush")
    alloc = load_allocation(tmp_path / "wush")
    assert len(alloc.layers) == 2 and alloc.budget == 3.0 and alloc.bpe(32) <= 3.0
    assert set(meta["clips_by_bits"]) == {"2", "3", "4"}
    assert set(meta["bit_errors"]) == {f"{b}b/{m}" for b in (2, 3, 4) for m in ("float16", "uint8")}
    errs = np.asarray(meta["bit_errors"]["2b/float16"])
    assert errs.shape == (2, 2) and np.all(errs > np.asarray(meta["bit_errors"]["4b/float16"]))
    lm = load_model(str(tiny_dir))
    tf, got, _ = common.load_allocated(tmp_path, "wush", lm.cfg, lm.fingerprint)
    assert got == alloc
    want_k = [meta["clips_by_bits"][str(k.bits)]["k"][i] for i, (k, _) in enumerate(alloc.layers)]
    np.testing.assert_allclose(np.asarray(tf.clip_k), want_k)


def test_resume_never_mixes_other_data(tiny_dir, text_file, tmp_path):
    out = tmp_path / "o"
    cfg = _cfg(tiny_dir, text_file, out, methods=("wush",), bits=(2,), tokens=512)
    cal.main(cfg)
    before = (out / "stats.npz").read_bytes()
    other = tmp_path / "other.txt"
    other.write_text(assets.load_play("hamlet")[:60000])  # same settings, other text
    with pytest.raises(ValueError, match="differs: data, windows_sha256"):
        cal.main(dataclasses.replace(cfg, data=str(other)))
    with pytest.raises(ValueError, match="differs: seq_len"):
        cal.main(dataclasses.replace(cfg, seq_len=64))
    assert (out / "stats.npz").read_bytes() == before  # the good file is untouched
    cal.main(dataclasses.replace(cfg, data=str(other), fresh=True))  # asked for: starts over
    assert (out / "stats.npz").read_bytes() != before


def test_hadamard_needs_power_of_two_head_dim(tmp_path, text_file):
    d = tmp_path / "hd48"
    tok = Tokenizer.from_gguf(assets.default_model_path())
    cfg = transformers.LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=96,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=48,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_hf_dir(d)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        cal.main(_cfg(d, text_file, tmp_path / "o", methods=("wush",), tokens=256))
    assert not (tmp_path / "o" / "wush").exists()


@pytest.mark.slow
def test_directional_on_real_model(tmp_path):
    """Shipped SmolLM2, real calibration plays, 2 bits: wush <= oscar < identity, wush < hadamard
    (mean over layers of the held-out attention-output error)."""
    s = cal.main(
        cal.CalibrateConfig(
            methods=("wush", "oscar"),
            tokens=4096,
            seq_len=512,
            bits=(2,),
            holdout=2,
            out=str(tmp_path),
            progress=False,
        )
    )
    mean = {m: float(np.mean(v["output_error"])) for m, v in s["methods"].items()}
    assert mean["wush"] <= mean["oscar"] < mean["identity"], mean
    assert mean["wush"] < mean["hadamard"], mean


def test_relative_out_path_works(tiny_dir, text_file, tmp_path, monkeypatch):
    """The documented `--out runs/calib` form: a path relative to the working directory."""
    monkeypatch.chdir(tmp_path)
    cal.main(_cfg(tiny_dir, text_file, "runs/calib", methods=("wush",), bits=(2,), tokens=256))
    tf, meta = load_transforms("runs/calib/wush")
    assert meta["method"] == "wush"


def test_center_keys_stores_the_mean_and_centres_the_statistics(tiny_dir, text_file, tmp_path):
    """--center-keys: the checkpoint holds each head's mean key over the calibration windows,
    and the statistics (here the key Gram) are of the keys less that mean."""
    cfg = _cfg(tiny_dir, text_file, tmp_path, methods=("kv_pca",), bits=(2,), tokens=512)
    cal.main(dataclasses.replace(cfg, center_keys=True))
    tf, meta = load_transforms(tmp_path / "kv_pca")
    assert meta["center_keys"] is True
    lm = cal.load_model(str(tiny_dir))
    text = text_file.read_text()
    windows = cal.token_windows(text, lm.tokenizer, 128, 512 // 128 + 1, "test")
    calib_windows, _ = cal.split_holdout(windows, 1)
    acts = cal.capture_activations(lm, calib_windows)
    keys = np.stack([k for _, k, _ in acts]).astype(np.float64)  # [L, B, T, Hkv, d]
    mean = keys.mean(axis=(1, 2))
    np.testing.assert_allclose(np.asarray(tf.key_mean), mean, rtol=1e-4, atol=1e-5)
    saved = np.load(tmp_path / "stats.npz")
    count = int(saved["0/count"])
    for layer in range(keys.shape[0]):
        centred = keys[layer] - mean[layer]
        gram = np.einsum("btkx,btky->kxy", centred, centred) / count
        np.testing.assert_allclose(saved[f"{layer}/KK"] / count, gram, rtol=1e-3, atol=1e-5)
    # The same run without the option stores no mean and a Gram of the raw keys.
    plain = tmp_path / "plain"
    cal.main(dataclasses.replace(cfg, out=str(plain)))
    tf0, meta0 = load_transforms(plain / "kv_pca")
    assert tf0.key_mean is None and meta0["center_keys"] is False
