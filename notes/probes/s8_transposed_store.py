"""Probe: a float32 [64, 8] WGMMA tile rounded to high/low 8-bit parts and stored transposed
into a 64-byte-swizzled int8 [16, 128] tile (the B operand of an 8-bit value MMA). The cast
to the transposed layout is made in float16 (Mosaic GPU refuses it for 8-bit arrays)."""
import numpy as np, jax, jax.numpy as jnp, sys
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

def kernel(x_gmem, o_gmem, x_smem, o_smem, bar):
    plgpu.copy_gmem_to_smem(x_gmem, x_smem, bar.at[0])
    plgpu.barrier_wait(bar.at[0])
    x = plgpu.load(x_smem, (), layout=plgpu.Layout.WGMMA)  # f32 [64, 8]
    hi = jnp.round(x * 127.0)
    lo = jnp.round((x * 127.0 - hi) * 254.0)
    for j, v in enumerate((hi, lo)):
        vt = plgpu.layout_cast(v.astype(jnp.float16), plgpu.Layout.WGMMA_TRANSPOSED)
        vt = vt.astype(jnp.int8)
        plgpu.transpose_ref(o_smem.at[pl.ds(8 * j, 8), pl.ds(0, 64)], (1, 0))[...] = vt
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem)
    plgpu.wait_smem_to_gmem(0)

def run(x):
    sw = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(64))
    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((16, 128), jnp.int8),
        scratch_types=dict(x_smem=plgpu.SMEM((64, 8), jnp.float32), o_smem=plgpu.SMEM((16, 128), jnp.int8, transforms=sw),
          bar=plgpu.Barrier(num_arrivals=1, num_barriers=1)))(x)

x = jnp.asarray(np.random.default_rng(0).random((64, 8), np.float32))
if sys.argv[1:] == ["lower"]:
    jax.jit(run).trace(x).lower(lowering_platforms=("cuda",)); print("lowered")
else:
    o = np.asarray(run(x)).astype(np.int32); xs = np.asarray(x) * 127
    hi = np.round(xs); lo = np.round((xs - hi) * 254)
    print("hi ok", (o[:8, :64] == hi.T).all(), "lo ok", (o[8:, :64] == lo.T).all())
