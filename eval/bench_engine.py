"""End-to-end decode throughput of the Engine: dense cache vs paged 2-bit cache (reference
attention and Pallas kernels), on a random-weight model of real shapes.

The shipped model cannot travel to an accelerator machine, so speed is measured with random
weights of a real model's shapes (default: Qwen3-8B attention and MLP widths, fewer layers).
Each mode runs `generate` once to compile every step variant, then once timed (prefill_s and
decode_s are compiled-code times). Random weights make greedy continuations meaningless, so
the paged reference and Pallas paths are compared on the logits of one decode step after the
prompt (same cache contents, two attention paths) as well as on token agreement.

    python -m eval.bench_engine --layers 8 --batch 4 --prompt-len 1024 --new-tokens 64
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.cache.paged import CacheConfig
from kvjax.cache.quantizers import QuantConfig
from kvjax.cache.transforms import KVTransforms
from kvjax.config import ModelConfig
from kvjax.models.model import Transformer
from kvjax.serving.engine import Engine


@dataclasses.dataclass(frozen=True)
class EngineBenchConfig:
    layers: int = 8
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    vocab_size: int = 151936
    batch: int = 4
    prompt_len: int = 1024
    new_tokens: int = 64
    bits: int = 2
    sink: int = 64
    keep: int = 256
    flush: int = 16
    modes: tuple[str, ...] = ("dense", "paged_reference", "paged_pallas")
    out: str = "runs/bench_engine.json"


def model_config(c: EngineBenchConfig) -> ModelConfig:
    return ModelConfig(
        model_type="qwen3",
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_layers=c.layers,
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rope_theta=1e6,
        max_position_embeddings=max(4096, c.prompt_len + c.new_tokens),
        qk_norm=True,
    )


def _engine(model: Transformer, mode: str, c: EngineBenchConfig) -> Engine:
    if mode == "dense":
        return Engine(model, cache_kind="dense")
    attention = "pallas" if mode == "paged_pallas" else "reference"
    ccfg = CacheConfig(
        sink=c.sink,
        keep=c.keep,
        flush=c.flush,
        quant=QuantConfig(bits=c.bits),
        fp_dtype=jnp.dtype(model.dtype).name,
        attention=attention,
    )
    tf = KVTransforms.identity(model.cfg)
    return Engine(model, cache_kind="paged", transforms=tf, cache_cfg=ccfg)


def run(c: EngineBenchConfig) -> dict:
    cfg = model_config(c)
    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    model = Transformer(cfg, dtype, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, (c.batch, c.prompt_len)).tolist()
    rows, tokens, first_logits = [], {}, {}
    for mode in c.modes:
        eng = _engine(model, mode, c)
        # Warm-up with the same shapes: the paged cache compiles a second step variant the
        # first time a decode step flushes, which would otherwise land inside the timing.
        eng.generate(prompts, c.new_tokens)
        t0 = time.perf_counter()
        res = eng.generate(prompts, c.new_tokens)
        wall = time.perf_counter() - t0
        tokens[mode] = np.asarray(res.tokens)
        # Logits of one decode step (token 0) after the prompt, on a fresh cache: the step
        # where the paged paths differ only in their attention implementation.
        cache = eng.new_cache(c.batch, c.prompt_len + 1)
        for i in range(0, c.prompt_len, eng.prefill_chunk):
            _, cache = eng.run_chunk(cache, np.asarray(prompts)[:, i : i + eng.prefill_chunk])
        logits, _ = eng.run_chunk(cache, np.zeros((c.batch, 1), np.int32))
        first_logits[mode] = np.asarray(logits, np.float32)
        rows.append(
            dict(
                mode=mode,
                prefill_s=round(res.prefill_seconds, 4),
                decode_steps=res.decode_steps,
                decode_s=round(res.decode_seconds, 4),
                decode_tok_s=round(res.decode_tokens_per_second, 1),
                wall_s=round(wall, 2),
            )
        )
        print(rows[-1], flush=True)

    def rel_err(a, b):
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))

    checks = {}
    if "dense" in tokens and "paged_reference" in tokens:
        # The 2-bit cache's own effect on the logits (quantization error), for scale.
        checks["decode_logits_rel_err_paged_vs_dense"] = rel_err(
            first_logits["dense"], first_logits["paged_reference"]
        )
    if "paged_reference" in tokens and "paged_pallas" in tokens:
        checks["decode_logits_rel_err_pallas_vs_reference"] = rel_err(
            first_logits["paged_reference"], first_logits["paged_pallas"]
        )
        checks["token_agreement_pallas_vs_reference"] = float(
            np.mean(tokens["paged_reference"] == tokens["paged_pallas"])
        )
    return dict(
        date=datetime.date.today().isoformat(),
        machine=platform.node(),
        device=str(jax.devices()[0].device_kind),
        jax=jax.__version__,
        config=dataclasses.asdict(c),
        rows=rows,
        checks=checks,
    )


def main(argv: list[str] | None = None) -> dict:
    d = EngineBenchConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(EngineBenchConfig):
        if f.name == "modes":
            p.add_argument("--modes", default=",".join(d.modes))
        else:
            p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    a = p.parse_args(argv)
    kw = {k: v for k, v in vars(a).items()}
    kw["modes"] = tuple(m for m in a.modes.split(",") if m)
    bad = [m for m in kw["modes"] if m not in d.modes]
    if bad:
        raise SystemExit(f"unknown --modes {bad}; choose from {d.modes}")
    c = EngineBenchConfig(**kw)
    result = run(c)
    os.makedirs(os.path.dirname(os.path.abspath(c.out)), exist_ok=True)
    with open(c.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["checks"]), "->", c.out)
    return result


if __name__ == "__main__":
    main()
