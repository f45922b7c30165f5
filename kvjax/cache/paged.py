"""The paged mixed-precision KV cache: the one module that owns the cache policy.

Per sequence, positions split into three segments (DESIGN.md section 4):

    [0, sink)           full precision   ("sink" pages)
    [sink, quant_end)   low-bit          (2/3/4-bit codes + per-group scale/zero)
    [quant_end, S)      full precision   ("recent" pages)

`quant_end` advances in multiples of `flush` so that at least `keep` recent positions stay in
full precision. Everything is stored in the transformed frame (`x @ A`, `kvjax.cache.transforms`).

Two objects split the work:

- `PagedKVCache` is the device-side pytree: page pools per layer, page tables, the index plan of
  the current step. It implements the cache protocol of `kvjax.cache.dense` (`attend`, `advance`)
  and runs under jit.
- `PageManager` (`kvjax.cache.allocator`) is the host-side allocator: free lists and
  per-sequence page lists. Before each model call `prepare(cache, num_new)` plans where every
  new token goes and which recent pages flush into low-bit pages, raising `PagePoolExhausted`
  *before* changing anything when a pool is too small, so stored sequences are never touched
  by a failed step. Plans have fixed shapes per chunk length, with one exception: a step in
  which no sequence flushes carries zero flush slots (most decode steps), so a jitted step
  compiles at most twice per length.

Within one call, the new tokens' queries attend to everything stored before the call plus the new
tokens themselves in full precision (causally); the flush into low-bit pages happens after. This
is what a serving prefill does, and with 16-token chunks it is the WUSH-KV perplexity protocol.

Sliding-window layers (Gemma 3's local layers, `ModelConfig.layer_windows`): a query at position
t reads only keys at positions > t - window. Every layer shares one page plan, so a sliding layer
stores the same segments as a global one; its policy (`CacheConfig.sliding_layers`, resolved per
layer by `CacheConfig.layer_policies`) decides whether its middle segment is low-bit or kept in
full precision (the default). Stored positions follow from the plan alone: fp slot i of the
gathered fp pages holds position i (sink) or i + low_len (recent), low-bit slot j holds
sink + j. The Pallas decode kernels take no window yet, so sliding layers always decode through
the reference path (a correct but slower gather of the whole page table).

Page layout and bit packing come from `pallas_kernels.layout`; nothing here does bit arithmetic.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import flax.struct
import jax
import jax.numpy as jnp

from kvjax.cache.attention import (
    attention_partial,
    empty_partial,
    finish_partial,
    merge_partials,
    split_heads_by_group,
)
from kvjax.cache.quantizers import QuantConfig, QuantizedArray, dequantize, quantize
from kvjax.cache.transforms import KVTransforms
from kvjax.config import ModelConfig
from pallas_kernels import layout as lay

SLIDING_LAYER_POLICIES: tuple[str, ...] = ("full_precision", "quantized")
# Low-bit tokens the reference path dequantizes and scores at once (one online-softmax block).
LOWBIT_KEY_BLOCK = 1024


@dataclasses.dataclass(frozen=True)
class LayerPolicy:
    """How one layer's keys and values are kept: its attention window and middle-segment
    quantizers (None: that segment holds full-precision tokens in the transformed frame).

    Attributes:
      window: sliding-window length in tokens, or None for full causal attention.
      quant, quant_v: key and value quantizers of the middle segment.
    """

    window: int | None
    quant: QuantConfig | None
    quant_v: QuantConfig | None


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Cache policy and pool sizes.

    Attributes:
      sink, keep, flush: window policy in tokens (defaults 64 / 256 / 16; the WUSH-KV perplexity
        protocol uses 16 / 128 / 16). sink and flush must be multiples of page_size.
      page_size: tokens per full-precision page.
      lowbit_page_size: tokens per low-bit page (None: page_size). flush must be a multiple
        of it, so every step writes whole low-bit pages. The Mosaic GPU decode body reads
        low-bit pages of 64 or 128 tokens (and dims-major values at 128).
      value_layout: 'tokens' (value codes packed along dimensions, like keys) or 'dims'
        (packed along a page's tokens, `pallas_kernels.layout`: what the Mosaic GPU body's
        value MMA reads in place; 2- or 4-bit values only).
      quant: quantizer for the middle segment; None keeps it in full precision (an identity
        quantizer, used to test the paging and transform plumbing exactly).
      quant_v: quantizer for values if it differs from keys (default: same as `quant`).
      fp_dtype: dtype of full-precision pages.
      max_seq_len: longest sequence a page table can describe.
      num_lowbit_pages, num_fp_pages: pool sizes (pages per layer); None sizes the pools so every
        batch slot can reach max_seq_len.
      attention: 'reference' (pure jnp) or 'pallas' (decode kernels; single-token steps).
        Sliding-window layers decode through the reference path either way (the kernels take
        no window mask).
      sliding_layers: policy of sliding-window layers (Gemma 3's local layers).
        'full_precision' (default): their middle segment is stored unquantized, so every key
        such a layer can see is exact; their pools are sized like the others' (a window-sized
        ring buffer would need a plan of its own). 'quantized': they follow `quant` /
        `quant_v` like global layers.
      layer_quant: a bit allocation: one (key, value) quantizer pair per layer, each with its
        own width and metadata encoding (`kvjax.cache.budget`; `python -m kvjax.calibrate
        --bpe-budget` stores one with the transforms, `kvjax.storage.load_allocation` reads
        it). None: every layer uses `quant` / `quant_v`. Needs `quant` (the low-bit segment
        exists at all); sliding layers still follow `sliding_layers`. With
        attention='pallas', layers whose K or V width is 3 (bit-sliced rows) are stored and
        decoded through the reference path.
      flush_rows: flush rows of a planned decode window when few of its rows flush (None:
        4x the expected count, 4 * ceil(B / flush), at least 8). The planner packs each
        step's flushing rows into this many rows, or all B when more flush in one step
        (`PageManager.plan_window`): in serving a row flushes once in `flush` steps, so a
        step quantizes a few rows' slots, not all B rows'. Each of the two row counts is its
        own compiled window; with the default, staggered rows (serving) need only the first.
    """

    sink: int = 64
    keep: int = 256
    flush: int = 16
    page_size: int = 16
    lowbit_page_size: int | None = None
    value_layout: Literal["tokens", "dims"] = "tokens"
    quant: QuantConfig | None = dataclasses.field(default_factory=QuantConfig)
    quant_v: QuantConfig | None = None
    fp_dtype: str = "float32"
    max_seq_len: int = 4096
    num_lowbit_pages: int | None = None
    num_fp_pages: int | None = None
    attention: Literal["reference", "pallas"] = "reference"
    sliding_layers: Literal["full_precision", "quantized"] = "full_precision"
    layer_quant: tuple[tuple[QuantConfig, QuantConfig], ...] | None = None
    flush_rows: int | None = None

    def __post_init__(self):
        p = self.page_size
        if p <= 0 or self.flush <= 0 or self.sink < 0 or self.keep < 0:
            raise ValueError(
                f"invalid windows: page_size={p} sink={self.sink} "
                f"keep={self.keep} flush={self.flush}"
            )
        if self.sink % p or self.flush % p:
            raise ValueError(
                f"sink={self.sink} and flush={self.flush} must be multiples of page_size={p}"
            )
        if self.keep < 1:
            raise ValueError(f"keep={self.keep}: at least the newest token stays full precision")
        if self.lowbit_page_size is not None and (
            self.lowbit_page_size <= 0 or self.flush % self.lowbit_page_size
        ):
            raise ValueError(
                f"lowbit_page_size={self.lowbit_page_size} must be positive and divide "
                f"flush={self.flush} (every flush writes whole low-bit pages)"
            )
        if self.value_layout not in lay.VALUE_LAYOUTS:
            raise ValueError(f"value_layout={self.value_layout!r}; use one of {lay.VALUE_LAYOUTS}")
        if self.value_layout == "dims":
            widths = [self.value_quant] if self.layer_quant is None else [
                v for _, v in self.layer_quant]  # fmt: skip
            bad = [q.bits for q in widths if q is not None and not lay.is_packed(q.bits)]
            if self.quant is None or bad:
                raise ValueError(
                    f"value_layout='dims' packs 2- or 4-bit value codes along tokens; got value "
                    f"widths {bad or None}"
                )
            if self.low_page % 4:
                raise ValueError(
                    f"value_layout='dims' needs low-bit pages of a multiple of 4 tokens, got "
                    f"{self.low_page}"
                )
        if self.attention not in ("reference", "pallas"):
            raise ValueError(f"attention={self.attention!r}; use 'reference' or 'pallas'")
        if self.flush_rows is not None and self.flush_rows < 1:
            raise ValueError(f"flush_rows={self.flush_rows}: must be >= 1 (or None)")
        if self.quant is None and self.quant_v is not None:
            raise ValueError("quant_v given without quant")
        if self.sliding_layers not in SLIDING_LAYER_POLICIES:
            raise ValueError(
                f"sliding_layers={self.sliding_layers!r}; use one of {SLIDING_LAYER_POLICIES}"
            )
        if self.layer_quant is not None:
            if self.quant is None:
                raise ValueError("layer_quant given with quant=None (no low-bit segment)")
            if not isinstance(self.layer_quant, tuple) or not all(
                isinstance(p, tuple) and len(p) == 2 and all(isinstance(q, QuantConfig) for q in p)
                for p in self.layer_quant
            ):
                raise ValueError(
                    "layer_quant must be a tuple of (key, value) QuantConfig pairs, one per layer"
                )

    def layer_policies(self, model_cfg: ModelConfig) -> tuple[LayerPolicy, ...]:
        """Each layer's window and quantizers: the one place the per-layer policy is decided."""
        windows = model_cfg.layer_windows
        if self.layer_quant is not None and len(self.layer_quant) != len(windows):
            raise ValueError(
                f"layer_quant has {len(self.layer_quant)} layers, the model {len(windows)}"
            )
        out = []
        for i, window in enumerate(windows):
            if window is not None and self.sliding_layers == "full_precision":
                out.append(LayerPolicy(window, None, None))
            elif self.layer_quant is not None:
                out.append(LayerPolicy(window, *self.layer_quant[i]))
            else:
                out.append(LayerPolicy(window, self.quant, self.value_quant))
        return tuple(out)

    @property
    def low_page(self) -> int:
        """Tokens per low-bit page."""
        return self.page_size if self.lowbit_page_size is None else self.lowbit_page_size

    @property
    def all_full_precision(self) -> bool:
        """No token ever leaves the sink + recent windows (quant_end never passes sink)."""
        return self.quant_end(self.max_seq_len) == self.sink

    @property
    def value_quant(self) -> QuantConfig | None:
        return self.quant_v if self.quant_v is not None else self.quant

    def flush_row_counts(self, rows: int) -> tuple[int, ...]:
        """Row counts a planned decode window's flush arrays may have for a batch of `rows`:
        the window takes the smallest that holds every step's flushing rows (`flush_rows`)."""
        r = self.flush_rows or max(8, 4 * -(-rows // self.flush))
        return tuple(sorted({min(r, rows), rows}))

    def quant_end(self, length):  # int -> int, or i32 array -> i32 array (elementwise)
        """First position of the recent window for a sequence of `length` tokens: the one
        place the window policy is computed (the allocator and `eval`'s simulated cache)."""
        over = length - self.sink - self.keep
        over = over * (over > 0)
        return self.sink + (over // self.flush) * self.flush

    def fp_pages_per_seq(self) -> int:
        """Full-precision pages one sequence can hold during a step: sink pages, the recent pages
        being flushed by the step, and the recent pages after it (each under keep + flush)."""
        p = self.page_size
        if self.all_full_precision:  # nothing is ever flushed: the whole sequence, once
            return self.sink // p + -(-(self.max_seq_len - self.sink) // p)
        return self.sink // p + 2 * (-(-(self.keep + self.flush) // p) + 1)

    def lowbit_pages_per_seq(self) -> int:
        """Low-bit pages hold [sink, quant_end(max_seq_len)): none when all full precision."""
        return -(-(self.quant_end(self.max_seq_len) - self.sink) // self.low_page)


# ------------------------------------------------------------------------------------------
# Device side
# ------------------------------------------------------------------------------------------


@flax.struct.dataclass
class LayerPools:
    """One layer's pools. Low-bit pools hold codes/scale/zero, or fp arrays when quant is None."""

    k_fp: jax.Array  # fp[P_fp, Hkv, page, d]
    v_fp: jax.Array
    k_low: tuple[jax.Array, ...]  # (codes u8[P_q, Hkv, page, d/n], scale, zero) | (fp[...],)
    v_low: tuple[jax.Array, ...]  # as k_low; value_layout='dims': codes u8[P_q, Hkv, d, page/n]


@flax.struct.dataclass
class StepPlan:
    """Where this step's tokens go. Flat slots are `page * page_size + slot` (the low-bit pool's
    page size for low-bit slots); an index equal to the pool's slot count is out of range and
    dropped by the scatter."""

    fp_table: jax.Array  # i32[B, M_fp] sink pages then recent pages (old and new)
    fp_len: jax.Array  # i32[B] valid fp tokens before this step
    low_table: jax.Array  # i32[B, M_q]
    low_len: jax.Array  # i32[B] valid low-bit tokens before this step
    new_fp_dst: jax.Array  # i32[B, T] fp slot of each new token (or dropped)
    new_low_dst: jax.Array  # i32[B, T] low-bit slot of each new token (or dropped)
    # fp slots of stored tokens flushed to low bits this step, and their low-bit slots (or
    # dropped): R = B rows of F slots, or in a planned decode window R packed rows (row r
    # is not batch row r: the slots are flat pool slots)
    flush_src: jax.Array  # i32[R, F]
    flush_dst: jax.Array  # i32[R, F]


@flax.struct.dataclass
class KVMoments:
    """Running sums of one layer's stored-frame keys and values, squared per channel (the
    drift check of `kvjax.serving.drift`): written tokens only, padding rows excluded."""

    k2: jax.Array  # f32[Hkv, d] sum over tokens of (k A_K)^2
    v2: jax.Array  # f32[Hkv, d] sum over tokens of (v A_V)^2
    count: jax.Array  # f32[] tokens summed

    @classmethod
    def zeros(cls, num_kv_heads: int, head_dim: int) -> KVMoments:
        def z():  # distinct buffers: the engine donates the cache
            return jnp.zeros((num_kv_heads, head_dim), jnp.float32)

        return cls(k2=z(), v2=z(), count=jnp.zeros((), jnp.float32))


@flax.struct.dataclass
class PagedKVCache:
    pools: tuple[LayerPools, ...]
    transforms: KVTransforms
    lengths: jax.Array  # i32[B]
    plan: StepPlan | None
    cfg: CacheConfig = flax.struct.field(pytree_node=False)
    sm_scale: float = flax.struct.field(pytree_node=False)
    # A mesh with a "model" axis: the decode kernels then run per device on its KV heads.
    mesh: Any = flax.struct.field(pytree_node=False, default=None)
    # Per layer window and quantizers (`CacheConfig.layer_policies`); () : cfg's, no windows.
    layers: tuple[LayerPolicy, ...] = flax.struct.field(pytree_node=False, default=())
    # Opt-in per-layer moment sums (`with_moments`); None costs nothing.
    moments: tuple[KVMoments, ...] | None = None

    # ---- construction -----------------------------------------------------------------
    @classmethod
    def create(
        cls,
        model_cfg: ModelConfig,
        cache_cfg: CacheConfig,
        transforms: KVTransforms,
        batch_size: int,
    ) -> PagedKVCache:
        """Allocates the pools (filled with NaN so a stray read of an unowned slot shows)."""
        transforms.check_matches(model_cfg)
        n_fp = cache_cfg.num_fp_pages or batch_size * cache_cfg.fp_pages_per_seq()
        n_q = cache_cfg.num_lowbit_pages or max(1, batch_size * cache_cfg.lowbit_pages_per_seq())
        layers = cache_cfg.layer_policies(model_cfg)
        pools = tuple(_make_pools(model_cfg, cache_cfg, pol, n_fp, n_q) for pol in layers)
        return cls(
            pools=pools,
            transforms=transforms,
            lengths=jnp.zeros((batch_size,), jnp.int32),
            plan=None,
            cfg=cache_cfg,
            sm_scale=model_cfg.attention_scale,
            layers=layers,
        )

    def with_moments(self) -> PagedKVCache:
        """This cache with zeroed per-layer moment sums, accumulated by every `attend`."""
        hkv, d = self.pools[0].k_fp.shape[1], self.pools[0].k_fp.shape[3]
        return self.replace(moments=tuple(KVMoments.zeros(hkv, d) for _ in self.pools))

    def policy(self, layer: int) -> LayerPolicy:
        """Window and quantizers of `layer`."""
        if self.layers:
            return self.layers[layer]
        return LayerPolicy(None, self.cfg.quant, self.cfg.value_quant)

    @property
    def num_fp_pages(self) -> int:
        return self.pools[0].k_fp.shape[0]

    @property
    def num_lowbit_pages(self) -> int:
        return self.pools[0].k_low[0].shape[0]

    # ---- memory accounting ------------------------------------------------------------
    def allocated_bytes(self) -> int:
        """Bytes of every pool array (what the device actually holds for this cache)."""
        return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(self.pools))

    # ---- the cache protocol -----------------------------------------------------------
    def attend(
        self,
        layer: int,
        q: jax.Array,  # f[B, T, Hq, d]
        k: jax.Array,  # f[B, T, Hkv, d]
        v: jax.Array,  # f[B, T, Hkv, d]
        positions: jax.Array,  # i32[B, T]
    ) -> tuple[jax.Array, PagedKVCache]:
        if self.plan is None:
            raise ValueError("PagedKVCache.attend without a plan: call PageManager.prepare first")
        plan, tf, cfg = self.plan, self.transforms, self.cfg
        pol = self.policy(layer)
        pools = self.pools[layer]
        b, t = q.shape[:2]
        if plan.new_fp_dst.shape != (b, t):
            raise ValueError(f"plan made for {plan.new_fp_dst.shape} tokens, got {q.shape=}")
        # Move everything into the stored frames: k A_K, v A_V, q B_K^T.
        k_t = tf.keys_to_stored(layer, k)
        v_t = tf.values_to_stored(layer, v)
        q_t = tf.queries_to_key_frame(layer, q)

        # Every write comes first and attention reads only the written pools: a pool read
        # before an unrelated write to it would make XLA copy the whole pool (every decode
        # step, inside the engine's loop). The writes land in slots the attention masks off
        # (new fp tokens are read from k_t in the reference path; flushed slots lie beyond
        # low_len), and flushes read stored slots the new tokens do not touch.
        # New tokens that stay full precision go into fp pages (decode reads them there).
        k_fp = _scatter_tokens(pools.k_fp, plan.new_fp_dst, k_t)
        v_fp = _scatter_tokens(pools.v_fp, plan.new_fp_dst, v_t)

        # Flush: stored recent tokens leaving the window, and new tokens that go straight to low
        # bits (long prefill chunks), are quantized into low-bit pages. F == 0 (no sequence
        # flushes this step) and single-token decode: nothing reaches the low-bit pools.
        if t > 1:
            k_low, v_low = self._store_lowbit(
                layer, pools, k_fp, v_fp, plan.flush_src, plan.flush_dst, new=(k, k_t, v, v_t)
            )
        elif plan.flush_src.shape[1] == 0:  # single-token decode never writes new low tokens
            k_low, v_low = pools.k_low, pools.v_low
        else:
            # A planned window's flush rows are packed (`PageManager.plan_window`): R rows of
            # slots, most steps none flushing. One two-way cond: more branches, or control
            # flow inside a branch, make XLA copy the low-bit pools on every step.
            drop = self.num_lowbit_pages * cfg.low_page
            k_low, v_low = jax.lax.cond(
                jnp.any(plan.flush_dst < drop),
                lambda: self._store_lowbit(
                    layer, pools, k_fp, v_fp, plan.flush_src, plan.flush_dst
                ),
                lambda: (pools.k_low, pools.v_low),
            )
        new_pools = LayerPools(k_fp=k_fp, v_fp=v_fp, k_low=k_low, v_low=v_low)
        if self.mesh is not None:  # keep every pool split by KV heads across the calls
            from jax.sharding import NamedSharding
            from jax.sharding import PartitionSpec as P

            by_head = NamedSharding(self.mesh, P(None, "model"))
            new_pools = jax.tree.map(
                lambda x: jax.lax.with_sharding_constraint(x, by_head), new_pools
            )

        if (
            cfg.attention == "pallas"
            and t == 1
            and pol.window is None
            and (_kernel_layer(pol) or cfg.layer_quant is None)
        ):
            # the kernel moves q into the key frame and applies B_V itself
            o = self._pallas_decode(layer, q, new_pools, pol)
        else:
            # Sliding-window layers always come here: the kernels take no window mask; so do
            # a bit allocation's 3-bit layers (bit-sliced rows, which the kernels do not read).
            o_t = self._reference_attend(new_pools, q_t, k_t, v_t, positions, pol)  # value frame
            o = tf.outputs_from_value_frame(layer, o_t)

        pools_all = self.pools[:layer] + (new_pools,) + self.pools[layer + 1 :]
        new = self.replace(pools=pools_all)
        if self.moments is not None:
            new = new.replace(moments=self._add_moments(layer, plan, k_t, v_t))
        return o, new

    def _store_lowbit(
        self, layer: int, pools: LayerPools, k_fp, v_fp, flush_src, flush_dst, new=None
    ) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        """One layer's low-bit pools after quantizing the stored tokens at fp slots `flush_src`
        (of `k_fp` / `v_fp`) into low-bit slots `flush_dst`, and in a prefill chunk `new` = (k,
        k_t, v, v_t), the chunk's tokens that go straight to low bits (`plan.new_low_dst`)."""
        plan, tf, cfg = self.plan, self.transforms, self.cfg
        pol = self.policy(layer)
        d = k_fp.shape[-1]
        k, k_t, v, v_t = new if new is not None else (None,) * 4
        # Gathered here, not outside the decode step's cond: most steps flush nothing.
        fk = _gather_tokens(k_fp, flush_src)  # [R, F, K, d]
        fv = _gather_tokens(v_fp, flush_src)
        dims = cfg.value_layout == "dims"
        if cfg.attention == "pallas" and _kernel_layer(pol) and not dims:
            # The fused quantize+pack kernel: flushed tokens are already in the stored
            # frame (identity transform); new tokens going straight to low bits are
            # transformed by the kernel itself.
            eye = jnp.broadcast_to(jnp.eye(d, dtype=jnp.float32), tf.a_k[layer].shape)
            k_low, v_low = pools.k_low, pools.v_low
            sets = [(flush_dst, fk, fv, eye, eye)] if fk.shape[1] else []
            if new is not None:
                sets.append(
                    (
                        plan.new_low_dst,
                        tf.centred_keys(layer, k),
                        v,
                        tf.a_k[layer],
                        tf.a_v[layer],
                    )
                )
            for dst, xk, xv, ak, av in sets:
                k_low = _store_low_kernel(k_low, dst, xk, ak, pol.quant, tf.clip_k[layer])
                v_low = _store_low_kernel(v_low, dst, xv, av, pol.quant_v, tf.clip_v[layer])
            return k_low, v_low
        # every page this step writes has a token at a multiple of the page size in one
        # of the two lists (both are runs of consecutive slots from a page start or
        # ending at one): the pages to clear, without a page-sized update per token
        starts = [flush_dst[:, :: cfg.low_page]]
        if new is not None:  # new tokens straight to low bits (a decode token never goes there)
            dst = jnp.concatenate([flush_dst, plan.new_low_dst], axis=1)
            xk, xv = jnp.concatenate([fk, k_t], axis=1), jnp.concatenate([fv, v_t], axis=1)
            starts.append(plan.new_low_dst[:, :: cfg.low_page])
        else:
            dst, xk, xv = flush_dst, fk, fv
        k_low = _store_low(pools.k_low, dst, xk, pol.quant, tf.clip_k[layer])
        v_low = _store_low(
            pools.v_low,
            dst,
            xv,
            pol.quant_v,
            tf.clip_v[layer],
            dims_page=cfg.low_page if dims else None,
            page_starts=jnp.concatenate(starts, 1) if dims else None,
        )
        return k_low, v_low

    def _add_moments(self, layer: int, plan: StepPlan, k_t, v_t) -> tuple[KVMoments, ...]:
        # A token is real when the plan stores it somewhere (padding goes to the drop slot).
        real = (plan.new_fp_dst < self.num_fp_pages * self.cfg.page_size) | (
            plan.new_low_dst < self.num_lowbit_pages * self.cfg.low_page
        )  # [B, T]
        w = real.astype(jnp.float32)[:, :, None, None]
        m = self.moments[layer]
        upd = KVMoments(
            k2=m.k2 + jnp.sum(w * jnp.square(k_t.astype(jnp.float32)), axis=(0, 1)),
            v2=m.v2 + jnp.sum(w * jnp.square(v_t.astype(jnp.float32)), axis=(0, 1)),
            count=m.count + jnp.sum(real),
        )
        return self.moments[:layer] + (upd,) + self.moments[layer + 1 :]

    def advance(self, num_tokens: int) -> PagedKVCache:
        return self.replace(lengths=self.lengths + num_tokens)

    # ---- attention paths ----------------------------------------------------------------
    def _reference_attend(self, pools, q_t, k_t, v_t, positions, pol: LayerPolicy) -> jax.Array:
        """Dequantize stored tokens and attend: [stored fp | stored low-bit | new (causal)].

        One online softmax over the three segments (`attention_partial` / `merge_partials`).
        The low-bit pages are read `LOWBIT_KEY_BLOCK` tokens at a time and only up to the
        longest sequence's low-bit segment, so a prefill chunk never holds more than one
        block's scores in float32, nor dequantizes pages past the stored tokens (a table
        sized for `max_seq_len` costs nothing beyond what the sequences hold); a sliding
        layer starts at the first block its oldest query's window reaches.
        """
        plan = self.plan
        sink = self.cfg.sink
        qg = split_heads_by_group(q_t.astype(jnp.float32), k_t.shape[2])
        d = k_t.shape[-1]

        def visible(kv_pos, valid):  # i32[B, S] positions, bool[B, S] -> bool[B, T, S]
            mask = valid[:, None, :]
            if pol.window is not None:
                mask = mask & (positions[:, :, None] - kv_pos[:, None, :] < pol.window)
            return mask

        def attend(state, k, v, mask):
            part = attention_partial(qg, k, v, mask, sm_scale=self.sm_scale)
            return merge_partials(state, part)

        # Stored slots' positions come from the plan: fp slot i is sink position i or recent
        # position i + low_len (recent pages start at quant_end = sink + low_len); low-bit
        # slot j is position sink + j. New tokens carry their own positions.
        kf = _gather_pages(pools.k_fp, plan.fp_table)  # [B, M_fp*P, K, d]
        vf = _gather_pages(pools.v_fp, plan.fp_table)
        i_fp = jnp.arange(kf.shape[1], dtype=jnp.int32)[None, :]
        fp_pos = i_fp + jnp.where(i_fp >= sink, plan.low_len[:, None], 0)
        state = attend(empty_partial(qg), kf, vf, visible(fp_pos, i_fp < plan.fp_len[:, None]))
        causal = positions[:, None, :] <= positions[:, :, None]  # [B, T, T]
        new_mask = visible(positions, jnp.ones_like(positions, bool)) & causal
        state = attend(state, k_t, v_t, new_mask)

        table = plan.low_table  # [B, M_q]
        if table.shape[1]:
            page = self.cfg.low_page
            per = max(1, LOWBIT_KEY_BLOCK // page)  # pages per block
            table = jnp.pad(table, ((0, 0), (0, -table.shape[1] % per)))
            n_blocks = (jnp.max(plan.low_len) + per * page - 1) // (per * page)
            first = 0  # a sliding layer skips the blocks below every query's window
            if pol.window is not None:
                oldest = jnp.min(positions) - pol.window + 1 - sink  # low-bit slot index
                first = jnp.maximum(oldest, 0) // (per * page)

            def block(j, state):
                tab = jax.lax.dynamic_slice_in_dim(table, j * per, per, axis=1)
                kq = _read_low(pools.k_low, tab, pol.quant, d)  # f32[B, per*P, K, d]
                vq = _read_low(pools.v_low, tab, pol.quant_v, d, self.cfg.value_layout)
                idx = j * per * page + jnp.arange(per * page, dtype=jnp.int32)[None, :]
                low_pos = jnp.broadcast_to(sink + idx, (qg.shape[0], per * page))
                return attend(state, kq, vq, visible(low_pos, idx < plan.low_len[:, None]))

            state = jax.lax.fori_loop(first, n_blocks, block, state)
        return finish_partial(state, q_t.shape)

    def _per_kv_shard(self, fn, args, kinds):
        """Runs a kernel call on each device's KV heads when the cache has a "model" mesh axis.

        kinds per argument: "heads" [B, Hq, ...] (output too), "pool" [P, Hkv, ...], "kv"
        [Hkv, ...] or None (replicated)."""
        mesh = self.mesh
        if mesh is None or mesh.shape.get("model", 1) == 1:
            return fn(*args)
        from jax.sharding import PartitionSpec as P

        spec = {"heads": P(None, "model"), "pool": P(None, "model"), "kv": P("model"), None: P()}
        present = [i for i, a in enumerate(args) if a is not None]

        def call(*xs):
            full = [None] * len(args)
            for i, x in zip(present, xs):
                full[i] = x
            return fn(*full)

        return jax.shard_map(
            call,
            mesh=mesh,
            in_specs=tuple(spec[kinds[i]] for i in present),
            out_specs=P(None, "model"),
            check_vma=False,
        )(*(args[i] for i in present))

    def decode_backend(self, layer: int, num_heads: int) -> str:
        """The Pallas body ("gpu", "gpu_mosaic" or "tpu") the pallas decode path runs for
        `layer` on this machine, for `num_heads` query heads: the choosers of
        `pallas_kernels.decode_attention` on this layer's pools and policy."""
        return self._decode_backend(layer, self.pools[layer], self.policy(layer), num_heads)

    def _decode_backend(self, layer, pools: LayerPools, pol: LayerPolicy, num_heads: int) -> str:
        from pallas_kernels import decode_attention as da  # lazy: optional path

        cfg, d = self.cfg, pools.k_fp.shape[-1]
        if cfg.quant is None and cfg.all_full_precision:
            return da.fp_backend(pools.k_fp.dtype, d, pools.k_fp.shape[2])
        if not _kernel_layer(pol):
            raise ValueError(
                "the pallas decode path needs packed 2- or 4-bit pages (or quant=None with "
                f"keep covering max_seq_len); layer {layer} has keys {pol.quant} and values "
                f"{pol.quant_v}"
            )
        kc, ks, kz = pools.k_low
        _, vs, vz = pools.v_low
        return da.lowbit_backend(
            head_dim=d, bits=pol.quant.bits, bits_v=pol.quant_v.bits,
            group_size=d // ks.shape[-1], group=num_heads // kc.shape[1], page_size=cfg.low_page,
            meta_dtypes=(ks.dtype, kz.dtype, vs.dtype, vz.dtype), value_layout=cfg.value_layout,
        )  # fmt: skip

    def _pallas_decode(self, layer, q, pools: LayerPools, pol: LayerPolicy) -> jax.Array:
        """Single-token decode through the Pallas kernel, reading packed pages directly."""
        from pallas_kernels import decode_attention as da  # lazy: optional path

        plan, cfg, tf = self.plan, self.cfg, self.transforms
        backend = self._decode_backend(layer, pools, pol, q.shape[2])
        if cfg.quant is None and cfg.all_full_precision:
            return self._pallas_decode_fp(layer, q, pools, backend)
        bits_k, bits_v = pol.quant.bits, pol.quant_v.bits
        kc, ks, kz = pools.k_low
        vc, vs, vz = pools.v_low

        def run(q, k_fp, v_fp, fp_table, fp_len, kc, vc, ks, kz, vs, vz, low_table, low_len,
                bk_t, bv):  # fmt: skip
            lowbit = da.LowbitPages(
                da.QuantizedPages(kc, ks, kz), da.QuantizedPages(vc, vs, vz), low_table, low_len
            )
            return da.decode_attention(
                q, da.FpPages(k_fp, v_fp, fp_table, fp_len), lowbit, da.HeadTransforms(bk_t, bv),
                bits=bits_k, bits_v=None if bits_v == bits_k else bits_v,
                sm_scale=self.sm_scale, backend=backend, value_layout=cfg.value_layout,
                pages_per_block=1 if backend == "gpu_mosaic" else None,
                interpret=jax.default_backend() == "cpu",
            )  # fmt: skip

        bv = None if tf.values_folded else tf.b_v[layer]
        args = (
            q[:, 0],
            pools.k_fp,
            pools.v_fp,
            plan.fp_table,
            plan.fp_len + 1,
            kc,
            vc,
            ks,
            kz,
            vs,
            vz,
            plan.low_table,
            plan.low_len,
            jnp.swapaxes(tf.b_k[layer], -1, -2),
            bv,
        )
        kinds = ("heads", "pool", "pool", None, None, "pool", "pool", "pool", "pool", "pool",
                 "pool", None, None, "kv", "kv")  # fmt: skip
        o = self._per_kv_shard(run, args, kinds)
        return o[:, None].astype(jnp.float32)

    def _pallas_decode_fp(self, layer, q, pools: LayerPools, backend: str) -> jax.Array:
        """An all full-precision cache: the BF16 paged kernel over the fp pages (the Mosaic GPU
        body on Hopper, see `da.fp_backend`), the transforms applied outside it (query into
        the key frame, output out of the value frame)."""
        from pallas_kernels import decode_attention as da  # lazy: optional path

        tf, plan = self.transforms, self.plan
        q_t = tf.queries_to_key_frame(layer, q)[:, 0]

        def run(q, k, v, table, lengths):
            return da.decode_attention_bf16(
                q, da.FpPages(k, v, table, lengths), sm_scale=self.sm_scale, backend=backend,
                interpret=jax.default_backend() == "cpu",
            )  # fmt: skip

        args = (q_t.astype(pools.k_fp.dtype), pools.k_fp, pools.v_fp, plan.fp_table,
                plan.fp_len + 1)  # fmt: skip
        o_t = self._per_kv_shard(run, args, ("heads", "pool", "pool", None, None))
        return tf.outputs_from_value_frame(layer, o_t[:, None].astype(jnp.float32))


def _kernel_layer(pol: LayerPolicy) -> bool:
    """Whether the Pallas kernels store and read this layer's low-bit pages (packed 2/4 bits
    for keys and values; 3-bit rows are bit-sliced and go through the reference path)."""
    return (
        pol.quant is not None
        and pol.quant_v is not None
        and lay.is_packed(pol.quant.bits)
        and lay.is_packed(pol.quant_v.bits)
    )


def _make_pools(
    mcfg: ModelConfig, ccfg: CacheConfig, pol: LayerPolicy, n_fp: int, n_q: int
) -> LayerPools:
    d, hkv, p, pl = mcfg.head_dim, mcfg.num_kv_heads, ccfg.page_size, ccfg.low_page
    fp_dtype = jnp.dtype(ccfg.fp_dtype)

    def low(qc: QuantConfig | None, dims: bool = False):
        if qc is None:
            return (jnp.full((n_q, hkv, pl, d), jnp.nan, fp_dtype),)
        lo = lay.PageLayout(
            page_size=pl,
            num_kv_heads=hkv,
            head_dim=d,
            bits=qc.bits,
            group_size=qc.resolve_group_size(d),
            meta_dtype=qc.meta_dtype,
            fp_dtype=ccfg.fp_dtype,
        )
        codes_shape = lo.codes_shape(n_q)
        if dims:  # packed along the page's tokens
            codes_shape = (n_q, hkv, d, lay.packed_dim(pl, qc.bits))
        return (
            # dims-major pages start as all ones, so a page whose clearing were missed shows
            jnp.full(codes_shape, 0xFF if dims else 0, lo.codes_dtype),
            jnp.full(lo.meta_shape(n_q), jnp.nan, lo.meta_jnp_dtype),
            jnp.full(lo.meta_shape(n_q), jnp.nan, lo.meta_jnp_dtype),
        )

    fp = jnp.full((n_fp, hkv, p, d), jnp.nan, fp_dtype)
    dims = ccfg.value_layout == "dims"
    return LayerPools(
        k_fp=fp,
        v_fp=jnp.full_like(fp, jnp.nan),
        k_low=low(pol.quant),
        v_low=low(pol.quant_v, dims and pol.quant_v is not None),
    )


def _split_slot(pool: jax.Array, flat: jax.Array) -> tuple[jax.Array, jax.Array]:
    page_size = pool.shape[2]
    return flat // page_size, flat % page_size


def _scatter_tokens(pool: jax.Array, flat: jax.Array, vals: jax.Array) -> jax.Array:
    """Writes vals [B, T, K, w] at flat slots [B, T]; out-of-range slots are dropped."""
    page, slot = _split_slot(pool, flat.reshape(-1))
    return lay.scatter_tokens(pool, vals.reshape(-1, *vals.shape[2:]), page, slot)


def _gather_tokens(pool: jax.Array, flat: jax.Array) -> jax.Array:
    """[B, F] flat slots -> f32[B, F, K, d] (out-of-range slots read as 0, later dropped)."""
    page, slot = _split_slot(pool, flat)
    out = pool.at[page, :, slot].get(mode="fill", fill_value=0)  # [B, F, K, d]
    return out.astype(jnp.float32)


def _gather_pages(pool: jax.Array, table: jax.Array) -> jax.Array:
    """[B, M] page table -> [B, M*P, K, ...] tokens in page order."""
    g = pool[table]  # [B, M, K, P, ...]
    g = jnp.swapaxes(g, 2, 3)  # [B, M, P, K, ...]
    return g.reshape(g.shape[0], -1, *g.shape[3:])


def _store_low(low, dst, vals, qc: QuantConfig | None, clip, dims_page=None, page_starts=None):
    """Quantizes vals [B, N, K, d] into the low-bit pools at flat slots dst [B, N].
    dims_page: the codes pool is dimension-major with pages of that many tokens;
    page_starts: flat slots (any shape) covering every page dst writes."""
    if qc is None:
        return (_scatter_tokens(low[0], dst, vals),)
    # The stored clip is OSCAR's percentile kappa; quest/minmax use their own rules.
    qa = quantize(vals, qc, clip=clip if qc.method == "oscar" else None)
    meta = tuple(_scatter_tokens(pool, dst, x) for pool, x in zip(low[1:], (qa.scale, qa.zero)))
    if dims_page is None:
        return (_scatter_tokens(low[0], dst, qa.codes), *meta)
    codes = _scatter_codes_dims(low[0], dst, qa.unpacked_codes(), qc.bits, dims_page, page_starts)
    return (codes, *meta)


def _scatter_codes_dims(pool, dst, codes, bits: int, page_size: int, page_starts) -> jax.Array:
    """Writes codes u8[B, N, K, d] (one per channel) into a dimension-major codes pool
    u8[P, K, d, page/n] at flat slots dst [B, N]. Token slot s of a page is bit field
    (s // (page/n)) of byte s % (page/n) (`pallas_kernels.layout`), so tokens share bytes:
    the pages written (those of `page_starts`) are zeroed, then each code is added at its
    shift (the fields are disjoint, so the adds are exact and their order does not matter).
    Correct because every step writes whole low-bit pages (`CacheConfig`: flush is a multiple
    of the page)."""
    w = pool.shape[3]
    flat = dst.reshape(-1)
    page, slot = flat // page_size, flat % page_size
    shift = ((slot // w) * bits).astype(jnp.uint8)[:, None, None]
    c = codes.reshape(-1, *codes.shape[2:]).astype(jnp.uint8) << shift  # [N, K, d]
    pool = pool.at[page_starts.reshape(-1) // page_size].set(jnp.uint8(0), mode="drop")
    return pool.at[page, :, :, slot % w].add(c, mode="drop")


def _store_low_kernel(low, dst, x, a, qc: QuantConfig, clip):
    """Quantize+pack x [B, N, K, d] (transformed by `a` in the kernel) into the low-bit pools."""
    from pallas_kernels.quantize_pack import quantize_pack_to_pages  # lazy: optional path

    if qc.bits not in (2, 4):
        raise ValueError(f"the pallas path stores packed 2- or 4-bit pages, not bits={qc.bits}")
    page, slot = _split_slot(low[0], dst.reshape(-1))
    return quantize_pack_to_pages(
        x.reshape(-1, *x.shape[2:]),
        a,
        *low,
        page,
        slot,
        clip if qc.method == "oscar" else None,
        method=qc.method,
        bits=qc.bits,
        group_size=qc.group_size,
        backend="tpu" if jax.default_backend() == "tpu" else "gpu",
        interpret=jax.default_backend() == "cpu",
    )


def _read_low(low, table, qc: QuantConfig | None, d: int, layout: str = "tokens") -> jax.Array:
    if qc is None:
        return _gather_pages(low[0], table).astype(jnp.float32)
    scale, zero = (_gather_pages(x, table) for x in low[1:])
    if layout == "dims":  # u8[B, M, K, d, page/n] -> token-major packed rows [B, M*page, K, d/n]
        page = scale.shape[1] // table.shape[1]
        tok = lay.unpack_value_page_dims_major(low[0][table], qc.bits, page)  # [B, M, K, P, d]
        tok = jnp.swapaxes(tok, 2, 3).reshape(table.shape[0], -1, tok.shape[2], d)
        codes = lay.pack_codes(tok, qc.bits)
    else:
        codes = _gather_pages(low[0], table)
    qa = QuantizedArray(
        codes=codes,
        scale=scale,
        zero=zero,
        bits=qc.bits,
        group_size=qc.resolve_group_size(d),
        d=d,
        packed=lay.is_packed(qc.bits),
    )
    return dequantize(qa)


# ------------------------------------------------------------------------------------------
# Host side
# ------------------------------------------------------------------------------------------
