"""Runs one low-bit decode-attention variant once, for profilers.

    ncu --clock-control none -k regex:paged_decode_int \
        python3 notes/decode_kernel_once.py int2_pallas
    ncu --clock-control none --metrics gpu__time_duration.sum \
        python3 notes/decode_kernel_once.py int2_pallas 1x65536     # every kernel of one call

VARIANT is a row name of `eval.bench_decode.LOWBIT_VARIANTS`, or ``mosaic_split:STAGE`` (the
Mosaic split kernel alone, 2 bits, 128-token dimension-major pages, computing STAGE of
`gpu_mosaic.STAGES_KINDS`: what `eval.bench_decode`'s ``mosaic_stages`` rows time), or
``mosaic_split:STAGE:OVERLAP`` with an MMA schedule of `gpu_mosaic.OVERLAPS`; the
inputs (cache split into sink/recent full-precision and low-bit pages, random transforms) are
the benchmark's own, at
BATCHxCONTEXT (default 8x16384). The call is compiled and run once before the profiled call, so
a profile of the last launches (``--launch-skip`` or the listing's tail) shows steady state.
`notes/device_run.sh` steps ``ncu`` and ``kernels`` use it. Dumping the kernel's PTX through XLA
was tried in run 7: ``--xla_dump_to`` writes no PTX for Pallas Triton kernels on this stack;
`notes/kernel_sass.py` compiles the kernel for sm_90 on a CPU machine instead. For the
Mosaic GPU body, ``MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_TO=DIR``
writes ptxas' resource report and the SASS of every kernel compiled.
"""

from __future__ import annotations

import os
import sys


def run_split_once(stage: str, batch: int, ctx: int, overlap: str = "values") -> None:
    import jax

    from eval import bench_decode as bd
    from pallas_kernels import decode_attention as da
    from pallas_kernels.decode_attention import api
    from pallas_kernels.decode_attention import gpu_mosaic as gm

    cfg = bd.BenchConfig()
    x = bd._make_lowbit_inputs(cfg, batch, ctx, 2, jax.random.key(0), 128, "dims")
    low = x["lowbit"]
    splits = da.lowbit_auto_splits(batch, cfg.kv_heads, low.table.shape[1], 1)
    (kc, ks, kz), (vc, vs, vz) = low.k, low.v
    ls = (kc, vc, ks, kz, vs, vz, api.split_table(low.table, splits, 1), low.length)
    group = cfg.q_heads // cfg.kv_heads
    qg = jax.random.normal(jax.random.key(1), (batch, cfg.kv_heads, group, cfg.head_dim))
    f = jax.jit(
        lambda qg, ls: gm.lowbit_partials(
            qg,
            ls,
            bits=2,
            scale_log2=0.1,
            group=group,
            stage=stage,
            value_layout="dims",
            overlap=overlap,
        )
    )
    for _ in range(2):
        jax.block_until_ready(f(qg, ls))


def run_once(name: str, batch: int, ctx: int) -> None:
    import jax

    from eval import bench_decode as bd
    from pallas_kernels import decode_attention as da

    cfg = bd.BenchConfig()
    bits, kw, override = bd.lowbit_variant(cfg, batch, ctx, name)
    override = dict(override)
    page_q = override.pop("lowbit_page_size", None)
    vl = kw.get("value_layout", "tokens")
    x = bd._make_lowbit_inputs(cfg, batch, ctx, bits, jax.random.key(0), page_q, vl)
    x = bd.with_overrides(x, override, batch)
    sm = cfg.head_dim**-0.5
    for _ in range(2):  # compile + warm, then the call a profile reads last
        da.decode_attention_variant(**x, bits=bits, sm_scale=sm, **kw).block_until_ready()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from eval.bench_decode import LOWBIT_VARIANTS
    from pallas_kernels.decode_attention.gpu_mosaic import OVERLAPS, STAGES_KINDS

    split_names = [f"mosaic_split:{k}" for k in STAGES_KINDS]
    split_names += [f"{n}:{o}" for n in split_names for o in OVERLAPS]
    if len(sys.argv) not in (2, 3) or sys.argv[1] not in [*LOWBIT_VARIANTS, *split_names]:
        raise SystemExit(
            f"usage: decode_kernel_once.py VARIANT [BATCHxCONTEXT], VARIANT one of "
            f"{sorted(LOWBIT_VARIANTS) + split_names}"
        )
    b, c = (int(v) for v in (sys.argv[2] if len(sys.argv) == 3 else "8x16384").split("x"))
    if sys.argv[1].startswith("mosaic_split:"):
        stage, *overlap = sys.argv[1].split(":")[1:]
        run_split_once(stage, b, c, *overlap)
    else:
        run_once(sys.argv[1], b, c)
