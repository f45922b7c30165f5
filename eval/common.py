"""Shared pieces of the evaluation scripts: model and transforms loading, evaluation windows,
a protocol-exact single-pass simulation of the paged cache, and result writers.

The simulation (`WindowedQuantCache`) exists because the WUSH-KV perplexity protocol feeds each
2048-token window in 16-token chunks through the cache: 128 model calls per window, each reading
the whole paged cache through the pure-jnp reference path. On a 2-core CPU that is about ten
times the cost of one full-window forward. Quantization is per token and deterministic, so which
version of key/value `s` (full precision or its low-bit reconstruction) query `t` reads is fixed
by the cache policy alone: `s` is read from low-bit pages iff `sink <= s < quant_end(c(t))`,
where `c(t)` is the number of tokens stored before the chunk holding `t`. One forward with that
mixed mask computes the same numbers as the chunked paged run (tests check it against
`kvjax.cache.paged` end to end), so `eval.perplexity` can afford the full grid.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import platform
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax import assets
from kvjax.cache.allocator import PageManager
from kvjax.cache.attention import query_blocks, split_heads_by_group
from kvjax.cache.budget import BitAllocation
from kvjax.cache.paged import CacheConfig, LayerPolicy, PagedKVCache
from kvjax.cache.quantizers import QuantConfig, dequantize, quantize
from kvjax.cache.transforms import KVTransforms
from kvjax.config import ModelConfig
from kvjax.models.loading import LoadedModel
from kvjax.models.tokenizer import Tokenizer
from kvjax.storage import load_allocation, load_transforms

FULL_PRECISION = "full_precision"  # the row name of the unquantized baseline
ALL_METHODS: tuple[str, ...] = (
    "identity",
    "random",
    "hadamard",
    "kv_pca",
    "oscar",
    "oscar_tokenweight",
    "wush",
    "wush_a",
)


# ------------------------------------------------------------------------------------------
# windows and transforms
# ------------------------------------------------------------------------------------------


def evaluation_windows(
    tokenizer: Tokenizer,
    seq_len: int,
    num_windows: int,
    text: str | None = None,
) -> np.ndarray:  # i32[N, seq_len]
    """The first `num_windows` non-overlapping `seq_len`-token windows of the evaluation plays.

    A model whose tokenizer puts BOS first (`Tokenizer.add_bos_default`, Gemma) gets BOS as the
    first token of every window (in place of that window's first text token,
    `calib.data.token_windows`): without it Gemma 3 270M's perplexity almost doubles.

    Raises:
        ValueError: num_windows < 1, or the text holds fewer windows than asked for.
    """
    from calib.data import token_windows  # eval sits above calib in the layering

    if num_windows < 1:
        raise ValueError(f"num_windows={num_windows} must be >= 1")
    text = assets.evaluation_text() if text is None else text
    w = token_windows(text, tokenizer, seq_len, num_windows)  # BOS first where the model wants
    if len(w) < num_windows:
        raise ValueError(
            f"evaluation text holds {len(w)} windows of {seq_len} tokens, "
            f"num_windows={num_windows} asked for"
        )
    return w


def load_method(
    calib_dir: str | os.PathLike[str],
    method: str,
    bits: int,
    lm_cfg: ModelConfig,
    fingerprint: str | None,
) -> KVTransforms:
    """One calibrated method's transforms with the clips calibrated for `bits`.

    Args:
      calib_dir: the `--out` folder of `python -m kvjax.calibrate` (one sub-folder per method).
      method: the method name (a sub-folder of calib_dir).
      bits: the bit width whose calibrated clips to use (checkpoints store clips per width).
      lm_cfg: model config the transforms must fit.
      fingerprint: model fingerprint the transforms must have been calibrated for.

    Raises:
        ValueError: the checkpoint is missing, for another model, or has no clips for `bits`.
    """
    path = pathlib.Path(calib_dir) / method
    if not path.is_dir():
        raise ValueError(
            f"no calibrated transforms for method={method!r} at {str(path)!r}; "
            f"run python -m kvjax.calibrate --method {method} --out {calib_dir}"
        )
    tf, meta = load_transforms(path, lm_cfg, fingerprint)
    clips = meta.get("clips_by_bits", {}).get(str(bits))
    if clips is None:
        raise ValueError(
            f"{path} has no clips for bits={bits} (has "
            f"{sorted(meta.get('clips_by_bits', {}))}); recalibrate with --bits"
        )
    return dataclasses.replace(
        tf, clip_k=jnp.asarray(clips["k"], jnp.float32), clip_v=jnp.asarray(clips["v"], jnp.float32)
    )


def load_allocated(
    calib_dir: str | os.PathLike[str],
    method: str,
    lm_cfg: ModelConfig,
    fingerprint: str | None,
    allocation: BitAllocation | None = None,
) -> tuple[KVTransforms, BitAllocation, dict]:
    """One method's transforms with per-layer clips for a bit allocation: the one stored with
    the checkpoint (`kvjax.calibrate --bpe-budget`) or `allocation`. Also returns the
    checkpoint's metadata (its ``bit_errors`` let callers allocate at other budgets)."""
    path = pathlib.Path(calib_dir) / method
    if not path.is_dir():
        raise ValueError(f"no calibrated transforms for method={method!r} at {str(path)!r}")
    tf, meta = load_transforms(path, lm_cfg, fingerprint)
    if allocation is None:
        allocation = load_allocation(path)
    ck, cv = allocation.clips(meta.get("clips_by_bits", {}))
    tf = dataclasses.replace(
        tf, clip_k=jnp.asarray(ck, jnp.float32), clip_v=jnp.asarray(cv, jnp.float32)
    )
    return tf, allocation, meta


