"""Decode step time of the Engine at a fixed batch and context, per cache, against its floor.

    python -m eval.bench_engine --layers 1 --batch 2 --prompt-len 96 --new-tokens 3   # smoke
    python -m eval.bench_engine --layers 36 --batch 1 --prompt-len 100000 --new-tokens 64 \\
        --modes bf16_paged int2_pallas            # batch 1 at 100k on the H200

Each mode runs the batch once to compile, then once timed on a fresh engine (the `kvjax.Engine`
run loop: chunked prefill, then decode windows of `--decode-steps` steps per host sync). The
floor of a decode step is the bytes it must read, weights plus the cache pages it holds, at the
measured read bandwidth (`--ceiling-gib` array summed once per copy, best of a few).

Random weights make greedy continuations meaningless, so the paged reference and Pallas paths
are also compared on the logits of one decode step after the prompt (same cache contents, two
attention paths), with the 2-bit cache's own error against the dense cache for scale.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eval import common, profile_trace
from eval.bench_serving import MODES, make_engine
from kvjax import cli
from kvjax.cache.allocator import PageManager
from kvjax.cache.dense import DenseKVCache
from kvjax.cache.paged import PagedKVCache
from kvjax.serving import engine as engine_mod
from kvjax.serving.engine import EngineConfig


@dataclasses.dataclass(frozen=True)
class EngineBenchConfig:
    layers: int = cli.option(8, "decoder layers (36 = the whole Qwen3-8B)")
    hidden_size: int = cli.option(4096, "model width")
    intermediate_size: int = cli.option(12288, "MLP width")
    num_heads: int = cli.option(32, "query heads")
    num_kv_heads: int = cli.option(8, "KV heads")
    head_dim: int = cli.option(128, "head dimension")
    vocab_size: int = cli.option(151936, "vocabulary")
    batch: int = cli.option(4, "sequences")
    prompt_len: int = cli.option(1024, "prompt tokens per sequence")
    stagger: int = cli.option(
        0,
        "row i's prompt is prompt_len - (i * stagger) // batch tokens, so rows flush recent "
        "tokens into low-bit pages at different steps as they do in serving (0: all equal)",
    )
    new_tokens: int = cli.option(64, "tokens generated per sequence")
    decode_steps: int = cli.option(16, "decode steps per host sync")
    prefill_chunk: int = cli.option(512, "prefill chunk")
    prefill_rows: int = cli.option(0, "sequences per prefill call (0: all of the batch)")
    bits: int = cli.option(2, "low-bit width", choices=(2, 4))
    sink: int = cli.option(64, "full-precision sink tokens")
    keep: int = cli.option(256, "full-precision recent tokens")
    page_size: int = cli.option(16, "tokens per page")
    flush_rows: int = cli.option(
        0, "packed flush rows of a decode window (`CacheConfig.flush_rows`; 0: default)"
    )
    modes: tuple[str, ...] = cli.option(
        ("bf16_dense", "int2_reference", "int2_pallas"), "caches to time", choices=MODES
    )
    ceiling_gib: float = cli.option(4.0, "GiB read to measure bandwidth (0: skip)")
    synthetic_prefill: bool = cli.option(
        False,
        "skip the prefill's device work (pages keep their initial values; the decode step's "
        "time does not depend on them): long contexts in seconds, no prefill figures",
    )
    profile_windows: int = cli.option(
        0, "after timing, trace this many decode windows per mode and total their kernels"
    )
    out: str = cli.option("runs/bench_engine", "output directory (json + md)")


def read_ceiling(gib: float) -> float | None:
    """Measured read bandwidth in bytes/s: each timed sum reads its own array."""
    if gib <= 0:
        return None
    n = int(gib * 2**30) // 4
    copies = [jnp.full((n,), float(i), jnp.float32) for i in range(3)]
    f = jax.jit(jnp.sum)
    f(copies[0]).block_until_ready()
    best = float("inf")
    for x in copies:
        t0 = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return n * 4 / best


def first_decode_logits(model, eng, prompts: np.ndarray) -> np.ndarray:
    """Logits of one decode step after the prompt, through `eng`'s cache kind and attention."""
    graphdef, params = nnx.split(model)
    b, t = prompts.shape

    @jax.jit
    def step(params, tokens, cache):  # params an argument: closed over they are constants
        return nnx.merge(graphdef, params)(tokens, cache)

    if eng.cache_kind == "dense":
        cache = DenseKVCache.create(model.cfg, b, t + 1, model.dtype)
        mgr = None
    else:
        ccfg = dataclasses.replace(eng.cache_cfg, num_fp_pages=None, num_lowbit_pages=None)
        cache = PagedKVCache.create(model.cfg, ccfg, eng.transforms, b)
        mgr = PageManager(cache)
    c = eng.ecfg.prefill_chunk
    for i in [*range(0, t, c), t]:
        chunk = prompts[:, i : i + c] if i < t else np.zeros((b, 1), np.int32)
        if mgr is not None:
            cache = mgr.prepare(cache, chunk.shape[1])
        logits, cache = step(params, jnp.asarray(chunk), cache)
    return np.asarray(logits[:, -1], np.float32)


