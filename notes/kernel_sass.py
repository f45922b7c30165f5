"""Compiles the GPU decode kernel for sm_90 on a machine without a GPU and reports what ptxas
made of it: registers, shared memory, resident programs per SM, and the instruction mix of
the hottest loop (the low-bit loop). Costs no device time.

    python notes/kernel_sass.py OUT_DIR VARIANT [VARIANT ...] --triton-python PY [--warps 4]

Step 1 (this interpreter: the repo's venv, jax on CPU) lowers the variant (a row name of
`eval.bench_decode.LOWBIT_VARIANTS`, at the shape of `notes/decode_kernel_once.py`, or
``quantize_pack_radix`` / ``quantize_pack_rank`` for the GPU quantize_pack kernel) to Triton
IR with ``lowering_platforms=("cuda",)`` and writes ``VARIANT.ttir``. Step 2 runs ``PY`` (any
Python with ``pip install triton`` -- Triton's wheel carries ptxas and cuobjdump; kept out of
the project's dependencies) to compile it with the variant's warps/stages for
``GPUTarget("cuda", 90, 32)`` and write ``.ttgir``, ``.ptx``, ``.cubin`` and ``.sass`` beside it.

The TTIR comes from the local jax and the compile from the local Triton, not the H200's
(jax 0.11.2 / XLA's own Triton pipeline), so treat the numbers as close, not exact; they
matched run 8's ncu register count (167 here, 168 there).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import subprocess
import sys

_COMPILE = r"""
import json, os, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
src, warps, stages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=warps, num_stages=stages))
base = os.path.splitext(src)[0]
for ext in ("ttgir", "ptx"):
    open(base + "." + ext, "w").write(k.asm[ext])
open(base + ".cubin", "wb").write(k.asm["cubin"])
bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
cuobjdump = os.path.join(bindir, "cuobjdump")
res = subprocess.run([cuobjdump, "--dump-resource-usage", base + ".cubin"],
                     capture_output=True, text=True, check=True).stdout
sass = subprocess.run([cuobjdump, "--dump-sass", base + ".cubin"],
                      capture_output=True, text=True, check=True).stdout
open(base + ".sass", "w").write(sass)
print(json.dumps({"shared_bytes": k.metadata.shared, "resources": res}))
"""


@contextlib.contextmanager
def _captured_triton_modules():
    """Collects the Triton IR text of every Pallas kernel lowered inside the block."""
    from jax._src.pallas.triton import lowering

    captured: list[str] = []
    original = lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    lowering.lower_jaxpr_to_triton_module = capture
    try:
        yield captured
    finally:
        lowering.lower_jaxpr_to_triton_module = original


QUANTIZE_PACK_VARIANTS = ("quantize_pack_radix", "quantize_pack_rank")


def _dump_quantize_pack(variant: str, out_dir: str) -> tuple[str, dict]:
    """The GPU quantize_pack kernel at 64 tokens x 8 KV heads x 128, 2 bits, oscar clip 0.95,
    with its quantile implementation set by the variant name."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.quantize_pack import gpu_triton as gqp

    default = gqp.QUANTILE
    gqp.QUANTILE = variant.rsplit("_", 1)[1]
    try:
        x = jnp.zeros((8, 64, 128), jnp.bfloat16)
        a = jnp.zeros((8, 128, 128), jnp.float32)
        clip = jnp.full((8, 1), 0.95, jnp.float32)
        kw = dict(method="oscar", bits=2, group_size=128, meta_dtype=jnp.float16)
        kw.update(block_tokens=16, num_warps=4, interpret=False)
        with _captured_triton_modules() as captured:
            jax.jit(lambda x, a, c: gqp.quantize_pack_gpu(x, a, c, **kw)).trace(x, a, clip).lower(
                lowering_platforms=("cuda",)
            )
    finally:
        gqp.QUANTILE = default
    path = os.path.join(out_dir, f"{variant}.ttir")
    with open(path, "w") as f:
        f.write(captured[0])
    return path, dict(warps=4, stages=1)