# ------------------------------------------------------------------------------------------
# the single-pass simulation of the chunked paged cache
# ------------------------------------------------------------------------------------------


def _roundtrip_stored(x_t: jax.Array, qc: QuantConfig | None, clip: jax.Array) -> jax.Array:
    """What a low-bit page returns for transformed-frame tokens x_t (same calls as the cache)."""
    if qc is None:
        return x_t
    return dequantize(quantize(x_t, qc, clip=clip if qc.method == "oscar" else None))


def low_bit_mask(
    positions: jax.Array,  # i32[B, T] query positions (a window starting at 0)
    cache_cfg: CacheConfig,
    chunk: int,
    decode_from: int | None = None,
) -> jax.Array:  # bool[B, T, T]
    """True where query t reads key s from the low-bit segment under chunked feeding.

    A chunk starting at c sees the cache as stored after c tokens: `[sink, quant_end(c))` is
    low-bit, everything else (sink, recent window, the chunk itself) full precision. Positions
    from `decode_from` on are fed one token per call (greedy decoding after a prefill).
    """
    c0 = (positions // chunk) * chunk  # tokens stored before the chunk holding t
    if decode_from is not None:
        c0 = jnp.where(positions >= decode_from, positions, jnp.minimum(c0, decode_from))
    q_end = cache_cfg.quant_end(c0)
    s = positions[:, None, :]  # key positions
    return (s >= cache_cfg.sink) & (s < q_end[:, :, None]) & (s <= positions[:, :, None])


@flax.struct.dataclass
class WindowedQuantCache:
    """Cache-protocol object for ONE call holding a whole window from position 0.

    It reproduces what `PagedKVCache` computes when the same window is fed `chunk` tokens per
    call (see the module docstring). It stores nothing, so it serves a single call only.
    """

    transforms: KVTransforms
    lengths: jax.Array  # i32[B], must be zeros: the window starts at position 0
    cfg: CacheConfig = flax.struct.field(pytree_node=False)
    chunk: int = flax.struct.field(pytree_node=False)
    sm_scale: float = flax.struct.field(pytree_node=False)
    decode_from: int | None = flax.struct.field(pytree_node=False, default=None)
    # Per layer window and quantizers, as the paged cache resolves them (sliding layers).
    layers: tuple[LayerPolicy, ...] = flax.struct.field(pytree_node=False, default=())

    @classmethod
    def create(
        cls,
        model_cfg: ModelConfig,
        cache_cfg: CacheConfig,
        transforms: KVTransforms,
        batch_size: int,
        chunk: int,
        decode_from: int | None = None,
    ) -> WindowedQuantCache:
        if chunk < 1:
            raise ValueError(f"chunk={chunk} must be >= 1")
        transforms.check_matches(model_cfg)
        return cls(
            transforms=transforms,
            lengths=jnp.zeros((batch_size,), jnp.int32),
            cfg=cache_cfg,
            chunk=chunk,
            sm_scale=model_cfg.attention_scale,
            decode_from=decode_from,
            layers=cache_cfg.layer_policies(model_cfg),
        )

    def attend(
        self,
        layer: int,
        q: jax.Array,  # f[B, T, Hq, d]
        k: jax.Array,  # f[B, T, Hkv, d]
        v: jax.Array,  # f[B, T, Hkv, d]
        positions: jax.Array,  # i32[B, T]
    ) -> tuple[jax.Array, WindowedQuantCache]:
        tf, cfg = self.transforms, self.cfg
        pol = self.layers[layer] if self.layers else LayerPolicy(None, cfg.quant, cfg.value_quant)
        hkv = k.shape[2]
        # The stored frames, as the paged cache forms them: k A_K, v A_V, q B_K^T.
        k_t = tf.keys_to_stored(layer, k)
        v_t = tf.values_to_stored(layer, v)
        q_t = split_heads_by_group(tf.queries_to_key_frame(layer, q), hkv)  # [B, T, K, G, J]
        k_lo = _roundtrip_stored(k_t, pol.quant, tf.clip_k[layer])
        v_lo = _roundtrip_stored(v_t, pol.quant_v, tf.clip_v[layer])

        low = low_bit_mask(positions, cfg, self.chunk, self.decode_from)[
            :, None, None
        ]  # [B, 1, 1, T, S]
        diff = positions[:, None, None, :, None] - positions[:, None, None, None, :]
        causal = diff >= 0  # [B, 1, 1, T, S]
        if pol.window is not None:  # sliding-window layer: keys within the window only
            causal &= diff < pol.window

        def block(a: int, b: int) -> jax.Array:  # queries [a, b) over keys [0, b)
            qb, lo, ca = q_t[:, a:b], low[..., a:b, :b], causal[..., a:b, :b]
            s_fp = jnp.einsum("BTKGH,BSKH->BKGTS", qb, k_t[:, :b])  # [B, K, G, b - a, b]
            s_lo = jnp.einsum("BTKGH,BSKH->BKGTS", qb, k_lo[:, :b])
            s = jnp.where(lo, s_lo, s_fp) * self.sm_scale
            p = jax.nn.softmax(jnp.where(ca, s, -jnp.inf), axis=-1)
            o = jnp.einsum("BKGTS,BSKH->BTKGH", jnp.where(lo, 0.0, p), v_t[:, :b])
            return o + jnp.einsum("BKGTS,BSKH->BTKGH", jnp.where(lo, p, 0.0), v_lo[:, :b])

        # The window starts at position 0, so keys past a query block's end are all masked:
        # blocks of queries skip them (as `causal_self_attention` does).
        o = jnp.concatenate([block(a, b) for a, b in query_blocks(q.shape[1])], axis=1)
        return tf.outputs_from_value_frame(layer, o.reshape(q.shape)), self

    def advance(self, num_tokens: int) -> WindowedQuantCache:
        return self.replace(lengths=self.lengths + num_tokens)


# ------------------------------------------------------------------------------------------
# token log-likelihoods: one pass (simulation / plain forward) or chunked through the cache
# ------------------------------------------------------------------------------------------


def _target_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """log p(target) per position; logits f32[B, T, V], targets i32[B, T] -> f32[B, T]."""
    lp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0]


