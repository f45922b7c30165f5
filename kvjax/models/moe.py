"""Mixture-of-experts math: routers and the routed-expert mixture, as pure functions.

Routing picks `k` experts per token and their mixing weights (`route`); the mixture
`y_n = sum_j w_nj * E_{idx_nj}(x_n)` with SwiGLU experts `E_e(x) = (silu(x Wg_e) * (x Wu_e)) Wd_e`
is then computed by one of three exact implementations (`routed_experts`):

- `"sorted"` (default): the N*k (token, expert) assignments are sorted by expert and laid out
  in row tiles that each belong to a single expert (every expert's run padded to a multiple of
  the tile height); a loop over tiles multiplies each tile by its own expert's weights. Work is
  at most ~2 N k rows per matmul whatever the expert count, and no per-token weight copies are
  made, so it scales to hundreds of experts.
- `"ragged"`: the same sorted rows through `jax.lax.ragged_dot` (a grouped matmul). Backends
  with a native grouped matmul run it at routed cost; XLA:CPU lowers it densely (every row
  against every expert), which is why it is not the default.
- `"dense"`: every expert on every token, weighted by a mostly-zero [N, E] matrix. E times the
  FLOPs; the slow twin the other two are tested against.

The nnx modules holding the weights live in `kvjax.models.model`; these functions see plain arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.config import MoEConfig

MOE_IMPLS: tuple[str, ...] = ("sorted", "ragged", "dense")
DEFAULT_MAX_TILE_ROWS = 64


def route(
    logits: jax.Array,  # f32[N, E] router logits
    moe: MoEConfig,
    correction_bias: jax.Array | None = None,  # f32[E]; with moe.score_correction_bias
) -> tuple[jax.Array, jax.Array]:
    """Top-k expert choice and mixing weights per token.

    Args:
        logits: router logits `x W_gate^T`, float32.
        moe: scoring, grouping, normalisation and scaling options (see `MoEConfig`).
        correction_bias: the per-expert bias added to sigmoid scores for selection only.

    Returns:
        (weights f32[N, k], indices i32[N, k]); order within the k is not meaningful.

    Raises:
        ValueError: logits are not [N, num_experts], or the bias is missing/unexpected.
    """
    n_exp, k = moe.num_experts, moe.num_experts_per_tok
    if logits.ndim != 2 or logits.shape[1] != n_exp:
        raise ValueError(f"{logits.shape=}; want [N, num_experts={n_exp}]")
    if moe.score_correction_bias != (correction_bias is not None):
        raise ValueError(
            f"correction_bias given={correction_bias is not None} but "
            f"moe.score_correction_bias={moe.score_correction_bias}"
        )
    logits = logits.astype(jnp.float32)
    if moe.scoring == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
    choice = scores
    if correction_bias is not None:
        if correction_bias.shape != (n_exp,):
            raise ValueError(f"{correction_bias.shape=}; want ({n_exp},)")
        choice = scores + correction_bias.astype(jnp.float32)[None, :]
    if moe.n_group > 1:
        choice = _mask_to_best_groups(choice, moe.n_group, moe.topk_group)
    _, idx = jax.lax.top_k(choice, k)  # [N, k]
    weights = jnp.take_along_axis(scores, idx, axis=-1)  # unbiased scores mix the experts
    if moe.norm_topk_prob:
        # The sigmoid router guards the division (its scores can all be ~0); softmax's can't.
        eps = 1e-20 if moe.scoring == "sigmoid" else 0.0
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + eps)
    return weights * moe.routed_scaling_factor, idx.astype(jnp.int32)


def _mask_to_best_groups(
    choice: jax.Array,  # f32[N, E]
    n_group: int,
    topk_group: int,
) -> jax.Array:
    """Sets the scores of experts outside each token's `topk_group` best groups to -inf.

    A group's rank is the sum of its two best scores (GLM-4-MoE / DeepSeek-V3 `noaux_tc`).
    """
    n, e = choice.shape
    grouped = choice.reshape(n, n_group, e // n_group)  # [N, G, E/G]
    group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, G]
    _, best = jax.lax.top_k(group_score, topk_group)  # [N, topk_group]
    keep = jnp.any(best[:, :, None] == jnp.arange(n_group)[None, None, :], axis=1)  # [N, G]
    keep = jnp.repeat(keep, e // n_group, axis=1)  # [N, E]
    return jnp.where(keep, choice, -jnp.inf)


def _check_expert_args(x, idx, weights, w_gate, w_up, w_down) -> None:
    n, d = x.shape
    e, d_g, i = w_gate.shape
    if d_g != d or w_up.shape != w_gate.shape or w_down.shape != (e, i, d):
        raise ValueError(
            f"{x.shape=} {w_gate.shape=} {w_up.shape=} {w_down.shape=}; want x [N, D], "
            "w_gate/w_up [E, D, I], w_down [E, I, D]"
        )
    if idx.ndim != 2 or idx.shape[0] != n or weights.shape != idx.shape:
        raise ValueError(f"{idx.shape=} {weights.shape=}; want both [N={n}, k]")


def _swiglu(x, w_gate, w_up, w_down):
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def _sort_by_expert(idx: jax.Array, num_experts: int, k: int):
    """Assignments sorted by expert: (token of each sorted row, its slot, expert counts)."""
    flat = idx.reshape(-1)  # [M = N*k], token-major
    order = jnp.argsort(flat, stable=True)  # [M]
    counts = jnp.bincount(flat, length=num_experts)  # [E]
    return order, order // k, counts


def tile_plan(num_rows: int, num_experts: int, max_tile_rows: int) -> tuple[int, int]:
    """(tile height b, tile count T) for `num_rows` expert-sorted rows; static shapes.

    Padding wastes fewer than b rows per expert in use (at most min(E, M) of them), so the
    T * b rows computed are bounded by M + min(E, M) (b - 1); choosing b <= M / min(E, M) keeps
    that under 2 M, independent of the expert count.
    """
    if num_rows < 1 or num_experts < 1 or max_tile_rows < 1:
        raise ValueError(f"{num_rows=}, {num_experts=}, {max_tile_rows=} must all be positive")
    used = min(num_experts, num_rows)
    b = max(1, min(max_tile_rows, num_rows // used))
    return b, (num_rows + used * (b - 1)) // b


def routed_experts_sorted(
    x: jax.Array,  # f[N, D]
    idx: jax.Array,  # i32[N, k] chosen experts
    weights: jax.Array,  # f32[N, k] mixing weights
    w_gate: jax.Array,  # f[E, D, I]
    w_up: jax.Array,  # f[E, D, I]
    w_down: jax.Array,  # f[E, I, D]
    *,
    max_tile_rows: int = DEFAULT_MAX_TILE_ROWS,
) -> jax.Array:
    """Routed mixture through expert-sorted row tiles; returns f[N, D] in x's dtype.

    Rows of expert e occupy a contiguous run padded up to a multiple of the tile height b, so
    each tile has one expert. With nz experts in use the tiles hold at most M + nz (b - 1) rows
    (M = N k), a static bound, and b <= M / nz keeps that below 2 M.
    """
    _check_expert_args(x, idx, weights, w_gate, w_up, w_down)
    n, d = x.shape
    num_experts, k = w_gate.shape[0], idx.shape[1]
    m = n * k
    b, num_tiles = tile_plan(m, num_experts, max_tile_rows)
    order, token, counts = _sort_by_expert(idx, num_experts, k)
    expert = idx.reshape(-1)[order]  # [M] nondecreasing
    start = jnp.cumsum(counts) - counts  # [E] first sorted row of each expert
    padded = -(-counts // b) * b  # [E] each run rounded up to whole tiles
    padded_end = jnp.cumsum(padded)  # [E]
    dest = padded_end[expert] - padded[expert] + jnp.arange(m) - start[expert]  # [M]
    rows = jnp.zeros((num_tiles * b, d), x.dtype).at[dest].set(x[token])
    # Tile t starts at row t*b; its expert is the first whose padded run ends after that row.
    # Tiles past the last run hold zeros; they get a valid expert id and are never read back.
    tile_expert = jnp.searchsorted(padded_end, jnp.arange(num_tiles) * b, side="right")
    tile_expert = jnp.minimum(tile_expert, num_experts - 1)  # [T]

    def one_tile(args):
        rows_t, e = args  # [b, D], scalar
        return _swiglu(rows_t, w_gate[e], w_up[e], w_down[e])  # [b, D]

    out_rows = jax.lax.map(one_tile, (rows.reshape(num_tiles, b, d), tile_expert))
    out_rows = out_rows.reshape(num_tiles * b, d)[dest].astype(jnp.float32)  # [M, D] sorted
    mixed = out_rows * weights.reshape(-1)[order][:, None].astype(jnp.float32)
    return jnp.zeros((n, d), jnp.float32).at[token].add(mixed).astype(x.dtype)


def routed_experts_ragged(
    x: jax.Array,  # f[N, D]
    idx: jax.Array,  # i32[N, k]
    weights: jax.Array,  # f32[N, k]
    w_gate: jax.Array,  # f[E, D, I]
    w_up: jax.Array,  # f[E, D, I]
    w_down: jax.Array,  # f[E, I, D]
) -> jax.Array:
    """Routed mixture with `jax.lax.ragged_dot` over expert-sorted rows; f[N, D]."""
    _check_expert_args(x, idx, weights, w_gate, w_up, w_down)
    n, d = x.shape
    num_experts, k = w_gate.shape[0], idx.shape[1]
    order, token, counts = _sort_by_expert(idx, num_experts, k)
    xs = x[token]  # [M, D]
    counts = counts.astype(jnp.int32)
    h = jax.nn.silu(jax.lax.ragged_dot(xs, w_gate, counts)) * jax.lax.ragged_dot(
        xs, w_up, counts
    )  # [M, I]
    ys = jax.lax.ragged_dot(h, w_down, counts).astype(jnp.float32)  # [M, D]
    mixed = ys * weights.reshape(-1)[order][:, None].astype(jnp.float32)
    return jnp.zeros((n, d), jnp.float32).at[token].add(mixed).astype(x.dtype)


def routed_experts_dense(
    x: jax.Array,  # f[N, D]
    idx: jax.Array,  # i32[N, k]
    weights: jax.Array,  # f32[N, k]
    w_gate: jax.Array,  # f[E, D, I]
    w_up: jax.Array,  # f[E, D, I]
    w_down: jax.Array,  # f[E, I, D]
) -> jax.Array:
    """Every expert on every token, mixed by the sparse [N, E] weights (the slow twin)."""
    _check_expert_args(x, idx, weights, w_gate, w_up, w_down)
    n, d = x.shape
    num_experts = w_gate.shape[0]
    h = jax.nn.silu(jnp.einsum("ND,EDI->NEI", x, w_gate)) * jnp.einsum(
        "ND,EDI->NEI", x, w_up
    )  # [N, E, I]
    ys = jnp.einsum("NEI,EID->NED", h, w_down).astype(jnp.float32)  # [N, E, D]
    mix = jnp.zeros((n, num_experts), jnp.float32)
    mix = mix.at[jnp.arange(n)[:, None], idx].add(weights.astype(jnp.float32))  # [N, E]
    return jnp.einsum("NE,NED->ND", mix, ys).astype(x.dtype)


def routed_experts(
    x: jax.Array,  # f[N, D]
    idx: jax.Array,  # i32[N, k]
    weights: jax.Array,  # f32[N, k]
    w_gate: jax.Array,  # f[E, D, I]
    w_up: jax.Array,  # f[E, D, I]
    w_down: jax.Array,  # f[E, I, D]
    *,
    impl: str = "sorted",
) -> jax.Array:
    """The routed mixture by implementation name (one of `MOE_IMPLS`); f[N, D].

    Raises:
        ValueError: unknown `impl` or inconsistent shapes.
    """
    if impl == "sorted":
        return routed_experts_sorted(x, idx, weights, w_gate, w_up, w_down)
    if impl == "ragged":
        return routed_experts_ragged(x, idx, weights, w_gate, w_up, w_down)
    if impl == "dense":
        return routed_experts_dense(x, idx, weights, w_gate, w_up, w_down)
    raise ValueError(f"impl={impl!r}; use one of {MOE_IMPLS}")
