"""Bit allocation: per-(layer, K/V) low-bit formats that minimise the summed measured error
under an average bits-per-element budget.

The math (`allocate_core`) is a multiple-choice knapsack: slot ``s`` (one layer's keys or
values) takes exactly one format ``f`` at integer cost ``c[s, f]`` (stored bits per token of one
KV head, `kvjax.cache.budget.Format.bits_per_token`) and measured error ``e[s, f]``; minimise
``sum_s e[s, f_s]`` subject to ``sum_s c[s, f_s] <= C``. Costs are small integers (a few hundred
per slot), so a dynamic program over the total cost solves it exactly in
``O(slots * formats * C)`` (milliseconds at 30-100 slots), rather than the greedy / Lagrangian
relaxation, which can leave budget on the table between hull points.

The glue (`allocate`) turns a budget stated with `kvjax.cache.budget.cache_bpe`'s accounting
(full-precision windows at a context length included) into the low-bit pages' share, and
returns a `BitAllocation`.

Only layers that hold low-bit pages take part (`lowbit_layers`): Gemma 3's sliding-window
layers keep full precision in the cache (`CacheConfig.sliding_layers`), so a format chosen for
them would never be stored, and counting them in the budget would let the global layers spend
bits the sliding layers "saved". Such layers are left out of the knapsack and of the budget and
carry the cheapest format as a placeholder the cache ignores; `lowbit_part` is the allocation
of the layers that count, for bits per element and format counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from kvjax.cache.budget import BitAllocation, Format, lowbit_fraction
from kvjax.cache.paged import CacheConfig
from kvjax.config import ModelConfig

DEFAULT_WIDTHS: tuple[int, ...] = (2, 3, 4)
DEFAULT_META: tuple[str, ...] = ("float16", "uint8")


def allocate_core(
    errors: np.ndarray,  # f[S, F] measured error of slot s in format f
    costs: np.ndarray,  # i[S, F] integer cost of slot s in format f
    capacity: int,  # total cost allowed
) -> np.ndarray:  # i[S] chosen format of each slot
    """Exact minimum of ``sum_s errors[s, f_s]`` with ``sum_s costs[s, f_s] <= capacity``.

    Raises:
      ValueError: shapes disagree, a cost is negative, or even the cheapest choice of every
        slot costs more than ``capacity``.
    """
    errors = np.asarray(errors, np.float64)
    costs = np.asarray(costs)
    if errors.shape != costs.shape or errors.ndim != 2:
        raise ValueError(f"{errors.shape=} and {costs.shape=} must be equal [slots, formats]")
    if not np.issubdtype(costs.dtype, np.integer) or (costs < 0).any():
        raise ValueError("costs must be non-negative integers")
    cheapest = int(costs.min(axis=1).sum())
    if cheapest > capacity:
        raise ValueError(f"capacity {capacity} is below the cheapest allocation's {cheapest}")
    n_slots, _ = errors.shape
    cap = int(capacity)
    inf = np.inf
    best = np.zeros(cap + 1)  # best[c]: least error of the slots so far with total cost <= c
    choice = np.zeros((n_slots, cap + 1), np.int16)
    for s in range(n_slots):
        new = np.full(cap + 1, inf)
        for f in range(errors.shape[1]):
            c = int(costs[s, f])
            if c > cap:
                continue
            cand = np.full(cap + 1, inf)
            cand[c:] = best[: cap + 1 - c] + errors[s, f]
            better = cand < new
            new[better] = cand[better]
            choice[s, better] = f
        best = new
    out = np.zeros(n_slots, np.int64)
    c = cap
    for s in range(n_slots - 1, -1, -1):  # walk back through the choices
        f = int(choice[s, c])
        out[s] = f
        c -= int(costs[s, f])
    return out


def lowbit_budget(budget: float, context: int | None, sink: int, keep: int, flush: int,
                  fp_bits: int) -> float:  # fmt: skip
    """The low-bit pages' average bits per element that a total ``budget`` leaves after the
    full-precision windows (`kvjax.cache.budget.cache_bpe`)."""
    f_low = lowbit_fraction(context, sink, keep, flush)
    if f_low <= 0:
        raise ValueError(
            f"at context={context} with sink={sink}, keep={keep} no token is in low-bit pages"
        )
    return (budget - (1.0 - f_low) * fp_bits) / f_low


def check_budget(
    budget: float,
    formats: Sequence[Format],
    head_dim: int,
    group_size: int | None = None,
    *,
    context: int | None = None,
    sink: int = 64,
    keep: int = 256,
    flush: int = 16,
    fp_bits: int = 16,
) -> None:
    """Raises ValueError (one line, naming the budget) when no allocation of `formats` fits."""
    if not np.isfinite(budget) or budget <= 0:
        raise ValueError(f"--bpe-budget {budget}: must be a positive number of bits per element")
    low = lowbit_budget(budget, context, sink, keep, flush, fp_bits)
    cheapest = min(f.bits_per_element(head_dim, group_size) for f in formats)
    if low < cheapest - 1e-9:
        at = "in low-bit pages" if context is None else f"at {context} tokens"
        need = (
            cheapest
            if context is None
            else budget + (cheapest - low) * lowbit_fraction(context, sink, keep, flush)
        )
        raise ValueError(
            f"--bpe-budget {budget}: below the cheapest allocation ({need:.4g} bits per element "
            f"{at}, every cache {min(formats, key=lambda f: f.bits_per_element(head_dim)).name})"
        )


def lowbit_layers(model_cfg: ModelConfig) -> tuple[bool, ...]:
    """Per layer: whether it holds low-bit pages under the cache's default policy
    (`CacheConfig.layer_policies`; False for Gemma 3's sliding-window layers)."""
    return tuple(p.quant is not None for p in CacheConfig().layer_policies(model_cfg))


def lowbit_part(alloc: BitAllocation, lowbit: Sequence[bool] | None) -> BitAllocation:
    """`alloc` restricted to the layers that hold low-bit pages (all of them when None)."""
    if lowbit is None or all(lowbit):
        return alloc
    if len(lowbit) != len(alloc.layers):
        raise ValueError(f"lowbit has {len(lowbit)} layers, the allocation {len(alloc.layers)}")
    layers = tuple(p for p, low in zip(alloc.layers, lowbit) if low)
    return dataclasses.replace(alloc, layers=layers)


def allocate(
    errors: dict[str, np.ndarray],  # format name -> f[L, 2] error of (layer, K/V)
    budget: float,
    head_dim: int,
    group_size: int | None = None,
    *,
    context: int | None = None,
    sink: int = 64,
    keep: int = 256,
    flush: int = 16,
    fp_bits: int = 16,
    lowbit: Sequence[bool] | None = None,
) -> BitAllocation:
    """The formats of `errors` per (layer, K/V) minimising their summed error under `budget`.

    Args:
      errors: measured error per format (`Format.name`), one row per layer, columns keys and
        values (`calib.calibrate.kv_output_errors`).
      budget: average bits per element (`kvjax.cache.budget.cache_bpe`'s accounting).
      head_dim, group_size: the cache's shapes (scale/zero cost per element).
      context, sink, keep, flush, fp_bits: the accounting of the budget; context None: the
        low-bit pages alone (long-context limit).
      lowbit: per layer, whether it holds low-bit pages (`lowbit_layers`; None: all). The
        budget is the average over those layers only; the others get the cheapest format as
        an unused placeholder.
    """
    formats = [Format.parse(n) for n in errors]
    check_budget(budget, formats, head_dim, group_size, context=context, sink=sink, keep=keep,
                 flush=flush, fp_bits=fp_bits)  # fmt: skip
    low = lowbit_budget(budget, context, sink, keep, flush, fp_bits)
    e = np.stack([np.asarray(errors[f.name], np.float64).reshape(-1) for f in formats], axis=1)
    n_slots = e.shape[0]
    keep_layer = np.ones(n_slots // 2, bool) if lowbit is None else np.asarray(lowbit, bool)
    if keep_layer.shape != (n_slots // 2,):
        raise ValueError(f"lowbit has {keep_layer.size} layers, the errors {n_slots // 2}")
    if not keep_layer.any():
        raise ValueError("no layer holds low-bit pages: nothing to allocate")
    used = np.repeat(keep_layer, 2)  # slot 2 l: layer l's keys, 2 l + 1: its values
    per_slot = np.asarray([f.bits_per_token(head_dim, group_size) for f in formats], np.int64)
    costs = np.broadcast_to(per_slot, e.shape).copy()
    capacity = int(np.floor(low * head_dim * int(used.sum()) + 1e-6))
    pick = np.full(n_slots, int(np.argmin(per_slot)), np.int64)  # placeholder: the cheapest
    pick[used] = allocate_core(e[used], costs[used], capacity)
    chosen = [formats[i] for i in pick]
    layers = tuple((chosen[2 * i], chosen[2 * i + 1]) for i in range(n_slots // 2))
    return BitAllocation(layers, budget=budget, context=context, sink=sink, keep=keep,
                         flush=flush, fp_bits=fp_bits)  # fmt: skip


def candidate_formats(
    widths: Sequence[int] = DEFAULT_WIDTHS, meta: Sequence[str] = DEFAULT_META
) -> list[Format]:
    return [Format(b, m) for b in widths for m in meta]