class _LastPositions(nnx.Module):
    """Wraps the final norm so that only the last `n` positions reach the LM head."""

    def __init__(self, norm: nnx.Module, n: int):
        self.inner = norm
        self.n = n

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.inner(x[:, -self.n :])


class TokenScorer:
    """jit-compiled log p(next token) of windows under a given cache setting.

    One compilation per (cache config, batch shape); transforms are traced arguments, so every
    method at a bit width reuses the same executable.
    """

    def __init__(self, model: nnx.Module):
        self.model = model
        self.graphdef, self.params = nnx.split(model)

        def full(params, tokens, targets, cache):
            m = nnx.merge(self.graphdef, params)
            logits, _ = m(tokens, cache)
            return _target_logprobs(logits, targets), jnp.argmax(logits, -1).astype(jnp.int32)

        def step(params, tokens, targets, cache):
            m = nnx.merge(self.graphdef, params)
            logits, cache = m(tokens, cache)
            return _target_logprobs(logits, targets), cache

        def tail(params, tokens, cache, n):
            m = nnx.merge(self.graphdef, params)
            m.norm = _LastPositions(m.norm, n)  # the [B, T, V] logits would cost ~20% more
            logits, _ = m(tokens, cache)
            return jnp.argmax(logits, -1).astype(jnp.int32)

        self._full = jax.jit(full)
        self._step = jax.jit(step, donate_argnums=(3,))
        self._tail = jax.jit(tail, static_argnums=(3,))

    def one_pass(
        self,
        windows: np.ndarray,  # i32[B, T]
        cache_cfg: CacheConfig | None,
        transforms: KVTransforms | None,
        chunk: int,
        decode_from: int | None = None,
        return_argmax: bool = False,
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:  # f32[B, T-1] (, i32[B, T-1])
        """log p(w[t+1] | w[:t+1]) with the chunked cache simulated in one forward.

        cache_cfg None (or transforms None) is the plain full-precision forward, no cache.
        Positions from `decode_from` on are treated as single-token decode steps. With
        `return_argmax`, also returns the greedy next token at every position.
        """
        tokens = jnp.asarray(windows[:, :-1], jnp.int32)
        targets = jnp.asarray(windows[:, 1:], jnp.int32)
        cache = None
        if cache_cfg is not None and transforms is not None:
            cache = WindowedQuantCache.create(
                self.model.cfg, cache_cfg, transforms, windows.shape[0], chunk, decode_from
            )
        lp, top = self._full(self.params, tokens, targets, cache)
        return (np.asarray(lp), np.asarray(top)) if return_argmax else np.asarray(lp)

    def tail_argmax(
        self,
        windows: np.ndarray,  # i32[B, T]
        cache_cfg: CacheConfig | None,
        transforms: KVTransforms | None,
        chunk: int,
        decode_from: int | None,
        n: int,
    ) -> np.ndarray:  # i32[B, n]
        """`one_pass(..., return_argmax=True)[1][:, -n:]`, with the LM head applied to those n
        positions only (greedy answers of retrieval prompts)."""
        tokens = jnp.asarray(windows[:, :-1], jnp.int32)
        cache = None
        if cache_cfg is not None and transforms is not None:
            cache = WindowedQuantCache.create(
                self.model.cfg, cache_cfg, transforms, windows.shape[0], chunk, decode_from
            )
        return np.asarray(self._tail(self.params, tokens, cache, n))

    def chunked(
        self,
        windows: np.ndarray,  # i32[B, T]
        cache_cfg: CacheConfig,
        transforms: KVTransforms,
        chunk: int,
        decode_from: int | None = None,
    ) -> np.ndarray:  # f32[B, T-1]
        """The same log-likelihoods fed `chunk` tokens per call through the real paged cache
        (one token per call from `decode_from` on, as greedy decoding after a prefill)."""
        b, t = windows.shape
        ccfg = dataclasses.replace(cache_cfg, max_seq_len=max(cache_cfg.max_seq_len, t))
        # The step donates the cache, transforms included: give it private copies so the
        # caller's arrays survive (and aliased A/B arrays are not donated twice).
        own = jax.tree.map(lambda x: jnp.array(x, copy=True), transforms)
        cache = PagedKVCache.create(self.model.cfg, ccfg, own, b)
        mgr = PageManager(cache)
        tokens, targets = windows[:, :-1], windows[:, 1:]
        stop = t - 1 if decode_from is None else min(decode_from, t - 1)
        bounds = [(i, min(i + chunk, stop)) for i in range(0, stop, chunk)]
        bounds += [(i, i + 1) for i in range(stop, t - 1)]
        out = []
        for i, j in bounds:
            cache = mgr.prepare(cache, j - i)
            lp, cache = self._step(
                self.params, jnp.asarray(tokens[:, i:j]), jnp.asarray(targets[:, i:j]), cache
            )
            out.append(np.asarray(lp))
        return np.concatenate(out, axis=1)


# ------------------------------------------------------------------------------------------
# result files
# ------------------------------------------------------------------------------------------


def git_commit() -> str:
    """The checkout's commit (``+dirty`` with uncommitted changes), or ``unknown``.

    ``KVJAX_COMMIT`` overrides it: a copy of the tree on another machine (the device runs)
    may carry another commit's ``.git``."""
    import subprocess

    if os.environ.get("KVJAX_COMMIT"):
        return os.environ["KVJAX_COMMIT"]
    here = pathlib.Path(__file__).resolve().parent
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
        )
    except OSError:
        return "unknown"
    if rev.returncode:
        return "unknown"
    return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def command_line() -> str:
    """The command that is running, as a user would type it (``python -m module args``), with
    ``XLA_FLAGS`` in front where set: the flags change what XLA compiles and so the timings."""
    import shlex
    import sys

    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    head = (
        ["python", "-m", spec.name] if spec is not None and spec.name else ["python", *sys.argv[:1]]
    )
    flags = os.environ.get("XLA_FLAGS", "").strip()
    return (f"XLA_FLAGS={shlex.quote(flags)} " if flags else "") + shlex.join(head + sys.argv[1:])


