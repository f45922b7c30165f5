"""Calibrate KV-cache transforms for a model: statistics -> transforms -> clips -> checkpoints.

    python -m kvjax.calibrate                                  # shipped SmolLM2, wush, 64k tokens
    python -m kvjax.calibrate --method wush oscar hadamard --bits 2 4 --out runs/calib
    python -m kvjax.calibrate --model /path/Qwen3-8B --data my_texts/ --tokens 262144

Pipeline (one forward pass over the calibration windows, statistics shared by every method):
1. tokenize the calibration text into `seq_len` windows; the last `holdout` windows are held out;
2. stream per-layer statistics (calib.statistics) through the model's observer, jit-compiled
   per batch; they are saved after every batch to `<out>/stats.npz`, so an interrupted run
   resumes where it stopped when rerun with the same --out and settings;
3. build each method's (A, B) pairs (calib.transforms) in float64 on the host;
4. choose per-layer clips for each bit width on the held-out windows (calib.clip);
5. write one orbax checkpoint per method to `<out>/<method>/` (kvjax.storage) and a summary:
   per-layer attention-output error at 2 bits on the held-out windows for identity, hadamard
   and the calibrated methods (`<out>/summary.json`, printed as a table).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from calib import allocation, errors, sensitivity
from calib import clip as clip_lib
from calib.data import check_text, split_holdout, token_windows
from calib.statistics import finalize_stats, init_stats, required_stats, update_stats
from calib.transforms import _HADAMARD_METHODS, METHODS, TransformPair, build_transforms
from kvjax import assets, cli
from kvjax.cache.budget import BitAllocation
from kvjax.cache.quantizers import QuantConfig
from kvjax.cache.transforms import KVTransforms
from kvjax.models.loading import LoadedModel, load_model
from kvjax.models.model import capture_observed
from kvjax.serving import drift, sharding
from kvjax.storage import KVJAX_VERSION, save_transforms
from pallas_kernels import layout

BASELINES = ("identity", "hadamard")  # always scored in the closing table
HOLDOUT_TOKENS = 512


@dataclasses.dataclass(frozen=True)
class CalibrateConfig:
    model: str | None = cli.option(
        None, "HF checkpoint dir or .gguf (default: the shipped SmolLM2-135M-Instruct)"
    )
    data: str | None = cli.option(
        None, f"calibration text: {assets.TEXT_FORMATS} (default: the shipped plays)"
    )
    text_field: str = cli.option("text", "record field of .jsonl / .parquet / datasets data")
    methods: tuple[str, ...] = cli.option(
        ("wush",), f"one or more of: {', '.join(METHODS)}", flag="--method"
    )
    tokens: int = cli.option(65536, "calibration tokens (held-out windows come on top)")
    # Windows as long as the contexts served: post-RoPE key statistics depend on the positions
    # seen (slow rotary pairs barely turn in short windows). On SmolLM2, wush calibrated on
    # 512-token windows lost 10.4% perplexity at 2 bits on 2048-token held-out text, 5.9% when
    # calibrated on 2048-token windows (notes in RESULTS.md).
    seq_len: int = cli.option(2048, "tokens per calibration window")
    batch_size: int = cli.option(1, "windows per model call")
    bits: tuple[int, ...] = cli.option((2,), "bit widths to calibrate clips for (2, 3, 4)")
    clips: str = cli.option(
        "calibrated",
        "clip ratios: calibrated per layer, or OSCAR's 0.96/0.92",
        choices=("calibrated", "paper"),
    )
    group_size: int | None = cli.option(None, "channels per scale/zero (none: the whole head)")
    share: str = cli.option(
        "head", "one transform per KV head or per layer", choices=("head", "layer")
    )
    gamma: float = cli.option(1e-2, "WUSH damping")
    center_keys: bool = cli.option(
        False,
        "subtract each (layer, KV head)'s mean key (after RoPE) before the transform, in "
        "calibration and in the cache (one extra forward pass over the calibration windows; "
        "the softmax is unchanged)",
    )
    seed: int = cli.option(0, "seed of the random transforms")
    holdout: int = cli.option(2, "held-out calibration windows for clips and the closing table")
    data_parallel: int = cli.option(1, "local devices to shard each batch over (sums of stats)")
    out: str = cli.option("runs/calib", "output folder (one sub-folder per method)")
    progress: bool = cli.option(True, "progress bar of the statistics pass")
    fresh: bool = cli.option(
        False, "start the statistics over even if <out>/stats.npz holds another run's"
    )
    bpe_budget: float | None = cli.option(
        None,
        "choose per-(layer, K/V) widths and scale/zero encodings under this average bits per "
        "element (codes + scale/zero + full-precision windows at --bpe-context), stored with "
        "the transforms",
    )
    bpe_context: int = cli.option(
        0, "context length the budget counts the full-precision windows at (0: low-bit only)"
    )
    bpe_windows: tuple[int, int, int] = cli.option(
        (64, 256, 16), "sink/keep/flush of that accounting", metavar=("SINK", "KEEP", "FLUSH")
    )
    alloc_widths: tuple[int, ...] = cli.option(
        allocation.DEFAULT_WIDTHS, "code widths the allocation chooses from"
    )
    alloc_meta: tuple[str, ...] = cli.option(
        allocation.DEFAULT_META, "scale/zero encodings it chooses from (float16, uint8, ...)"
    )
    allocation_objective: str = cli.option(
        "kl_scaled",
        "what the allocation minimises, summed over (layer, K/V): attention = the layer's "
        "relative attention-output error; kl = the model's next-token KL to full precision "
        "with only that cache quantized, measured at every format (one forward per cache and "
        "format); kl_scaled = that KL measured at the cheapest format, other formats scaled "
        "by their attention error (one forward per cache)",
    )
    alloc_kl_windows: tuple[int, int, int] = cli.option(
        (16, 128, 16),
        "sink/keep/flush of the cache the kl objectives simulate (full-precision windows)",
        metavar=("SINK", "KEEP", "FLUSH"),
    )
    alloc_kl_tokens: int = cli.option(
        HOLDOUT_TOKENS, "positions of each held-out window the kl objectives score"
    )


MIN_SEQ_LEN = 64
MAX_SEQ_LEN = 1 << 20


def validate(cfg: CalibrateConfig) -> None:
    """Every check that needs no model, before anything loads; raises `cli.UsageError`."""
    methods = tuple(dict.fromkeys(cfg.methods))
    bad = [m for m in methods if m not in METHODS]
    cli.check(
        not bad and bool(methods),
        f"unknown method(s) {bad or '(none)'}; choose from {', '.join(METHODS)}",
    )
    for b in cfg.bits:
        cli.check(b in (2, 3, 4), f"--bits {b}: supported 2, 3, 4")
    cli.check(cfg.clips in ("calibrated", "paper"), f"--clips {cfg.clips!r}: use calibrated/paper")
    cli.check(cfg.share in ("head", "layer"), f"--share {cfg.share!r}: use head or layer")
    cli.check(cfg.tokens > 0, f"--tokens {cfg.tokens}: must be > 0")
    cli.check(
        MIN_SEQ_LEN <= cfg.seq_len <= MAX_SEQ_LEN,
        f"--seq-len {cfg.seq_len}: must be in [{MIN_SEQ_LEN}, {MAX_SEQ_LEN}]",
    )
    cli.check(cfg.batch_size >= 1, f"--batch-size {cfg.batch_size}: must be >= 1")
    cli.check(cfg.holdout >= 1, f"--holdout {cfg.holdout}: must be >= 1 (clips are chosen on it)")
    cli.check(
        cfg.group_size is None or cfg.group_size > 0, f"--group-size {cfg.group_size}: must be > 0"
    )
    cli.check(cfg.gamma > 0, f"--gamma {cfg.gamma}: must be > 0")
    cli.check(cfg.data_parallel >= 1, f"--data-parallel {cfg.data_parallel}: must be >= 1")
    cli.check(
        cfg.batch_size % cfg.data_parallel == 0,
        f"--batch-size {cfg.batch_size} must be a multiple of --data-parallel {cfg.data_parallel}",
    )
    cli.check(
        cfg.allocation_objective in sensitivity.OBJECTIVES,
        f"--allocation-objective {cfg.allocation_objective!r}: one of "
        f"{', '.join(sensitivity.OBJECTIVES)}",
    )
    if cfg.bpe_budget is not None:
        b = cfg.bpe_budget
        cli.check(
            math.isfinite(b) and b > 0, f"--bpe-budget {b}: must be a positive bits per element"
        )
        cli.check(cfg.bpe_context >= 0, f"--bpe-context {cfg.bpe_context}: must be >= 0")
        sink, keep, flush = cfg.bpe_windows
        cli.check(
            sink >= 0 and keep >= 1 and flush >= 1, f"--bpe-windows {cfg.bpe_windows}: invalid"
        )
        for w in cfg.alloc_widths:
            cli.check(w in (2, 3, 4), f"--alloc-widths {w}: supported 2, 3, 4")
        for m in cfg.alloc_meta:
            cli.check(
                m in layout.META_DTYPES,
                f"--alloc-meta {m!r}: one of {', '.join(layout.META_DTYPES)}",
            )
        cli.check(
            cfg.clips == "calibrated", "--bpe-budget needs --clips calibrated (clips per width)"
        )
        if cfg.allocation_objective != "attention":
            sink, keep, flush = cfg.alloc_kl_windows
            cli.check(
                sink >= 0 and keep >= 1 and flush >= 1,
                f"--alloc-kl-windows {cfg.alloc_kl_windows}: need sink >= 0, keep and flush >= 1",
            )
            t = min(cfg.alloc_kl_tokens, cfg.seq_len)
            cli.check(
                t - 1 - sink - keep >= flush,
                f"--alloc-kl-tokens {cfg.alloc_kl_tokens} (at --seq-len {cfg.seq_len}): too "
                f"short for --alloc-kl-windows {sink} {keep} {flush}, no position would read a "
                f"low-bit token",
            )
    cli.check_paths_exist(data=cfg.data, model=cfg.model)
    cli.check(not pathlib.Path(cfg.out).is_file(), f"--out {cfg.out!r} is a file, not a directory")


# ------------------------------------------------------------------------------------------
# statistics
# ------------------------------------------------------------------------------------------


def _o_proj_torch(m, layer: int) -> jax.Array:
    return m.layers[layer].self_attn.o_proj.kernel[...].T.astype(jnp.float32)  # [D, Hq*d]


def make_stats_step(lm: LoadedModel, names: frozenset[str]):
    """jit(params, stats, tokens, key_mean) -> stats: one batch through the model, observer
    accumulates; keys less `key_mean` (f32[L, Hkv, d], or None) as the cache will store them."""
    graphdef, _ = nnx.split(lm.model)
    needs_wo = bool({"H_K", "H_V"} & names)

    def step(params, stats, tokens, key_mean=None):
        m = nnx.merge(graphdef, params)
        m.set_observer(
            lambda l, q, k, v, o: update_stats(
                stats[l],
                q,
                _centred(k, key_mean, l),
                v,
                o,
                w_o=_o_proj_torch(m, l) if needs_wo else None,
                sm_scale=lm.cfg.attention_scale,
            )
        )
        m(tokens)
        return capture_observed(m)

    return jax.jit(step, donate_argnums=(1,))


def _centred(k: jax.Array, key_mean: jax.Array | None, layer: int) -> jax.Array:
    return k if key_mean is None else k.astype(jnp.float32) - key_mean[layer]


def key_means(lm: LoadedModel, windows: np.ndarray, batch_size: int) -> np.ndarray:
    """The mean key after RoPE per layer and KV head over `windows`: f32[L, Hkv, d].

    Its own pass, before the statistics: the Grams must be of centred keys, and subtracting
    mu mu^T from float32 sums of keys with a large shared offset would cancel most digits."""
    graphdef, params = nnx.split(lm.model)

    @jax.jit
    def run(params, tokens):
        m = nnx.merge(graphdef, params)
        m.set_observer(lambda l, q, k, v, o: jnp.sum(k.astype(jnp.float32), axis=(0, 1)))
        m(tokens)
        return jnp.stack(capture_observed(m))  # [L, Hkv, d]

    total = np.zeros((lm.cfg.num_layers, lm.cfg.num_kv_heads, lm.cfg.head_dim), np.float64)
    for i in range(0, len(windows), batch_size):
        total += np.asarray(run(params, jnp.asarray(windows[i : i + batch_size])), np.float64)
    return (total / windows.size).astype(np.float32)


def collect_statistics(
    lm: LoadedModel,
    windows: np.ndarray,  # i32[N, T]
    names: frozenset[str],
    batch_size: int,
    resume_file: pathlib.Path | None = None,
    resume_key: dict | None = None,
    progress: bool = True,
    data_parallel: int = 1,
    fresh: bool = False,
    key_mean: np.ndarray | None = None,
) -> tuple[list[dict], float]:
    """Per-layer statistic sums over all windows; resumes from `resume_file` when it matches.

    With `key_mean` (f32[L, Hkv, d]) the statistics see every key less its head's mean.

    A `resume_file` made with another key (other text, tokenizer, model or settings) is never
    mixed in, nor overwritten unless ``fresh``: that raises `cli.UsageError` before any work.

    With `data_parallel` > 1 each batch is sharded over that many devices ("data" mesh axis);
    parameters and statistics are replicated and XLA sums the per-device contributions.

    Returns (stats per layer, tokens/s of the statistics pass).
    """
    cfg = lm.cfg
    stats = [init_stats(names, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    start = 0
    if resume_file is not None and resume_file.is_file() and not fresh:
        saved = np.load(resume_file, allow_pickle=False)
        old = json.loads(str(saved["key"]))
        if old != resume_key:
            differs = sorted(
                k for k in set(old) | set(resume_key) if old.get(k) != resume_key.get(k)
            )
            cli.fail(
                f"{resume_file} holds statistics of other settings or data (differs: "
                f"{', '.join(differs)}); use another --out, or --fresh to start over"
            )
        start = int(saved["batches_done"])
        stats = [{n: jnp.asarray(saved[f"{i}/{n}"]) for n in stats[i]} for i in range(len(stats))]
        print(f"resuming from {resume_file}: {start} batches already done", file=sys.stderr)
    _, params = nnx.split(lm.model)
    step = make_stats_step(lm, names)
    km = None if key_mean is None else jnp.asarray(key_mean, jnp.float32)
    mesh = None
    if data_parallel > 1:
        if batch_size % data_parallel:
            raise ValueError(
                f"batch_size={batch_size} must be a multiple of data_parallel={data_parallel}"
            )
        mesh = sharding.make_mesh(data=data_parallel)
        params = jax.device_put(params, sharding.replicated(mesh))
        stats = jax.device_put(stats, sharding.replicated(mesh))
    n_batches = -(-len(windows) // batch_size)
    bar = tqdm(
        total=len(windows) * windows.shape[1],
        initial=start * batch_size * windows.shape[1],
        unit="tok",
        unit_scale=True,
        disable=not progress,
        desc="statistics",
    )
    t0, tokens_done = None, 0
    for bi in range(start, n_batches):
        batch = jnp.asarray(windows[bi * batch_size : (bi + 1) * batch_size])
        if mesh is not None:
            batch = _check_divisible(batch, data_parallel)
            batch = jax.device_put(batch, sharding.logical_sharding(mesh, "batch", None))
        stats = step(params, stats, batch, km)
        jax.block_until_ready(stats)
        if t0 is None:  # first batch includes compilation; time the rest
            t0 = time.perf_counter()
        else:
            tokens_done += batch.size
        bar.update(batch.size)
        if resume_file is not None:
            _save_resume(resume_file, stats, bi + 1, resume_key)
    bar.close()
    rate = tokens_done / (time.perf_counter() - t0) if tokens_done else float("nan")
    return stats, rate


def _check_divisible(batch: jax.Array, n: int) -> jax.Array:
    """The last batch may be short; a short batch cannot be split evenly, so refuse it."""
    if batch.shape[0] % n:
        raise ValueError(
            f"a batch of {batch.shape[0]} windows cannot be split over {n} devices; "
            f"choose --tokens so the window count is a multiple of the batch size"
        )
    return batch


def _save_resume(path: pathlib.Path, stats: list[dict], batches_done: int, key: dict) -> None:
    arrays = {f"{i}/{n}": np.asarray(x) for i, s in enumerate(stats) for n, x in s.items()}
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, batches_done=batches_done, key=json.dumps(key, sort_keys=True), **arrays)
    os.replace(tmp, path)


def capture_activations(
    lm: LoadedModel, windows: np.ndarray, key_mean: np.ndarray | None = None
) -> list[tuple[np.ndarray, ...]]:
    """Per layer (q, k, v) of `windows` (the held-out set), as float32 numpy; the keys less
    `key_mean` when given (what the clips and errors then see is what the cache stores)."""
    graphdef, params = nnx.split(lm.model)
    km = None if key_mean is None else jnp.asarray(key_mean, jnp.float32)

    @jax.jit
    def run(params, tokens, km):
        m = nnx.merge(graphdef, params)
        m.set_observer(lambda l, q, k, v, o: (q, _centred(k, km, l), v))
        m(tokens)
        return capture_observed(m)

    out = run(params, jnp.asarray(windows), km)
    return [tuple(np.asarray(x) for x in layer) for layer in out]


# ------------------------------------------------------------------------------------------
# transforms, clips, summary
# ------------------------------------------------------------------------------------------


def build_method(
    method: str, final_stats: list[dict], lm: LoadedModel, cfg: CalibrateConfig
) -> list[TransformPair]:
    w_o = [np.asarray(_o_proj_torch(lm.model, i)) for i in range(lm.cfg.num_layers)]
    return [
        build_transforms(
            method,
            final_stats[i],
            num_kv_heads=lm.cfg.num_kv_heads,
            head_dim=lm.cfg.head_dim,
            w_o=w_o[i],
            seed=cfg.seed * 100003 + i,
            gamma=cfg.gamma,
            share=cfg.share,
        )
        for i in range(lm.cfg.num_layers)
    ]


def to_kv_transforms(
    pairs: list[TransformPair], clip_k, clip_v, key_mean: np.ndarray | None = None
) -> KVTransforms:
    f = lambda name: jnp.asarray(np.stack([getattr(p, name) for p in pairs]), jnp.float32)  # noqa
    return KVTransforms(
        f("A_K"),
        f("B_K"),
        f("A_V"),
        f("B_V"),
        jnp.asarray(clip_k, jnp.float32),
        jnp.asarray(clip_v, jnp.float32),
        key_mean=None if key_mean is None else jnp.asarray(key_mean, jnp.float32),
    )


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "sm_scale"))
def _layer_output_error(q, k, v, a_k, b_k, a_v, b_v, ck, cv, w_o, *, bits, group_size, sm_scale):
    qc = QuantConfig(method="oscar", bits=bits, group_size=group_size)
    d = k.shape[-1]
    k_hat = errors.roundtrip(k, a_k, b_k, qc, ck)
    v_hat = errors.roundtrip(v, a_v, b_v, qc, cv)
    e = errors.attention_errors(
        q, k, v, k_hat, v_hat, errors.w_o_heads(w_o, k.shape[2], d), sm_scale
    )
    return e["out_err"] / e["out_ref"]


def output_errors(acts, pairs, clips, w_o, bits, group_size=None, sm_scale=None) -> np.ndarray:
    """Relative module-output error per layer, K and V both quantized (oscar quantizer);
    `sm_scale` None: head_dim ** -0.5."""
    sm = float(acts[0][1].shape[-1] ** -0.5 if sm_scale is None else sm_scale)
    f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return np.asarray(
        [
            float(
                _layer_output_error(
                    f(q),
                    f(k),
                    f(v),
                    f(pr.A_K),
                    f(pr.B_K),
                    f(pr.A_V),
                    f(pr.B_V),
                    f(ck),
                    f(cv),
                    f(wo),
                    bits=bits,
                    group_size=group_size,
                    sm_scale=sm,
                )
            )
            for (q, k, v), pr, (ck, cv), wo in zip(acts, pairs, zip(*clips), w_o)
        ]
    )


@functools.partial(
    jax.jit, static_argnames=("which", "bits", "meta_dtype", "group_size", "sm_scale")
)
def _kv_output_error(q, k, v, a, b, c, w_o, *, which, bits, meta_dtype, group_size, sm_scale):
    qc = QuantConfig(method="oscar", bits=bits, group_size=group_size, meta_dtype=meta_dtype)
    d = k.shape[-1]
    k_hat = errors.roundtrip(k, a, b, qc, c) if which == "k" else k
    v_hat = errors.roundtrip(v, a, b, qc, c) if which == "v" else v
    e = errors.attention_errors(
        q, k, v, k_hat, v_hat, errors.w_o_heads(w_o, k.shape[2], d), sm_scale
    )
    return e["out_err"] / e["out_ref"]


def kv_output_errors(
    acts, pairs, clips, w_o, bits, meta_dtype="float16", group_size=None, sm_scale=None
) -> np.ndarray:  # f64[L, 2]
    """Relative module-output error per layer with only the keys (column 0) or only the values
    (column 1) quantized (oscar quantizer, the clips calibrated for `bits`): the per-(layer,
    K/V) costs a bit allocation trades (`calib.allocation`)."""
    sm = float(acts[0][1].shape[-1] ** -0.5 if sm_scale is None else sm_scale)
    f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    out = np.zeros((len(acts), 2))
    for i, ((q, k, v), pr, ck, cv, wo) in enumerate(zip(acts, pairs, *clips, w_o)):
        for j, (which, a, b, c) in enumerate(
            (("k", pr.A_K, pr.B_K, ck), ("v", pr.A_V, pr.B_V, cv))
        ):
            out[i, j] = float(
                _kv_output_error(
                    f(q), f(k), f(v), f(a), f(b), f(c), f(wo), which=which, bits=bits,
                    meta_dtype=meta_dtype, group_size=group_size, sm_scale=sm,
                )
            )  # fmt: skip
    return out


def bit_errors(acts, pairs, clips_by_bits, w_o, cfg: CalibrateConfig, sm_scale) -> dict:
    """Format name -> f64[L, 2] (`kv_output_errors`) for every allocation candidate."""
    return {
        f.name: kv_output_errors(
            acts, pairs, clips_by_bits[f.bits], w_o, f.bits, f.meta_dtype, cfg.group_size, sm_scale
        )
        for f in allocation.candidate_formats(cfg.alloc_widths, cfg.alloc_meta)
    }


def objective_errors(
    cfg: CalibrateConfig,
    lm: LoadedModel,
    held: np.ndarray,
    pairs,
    clips_by_bits,
    attention: dict,
    key_mean: np.ndarray | None = None,
) -> tuple[dict, dict]:
    """The errors `cfg.allocation_objective` allocates from (format name -> f64[L, 2]) and a
    record of how they were measured, from `attention` (`bit_errors`) and, for the kl
    objectives, forwards of the model on the held-out calibration windows `held`."""
    obj = cfg.allocation_objective
    if obj == "attention":
        return attention, dict(objective=obj)
    formats = allocation.candidate_formats(cfg.alloc_widths, cfg.alloc_meta)
    ref = sensitivity.cheapest(formats, lm.cfg.head_dim, cfg.group_size)
    measure = formats if obj == "kl" else [ref]
    windows = held[:, : cfg.alloc_kl_tokens]
    t0 = time.perf_counter()
    low = [i for i, b in enumerate(allocation.lowbit_layers(lm.cfg)) if b]  # others: no forward
    kl = sensitivity.kl_bit_errors(
        lm, windows, pairs, clips_by_bits, measure, cfg.alloc_kl_windows, cfg.group_size,
        cfg.progress, layers=low, key_mean=key_mean,
    )  # fmt: skip
    info = dict(
        objective=obj,
        windows=int(windows.shape[0]),
        tokens_per_window=int(windows.shape[1]),
        cache_windows=list(cfg.alloc_kl_windows),
        measured_formats=[f.name for f in measure],
        seconds=time.perf_counter() - t0,
    )
    if obj == "kl":
        return kl, info
    info["reference_format"] = ref.name
    return sensitivity.scaled_errors(kl[ref.name], attention, ref.name), info


def allocate_bits(
    cfg: CalibrateConfig, errs: dict, head_dim: int, lowbit: Sequence[bool] | None = None
) -> BitAllocation:
    sink, keep, flush = cfg.bpe_windows
    return allocation.allocate(
        errs,
        cfg.bpe_budget,
        head_dim,
        cfg.group_size,
        context=cfg.bpe_context or None,
        sink=sink,
        keep=keep,
        flush=flush,
        lowbit=lowbit,
    )


def main(cfg: CalibrateConfig) -> dict:
    validate(cfg)
    methods = tuple(dict.fromkeys(cfg.methods))
    out = pathlib.Path(cfg.out)
    t_start = time.perf_counter()

    # The text first: a bad file is reported before the model loads.
    _phase("reading the calibration text" + ("" if cfg.data else " (shipped Shakespeare plays)"))
    # Read only what the windows need (a generous 16 characters per token), not a whole corpus.
    budget = (-(-cfg.tokens // cfg.seq_len) + cfg.holdout) * cfg.seq_len * 16
    text = assets.load_text(
        cfg.data, split="calibration", text_field=cfg.text_field, max_chars=budget
    )
    source = repr(cfg.data) if cfg.data else "the shipped calibration text"
    check_text(text, source)
    shipped = " (shipped SmolLM2-135M; the first run downloads ~93 MB)"
    _phase("loading the model" + ("" if cfg.model else shipped))
    lm = load_model(cfg.model)
    d = lm.cfg.head_dim
    cli.check(
        cfg.group_size is None or d % cfg.group_size == 0,
        f"--group-size {cfg.group_size} must divide the model's head_dim={d}",
    )
    if cfg.bpe_budget is not None:  # feasibility needs head_dim: before the statistics pass
        sink, keep, flush = cfg.bpe_windows
        try:
            allocation.check_budget(
                cfg.bpe_budget,
                allocation.candidate_formats(cfg.alloc_widths, cfg.alloc_meta),
                d,
                cfg.group_size,
                context=cfg.bpe_context or None,
                sink=sink,
                keep=keep,
                flush=flush,
            )
        except ValueError as e:
            cli.fail(str(e))
    if d & (d - 1):
        bad = [m for m in methods if m in _HADAMARD_METHODS]
        if bad:
            raise ValueError(
                f"method(s) {bad} use a Hadamard matrix and need a power-of-two "
                f"head_dim; this model has head_dim={d}"
            )
    if cfg.seq_len > lm.cfg.max_position_embeddings:
        print(
            f"--seq-len {cfg.seq_len} exceeds the model's context "
            f"{lm.cfg.max_position_embeddings}; using the context length",
            file=sys.stderr,
        )
        cfg = dataclasses.replace(cfg, seq_len=lm.cfg.max_position_embeddings)
    n_cal = -(-cfg.tokens // cfg.seq_len)
    windows = token_windows(text, lm.tokenizer, cfg.seq_len, n_cal + cfg.holdout, source)
    if len(windows) <= cfg.holdout:
        raise ValueError(
            f"calibration text gives {len(windows)} windows of {cfg.seq_len} "
            f"tokens; need more than holdout={cfg.holdout}"
        )
    cal, held = split_holdout(windows, cfg.holdout)
    baselines = tuple(m for m in BASELINES if not (d & (d - 1) and m in _HADAMARD_METHODS))
    all_methods = tuple(dict.fromkeys(baselines + methods))
    # C_Q weights the key clip error; KK and VV give the drift check its reference moments.
    names = required_stats(all_methods) | {"C_Q", "KK", "VV"}
    # The token windows' hash covers the text and the tokenizer; every setting that shapes
    # the sums is in the key too, so a resume never mixes two runs' statistics.
    key = dict(
        fingerprint=lm.fingerprint,
        data=cfg.data or "shipped",
        windows_sha256=hashlib.sha256(np.ascontiguousarray(cal).tobytes()).hexdigest(),
        seq_len=cfg.seq_len,
        windows=int(len(cal)),
        batch_size=cfg.batch_size,
        data_parallel=cfg.data_parallel,
        stats=sorted(names),
        center_keys=cfg.center_keys,
    )
    out.mkdir(parents=True, exist_ok=True)
    key_mean = None
    if cfg.center_keys:
        _phase("mean keys (--center-keys)")
        key_mean = key_means(lm, cal, cfg.batch_size)
    stats, rate = collect_statistics(
        lm,
        cal,
        frozenset(names),
        cfg.batch_size,
        out / "stats.npz",
        key,
        cfg.progress,
        cfg.data_parallel,
        cfg.fresh,
        key_mean,
    )
    final = [finalize_stats(s) for s in stats]
    # Clip choice and the closing table score attention over T x T probabilities; the first
    # HOLDOUT_TOKENS positions of each held-out window keep that affordable at long seq_len.
    acts = capture_activations(lm, held[:, :HOLDOUT_TOKENS], key_mean)
    w_o = [np.asarray(_o_proj_torch(lm.model, i)) for i in range(lm.cfg.num_layers)]
    c_q = [f["C_Q"] for f in final]

    summary = dict(
        model=lm.source,
        fingerprint=lm.fingerprint,
        tokens=int(cal.size),
        heldout_windows=int(len(held)),
        heldout_tokens=int(acts[0][1].shape[0] * acts[0][1].shape[1]),  # scored positions
        stats_tokens_per_s=rate,
        methods={},
    )
    table_bits = 2 if 2 in cfg.bits else cfg.bits[0]
    for mi, method in enumerate(all_methods):
        _phase(f"transforms and clips: {method} ({mi + 1}/{len(all_methods)})")
        pairs = build_method(method, final, lm, cfg)
        sm = lm.cfg.attention_scale  # the model's softmax scale (query_pre_attn_scalar, Gemma)
        clips_by_bits = {}
        widths = set(cfg.alloc_widths) if cfg.bpe_budget is not None else set()
        for b in sorted(set(cfg.bits) | {table_bits} | widths):
            if cfg.clips == "paper":
                ck = np.full(lm.cfg.num_layers, clip_lib.PAPER_CLIPS[0], np.float32)
                cv = np.full(lm.cfg.num_layers, clip_lib.PAPER_CLIPS[1], np.float32)
            else:
                ck, cv = clip_lib.calibrate_clips(
                    acts, pairs, c_q, w_o, bits=b, group_size=cfg.group_size, sm_scale=sm
                )
            clips_by_bits[b] = (ck, cv)
        err = output_errors(
            acts, pairs, clips_by_bits[table_bits], w_o, table_bits, cfg.group_size, sm
        )
        summary["methods"][method] = dict(
            output_error=err.tolist(),
            clips={
                str(b): dict(k=c[0].tolist(), v=c[1].tolist()) for b, c in clips_by_bits.items()
            },
        )
        alloc = None
        if method in methods and cfg.bpe_budget is not None:
            _phase(f"bit allocation: {method} at {cfg.bpe_budget} bits per element")
            attn = bit_errors(acts, pairs, clips_by_bits, w_o, cfg, sm)
            errs, how = objective_errors(cfg, lm, held, pairs, clips_by_bits, attn, key_mean)
            # Layers without low-bit pages (Gemma 3's sliding layers) are outside the budget.
            lowbit = allocation.lowbit_layers(lm.cfg)
            how = dict(how, lowbit_layers=[i for i, b in enumerate(lowbit) if b])
            alloc = allocate_bits(cfg, errs, d, lowbit)
            summary["methods"][method]["allocation"] = alloc.to_dict()
            summary["methods"][method]["allocation_objective"] = how
            summary["methods"][method]["bit_errors"] = {n: e.tolist() for n, e in errs.items()}
            if errs is not attn:
                summary["methods"][method]["bit_errors_attention"] = {
                    n: e.tolist() for n, e in attn.items()
                }
            total = sum(
                errs[f.name][i][j]
                for i, p in enumerate(alloc.layers)
                if lowbit[i]
                for j, f in enumerate(p)
            )
            where = f"{cfg.bpe_context} tokens" if cfg.bpe_context else "low-bit pages"
            part = allocation.lowbit_part(alloc, lowbit)
            print(
                f"{method}: allocation at {cfg.bpe_budget} BPE ({where}): {part.counts()} "
                f"({len(part.layers)} of {len(lowbit)} layers hold low-bit pages), "
                f"{part.bpe(d, cfg.group_size):.4f} BPE, summed {cfg.allocation_objective} "
                f"error {total:.4g}",
                file=sys.stderr,
            )
        if method in methods:
            primary = cfg.bits[0]
            tf = to_kv_transforms(pairs, *clips_by_bits[primary], key_mean)
            meta = dict(
                method=method,
                gamma=cfg.gamma,
                center_keys=cfg.center_keys,
                share=cfg.share,
                seed=cfg.seed,
                group_size=cfg.group_size,
                clip_mode=cfg.clips,
                clip_bits=primary,
                clips_by_bits=summary["methods"][method]["clips"],
                model_fingerprint=lm.fingerprint,
                model_source=lm.source,
                model_config=lm.cfg.to_dict(),
                tokens=int(cal.size),
                seq_len=cfg.seq_len,
                data=cfg.data
                or f"shipped Shakespeare calibration plays ({', '.join(assets.CALIBRATION_PLAYS)})",
                kvjax_version=KVJAX_VERSION,
            )
            if alloc is not None:
                meta["allocation"] = alloc.to_dict()
                for k in ("bit_errors", "bit_errors_attention", "allocation_objective"):
                    if k in summary["methods"][method]:
                        meta[k] = summary["methods"][method][k]
            ref = drift.reference_from_grams(
                [f["KK"] for f in final], [f["VV"] for f in final], tf.a_k, tf.a_v
            )
            save_transforms(out / method, tf, meta, extras=ref.arrays())
    summary["seconds"] = time.perf_counter() - t_start
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print_table(summary, table_bits)
    print(f"\nwrote transforms: {', '.join(str(out / m) for m in methods)}")
    print(
        f"      closing table: {out / 'summary.json'}; statistics (for resume): {out / 'stats.npz'}"
    )
    model_arg = f" --model {cfg.model}" if cfg.model else ""
    print(
        f"next: python -m kvjax.generate{model_arg} --transforms {out / methods[0]} "
        f"--bits {cfg.bits[0]} --sink 16 --keep 32 --prompt-file PROMPT.txt\n"
        f"      python -m eval.perplexity --calib-dir {out} --methods {' '.join(methods)}"
    )
    return summary


def _phase(message: str) -> None:
    print(f"[calibrate] {message}", file=sys.stderr, flush=True)


def print_table(summary: dict, bits: int) -> None:
    methods = list(summary["methods"])
    windows = summary.get("heldout_windows", 1)
    per_window = summary["heldout_tokens"] // max(1, windows)
    print(
        f"\nattention-output relative error at {bits} bits, K and V quantized (no full-precision "
        f"windows), on the first {per_window} positions of {windows} held-out calibration "
        f"windows ({summary['heldout_tokens']} tokens scored)"
    )
    print("| layer | " + " | ".join(methods) + " |")
    print("|---" * (len(methods) + 1) + "|")
    errs = [summary["methods"][m]["output_error"] for m in methods]
    for i in range(len(errs[0])):
        print(f"| {i} | " + " | ".join(f"{e[i]:.4f}" for e in errs) + " |")
    print("| mean | " + " | ".join(f"{np.mean(e):.4f}" for e in errs) + " |")
    rate = summary["stats_tokens_per_s"]
    # NaN rate: every batch came from saved statistics (or only the compile batch ran).
    stats_note = "resumed from saved statistics" if np.isnan(rate) else f"{rate:.0f} tokens/s"
    print(f"statistics pass: {stats_note}; total {summary['seconds']:.0f}s")


def parse_args(argv: Sequence[str] | None = None) -> CalibrateConfig:
    parser = cli.dataclass_parser(CalibrateConfig, "python -m kvjax.calibrate", __doc__)
    return cli.dataclass_from_args(CalibrateConfig, parser.parse_args(argv))


if __name__ == "__main__":
    main(parse_args())
