"""Data-parallel calibration statistics on 4 fake CPU devices equal the single-device sums."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import jax, numpy as np
    from flax import nnx
    from calib.calibrate import collect_statistics
    from calib.statistics import required_stats
    from kvjax.config import ModelConfig
    from kvjax.models.loading import LoadedModel
    from kvjax.models.model import Transformer

    assert jax.device_count() == 4, jax.devices()
    cfg = ModelConfig(model_type="qwen3", vocab_size=101, hidden_size=64, intermediate_size=96,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True)
    lm = LoadedModel(Transformer(cfg, rngs=nnx.Rngs(0)), None, cfg, "x", "random")
    windows = np.random.default_rng(0).integers(0, 101, (8, 32)).astype(np.int32)
    names = required_stats(["wush", "oscar", "wush_a"])
    one, _ = collect_statistics(lm, windows, names, 4, progress=False)
    four, _ = collect_statistics(lm, windows, names, 4, progress=False, data_parallel=4)
    for a, b in zip(one, four):
        for n in a:
            np.testing.assert_allclose(np.asarray(a[n]), np.asarray(b[n]), rtol=2e-5, atol=1e-4)
        assert len(b["C_Q"].sharding.device_set) == 4
    print("SHARDED_OK")
    """
)


def test_data_parallel_statistics_equal_single_device():
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu"
    )
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SHARDED_OK" in r.stdout
