"""Orbax storage of calibrated transforms, with metadata that lets a loader refuse the wrong file.

A transforms checkpoint is a directory:

    metadata.json   format version, method and hyper-parameters, model fingerprint and config,
                    tokens used, data description, kvjax version, sha256 of every array
    arrays/         orbax checkpoint of {a_k, b_k, a_v, b_v, clip_k, clip_v}, plus key_mean
                    when the keys are centred (`kvjax.cache.transforms`; absent: not centred)
    extras.npz      optional named arrays kept with the transforms (the drift check's
                    calibration moments, `kvjax.serving.drift`), digests in the metadata

metadata.json may also hold a bit allocation (``allocation``: per-layer key/value formats and
the budget's accounting, `kvjax.cache.budget.BitAllocation`) and the per-(layer, K/V) errors it
was chosen from (``bit_errors``), written by ``python -m kvjax.calibrate --bpe-budget``.

It is written to a temporary sibling and renamed into place, so an interrupted save never leaves
a directory that looks valid. `load_transforms` checks the format version, the digests (a
truncated or corrupted array fails), the shapes, and the model fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import tempfile
from typing import Any

import jax.numpy as jnp
import numpy as np

from kvjax.cache.budget import BitAllocation
from kvjax.cache.transforms import KVTransforms
from kvjax.config import ModelConfig
from kvjax.serving.drift import DriftReference

FORMAT_VERSION = 1
KVJAX_VERSION = "0.1.0"
_ARRAYS = ("a_k", "b_k", "a_v", "b_v", "clip_k", "clip_v")
_OPTIONAL = ("key_mean",)  # stored only when set; checkpoints without it load as None


class TransformsCheckpointError(ValueError):
    """A transforms checkpoint is missing, corrupt, of an unknown version, or for another model."""


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def _checkpointer():
    import orbax.checkpoint as ocp  # imported lazily: only storage needs it

    return ocp.StandardCheckpointer()


def save_transforms(
    path: str | os.PathLike[str],
    tf: KVTransforms,
    metadata: dict[str, Any],
    extras: dict[str, np.ndarray] | None = None,
) -> None:
    """Writes `tf`, `metadata` (must include 'model_fingerprint') and the optional `extras`
    arrays atomically to `path`."""
    path = pathlib.Path(path).absolute()  # orbax refuses relative paths
    if "model_fingerprint" not in metadata:
        raise ValueError("metadata must include 'model_fingerprint'")
    arrays = {
        k: np.asarray(getattr(tf, k), np.float32)
        for k in _ARRAYS + _OPTIONAL
        if getattr(tf, k) is not None
    }
    for k, a in arrays.items():
        if not np.all(np.isfinite(a)):
            raise ValueError(f"refusing to save non-finite transform array {k}")
    meta = dict(metadata)
    meta.update(
        format_version=FORMAT_VERSION,
        kvjax_version=KVJAX_VERSION,
        values_folded=False,
        shapes={k: list(a.shape) for k, a in arrays.items()},
        digests={k: _digest(a) for k, a in arrays.items()},
    )
    extras = {k: np.asarray(a, np.float32) for k, a in (extras or {}).items()}
    if extras:
        meta["extras"] = {
            k: dict(shape=list(a.shape), digest=_digest(a)) for k, a in extras.items()
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        ckpt = _checkpointer()
        ckpt.save(tmp / "arrays", arrays)
        ckpt.wait_until_finished()
        if extras:
            np.savez(tmp / "extras.npz", **extras)
        (tmp / "metadata.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    path = pathlib.Path(path)
    f = path / "metadata.json"
    if not f.is_file():
        raise TransformsCheckpointError(
            f"{path} is not a kvjax transforms checkpoint (no metadata.json)"
        )
    try:
        meta = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise TransformsCheckpointError(f"{f} is corrupt: {e}") from e
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise TransformsCheckpointError(
            f"{path}: format_version={version!r} is not supported (this kvjax reads "
            f"{FORMAT_VERSION})"
        )
    return meta


def load_extras(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """The checkpoint's extra arrays ({} when it has none), checked against their digests."""
    path = pathlib.Path(path)
    recorded = read_metadata(path).get("extras", {})
    if not recorded:
        return {}
    try:
        with np.load(path / "extras.npz") as f:
            out = {k: np.asarray(f[k]) for k in recorded}
    except (OSError, KeyError, ValueError) as e:
        raise TransformsCheckpointError(f"{path}: cannot read extras.npz ({e})") from e
    for k, a in out.items():
        if list(a.shape) != recorded[k]["shape"] or _digest(a) != recorded[k]["digest"]:
            raise TransformsCheckpointError(f"{path}: extra array {k} does not match its digest")
    return out