def dump_ttir(variant: str, out_dir: str) -> tuple[str, dict]:
    """Lowers one variant to TTIR; returns (path, launch options)."""
    import jax

    if variant in QUANTIZE_PACK_VARIANTS:
        return _dump_quantize_pack(variant, out_dir)

    from eval import bench_decode as bd
    from notes import decode_kernel_once as once
    from pallas_kernels import decode_attention as da
    from pallas_kernels.decode_attention import api as da_api

    _, opts, _ = bd.LOWBIT_VARIANTS[variant]
    real = da.decode_attention_variant

    def lower_only(**kw):
        def traced(v):  # arrays and the page-set pytrees (NamedTuples of arrays)
            return isinstance(v, (jax.Array, tuple))

        arrays = {k: v for k, v in kw.items() if traced(v)}
        static = {k: v for k, v in kw.items() if not traced(v)}
        jax.jit(lambda a: real(**a, **static)).trace(arrays).lower(lowering_platforms=("cuda",))
        return _Done()

    da.decode_attention_variant = lower_only
    try:
        with _captured_triton_modules() as captured:
            once.run_once(variant, 8, 16384)
    finally:
        da.decode_attention_variant = real
    kernels = [m for m in captured if "paged_decode_int" in m.split("\n", 1)[0]]
    path = os.path.join(out_dir, f"{variant}.ttir")
    with open(path, "w") as f:
        f.write(kernels[0])
    gpu = da_api._backend_module("gpu")
    launch = dict(
        warps=opts.get("num_warps") or gpu.DEFAULT_NUM_WARPS,
        stages=opts.get("num_stages") or gpu.DEFAULT_NUM_STAGES,
    )
    return path, launch


class _Done:
    def block_until_ready(self):
        return self


def loop_mix(sass: str) -> dict:
    """Instruction mix of the longest backward branch's body (the hot loop)."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    best = None
    for addr, text in ins:
        m = re.search(r"\bBRA\s+(?:`\()?\.?(?:L_x_\d+)?\)?\s*0x([0-9a-f]+)", text)
        if m:
            target = int(m.group(1), 16)
            if target < addr and (best is None or addr - target > best[1] - best[0]):
                best = (target, addr)
    if best is None:
        return {}
    mix = collections.Counter(
        re.sub(r"^@!?U?P[0-9T]+\s+", "", t).split()[0].split(".")[0]
        for a, t in ins
        if best[0] <= a <= best[1]
    )
    return {"instructions": sum(mix.values()), "mix": dict(mix.most_common())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("variants", nargs="+")
    p.add_argument("--triton-python", required=True, help="a Python with triton installed")
    a = p.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    report = {}
    for v in a.variants:
        path, launch = dump_ttir(v, a.out_dir)
        r = subprocess.run(
            [a.triton_python, "-c", _COMPILE, path, str(launch["warps"]), str(launch["stages"])],
            capture_output=True,
            text=True,
        )
        if r.returncode:
            raise SystemExit(f"{v}: compile failed:\n{r.stderr[-3000:]}")
        info = json.loads(r.stdout.strip().splitlines()[-1])
        regs = int(re.search(r"REG:(\d+)", info["resources"]).group(1))
        spill = int(re.search(r"STACK:(\d+)", info["resources"]).group(1))
        threads = 32 * launch["warps"]
        by_regs = 65536 // (threads * (-(-regs // 8) * 8))
        by_smem = (228 * 1024) // (info["shared_bytes"] + 1024)
        with open(os.path.splitext(path)[0] + ".sass") as f:
            sass = f.read()
        mix = loop_mix(sass)
        total = len(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+\S", sass, flags=re.M))
        report[v] = dict(
            launch,
            registers=regs,
            stack_bytes=spill,
            shared_bytes=info["shared_bytes"],
            programs_per_sm=min(by_regs, by_smem, 64 // launch["warps"]),
            sass_instructions=total,
            loop=mix,
        )
        line = mix.get("instructions", 0)
        print(
            f"{v:28s} warps {launch['warps']} regs {regs:3d} stack {spill:3d} "
            f"smem {info['shared_bytes']:6d} programs/SM {report[v]['programs_per_sm']} "
            f"loop instr/warp {line} (x warps {line * launch['warps']}) total SASS {total}"
        )
    with open(os.path.join(a.out_dir, "kernel_sass.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