@contextlib.contextmanager
def prefill_skipped(enabled: bool):
    """The engine's prefill call replaced by one that leaves the cache as it is and draws
    token 0: the engine's bookkeeping (pages, lengths, plans) runs exactly as in a real
    prefill, so the decode windows after it read as many pages as after a real one."""
    real = engine_mod._prefill_call
    if enabled:

        def skip(graphdef, params, tf, cache, tokens, logits_at, samp):
            return jnp.zeros(tokens.shape[:1], jnp.int32), cache

        engine_mod._prefill_call = skip
    try:
        yield
    finally:
        engine_mod._prefill_call = real


def profile_decode(eng, prompts: np.ndarray, c: EngineBenchConfig, trace_dir: str) -> dict:
    """Kernel times of `c.profile_windows` decode windows once every prompt is decoding."""
    for p in prompts:
        eng.submit(p.tolist(), c.new_tokens)
    while not all(r.decoding for r in eng.running) or len(eng.running) < len(prompts):
        eng.step()
    eng.step()  # one window outside the trace
    decoding = sum(r.decoding for r in eng.running)
    rows, busy = profile_trace.trace_and_summarize(eng.step, trace_dir, repeats=c.profile_windows)
    # The profiler can drop a window's device events: count the steps it saw by the decode
    # kernel's launches (one per layer per step), not by the windows run.
    steps = c.profile_windows * c.decode_steps
    per_layer = [r["count"] for r in rows if r["name"].startswith(("paged_decode_bf16",
                 "paged_decode_int"))]  # fmt: skip
    if per_layer:
        steps = max(1, per_layer[0] // c.layers)
    return dict(
        steps_seen=steps,
        busy_ms_per_step=round(busy / 1e6 / steps, 3),
        rows_decoding=decoding,
        kernels=rows[:40],
        markdown=profile_trace.markdown(rows, busy, per=steps),
    )


def main(c: EngineBenchConfig) -> dict:
    cli.check(c.batch >= 1 and c.prompt_len >= 1, "--batch and --prompt-len must be >= 1")
    cli.check(c.prefill_rows >= 0, f"--prefill-rows {c.prefill_rows}: must be >= 0")
    cli.check(c.profile_windows >= 0, f"--profile-windows {c.profile_windows}: must be >= 0")
    need = (c.profile_windows + 1) * c.decode_steps + 1 if c.profile_windows else 0
    cli.check(
        c.new_tokens >= need,
        f"--new-tokens {c.new_tokens}: --profile-windows {c.profile_windows} needs >= {need} "
        f"(one untraced window, then the traced ones, of --decode-steps {c.decode_steps})",
    )
    cli.check(c.flush_rows >= 0, f"--flush-rows {c.flush_rows}: must be >= 0")
    cli.check(c.new_tokens >= 2, f"--new-tokens {c.new_tokens}: >= 2 (one decode step)")
    cli.check(
        0 <= c.stagger < c.prompt_len,
        f"--stagger {c.stagger}: must be in [0, --prompt-len {c.prompt_len})",
    )
    shape = common.ModelShape(
        c.layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
        c.vocab_size,
    )  # fmt: skip
    max_len = c.prompt_len + c.new_tokens
    model = common.random_model(shape, max_len)
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))
    ceiling = read_ceiling(c.ceiling_gib if jax.default_backend() != "cpu" else 0.0)
    full = np.random.default_rng(0).integers(0, shape.vocab_size, (c.batch, c.prompt_len))
    prompts = [full[i, : c.prompt_len - (i * c.stagger) // c.batch] for i in range(c.batch)]

    def engine(mode, prefill_rows=c.prefill_rows or c.batch):
        ecfg = EngineConfig(
            max_seqs=c.batch,
            prefill_chunk=c.prefill_chunk,
            prefill_tokens_per_step=c.prefill_chunk * prefill_rows,
            decode_steps=c.decode_steps,
            prefix_sharing=False,
        )
        return make_engine(
            model, mode, max_len=max_len, engine_cfg=ecfg, bits=c.bits, sink=c.sink,
            keep=c.keep, page_size=c.page_size, flush_rows=c.flush_rows or None,
        )  # fmt: skip

    rows, tokens, logits, profiles = [], {}, {}, {}
    t_start = time.perf_counter()

    def progress(msg):  # long runs on a device: say which phase the time went to
        print(f"[{time.perf_counter() - t_start:7.1f} s] {msg}", flush=True)

    for mode in c.modes:
        with prefill_skipped(c.synthetic_prefill):
            # Compile every variant on a short prompt: the shapes depend on the pools and chunk,
            # not on the prompt's length.
            progress(f"{mode}: compile run")
            short = [p[: 2 * c.prefill_chunk + 1].tolist() for p in prompts]
            engine(mode).generate(short, c.new_tokens)
            progress(f"{mode}: timed run")
            eng = engine(mode)
            t0 = time.perf_counter()
            res = eng.generate([p.tolist() for p in prompts], c.new_tokens)
            wall = time.perf_counter() - t0
            tokens[mode] = np.asarray(res.tokens)
            # Bytes a decode step reads from the cache: the pages the sequences hold at the end.
            if eng.manager is not None:
                fp_b, low_b = eng._page_bytes()
                n_fp = n_low = 0
                for p in prompts:
                    f, lo = eng.manager.pages_for(len(p) + c.new_tokens)
                    n_fp, n_low = n_fp + f, n_low + lo
                cache_bytes = n_fp * fp_b + n_low * low_b
            else:
                per_token = 2 * shape.layers * shape.num_kv_heads * shape.head_dim
                cache_bytes = per_token * sum(len(p) + c.new_tokens for p in prompts)
                cache_bytes *= jnp.dtype(model.dtype).itemsize
            step_s = res.decode_seconds / max(res.decode_steps, 1)
            row = dict(
                mode=mode,
                prefill_s=None if c.synthetic_prefill else round(res.prefill_seconds, 4),
                prefill_tok_per_s=None
                if c.synthetic_prefill
                else round(c.batch * c.prompt_len / res.prefill_seconds, 1),
                decode_steps=res.decode_steps,
                decode_step_ms=round(1e3 * step_s, 3),
                decode_tok_per_s=round(res.decode_tokens_per_second, 1),
                weight_bytes=int(weight_bytes),
                cache_read_bytes=int(cache_bytes),
                wall_s=round(wall, 2),
            )
            if ceiling:
                floor = (weight_bytes + cache_bytes) / ceiling
                row.update(floor_ms=round(1e3 * floor, 3), step_over_floor=round(step_s / floor, 3))
        print(row, flush=True)  # before the profile, which has hung on the H200 (run 71)
        if c.profile_windows:
            # Every row prefilled in the same steps (skipped: only the decode is traced), so
            # all of them decode in the traced windows.
            progress(f"{mode}: profile")
            with prefill_skipped(True):
                prof = profile_decode(
                    engine(mode, prefill_rows=c.batch), prompts, c, f"{c.out}/trace_{mode}"
                )
            row["profile_busy_ms_per_step"] = prof["busy_ms_per_step"]
            profiles[mode] = prof
            print(prof["markdown"], flush=True)
        rows.append(row)
        # The logits check re-prefills without chunking (and means nothing on skipped prefills).
        if c.prompt_len * c.batch <= 1 << 16 and not (c.synthetic_prefill or c.stagger):
            logits[mode] = first_decode_logits(model, eng, full)
        del eng  # its pools, before the next mode's are made

    def rel_err(a, b):
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))

    checks = {}
    if "bf16_dense" in logits and "int2_reference" in logits:
        checks["decode_logits_rel_err_paged_vs_dense"] = rel_err(
            logits["bf16_dense"], logits["int2_reference"]
        )
    if "int2_reference" in logits and "int2_pallas" in logits:
        checks["decode_logits_rel_err_pallas_vs_reference"] = rel_err(
            logits["int2_reference"], logits["int2_pallas"]
        )
        checks["token_agreement_pallas_vs_reference"] = float(
            np.mean(tokens["int2_reference"] == tokens["int2_pallas"])
        )
    payload = dict(
        **common.environment(),
        device=str(jax.devices()[0].device_kind),
        read_ceiling_tb_s=None if ceiling is None else round(ceiling / 1e12, 3),
        config=dataclasses.asdict(c),
        rows=rows,
        checks=checks,
        profiles={m: {k: v for k, v in p.items() if k != "markdown"} for m, p in profiles.items()},
    )
    header = ["mode", "decode step ms", "floor ms", "step / floor", "decode tok/s",
              "prefill tok/s"]  # fmt: skip
    table = [
        [r["mode"], r["decode_step_ms"], r.get("floor_ms", "-"), r.get("step_over_floor", "-"),
         r["decode_tok_per_s"], r["prefill_tok_per_s"]]
        for r in rows
    ]  # fmt: skip
    md = (
        f"# bench_engine\n\n`{payload['command']}` at {payload['commit']}, {payload['date']}, "
        f"{payload['device']}, jax {payload['jax_version']}; batch {c.batch} x "
        f"{c.prompt_len} prompt tokens (stagger {c.stagger}), {c.layers} layers\n\n"
        + common.markdown_table(header, table)
        + "".join(
            f"\n## Kernels of a decode step, {m} (profile of {c.profile_windows} windows)\n\n"
            + p["markdown"]
            for m, p in profiles.items()
        )
    )
    jpath, _ = common.write_results(c.out, "bench_engine", payload, md)
    print(md, "\n", checks, "->", jpath)
    return payload


def parse_args(argv=None) -> EngineBenchConfig:
    parser = cli.dataclass_parser(EngineBenchConfig, "python -m eval.bench_engine", __doc__)
    return cli.dataclass_from_args(EngineBenchConfig, parser.parse_args(argv))


if __name__ == "__main__":
    cli.run(main, parse_args)
