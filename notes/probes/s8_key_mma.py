"""Probe: 2-bit key planes as a signed 8-bit register operand (two planes per K = 64 group),
an int32 accumulator with the query split in high/low 8-bit columns. `lower` checks the cuda
lowering on CPU; without arguments it runs on the GPU against numpy."""
import functools, numpy as np, jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith

def planes_s8(codes, bits, width):
    n = 8 // bits
    ppg = 64 // width
    groups = n // ppg
    rows = codes.shape[0]
    out = tuple(plgpu.ShapeDtypeStruct((rows, 64), jnp.int8, layout=plgpu.Layout.WGMMA_8BIT) for _ in range(groups))
    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_8BIT,), return_type=out)
    def unpack(_, arr):
        i32 = ir.IntegerType.get_signless(32)
        vt = arr.registers.flat[0].type
        mask = arith.constant(i32, ((1 << bits) - 1) * 0x01010101)
        planes = []
        for i in range(n):
            regs = np.empty_like(arr.registers)
            for idx, reg in np.ndenumerate(arr.registers):
                w = mgpu_utils.bitcast(reg, i32)
                if i:
                    w = arith.shrui(w, arith.constant(i32, bits * i))
                regs[idx] = mgpu_utils.bitcast(arith.andi(w, mask), vt)
            planes.append(regs)
        res = []
        for g in range(groups):
            r = np.concatenate(planes[g * ppg:(g + 1) * ppg], axis=1)
            res.append(mgpu.FragmentedArray(_registers=r, _layout=arr.layout, _is_signed=True))
        return tuple(res)
    return list(unpack(codes))

def kernel(c_gmem, q_gmem, o_gmem, c_smem, q_smem, o_smem, bar):
    plgpu.copy_gmem_to_smem(c_gmem, c_smem, bar.at[0])
    plgpu.copy_gmem_to_smem(q_gmem, q_smem, bar.at[0])
    plgpu.barrier_wait(bar.at[0])
    codes = plgpu.load(c_smem, (), layout=plgpu.Layout.WGMMA_8BIT)
    def body(acc_ref):
        for g, a in enumerate(planes_s8(codes, 2, 32)):
            plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(q_smem.at[g], (1, 0)))
        return acc_ref[...]
    acc = pl.run_scoped(body, plgpu.ACC((64, 16), jnp.int32))
    hi = acc[:, :8].astype(jnp.float32)
    lo = acc[:, 8:].astype(jnp.float32)
    o_smem[...] = hi + lo * (1 / 254)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem)
    plgpu.wait_smem_to_gmem(0)

def run(c, q):
    sw = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(64))
    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((64, 8), jnp.float32),
        scratch_types=dict(c_smem=plgpu.SMEM((64, 32), jnp.uint8), q_smem=plgpu.SMEM((2, 16, 64), jnp.int8, transforms=sw),
          o_smem=plgpu.SMEM((64, 8), jnp.float32), bar=plgpu.Barrier(num_arrivals=2, num_barriers=1)))(c, q)

def reference(c, q):
    c = np.asarray(c).astype(np.int32); q = np.asarray(q).astype(np.int32)
    planes = [(c >> (2 * i)) & 3 for i in range(4)]
    a = np.concatenate(planes, axis=1)  # [64, 128] dims
    qq = np.concatenate([q[0], q[1]], axis=1)  # [16, 128]
    r = a @ qq.T
    return r[:, :8] + r[:, 8:] / 254

if __name__ == "__main__":
    import sys
    rng = np.random.default_rng(0)
    c = jnp.asarray(rng.integers(0, 256, (64, 32), dtype=np.uint8))
    q = jnp.asarray(rng.integers(-127, 128, (2, 16, 64), dtype=np.int8))
    if sys.argv[1:] == ["lower"]:
        jax.jit(run).trace(c, q).lower(lowering_platforms=("cuda",))
        print("lowered")
    else:
        out = np.asarray(run(c, q)); ref = reference(c, q)
        print("max err", np.abs(out - ref).max(), np.abs(ref).max())
