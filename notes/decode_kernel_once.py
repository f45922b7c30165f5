"""Runs one GPU decode-kernel variant once at a mid-size shape, for profilers.

    ncu --clock-control none -k regex:paged_decode_int python3 notes/decode_kernel_once.py rows_asm

(`notes/device_run.sh` step ``ncu``). Dumping the kernel's PTX through XLA was tried in run 7:
``--xla_dump_to`` writes no PTX for Pallas Triton kernels on this stack, so profiles are the
way to read the compiled kernel.
"""

from __future__ import annotations

import os
import sys

VARIANTS = {
    "default": {},
    "warps1": dict(num_warps=1),
    "warps2": dict(num_warps=2),
    "ppb8": dict(pages_per_block=8),
    "prefetch_asm": dict(gather="prefetch", int_to_float="asm"),
    "rows_asm": dict(gather="rows", int_to_float="asm"),
    "rows_exponent": dict(gather="rows", int_to_float="exponent"),
    "pages_exponent": dict(gather="pages", int_to_float="exponent"),
}


def run_once(name: str) -> None:
    import jax
    import jax.numpy as jnp

    from pallas_kernels import decode_attention as da

    b, hq, hkv, d, page, bits = 8, 32, 8, 128, 16, 2
    n_fp, n_q = 32, 16384
    k = jax.random.key(0)
    f16 = jnp.float16
    pq = b * n_q // page
    x = dict(
        q=jax.random.normal(k, (b, hq, d), jnp.bfloat16),
        k_fp=jnp.zeros((b * n_fp // page, hkv, page, d), jnp.bfloat16),
        v_fp=jnp.zeros((b * n_fp // page, hkv, page, d), jnp.bfloat16),
        fp_page_table=jnp.arange(b * n_fp // page, dtype=jnp.int32).reshape(b, -1),
        fp_len=jnp.full((b,), n_fp, jnp.int32),
        k_codes=jnp.zeros((pq, hkv, page, d // 4), jnp.uint8),
        v_codes=jnp.zeros((pq, hkv, page, d // 4), jnp.uint8),
        k_scale=jnp.ones((pq, hkv, page, 1), f16),
        k_zero=jnp.zeros((pq, hkv, page, 1), f16),
        v_scale=jnp.ones((pq, hkv, page, 1), f16),
        v_zero=jnp.zeros((pq, hkv, page, 1), f16),
        q_page_table=jnp.arange(pq, dtype=jnp.int32).reshape(b, -1),
        q_len=jnp.full((b,), n_q, jnp.int32),
    )
    out = da.decode_attention_variant(**x, bits=bits, sm_scale=d**-0.5, **VARIANTS[name])
    out.block_until_ready()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if len(sys.argv) != 2 or sys.argv[1] not in VARIANTS:
        raise SystemExit(f"usage: decode_kernel_once.py VARIANT, one of {sorted(VARIANTS)}")
    run_once(sys.argv[1])
