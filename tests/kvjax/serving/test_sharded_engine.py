"""Tensor-parallel serving on 4 fake CPU devices: KV heads (with their query heads) and MLP
columns over a 2-way "model" axis give the same greedy tokens as one device, for the dense
cache and the paged 2-bit cache (reference attention and the Pallas kernel under shard_map)."""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import dataclasses
    import jax, numpy as np
    from flax import nnx
    from kvjax.cache.paged import CacheConfig
    from kvjax.cache.quantizers import QuantConfig
    from kvjax.config import ModelConfig
    from kvjax.models.model import Transformer
    from kvjax.serving.engine import Engine, EngineConfig
    from kvjax.serving.sharding import make_mesh

    assert jax.device_count() == 4, jax.devices()
    cfg = ModelConfig(model_type="qwen3", vocab_size=61, hidden_size=64, intermediate_size=96,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    mesh = make_mesh(data=1, model=2)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 61, n).tolist() for n in (40, 70, 9)]
    ecfg = EngineConfig(max_seqs=4, prefill_chunk=32, prefill_tokens_per_step=64, decode_steps=4)
    low = CacheConfig(sink=16, keep=16, flush=16, page_size=16, quant=QuantConfig(bits=2),
                      max_seq_len=128)
    cases = {
        "dense": dict(cache_kind="dense", cache_cfg=CacheConfig(max_seq_len=128)),
        "paged_reference": dict(cache_kind="paged", cache_cfg=low),
        "paged_pallas": dict(cache_kind="paged",
                             cache_cfg=dataclasses.replace(low, attention="pallas")),
    }
    import sys
    for name in sys.argv[1:]:
        kw = cases[name]
        one = Engine(model, engine_cfg=ecfg, **kw).generate(prompts, 8).tokens
        eng = Engine(model, engine_cfg=ecfg, mesh=mesh, **kw)
        two = eng.generate(prompts, 8).tokens
        assert one == two, (name, one, two)
        leaf = eng.cache.pools[0].k_low[0] if name != "dense" else eng.cache.k[0]
        assert len(leaf.sharding.device_set) == 2, leaf.sharding
        print(name, "OK")
    print("SHARDED_ENGINE_OK")
    """
)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param("dense", marks=pytest.mark.slow),
        pytest.param("paged_reference", marks=pytest.mark.slow),
        "paged_pallas",  # CI: the composite case (Pallas kernel per shard under shard_map)
    ],
)
def test_tensor_parallel_engine_matches_one_device(case):
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu"
    )
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, case], env=env, capture_output=True, text=True, timeout=900
    )
    assert "SHARDED_ENGINE_OK" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]
