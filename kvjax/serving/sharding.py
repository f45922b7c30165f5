"""Scale-out with JAX itself: logical axis names, one rules table, and mesh helpers.

Logical axes name what an array dimension *is*; `RULES` maps them to mesh axes. Calibration
shards the batch of token windows over the "data" mesh axis: each device runs the forward on its
windows and XLA sums the per-device statistic contributions (the statistics are sums over
tokens), so the result equals the single-device computation.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# logical axis -> mesh axis (None = replicated)
RULES: dict[str, str | None] = {
    "batch": "data",
    "kv_heads": "model",
    "sequence": None,
    "head_dim": None,
}


def make_mesh(data: int | None = None, model: int = 1) -> Mesh:
    """A ("data", "model") mesh over the local devices; data defaults to all of them / model."""
    devices = jax.devices()
    if data is None:
        data = len(devices) // model
    if data * model > len(devices) or data < 1 or model < 1:
        raise ValueError(
            f"mesh data={data} x model={model} needs {data * model} devices, "
            f"{len(devices)} available"
        )
    grid = np.asarray(devices[: data * model]).reshape(data, model)
    return Mesh(grid, ("data", "model"))


def logical_sharding(mesh: Mesh, *logical_axes: str | None) -> NamedSharding:
    """NamedSharding for an array whose dimensions carry these logical names."""
    spec = []
    for name in logical_axes:
        if name is not None and name not in RULES:
            raise ValueError(f"unknown logical axis {name!r}; known: {sorted(RULES)}")
        axis = RULES.get(name) if name is not None else None
        spec.append(axis if axis in mesh.axis_names and mesh.shape[axis] > 1 else None)
    return NamedSharding(mesh, PartitionSpec(*spec))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