def load_drift_reference(path: str | os.PathLike[str]) -> DriftReference:
    """The drift check's calibration moments stored with a transforms checkpoint."""
    extras = load_extras(path)
    if "drift_k" not in extras:
        raise TransformsCheckpointError(
            f"{path} holds no drift reference (calibrated before kvjax stored one: rerun "
            f"python -m kvjax.calibrate)"
        )
    return DriftReference.from_arrays(extras)


def load_allocation(path: str | os.PathLike[str]) -> BitAllocation:
    """The bit allocation stored with a transforms checkpoint (`kvjax.calibrate
    --bpe-budget`): per-layer (key, value) formats, `CacheConfig.layer_quant` via
    `BitAllocation.layer_quant`, per-layer clips via `BitAllocation.clips`."""
    meta = read_metadata(path)
    if "allocation" not in meta:
        raise TransformsCheckpointError(
            f"{path} holds no bit allocation (calibrate with python -m kvjax.calibrate "
            f"--bpe-budget BPE)"
        )
    return BitAllocation.from_dict(meta["allocation"])


def load_transforms(
    path: str | os.PathLike[str],
    cfg: ModelConfig | None = None,
    fingerprint: str | None = None,
) -> tuple[KVTransforms, dict[str, Any]]:
    """Loads and verifies a transforms checkpoint.

    Args:
      path: the checkpoint directory (one method).
      cfg: when given, shapes must match this model.
      fingerprint: when given, must equal the stored model fingerprint.

    Raises:
      TransformsCheckpointError: missing/corrupt/truncated files, unknown format version, or a
        fingerprint/shape mismatch (transforms made for another model).
    """
    path = pathlib.Path(path).absolute()
    meta = read_metadata(path)
    if fingerprint is not None and meta.get("model_fingerprint") != fingerprint:
        raise TransformsCheckpointError(
            f"{path} was calibrated for model {meta.get('model_fingerprint')} "
            f"({meta.get('model_source', '?')}), not for this model ({fingerprint})"
        )
    try:
        arrays = _checkpointer().restore(path / "arrays")
    except Exception as e:  # orbax raises several types for damaged files
        raise TransformsCheckpointError(
            f"{path}: cannot read arrays ({type(e).__name__}: {e})"
        ) from e
    for k in _ARRAYS + tuple(k for k in _OPTIONAL if k in meta["shapes"]):
        if k not in arrays:
            raise TransformsCheckpointError(f"{path}: array {k} is missing")
        a = np.asarray(arrays[k], np.float32)
        if list(a.shape) != meta["shapes"][k] or _digest(a) != meta["digests"][k]:
            raise TransformsCheckpointError(
                f"{path}: array {k} does not match its recorded shape/digest (corrupt or "
                f"truncated checkpoint)"
            )
    tf = KVTransforms(
        *(jnp.asarray(np.asarray(arrays[k], np.float32)) for k in _ARRAYS),
        **{
            k: jnp.asarray(np.asarray(arrays[k], np.float32))
            for k in _OPTIONAL
            if k in meta["shapes"]
        },
    )
    if cfg is not None:
        try:
            tf.check_matches(cfg)
        except ValueError as e:
            raise TransformsCheckpointError(f"{path}: {e}") from e
    return tf, meta