def environment() -> dict[str, Any]:
    """Command, commit, date, machine and library versions, recorded in every result file."""
    return dict(
        command=command_line(),
        commit=git_commit(),
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        machine=f"{platform.machine()} {platform.processor() or ''}".strip(),
        cpu_count=os.cpu_count(),
        jax_version=jax.__version__,
        jax_backend=jax.default_backend(),
        python=platform.python_version(),
    )


def model_info(lm: LoadedModel) -> dict[str, Any]:
    return dict(
        source=lm.source,
        fingerprint=lm.fingerprint,
        num_layers=lm.cfg.num_layers,
        num_heads=lm.cfg.num_heads,
        num_kv_heads=lm.cfg.num_kv_heads,
        head_dim=lm.cfg.head_dim,
    )


def write_results(
    out_dir: str | os.PathLike[str],
    name: str,
    payload: dict[str, Any],
    markdown: str,
) -> tuple[pathlib.Path, pathlib.Path]:
    """Writes `<out_dir>/<name>.json` and `<out_dir>/<name>.md`; returns both paths."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jpath, mpath = out / f"{name}.json", out / f"{name}.md"
    jpath.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    mpath.write_text(markdown if markdown.endswith("\n") else markdown + "\n")
    return jpath, mpath


def read_runs(paths: Sequence[str], eval_name: str) -> list[dict[str, Any]]:
    """The payloads of `--merge`'s result files, in order. Fails naming the file where one is
    unreadable, holds another evaluation, or scored another model than the first."""
    payloads = []
    for p in paths:
        try:
            payloads.append(json.loads(pathlib.Path(p).read_text()))
        except (OSError, ValueError) as e:
            raise ValueError(f"--merge {p}: not a readable {eval_name}.json ({e})") from None
        if payloads[-1].get("eval") != eval_name:
            raise ValueError(f"--merge {p}: eval={payloads[-1].get('eval')!r}, not {eval_name}")
        if payloads[-1]["model"].get("fingerprint") != payloads[0]["model"].get("fingerprint"):
            raise ValueError(f"--merge {p}: another model than {paths[0]}'s")
    return payloads


def config_fields(conf: dict[str, Any], cls: type) -> dict[str, Any]:
    """A stored config's fields that dataclass `cls` has, JSON lists back as tuples."""
    fields = {f.name for f in dataclasses.fields(cls)}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in conf.items() if k in fields}


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats are written as given (format them before)."""
    lines = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def check_methods(methods: Sequence[str]) -> None:
    """Raises ValueError naming any method that is not a known transform."""
    bad = [m for m in methods if m not in ALL_METHODS]
    if bad:
        raise ValueError(f"unknown method(s) {bad}; choose from {', '.join(ALL_METHODS)}")


# ------------------------------------------------------------------------------------------
# random-weight models of real shapes (speed on machines the shipped model cannot reach)
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A decoder's shapes; the defaults are Qwen3-8B's (36 layers, 32 q / 8 kv heads, d 128)."""

    layers: int = 36
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    vocab_size: int = 151936

    def model_config(self, max_len: int = 4096) -> ModelConfig:
        return ModelConfig(
            model_type="qwen3",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rope_theta=1e6,
            max_position_embeddings=max(4096, max_len),
            qk_norm=True,
        )


def random_model(shape: ModelShape, max_len: int = 4096):
    """A Transformer with random weights: bf16 on accelerators, float32 on CPU."""
    from kvjax.models.model import Transformer

    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    return Transformer(shape.model_config(max_len), dtype, rngs=nnx.Rngs(0))
