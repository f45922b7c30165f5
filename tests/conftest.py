"""Settings shared by every test module."""

import jax

# Tests compare float32 paths at CPU tolerances (down to 2e-5). On a GPU the default matmul
# precision runs float32 dots as TF32/bf16 passes (seen on the H200: session 2, run 6), so the
# suite asks for full float32 everywhere; on the CPU this changes nothing.
jax.config.update("jax_default_matmul_precision", "highest")
