"""Decode-attention benchmark: packed 2/4-bit paged kernels vs BF16 baselines (issue 6).

Qwen3-8B attention shapes (32 query / 8 KV heads, head_dim 128). For each (batch, context)
point it times: the 2-bit and 4-bit mixed-precision Pallas kernels (sink 64 + recent 256
tokens full precision, the rest low-bit, query transform and value inverse applied in the
kernel), the BF16 Pallas paged kernel, XLA attention over a dense BF16 cache,
``jax.nn.dot_product_attention(implementation="cudnn")`` and, where PyTorch is importable,
``torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)``. It reports median
times, bytes read, achieved bandwidth against a read-bandwidth ceiling measured in the same
run (a large reduction), speedups, and the quantize_pack cost per decode step (one token per
sequence, K and V, all layers) and per prefill-sized call.

Example (GPU)::

    python -m eval.bench_decode --points 8x131072 1x65536 --out runs/bench_decode.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from eval.common import environment
from kvjax import cli
from pallas_kernels import decode_attention as da
from pallas_kernels import layout
from pallas_kernels.decode_attention import api as da_api

DEFAULT_POINTS = (
    (1, 32768),
    (1, 65536),
    (1, 131072),
    (8, 32768),
    (8, 131072),
    (32, 32768),
    (16, 131072),
    (32, 131072),
)


def parse_point(s: str) -> tuple[int, int]:
    """ "8x131072" -> (8, 131072)."""
    try:
        b, c = s.lower().split("x")
        return int(b), int(c)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not BATCHxCONTEXT (e.g. 8x131072)") from None


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What to measure.

    Attributes:
      points: (batch, context) pairs.
      q_heads, kv_heads, head_dim, layers: model attention shape (Qwen3-8B defaults).
      page_size, sink, recent: cache layout; sink + recent tokens stay full precision.
      variants: which rows to time (names as in the output table).
      repeats: timed batches per variant (median reported); calls_per_repeat per batch.
      backend: 'gpu' or 'tpu' (TPU runs only the Pallas variants and XLA).
      num_splits, pages_per_block, num_warps, num_stages: kernel tuning (None = defaults).
      out: JSON path; a markdown table is written beside it (.md).
      tune: run the low-bit attribution/tuning sweep (`tune_lowbit`) instead of the table.
      lowbit_variants: extra low-bit rows (names in `LOWBIT_VARIANTS`) timed at every point,
        to attribute time to stages of the kernel.
    """

    points: tuple[tuple[int, int], ...] = cli.option(
        DEFAULT_POINTS, "BATCHxCONTEXT points, e.g. 8x131072 1x65536", type=parse_point
    )
    q_heads: int = cli.option(32, "query heads")
    kv_heads: int = cli.option(8, "KV heads")
    head_dim: int = cli.option(128, "head dimension")
    layers: int = cli.option(36, "layers (quantize_pack cost per decode step)")
    page_size: int = cli.option(16, "tokens per page")
    sink: int = cli.option(64, "full-precision sink tokens")
    recent: int = cli.option(256, "full-precision recent tokens")
    variants: tuple[str, ...] = cli.option(
        (
            "int2_pallas",
            "int4_pallas",
            "int2_mosaic",
            "int4_mosaic",
            "bf16_pallas",
            "xla_dense_bf16",
            "cudnn_bf16",
            "torch_sdpa_bf16",
        ),
        "rows to time (names as in the output table)",
    )
    repeats: int = cli.option(7, "timed batches per variant (median reported)")
    calls_per_repeat: int = cli.option(20, "calls per timed batch, each on its own copy")
    backend: str = cli.option("gpu", "kernel backend", choices=da.BACKENDS)
    num_splits: int | None = cli.option(None, "sequence splits (none: the kernel's choice)")
    pages_per_block: int | None = cli.option(None, "pages per kernel step (none: default)")
    num_warps: int | None = cli.option(None, "Triton warps (none: default)")
    num_stages: int | None = cli.option(None, "Triton pipeline stages (none: default)")
    out: str = cli.option(
        "runs/bench_decode.json", "JSON path (a .md table beside it); results/ only when asked"
    )
    tune: bool = cli.option(False, "the low-bit attribution/tuning sweep instead of the table")
    lowbit_variants: tuple[str, ...] = cli.option(
        (), "extra low-bit rows from LOWBIT_VARIANTS (or 'all')"
    )
    stages: tuple[str, ...] = cli.option(
        (), "the `mosaic_stages` rows to time, by stage (gpu_mosaic.STAGES_KINDS; none: all)"
    )
    quantize_pack: bool = cli.option(True, "also time quantize_pack per decode step")
    quantize_pack_tokens: tuple[int, ...] = cli.option(
        (64, 1024, 8192), "prefill-sized quantize_pack calls timed"
    )

    def __post_init__(self):
        if self.lowbit_variants == ("all",):
            object.__setattr__(self, "lowbit_variants", tuple(LOWBIT_VARIANTS))
        unknown = [v for v in self.lowbit_variants if v not in LOWBIT_VARIANTS]
        if unknown:
            raise ValueError(f"unknown --lowbit-variants {unknown}; see LOWBIT_VARIANTS")
        from pallas_kernels.decode_attention.gpu_mosaic import STAGES_KINDS

        bad = [s for s in self.stages if s not in STAGES_KINDS]
        if bad:
            raise ValueError(f"unknown --stages {bad}; one of {STAGES_KINDS}")


# ------------------------------------------------------------------------------------------
def _steady_seconds(batch: Callable[[int], float], units: int) -> float:
    """Seconds per unit of back-to-back work, fixed per-batch costs cancelled: ``batch(k)``
    times k units with one start and one sync; the difference of a 3k- and a k-unit batch
    leaves out what every batch pays once (the first dispatch's host time, the final sync),
    which torch's CUDA-event rows never see either (run 102: at 8 x 32k 7 calls per dispatch,
    ~18 us per call of wall beyond the device's span in a 4-dispatch batch)."""
    return (batch(3 * units) - batch(units)) / (2 * units)


def _time_jax(fn: Callable[[], jax.Array], cfg: BenchConfig) -> float:
    """Median seconds per call: batches of back-to-back calls, one sync per batch."""
    jax.block_until_ready(fn())  # compile + warm up
    jax.block_until_ready(fn())

    def batch(k: int) -> float:
        t0 = time.perf_counter()
        for _ in range(k):
            r = fn()
        jax.block_until_ready(r)
        return time.perf_counter() - t0

    return statistics.median(
        _steady_seconds(batch, cfg.calls_per_repeat) for _ in range(cfg.repeats)
    )


