"""Dumps the compiled PTX of the GPU decode kernel's inner-loop variants and counts the
instruction mix, so a change to the low-bit loop can be read as instructions (device notes).

Run on a GPU machine; set nothing else:

    python notes/decode_kernel_ptx.py OUT_DIR

Each variant is compiled in its own process-level XLA dump directory (XLA_FLAGS is read at
start, so the script re-executes itself once per variant).
"""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import shutil
import subprocess
import sys

VARIANTS = {
    "prefetch_asm": dict(gather="prefetch", int_to_float="asm"),
    "rows_asm": dict(gather="rows", int_to_float="asm"),
    "rows_exponent": dict(gather="rows", int_to_float="exponent"),
    "pages_exponent": dict(gather="pages", int_to_float="exponent"),
}


def compile_one(name: str) -> None:
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


def count(ptx_text: str) -> dict[str, int]:
    """Opcode histogram of the decode kernel's PTX (the function named paged_decode_int*)."""
    m = re.search(r"\.entry\s+(\S*paged_decode_int\S*)\((.*?)^\}", ptx_text, re.S | re.M)
    body = m.group(0) if m else ptx_text
    ops = collections.Counter()
    for line in body.splitlines():
        line = line.strip()
        if not line or line.startswith(("//", ".", "{", "}", "$")) or line.endswith(":"):
            continue
        op = line.split()[0].rstrip(";")
        if op.startswith("@"):
            op = line.split()[1]
        ops[op.split(".")[0] + ("." + op.split(".")[1] if "." in op else "")] += 1
    return dict(ops.most_common())


def main(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    summary = {}
    for name in VARIANTS:
        dump = os.path.join(out_dir, f"dump_{name}")
        env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={dump}")
        subprocess.run([sys.executable, __file__, "--one", name], env=env, check=True)
        files = sorted(glob.glob(os.path.join(dump, "**", "*"), recursive=True))
        with open(os.path.join(out_dir, f"{name}_files.txt"), "w") as f:
            f.write("\n".join(files))
        hit = []
        for p in files:
            if os.path.isfile(p) and os.path.getsize(p) < 64 << 20:
                text = open(p, errors="replace").read()
                if ".entry" in text and "paged_decode_int" in text:
                    hit.append(text)
        summary[name] = count(hit[0]) if hit else {"no_ptx_found": len(files)}
        if hit:
            with open(os.path.join(out_dir, f"{name}.ptx"), "w") as f:
                f.write(hit[0])
        shutil.rmtree(dump, ignore_errors=True)
    with open(os.path.join(out_dir, "ptx_ops.json"), "w") as f:
        json.dump(summary, f, indent=1)
    for name, ops in summary.items():
        print(name, dict(list(ops.items())[:25]))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        compile_one(sys.argv[2])
    else:
        main(sys.argv[1])
