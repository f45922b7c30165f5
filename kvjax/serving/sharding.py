"""Scale-out with JAX itself: logical axis names, one rules table, and mesh helpers.

Logical axes name what an array dimension *is*; `RULES` maps them to mesh axes. Calibration
shards the batch of token windows over the "data" mesh axis: each device runs the forward on its
windows and XLA sums the per-device statistic contributions (the statistics are sums over
tokens), so the result equals the single-device computation.

Serving is tensor parallel over the "model" axis: attention heads (query heads with their KV
heads, so a GQA group never straddles devices), MLP columns and the cache's KV-head dimension
are split (`param_shardings`, `cache_shardings`); XLA partitions the model's matmuls and adds
the reductions, and the Pallas decode kernels run per device under `shard_map` on the device's
KV heads (`kvjax.cache.paged`). A paged cache's pools serve every sequence, so sequences are
not split over "data" in serving: each data-parallel replica is its own engine.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# logical axis -> mesh axis (None = replicated)
RULES: dict[str, str | None] = {
    "batch": "data",
    "kv_heads": "model",
    "heads": "model",
    "mlp": "model",
    "embed": None,
    "vocab": None,
    "sequence": None,
    "head_dim": None,
    "pages": None,
}

# Module name -> logical axes of its kernel (a bias takes the kernel's last axis).
PARAM_AXES: dict[str, tuple[str, str]] = {
    "q_proj": ("embed", "heads"),
    "k_proj": ("embed", "kv_heads"),
    "v_proj": ("embed", "kv_heads"),
    "o_proj": ("heads", "embed"),
    "gate_proj": ("embed", "mlp"),
    "up_proj": ("embed", "mlp"),
    "down_proj": ("mlp", "embed"),
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


def check_divides(mesh: Mesh, cfg) -> None:
    """Raises ValueError when the model's heads or MLP do not split over the "model" axis."""
    m = mesh.shape.get("model", 1)
    for name, n in (
        ("num_kv_heads", cfg.num_kv_heads),
        ("intermediate_size", cfg.intermediate_size),
    ):
        if n % m:
            raise ValueError(f"{name}={n} does not split over a {m}-way 'model' mesh axis")


def param_shardings(mesh: Mesh, state):
    """A NamedSharding per parameter of an `nnx.state` pytree, from `PARAM_AXES`: projection
    kernels split by heads or MLP columns, everything else (norms, embeddings, experts)
    replicated."""

    def one(path, x):
        names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        names = [n for n in names if isinstance(n, str) and n != "value"]
        module = names[-2] if len(names) >= 2 else None
        axes = PARAM_AXES.get(module)
        if axes is None or x.ndim not in (1, 2):
            return replicated(mesh)
        if x.ndim == 1:  # bias
            return logical_sharding(mesh, axes[1])
        return logical_sharding(mesh, *axes)

    return jax.tree_util.tree_map_with_path(one, state)


def cache_shardings(mesh: Mesh, cache):
    """Shardings for a paged or dense cache: every pool split on its KV-head dimension (dim 1
    of paged pools [pages, kv_heads, page, w], dim 2 of dense [batch, seq, kv_heads, d]);
    tables, lengths and transforms replicated."""
    from kvjax.cache.dense import DenseKVCache

    kv_dim = 2 if isinstance(cache, DenseKVCache) else 1

    def pools_sharding(x):
        axes = [None] * x.ndim
        axes[kv_dim] = "kv_heads"
        return logical_sharding(mesh, *axes)

    if isinstance(cache, DenseKVCache):
        return cache.replace(
            k=tuple(pools_sharding(x) for x in cache.k),
            v=tuple(pools_sharding(x) for x in cache.v),
            lengths=replicated(mesh),
        )
    return cache.replace(
        pools=jax.tree.map(pools_sharding, cache.pools),
        lengths=replicated(mesh),
        transforms=None
        if cache.transforms is None
        else jax.tree.map(lambda _: replicated(mesh), cache.transforms),
    )