# L2 of the H200 is 60 MB. Every call inside one timed jit reads its own input copy: XLA
# merges calls that share an operand (20 dense-attention calls over 4 copies compiled to one
# dot per copy, which read faster than HBM can deliver), and a copy read twice in a row can
# be served from L2. Copies are rotated so one round reads >= 3x the L2.
# A jit over n copies costs ~100 us of Python dispatch (its ~10 n array arguments) that the
# device waits through when its n calls take less (run 90, H100, 1 x 64k: 5 copies, 61 us per
# call of wall against 43.5 us of kernels). So a round also reads at least _ROUND_BYTES
# (~0.25 ms at the ceiling; 16 copies at batch 1), and the rows measure the device as torch's
# CUDA-graph rows do.
_L2_BYTES = 60 << 20
_ROUND_BYTES = 1 << 30
_MAX_COPIES = 16
_COPY_BUDGET_BYTES = 24 << 30  # device memory the input copies of one row may take
_MIN_ROUNDS = 10  # dispatches per timed batch: the first one's host cost is not overlapped


def copies_for(nbytes: int) -> int:
    """Independent input copies per timed jit: enough that one round reads >= 3x the L2 and
    `_ROUND_BYTES`, at most `_MAX_COPIES` and `_COPY_BUDGET_BYTES` (at least one)."""
    want = -(-max(3 * _L2_BYTES, _ROUND_BYTES) // max(1, nbytes))
    return int(max(1, min(_MAX_COPIES, want, _COPY_BUDGET_BYTES // max(1, nbytes))))


def unrolled_calls(call: Callable[[dict, jax.Array], jax.Array]) -> Callable:
    """One jit of ``call(cache, q)`` over lists of caches and queries, call ``i`` reading
    ``caches[i]`` and ``queries[i]`` only; ``call`` is a nested jit, so the kernel is lowered
    once however many calls the jit holds (16 Mosaic lowerings took 13.5 s on a CPU)."""
    one = jax.jit(call)

    @jax.jit
    def many(caches, queries):
        return tuple(one(c, q) for c, q in zip(caches, queries))

    return many


def _time_unrolled(
    call: Callable[[dict, jax.Array], jax.Array],
    caches: list[dict],
    queries: list[jax.Array],
    cfg: BenchConfig,
) -> float:
    """Median seconds per call of ``call(cache, q)``.

    One jit holds ``len(caches)`` calls (`unrolled_calls`: no operand shared between calls,
    so XLA cannot merge them); it is dispatched back to back at least `_MIN_ROUNDS` times and
    enough for ``calls_per_repeat`` calls per timed batch, with one sync per batch (host
    dispatch overlaps the device work after the first); `_steady_seconds` takes the
    difference of a 3x and a 1x batch, so the first dispatch and the sync cancel.
    """
    n = len(caches)
    if len(queries) < n:
        raise ValueError(f"{len(queries)=} queries for {n} cache copies")
    queries = queries[:n]
    rounds = max(_MIN_ROUNDS, -(-cfg.calls_per_repeat // n))

    many = unrolled_calls(call)
    jax.block_until_ready(many(caches, queries))  # compile + warm up
    jax.block_until_ready(many(caches, queries))

    def batch(k: int) -> float:
        t0 = time.perf_counter()
        jax.block_until_ready([many(caches, queries) for _ in range(k)])
        return time.perf_counter() - t0

    return statistics.median(_steady_seconds(batch, rounds) for _ in range(cfg.repeats)) / n


def read_bandwidth_ceiling(sizes: tuple[int, ...] | None = None) -> dict[str, float]:
    """Bytes/s of large reductions over device memory (reads dominate; the output is one
    scalar): XLA's and, where torch sees a GPU, torch's, over 4 and 16 GiB. The ceiling is the
    fastest of them (run 21: torch SDPA over 17 GB read faster than a 4 GiB XLA sum)."""
    if sizes is None:  # a CPU run (a smoke test of the script) has no 16 GiB to spare
        sizes = (4 << 30, 16 << 30) if jax.default_backend() == "gpu" else (1 << 30,)
    out = {}
    cfg = BenchConfig(repeats=7, calls_per_repeat=10)
    f = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    for nbytes in sizes:
        x = jnp.ones((nbytes // 2,), jnp.bfloat16) * jnp.bfloat16(1.5)
        out[f"xla_sum_{nbytes >> 30}GiB"] = nbytes / _time_jax(lambda x=x: f(x), cfg)
        x = None  # free the buffer before the next allocation
    try:
        import torch

        if torch.cuda.is_available():
            for nbytes in sizes:
                t = torch.full((nbytes // 2,), 1.5, device="cuda", dtype=torch.bfloat16)
                times = []
                for _ in range(10):
                    e0 = torch.cuda.Event(enable_timing=True)
                    e1 = torch.cuda.Event(enable_timing=True)
                    e0.record()
                    for _ in range(3):
                        t.sum(dtype=torch.float32)
                    e1.record()
                    torch.cuda.synchronize()
                    times.append(e0.elapsed_time(e1) / 1e3 / 3)
                out[f"torch_sum_{nbytes >> 30}GiB"] = nbytes / statistics.median(times[2:])
                del t
                torch.cuda.empty_cache()
    except ImportError:
        pass
    out["ceiling"] = max(out.values())
    return out


# Operand kinds of the stage rows: float16 codes (inline PTX), 8-bit key codes, and 8-bit
# keys with e4m3 value codes against the weights in two e4m3 parts or one
# (`gpu_mosaic.INT_TO_FLOAT`; run 64's 8-bit integer values, slower, are in BENCHMARKS.md).
INT_TO_FLOAT_ROWS = ("asm", "s8", "s8_e4m3x2", "s8_e4m3")
_OPERAND_SUFFIX = dict(asm="", s8="_s8_keys", s8_e4m3x2="_e4m3x2_values", s8_e4m3="_e4m3_values")


def mosaic_stage_rows(cfg: BenchConfig, batch: int, ctx: int, record) -> None:
    """Attribution of the Mosaic GPU body: its low-bit split kernel alone (no prologue, fp
    segment or merge), 2 bits, dimension-major value pages (128 tokens): computing
    everything (N = 16 or 8 MMA columns with one token stream, or the defaults: two streams
    where the group allows), keys only (no value product) or nothing but the TMA ring (loads
    only); tensor-map or bulk copies."""
    from pallas_kernels.decode_attention import gpu_mosaic as gm

    key = jax.random.key(batch * 31 + ctx)
    nbytes, n_fp, n_q = _bytes_lowbit(cfg, batch, ctx, 2)
    group = cfg.q_heads // cfg.kv_heads
    # (page, value layout, stage, code copies, overlap, mask, (MMA columns, token streams),
    # int_to_float). None: the kernel's defaults. Rows of earlier sessions (N = 16, one token
    # stream, tensor-map copies, jnp unpack, token-major values, the serial schedule, masking
    # every step, key sums read through a bias) are in BENCHMARKS.md.
    runs = [  # the ring alone first: the shortest rows
        (128, "dims", st, "bulk", "none", "last", None, "s8") for st in ("loads", "loads_codes")
    ]
    # The default operands' rows first: a device call's time limit may cut the list short.
    runs += [(128, "dims", st, "bulk", "values", "last", None, "s8") for st in ("full", "keys")]
    runs += [(128, "dims", "full", "bulk", "copies", "last", None, "s8")]
    runs += [
        (128, "dims", "full", "bulk", "values", "last", None, k)
        for k in INT_TO_FLOAT_ROWS
        if k != "s8"
    ]
    runs += [(128, "dims", "keys", "bulk", "values", "last", None, "asm")]
    runs += [
        (128, "dims", st, "bulk", "values", "last", None, "s8")
        for st in ("no_value_operand", "no_pt_store", "no_rescale", "half_value_mma")
    ]
    runs = [r for r in runs if not cfg.stages or r[2] in cfg.stages]
    for page_q, vl in dict.fromkeys((r[0], r[1]) for r in runs):
        caches = []
        for r in range(copies_for(nbytes)):
            x = _make_lowbit_inputs(cfg, batch, ctx, 2, jax.random.fold_in(key, r), page_q, vl)
            low = x["lowbit"]
            splits = da.lowbit_auto_splits(batch, cfg.kv_heads, low.table.shape[1], 1, "gpu_mosaic")
            tab = da_api.split_table(low.table, splits, 1)
            (kc, ks, kz), (vc, vs, vz) = low.k, low.v
            caches.append(dict(ls=(kc, vc, ks, kz, vs, vz, tab, low.length)))
        qs = [
            jax.random.normal(jax.random.fold_in(key, 50 + i), (batch, cfg.kv_heads, group, 128))
            for i in range(len(caches))
        ]
        for _, _, stage, copy, overlap, mask, nc, ko in [r for r in runs if r[:2] == (page_q, vl)]:

            def call(
                c, qg, stage=stage, vl=vl, copy=copy, overlap=overlap, mask=mask, nc=nc, ko=ko
            ):
                n_pad, streams = nc or (None, None)
                return gm.lowbit_partials(
                    qg,
                    c["ls"],
                    bits=2,
                    scale_log2=0.1,
                    group=group,
                    stage=stage,
                    value_layout=vl,
                    code_copy=copy,
                    overlap=overlap,
                    mask=mask,
                    n_pad=n_pad,
                    streams=streams,
                    int_to_float=ko,
                    columns=True,  # the kernel's own outputs: no slice after it
                )

            name = f"int2_mosaic_split_{stage}_page{page_q}_{vl}"
            name += "_bulk" if copy == "bulk" else ""
            name += f"_overlap_{overlap}" if overlap != "none" else ""
            name += "_mask_every" if mask == "every" else ""
            name += f"_n{nc[0]}_streams{nc[1]}" if nc else ""
            name += _OPERAND_SUFFIX[ko]
            record(
                name,
                lambda call=call, caches=caches, qs=qs: _time_unrolled(call, caches, qs, cfg),
                nbytes,
                lowbit_tokens=n_q,
            )
        caches = None


def _bytes_lowbit(
    cfg: BenchConfig,
    batch: int,
    ctx: int,
    bits: int,
    bits_v: int | None = None,
    meta_dtype: str = "float16",
) -> tuple[int, int, int]:
    """(bytes read, fp tokens, low-bit tokens) for one decode step of one layer."""
    n_fp, n_q = _split_context(cfg, ctx)
    nbytes = 0
    for b in (bits, bits if bits_v is None else bits_v):  # keys, values
        lay = layout.PageLayout(
            cfg.page_size, cfg.kv_heads, cfg.head_dim, bits=b, meta_dtype=meta_dtype
        )
        nbytes += batch * (n_q * lay.lowbit_bytes_per_token + n_fp * lay.fp_bytes_per_token)
    return nbytes, n_fp, n_q


def _split_context(cfg: BenchConfig, ctx: int) -> tuple[int, int]:
    n_q = max(0, (ctx - cfg.sink - cfg.recent) // cfg.page_size * cfg.page_size)
    return ctx - n_q, n_q


def _pages(n_tokens: int, page: int) -> int:
    return -(-n_tokens // page)


def _make_lowbit_inputs(
    cfg: BenchConfig,
    batch: int,
    ctx: int,
    bits: int,
    key,
    page_q: int | None = None,
    value_layout: str = "tokens",
    bits_v: int | None = None,
    meta_dtype: str = "float16",
) -> dict:
    """Random pools of one layer (``q``, ``fp``, ``lowbit``, ``transforms``: the arguments of
    `decode_attention`); low-bit pages hold ``page_q`` tokens (default: page_size),
    value codes in ``value_layout`` (`pallas_kernels.layout.VALUE_LAYOUTS`) at ``bits_v``
    bits (default: ``bits``), scale/zero stored as ``meta_dtype``."""
    d, hkv, page = cfg.head_dim, cfg.kv_heads, cfg.page_size
    bv = bits if bits_v is None else bits_v
    n, n_v = layout.codes_per_byte(bits), layout.codes_per_byte(bv)
    n_fp, n_q = _split_context(cfg, ctx)
    page_q = page if page_q is None else page_q
    pf, pq = _pages(n_fp, page), _pages(n_q, page_q) if n_q else 1
    ks = jax.random.split(key, 8)
    q_pages = batch * pq
    codes_shape = (q_pages, hkv, page_q, d // n)
    v_shape = (q_pages, hkv, page_q, d // n_v)
    v_shape = v_shape if value_layout == "tokens" else (q_pages, hkv, d, page_q // n_v)
    meta = (q_pages, hkv, page_q, 1)

    def meta_pool(k, kind, width):
        lo, hi = (0.01, 0.1) if kind == "scale" else (0.0, 2.0**width - 1)
        x = jax.random.uniform(k, meta, jnp.float32, lo, hi)
        return layout.encode_meta(x, meta_dtype, kind, width)  # uint8: the nearest byte

    fp = da.FpPages(
        k=jax.random.normal(ks[1], (batch * pf, hkv, page, d), jnp.bfloat16),
        v=jax.random.normal(ks[2], (batch * pf, hkv, page, d), jnp.bfloat16),
        table=jnp.arange(batch * pf, dtype=jnp.int32).reshape(batch, pf),
        length=jnp.full((batch,), n_fp, jnp.int32),
    )
    lowbit = da.LowbitPages(
        k=da.QuantizedPages(
            jax.random.randint(ks[3], codes_shape, 0, 256, jnp.int32).astype(jnp.uint8),
            meta_pool(ks[5], "scale", bits),
            meta_pool(ks[6], "zero", bits),
        ),
        v=da.QuantizedPages(
            jax.random.randint(ks[4], v_shape, 0, 256, jnp.int32).astype(jnp.uint8),
            meta_pool(ks[7], "scale", bv),
            meta_pool(jax.random.fold_in(ks[5], 1), "zero", bv),
        ),
        # A shuffled page table: real caches do not hand out pages in order.
        table=jax.random.permutation(ks[6], q_pages).astype(jnp.int32).reshape(batch, pq),
        length=jnp.full((batch,), n_q, jnp.int32),
    )
    transforms = da.HeadTransforms(
        jnp.linalg.qr(jax.random.normal(ks[0], (hkv, d, d)))[0],
        jnp.linalg.qr(jax.random.normal(ks[1], (hkv, d, d)))[0],
    )
    q = jax.random.normal(ks[0], (batch, cfg.q_heads, d), jnp.bfloat16)
    return dict(q=q, fp=fp, lowbit=lowbit, transforms=transforms)


def _dense_attention(q, k, v, sm_scale):
    """XLA attention over a dense cache: q [B, Hq, d], k/v [B, S, Hkv, d] (bf16)."""
    b, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, d)
    s = jnp.einsum("BKGH,BSKH->BKGS", qg, k, preferred_element_type=jnp.float32) * sm_scale
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("BKGS,BSKH->BKGH", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, hq, d)


_MOSAIC_DIMS = dict(backend="gpu_mosaic", pages_per_block=1, value_layout="dims")


def _dims(bits: int, **options) -> tuple[int, dict, dict]:
    """A row of the Mosaic GPU body on 128-token dimension-major pages, with kernel options."""
    return bits, dict(_MOSAIC_DIMS, **options), dict(lowbit_page_size=128)


# name -> (bits, kernel options, input overrides): attribution rows of the low-bit kernel.
LOWBIT_VARIANTS: dict[str, tuple[int, dict, dict]] = {
    "int2_pallas": (2, {}, {}),
    "int4_pallas": (4, {}, {}),
    # The Mosaic GPU body (tokens as the MMA's M) reads 64-token low-bit pages.
    "int2_mosaic": (2, dict(backend="gpu_mosaic", pages_per_block=1), dict(lowbit_page_size=64)),
    "int4_mosaic": (4, dict(backend="gpu_mosaic", pages_per_block=1), dict(lowbit_page_size=64)),
    "int2_mosaic_page128": (
        2,
        dict(backend="gpu_mosaic", pages_per_block=1),
        dict(lowbit_page_size=128),
    ),
    # Value codes packed along tokens (layout.VALUE_LAYOUTS "dims"), 128-token pages: the
    # value product takes them as the register operand (no float16 shared tile).
    "int2_mosaic_vdims": _dims(2),
    # Key codes as float16 operands through inline PTX (`gpu_mosaic._planes_asm`; the default
    # since session 17 is 8-bit integer key operands, the plain `*_mosaic_vdims` rows).
    "int2_mosaic_vdims_asm": _dims(2, int_to_float="asm"),
    "int4_mosaic_vdims_asm": _dims(4, int_to_float="asm"),
    # Tensor-map copies of the code tiles (the default is bulk copies where rows are 32 bytes).
    "int2_mosaic_vdims_tma": _dims(2, gather="tma"),
    "int4_mosaic_vdims": _dims(4),
    # e4m3 value operands (8-bit keys; the weights in two e4m3 parts, or one).
    "int2_mosaic_vdims_e4m3x2": _dims(2, int_to_float="s8_e4m3x2"),
    "int4_mosaic_vdims_e4m3x2": _dims(4, int_to_float="s8_e4m3x2"),
    "int2_mosaic_vdims_e4m3": _dims(2, int_to_float="s8_e4m3"),
    # The unpack in jnp ops (before run 48's inline PTX, `gpu_mosaic._planes_asm`).
    "int2_mosaic_vdims_exponent": _dims(2, int_to_float="exponent"),
    "int4_mosaic_vdims_exponent": _dims(4, int_to_float="exponent"),
    # Before runs 91-92: the query operands from XLA's fusions, sink/recent splits of 4 pages.
    "int2_mosaic_vdims_qxla_fp4": _dims(2, prologue="xla", fp_pages_per_split=4),
    "int2_mosaic_vdims_fp4": _dims(2, fp_pages_per_split=4),
    # Before session 31: the API's convert and head_matmul, then the operands kernel (three
    # kernels; the default "fused" prologue is one).
    "int2_mosaic_vdims_qtriton": _dims(2, prologue="triton"),
    # Sink/recent splits of 2 pages (batch 8 x 8 heads takes 1-page splits by default).
    "int2_mosaic_vdims_fp2": _dims(2, fp_pages_per_split=2),
    # Everything but the low-bit pages (their splits empty): the call's fixed cost and the
    # sink/recent kernel.
    "int2_mosaic_vdims_fp_segment_only": (
        2,
        _MOSAIC_DIMS,
        dict(lowbit_page_size=128, lowbit_len=0),
    ),
    # Split count of the dims body (splits_factor x the automatic choice).
    "int2_mosaic_vdims_splits_eighth": _dims(2, splits_factor=0.125),
    "int2_mosaic_vdims_splits_quarter": _dims(2, splits_factor=0.25),
    "int2_mosaic_vdims_splits_half": _dims(2, splits_factor=0.5),
    "int2_mosaic_vdims_splits_x2": _dims(2, splits_factor=2),
    # x4: ~1024 programs, the Mosaic body's automatic choice until session 30 (now ~256).
    "int2_mosaic_vdims_splits_x4": _dims(2, splits_factor=4),
    "int4_mosaic_vdims_splits_x4": _dims(4, splits_factor=4),
    "int2_mosaic_splits_x2": (
        2,
        dict(backend="gpu_mosaic", pages_per_block=1, splits_factor=2),
        dict(lowbit_page_size=64),
    ),
    "int2_mosaic_splits_half": (
        2,
        dict(backend="gpu_mosaic", pages_per_block=1, splits_factor=0.5),
        dict(lowbit_page_size=64),
    ),
    # The Triton inner loop is rows + asm + deferred (the other strategies measured slower and
    # were deleted; their rows are in notes/benchmarks_history.md).
    # Bit allocation's mixed widths and the 8-bit scale/zero encoding (Triton body).
    "int2_meta_uint8": (2, {}, dict(meta_dtype="uint8")),
    "int2k_int4v": (2, dict(bits_v=4), {}),
    "int4k_int2v": (4, dict(bits_v=2), {}),
    # The same on the Mosaic GPU body (dims values, 128-token pages).
    "int2_mosaic_vdims_meta_uint8": (
        2,
        _MOSAIC_DIMS,
        dict(lowbit_page_size=128, meta_dtype="uint8"),
    ),
    "int2k_int4v_mosaic_vdims": (2, dict(_MOSAIC_DIMS, bits_v=4), dict(lowbit_page_size=128)),
    "int4k_int2v_mosaic_vdims": (4, dict(_MOSAIC_DIMS, bits_v=2), dict(lowbit_page_size=128)),
    # Stages left out.
    "int2_no_transforms": (2, {}, dict(query_transform=None, value_inverse=None)),
    "int2_fp_segment_only": (2, {}, dict(lowbit_len=0)),
    # Launch shape.
    "int2_ppb16": (2, dict(pages_per_block=16), {}),
    "int2_ppb4": (2, dict(pages_per_block=4), {}),
    "int2_ppb2": (2, dict(pages_per_block=2), {}),
    "int4_ppb4": (4, dict(pages_per_block=4), {}),
    "int2_warps8": (2, dict(num_warps=8), {}),
    "int2_stages3": (2, dict(num_stages=3), {}),
    "int2_stages1": (2, dict(num_stages=1), {}),
    "int2_ppb8": (2, dict(pages_per_block=8), {}),
    # splits_factor multiplies the automatic split count, whose target was 512 programs up to
    # run 9, 1024 since (512 in run 12 only; notes/device_runs.md).
    "int2_ppb4_splits_x2": (2, dict(pages_per_block=4, splits_factor=2), {}),
    # One or two warps per program: no cross-warp row reductions or operand broadcasts
    # (M = 16 fits one warp's MMA tile), more programs resident per SM.
    "int2_warps1": (2, dict(num_warps=1, splits_factor=4), {}),
    "int2_warps2": (2, dict(num_warps=2, splits_factor=2), {}),
    "int2_warps1_ppb2": (2, dict(num_warps=1, pages_per_block=2, splits_factor=4), {}),
    "int2_warps2_ppb2": (2, dict(num_warps=2, pages_per_block=2, splits_factor=2), {}),
    "int2_splits_x2": (2, dict(splits_factor=2), {}),
    "int2_splits_half": (2, dict(splits_factor=0.5), {}),
}


def lowbit_variant(cfg: BenchConfig, batch: int, ctx: int, name: str) -> tuple[int, dict, dict]:
    """(bits, `decode_attention_variant` keyword options, input overrides) of one
    `LOWBIT_VARIANTS` row at one point: ``splits_factor`` resolved against the automatic split
    count, the config's tuning knobs as the base."""
    bits, opts, override = LOWBIT_VARIANTS[name]
    opts = dict(opts)
    kw = dict(
        num_splits=cfg.num_splits,
        pages_per_block=cfg.pages_per_block,
        backend=cfg.backend,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    factor = opts.pop("splits_factor", None)
    kw.update(opts)
    if factor is not None:
        ppb = kw["pages_per_block"] or da_api.default_pages_per_block(
            cfg.backend, bits, kw.get("bits_v")
        )
        page = override.get("lowbit_page_size", cfg.page_size)
        kw["num_splits"] = max(1, int(factor * _auto(cfg, batch, ctx, ppb, kw["backend"], page)))
    return bits, kw, override


def with_overrides(x: dict, override: dict, batch: int) -> dict:
    """Inputs of a variant row: ``lowbit_len`` overridden means no low-bit tokens at all."""
    for k, v in override.items():
        if k == "lowbit_len":
            x["lowbit"] = x["lowbit"]._replace(length=jnp.zeros((batch,), jnp.int32))
        else:
            x[k] = v
    return x


def _lowbit_row(cfg: BenchConfig, batch: int, ctx: int, name: str, key, record) -> None:
    bits, kw, override = lowbit_variant(cfg, batch, ctx, name)
    sm = cfg.head_dim**-0.5
    override = dict(override)
    meta_dtype = override.pop("meta_dtype", "float16")
    nbytes, n_fp, n_q = _bytes_lowbit(cfg, batch, ctx, bits, kw.get("bits_v"), meta_dtype)
    page_q = override.pop("lowbit_page_size", None)
    vl = kw.get("value_layout", "tokens")
    caches = []
    for r in range(copies_for(nbytes)):
        x = _make_lowbit_inputs(
            cfg,
            batch,
            ctx,
            bits,
            jax.random.fold_in(key, r),
            page_q,
            vl,
            bits_v=kw.get("bits_v"),
            meta_dtype=meta_dtype,
        )
        x.pop("q")
        caches.append(with_overrides(x, override, batch))
    qs = _queries(cfg, batch, key, len(caches))

    def call(x, q):
        return da.decode_attention_variant(q=q, **x, bits=bits, sm_scale=sm, **kw)

    record(
        name,
        lambda: _time_unrolled(call, caches, qs, cfg),
        nbytes,
        fp_tokens=n_fp,
        lowbit_tokens=n_q,
        options={k: v for k, v in kw.items() if v is not None and k != "backend"},
    )


def _queries(cfg: BenchConfig, batch: int, key, n: int) -> list[jax.Array]:
    ks = jax.random.split(jax.random.fold_in(key, 99), n)
    return [jax.random.normal(k, (batch, cfg.q_heads, cfg.head_dim), jnp.bfloat16) for k in ks]


def bench_point(cfg: BenchConfig, batch: int, ctx: int, ceiling: float) -> list[dict]:
    """Times every variant at one (batch, context) point; returns one row per variant."""
    d, hkv, page = cfg.head_dim, cfg.kv_heads, cfg.page_size
    sm = d**-0.5
    rows = []
    tune = dict(
        num_splits=cfg.num_splits,
        pages_per_block=cfg.pages_per_block,
        backend=cfg.backend,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    key = jax.random.key(batch * 1_000_003 + ctx)
    bf16_bytes = batch * ctx * hkv * d * 2 * 2

    def record(name, timer, nbytes, **extra):
        row = dict(variant=name, batch=batch, context=ctx, bytes_read=int(nbytes), **extra)
        try:
            t = timer()
            row.update(
                time_ms=t * 1e3,
                bandwidth_GBps=nbytes / t / 1e9,
                fraction_of_ceiling=nbytes / t / ceiling,
            )
            if nbytes / t > 1.02 * ceiling:  # faster than memory can deliver: a timing bug
                row["above_ceiling"] = True
                print(f"WARNING {name}: reads above the measured ceiling", flush=True)
        except Exception as e:  # a missing backend feature is a result, not a crash
            row.update(error=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(row)
        print(json.dumps(row), flush=True)

    lowbit = [v for v in cfg.variants if v in LOWBIT_VARIANTS]
    for name in lowbit + [v for v in cfg.lowbit_variants if v not in lowbit]:
        _lowbit_row(cfg, batch, ctx, name, key, record)
    if "mosaic_stages" in cfg.variants:
        mosaic_stage_rows(cfg, batch, ctx, record)

    need_dense = {"bf16_pallas", "bf16_mosaic", "xla_dense_bf16", "cudnn_bf16"} & set(cfg.variants)
    if need_dense:
        ks = jax.random.split(key, 3)
        n_copies = copies_for(bf16_bytes)
        qs = _queries(cfg, batch, key, n_copies)
        dense = [
            dict(
                k=jax.random.normal(
                    jax.random.fold_in(ks[1], r), (batch, ctx, hkv, d), jnp.bfloat16
                ),
                v=jax.random.normal(
                    jax.random.fold_in(ks[2], r), (batch, ctx, hkv, d), jnp.bfloat16
                ),
            )
            for r in range(n_copies)
        ]
        if {"bf16_pallas", "bf16_mosaic"} & set(cfg.variants):
            npg = _pages(ctx, page)
            tab = jnp.arange(batch * npg, dtype=jnp.int32).reshape(batch, npg)
            lens = jnp.full((batch,), ctx, jnp.int32)

            def to_pages(a):  # dense [B, S, Hkv, d] -> pages [B*S/page, Hkv, page, d]
                a = a.reshape(batch, npg, page, hkv, d).transpose(0, 1, 3, 2, 4)
                return a.reshape(batch * npg, hkv, page, d)

            paged = [dict(k=to_pages(c["k"]), v=to_pages(c["v"])) for c in dense]

            def call_pallas(c, q):
                fp = da.FpPages(c["k"], c["v"], tab, lens)
                return da.decode_attention_bf16(q, fp, sm_scale=sm, **tune)

            def call_mosaic(c, q):  # the Mosaic GPU BF16 body (`gpu_mosaic.fp_partials`)
                fp = da.FpPages(c["k"], c["v"], tab, lens)
                return da.decode_attention_bf16(q, fp, sm_scale=sm, backend="gpu_mosaic")

            for name, call in (("bf16_pallas", call_pallas), ("bf16_mosaic", call_mosaic)):
                if name in cfg.variants:
                    record(
                        name,
                        lambda call=call: _time_unrolled(call, paged, qs, cfg),
                        bf16_bytes,
                    )
            del paged
        if "xla_dense_bf16" in cfg.variants:
            record(
                "xla_dense_bf16",
                lambda: _time_unrolled(
                    lambda c, q: _dense_attention(q, c["k"], c["v"], sm), dense, qs, cfg
                ),
                bf16_bytes,
            )
        if "cudnn_bf16" in cfg.variants and cfg.backend == "gpu":

            def call_cudnn(c, q):
                return jax.nn.dot_product_attention(
                    q[:, None], c["k"], c["v"], scale=sm, implementation="cudnn"
                )

            record("cudnn_bf16", lambda: _time_unrolled(call_cudnn, dense, qs, cfg), bf16_bytes)
        del dense

    if "torch_sdpa_bf16" in cfg.variants and cfg.backend == "gpu":
        record("torch_sdpa_bf16", lambda: _time_torch_sdpa(cfg, batch, ctx), bf16_bytes)
    return rows


def _time_torch_sdpa(cfg: BenchConfig, batch: int, ctx: int) -> float:
    """Median seconds per SDPA call: one CUDA graph of calls that each read their own query
    and their own K/V copy (`copies_for`, as the JAX rows), replayed back to back for
    ``calls_per_repeat`` calls and timed with CUDA events (host launch cost excluded)."""
    import torch  # optional outside reference
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        raise RuntimeError("torch has no CUDA device")
    dev, bf = "cuda", torch.bfloat16
    n = copies_for(batch * ctx * cfg.kv_heads * cfg.head_dim * 2 * 2)
    rounds = max(_MIN_ROUNDS, -(-cfg.calls_per_repeat // n))
    qs = [torch.randn(batch, cfg.q_heads, 1, cfg.head_dim, device=dev, dtype=bf) for _ in range(n)]
    kv_shape = (batch, cfg.kv_heads, ctx, cfg.head_dim)
    kvs = [
        (torch.randn(kv_shape, device=dev, dtype=bf), torch.randn(kv_shape, device=dev, dtype=bf))
        for _ in range(n)
    ]

    def calls():
        return [
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True) for q, (k, v) in zip(qs, kvs)
        ]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            calls()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = calls()
    graph.replay()
    torch.cuda.synchronize()

    def batch(k: int) -> float:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(k):
            graph.replay()
        e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) / 1e3

    times = [_steady_seconds(batch, rounds) / n for _ in range(cfg.repeats)]
    del outs  # free the copies before the next row
    graph = None
    kvs.clear()
    torch.cuda.empty_cache()
    return statistics.median(times)


def _quantize_pack_call_ms(cfg: BenchConfig, tokens: int) -> dict:
    """Median ms per ``quantize_pack`` call on ``[tokens, Hkv, d]`` (random orthogonal
    transforms), bits 2 and 4, for the Pallas kernel (``kernel_*``) and the XLA-fused
    pure-jnp reference under jit (``xla_ref_*``)."""
    from pallas_kernels import quantize_pack as qp

    d = cfg.head_dim
    a = jnp.linalg.qr(jax.random.normal(jax.random.key(3), (cfg.kv_heads, d, d)))[0]
    keys = jax.random.split(jax.random.key(7), cfg.calls_per_repeat)
    xs = [jax.random.normal(k, (tokens, cfg.kv_heads, d), jnp.bfloat16) for k in keys]
    impls = {
        "kernel": lambda x, bits: qp.quantize_pack_kernel(
            x, a, 0.95, bits=bits, backend=cfg.backend
        ),
        "xla_ref": lambda x, bits: qp.ref_quantize_pack(x, a, 0.95, bits=bits),
    }
    out = {}
    for impl, fn in impls.items():
        for bits in (2, 4):
            tag = f"{impl}_int{bits}"
            try:
                t = _time_unrolled(
                    lambda c, x, fn=fn, bits=bits: fn(x, bits), [{}] * len(xs), xs, cfg
                )
                out[f"{tag}_per_call_ms"] = t * 1e3
            except Exception as e:
                out[f"{tag}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def quantize_pack_step_cost(cfg: BenchConfig, batch: int) -> dict:
    """Per decode step cost of quantizing one new token per sequence (K and V, all layers):
    one layer's call time (``[batch, Hkv, d]``) times ``2 * layers``, for the Pallas kernel
    and for the XLA-fused pure-jnp reference (`ref_quantize_pack` under jit)."""
    try:
        calls = _quantize_pack_call_ms(cfg, batch)
    except ImportError as e:
        return dict(batch=batch, error=f"quantize_pack unavailable: {e}")
    out = dict(batch=batch, layers=cfg.layers, **calls)
    for key, ms in calls.items():
        if key.endswith("_per_call_ms"):
            out[key.replace("_per_call_ms", "_per_step_ms")] = ms * 2 * cfg.layers
    print(json.dumps(out), flush=True)
    return out


def quantize_pack_prefill_cost(cfg: BenchConfig, tokens: int) -> dict:
    """One layer's K (or V) quantize_pack call over ``tokens`` prefill tokens: where the
    kernel starts to beat the XLA reference (sets ``quantize_pack.GPU_XLA_MAX_TOKENS``)."""
    try:
        out = dict(tokens=tokens, **_quantize_pack_call_ms(cfg, tokens))
    except ImportError as e:
        return dict(tokens=tokens, error=f"quantize_pack unavailable: {e}")
    print(json.dumps(out), flush=True)
    return out


def tune_lowbit(cfg: BenchConfig, ceiling: float) -> list[dict]:
    """Attribution and tuning sweep of the low-bit kernel (where does the time go?).

    Per point: bits 2 and 4 at the configured tuning, 2 bits without the in-kernel transforms,
    2 bits with no low-bit tokens (the full-precision segment alone), then a grid over
    pages_per_block x num_splits x num_warps x num_stages for 2 bits.
    """
    sm = cfg.head_dim**-0.5
    rows = []
    for batch, ctx in cfg.points:
        key = jax.random.key(batch * 7919 + ctx)
        xs = {bits: _make_lowbit_inputs(cfg, batch, ctx, bits, key) for bits in (2, 4)}
        base = dict(
            num_splits=cfg.num_splits,
            pages_per_block=cfg.pages_per_block,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        runs = [("int2", 2, {}, base), ("int4", 4, {}, base)]
        runs.append(("int2_no_transforms", 2, dict(transforms=None), base))
        runs.append(("int2_fp_segment_only", 2, dict(lowbit_len=0), base))
        for ppb in (8, 16, 32):
            for splits in (None, 4 * _auto(cfg, batch, ctx, ppb, cfg.backend)):
                for warps in (4, 8):
                    for stages in (2, 4):
                        t = dict(
                            num_splits=splits,
                            pages_per_block=ppb,
                            num_warps=warps,
                            num_stages=stages,
                        )
                        runs.append(("int2_tune", 2, {}, t))
        for name, bits, override, t in runs:
            x = with_overrides(dict(xs[bits]), override, batch)
            nbytes = _bytes_lowbit(cfg, batch, ctx, bits)[0]
            row = dict(variant=name, batch=batch, context=ctx, bytes_read=nbytes, **t)
            try:
                f = jax.jit(
                    lambda x, bits=bits, t=t: da.decode_attention(
                        **x, bits=bits, sm_scale=sm, backend=cfg.backend, **t
                    )
                )
                sec = _time_jax(lambda f=f, x=x: f(x), cfg)
                row.update(time_ms=sec * 1e3, fraction_of_ceiling=nbytes / sec / ceiling)
            except Exception as e:
                row.update(error=f"{type(e).__name__}: {str(e)[:200]}")
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _auto(
    cfg: BenchConfig, batch: int, ctx: int, ppb: int, backend: str, page: int | None = None
) -> int:
    """The split count `decode_attention` picks for this point's low-bit pages."""
    n_q = _split_context(cfg, ctx)[1]
    pages = max(1, _pages(n_q, page or cfg.page_size))
    return da.lowbit_auto_splits(batch, cfg.kv_heads, pages, ppb, backend)


def _speedups(rows: list[dict]) -> list[dict]:
    """Per point: speedup of each low-bit row over torch SDPA, cuDNN and the best JAX BF16 row."""
    out = []
    for point in sorted({(r["batch"], r["context"]) for r in rows}):
        at = [r for r in rows if (r["batch"], r["context"]) == point]
        t = {r["variant"]: r.get("time_ms") for r in at if not r.get("above_ceiling")}
        jax_bf16 = [
            t[v] for v in ("xla_dense_bf16", "cudnn_bf16", "bf16_pallas", "bf16_mosaic") if t.get(v)
        ]
        best = min(jax_bf16) if jax_bf16 else None
        for v in [r["variant"] for r in at if r["variant"] in LOWBIT_VARIANTS]:
            if not t.get(v):
                continue

            def ratio(base, v=v, t=t):
                return t[base] / t[v] if t.get(base) else None

            out.append(
                dict(
                    batch=point[0],
                    context=point[1],
                    variant=v,
                    vs_torch_sdpa=ratio("torch_sdpa_bf16"),
                    vs_cudnn=ratio("cudnn_bf16"),
                    vs_best_jax_bf16=None if best is None else best / t[v],
                )
            )
    return out


def markdown_table(result: dict) -> str:
    lines = [
        f"`{result.get('command', '')}` at commit {result.get('commit', '?')}, "
        f"{result.get('date', '')}, {result.get('device', '')}, jax {result.get('jax_version')}",
        "",
        "read-bandwidth ceiling (the fastest of XLA's and torch's bf16 sums over 4 and 16 GiB): "
        f"{result['read_ceiling_GBps']:.0f} GB/s",
        "",
        "| batch | context | variant | time (ms) | bytes read (MB) | GB/s | of ceiling |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        if "time_ms" in r:
            flag = " (above ceiling: invalid)" if r.get("above_ceiling") else ""
            lines.append(
                f"| {r['batch']} | {r['context']} | {r['variant']}{flag} | {r['time_ms']:.4f} | "
                f"{r['bytes_read'] / 1e6:.1f} | {r['bandwidth_GBps']:.0f} | "
                f"{r['fraction_of_ceiling']:.2f} |"
            )
        else:
            lines.append(
                f"| {r['batch']} | {r['context']} | {r['variant']} | failed: "
                f"{r['error'][:80]} | | | |"
            )
    lines += [
        "",
        "| batch | context | kernel | x torch SDPA | x cuDNN | x best JAX BF16 |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    for s in result["speedups"]:
        cells = [
            "-" if s[k] is None else f"{s[k]:.2f}"
            for k in ("vs_torch_sdpa", "vs_cudnn", "vs_best_jax_bf16")
        ]
        lines.append(
            f"| {s['batch']} | {s['context']} | {s['variant']} | " + " | ".join(cells) + " |"
        )

    def step_cell(q, tag):
        a, c = q.get(f"{tag}_per_step_ms"), q.get(f"{tag}_per_call_ms")
        return "-" if a is None else f"{a:.3f} ({c * 1e3:.1f} us)"

    def call_cell(q, tag):
        c = q.get(f"{tag}_per_call_ms")
        return "-" if c is None else f"{c:.3f}"

    cfg = result["config"]
    tables = [
        (
            "quantize_pack",
            "batch",
            step_cell,
            "quantize_pack per decode step (one token per sequence, K and V, "
            f"{cfg['layers']} layers; per call in brackets), ms:",
        ),
        (
            "quantize_pack_prefill",
            "tokens",
            call_cell,
            f"quantize_pack per prefill call (tokens x {cfg['kv_heads']} KV heads, "
            "one layer's K or V), ms:",
        ),
    ]
    for key, first, cell, title in tables:
        if not result.get(key):
            continue
        lines += [
            "",
            title,
            "",
            f"| {first} | kernel int2 | kernel int4 | XLA ref int2 | XLA ref int4 |",
            "|---:|---:|---:|---:|---:|",
        ]
        for q in result[key]:
            tags = ("kernel_int2", "kernel_int4", "xla_ref_int2", "xla_ref_int4")
            lines.append(f"| {q[first]} | " + " | ".join(cell(q, t) for t in tags) + " |")
    return "\n".join(lines) + "\n"


def main(cfg: BenchConfig) -> dict:
    """Runs the benchmark grid and writes JSON + markdown; returns the result dict."""
    dev = jax.devices()[0]
    ceilings = read_bandwidth_ceiling()
    ceiling = ceilings["ceiling"]
    print(f"device={dev.device_kind} read ceilings {ceilings}", flush=True)
    if cfg.tune:
        out = Path(cfg.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        rows = tune_lowbit(cfg, ceiling)
        res = dict(
            device=dev.device_kind,
            jax_version=jax.__version__,
            read_ceiling_GBps=ceiling / 1e9,
            tune_rows=rows,
        )
        out.write_text(json.dumps(res, indent=1))
        return res
    rows = []
    for batch, ctx in cfg.points:
        rows += bench_point(cfg, batch, ctx, ceiling)
    result = dict(
        **environment(),
        device=dev.device_kind,
        config=dataclasses.asdict(cfg),
        read_ceiling_GBps=ceiling / 1e9,
        read_ceilings_GBps={k: v / 1e9 for k, v in ceilings.items()},
        rows=rows,
        speedups=_speedups(rows),
    )
    try:
        import torch

        result["torch_version"] = torch.__version__
    except ImportError:
        pass
    # The attention rows are written before the quantize_pack costs, so a run cut short by a
    # time limit keeps them.
    _write_result(Path(cfg.out), result)
    qp = (
        [quantize_pack_step_cost(cfg, b) for b in sorted({b for b, _ in cfg.points})]
        if cfg.quantize_pack
        else []
    )
    qp_prefill = (
        [quantize_pack_prefill_cost(cfg, n) for n in cfg.quantize_pack_tokens]
        if cfg.quantize_pack
        else []
    )
    result.update(quantize_pack=qp, quantize_pack_prefill=qp_prefill)
    print(_write_result(Path(cfg.out), result))
    return result


def _write_result(out: Path, result: dict) -> str:
    """Writes `out` (JSON) and its markdown twin; returns the markdown."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    md = markdown_table(result)
    out.with_suffix(".md").write_text(md)
    return md


def parse_args(argv=None) -> BenchConfig:
    parser = cli.dataclass_parser(BenchConfig, "python -m eval.bench_decode", __doc__)
    return cli.dataclass_from_args(BenchConfig, parser.parse_args(argv))


if __name__ == "__main__":
    cli.run(main, parse_args)
