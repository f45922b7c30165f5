"""Serving throughput under one KV memory budget: N requests through `kvjax.Engine`, per cache.

    python -m eval.bench_serving                  # tiny smoke run on this machine
    python -m eval.bench_serving --layers 36 --kv-memory-gb 10 --requests 64 \\
        --prompt-len 1024 --output-len 4096       # the reasoning workload on the H200

Requests get prompt and output lengths drawn uniformly from [len * (1 - spread), len] and
arrive all at once (`--rate 0`) or as a Poisson stream of `--rate` requests per second. Each
mode first runs a short warm-up of the same requests (so compilation stays out of the timing),
then the workload on a fresh engine. Modes, all under the same `--kv-memory-gb`:

- int2_pallas: paged 2-bit cache on 16-token pages, the Pallas Triton decode body.
- int2_mosaic: paged 2-bit cache on 128-token dimension-major low-bit pages (flush 128), the
  Mosaic GPU decode body on Hopper (`lowbit_backend`).
- int2_reference: paged 2-bit cache, pure-jnp attention.
- bf16_paged: paged cache whose full-precision window covers every token, read by the
  BF16 paged Pallas kernel (`decode_attention_bf16`; the Mosaic GPU body on Hopper).
- bf16_dense: one contiguous full-precision row per sequence.

Random weights of real shapes (default Qwen3-8B): the values do not change the time. Output:
requests/s, output tokens/s of wall time (prefill included), time to first token and time per
output token (p50/p99), peak concurrent sequences, pool use, preemptions.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from eval import common
from kvjax import cli
from kvjax.cache.paged import CacheConfig
from kvjax.cache.quantizers import QuantConfig
from kvjax.cache.transforms import KVTransforms
from kvjax.serving.engine import Engine, EngineConfig

MODES = ("int2_pallas", "int2_mosaic", "int2_reference", "bf16_paged", "bf16_dense")


@dataclasses.dataclass(frozen=True)
class BenchServingConfig:
    layers: int = cli.option(2, "decoder layers (36 = the whole Qwen3-8B)")
    hidden_size: int = cli.option(256, "model width (Qwen3-8B: 4096)")
    intermediate_size: int = cli.option(512, "MLP width (Qwen3-8B: 12288)")
    num_heads: int = cli.option(8, "query heads (Qwen3-8B: 32)")
    num_kv_heads: int = cli.option(2, "KV heads (Qwen3-8B: 8)")
    head_dim: int = cli.option(64, "head dimension (Qwen3-8B: 128)")
    vocab_size: int = cli.option(1024, "vocabulary (Qwen3-8B: 151936)")
    requests: int = cli.option(8, "number of requests")
    prompt_len: int = cli.option(96, "longest prompt")
    output_len: int = cli.option(32, "most output tokens per request")
    spread: float = cli.option(0.25, "lengths drawn from [len * (1 - spread), len]")
    rate: float = cli.option(0.0, "arrivals per second (Poisson); 0 = all at once")
    kv_memory_gb: float = cli.option(0.05, "GiB for the cache pools, every mode")
    max_seqs: int = cli.option(64, "most concurrent sequences")
    decode_steps: int = cli.option(16, "decode steps per host sync")
    prefill_chunk: int = cli.option(512, "tokens per prefill chunk")
    prefill_tokens_per_step: int = cli.option(2048, "prefill tokens per engine step")
    bits: int = cli.option(2, "low-bit width of the int modes", choices=(2, 4))
    sink: int = cli.option(64, "full-precision sink tokens")
    keep: int = cli.option(256, "full-precision recent tokens")
    page_size: int = cli.option(16, "tokens per page")
    modes: tuple[str, ...] = cli.option(MODES, "caches to compare", choices=MODES)
    repeats: int = cli.option(1, "timed runs per mode (spread shows run-to-run noise)")
    warmup_tokens: int = cli.option(32, "output tokens per request in the warm-up run")
    seed: int = cli.option(0, "workload seed")
    out: str = cli.option("runs/bench_serving", "output directory (json + md)")


def validate(c: BenchServingConfig) -> None:
    for name in ("requests", "prompt_len", "output_len", "layers", "repeats"):
        cli.check(getattr(c, name) >= 1, f"--{name.replace('_', '-')} {getattr(c, name)}: >= 1")
    cli.check(0 <= c.spread < 1, f"--spread {c.spread}: must be in [0, 1)")
    cli.check(c.rate >= 0, f"--rate {c.rate}: must be >= 0")
    cli.check(c.kv_memory_gb > 0, f"--kv-memory-gb {c.kv_memory_gb}: must be > 0")
    cli.check(
        c.prefill_chunk % c.page_size == 0,
        f"--prefill-chunk {c.prefill_chunk} must be a multiple of --page-size {c.page_size}",
    )


def workload(c: BenchServingConfig) -> list[tuple[float, list[int], int]]:
    """(arrival second, prompt ids, output tokens) per request."""
    rng = np.random.default_rng(c.seed)

    def draw(n):
        return int(rng.integers(max(1, int(n * (1 - c.spread))), n + 1))

    t, reqs = 0.0, []
    for _ in range(c.requests):
        if c.rate > 0:
            t += float(rng.exponential(1 / c.rate))
        prompt = rng.integers(0, c.vocab_size, draw(c.prompt_len)).tolist()
        reqs.append((t, prompt, draw(c.output_len)))
    return reqs


def make_engine(
    model,
    mode: str,
    *,
    max_len: int,
    engine_cfg: EngineConfig,
    bits: int = 2,
    sink: int = 64,
    keep: int = 256,
    page_size: int = 16,
    flush_rows: int | None = None,
) -> Engine:
    """The engine of one benchmark mode (see the module docstring), identity transforms."""
    max_len = -(-max_len // page_size) * page_size
    fp_dtype = jnp.dtype(model.dtype).name
    if mode == "bf16_dense":
        ccfg = CacheConfig(max_seq_len=max_len, fp_dtype=fp_dtype)
        return Engine(model, cache_kind="dense", cache_cfg=ccfg, engine_cfg=engine_cfg)
    mosaic = dict(lowbit_page_size=128, value_layout="dims") if mode == "int2_mosaic" else {}
    ccfg = CacheConfig(
        sink=sink,
        # bf16_paged: the recent window holds every token, so every page is full precision
        keep=max_len if mode == "bf16_paged" else keep,
        flush=128 if mosaic else page_size,  # every flush writes whole low-bit pages
        page_size=page_size,
        **mosaic,
        quant=None if mode == "bf16_paged" else QuantConfig(bits=bits),
        fp_dtype=fp_dtype,
        max_seq_len=max_len,
        attention="reference" if mode == "int2_reference" else "pallas",
        flush_rows=flush_rows,
    )
    tf = KVTransforms.identity(model.cfg)
    return Engine(model, cache_kind="paged", transforms=tf, cache_cfg=ccfg, engine_cfg=engine_cfg)


def engine_for(model, mode: str, c: BenchServingConfig) -> Engine:
    max_len = c.prompt_len + c.output_len
    ecfg = EngineConfig(
        max_seqs=c.max_seqs,
        prefill_chunk=c.prefill_chunk,
        prefill_tokens_per_step=c.prefill_tokens_per_step,
        decode_steps=c.decode_steps,
        kv_memory_gb=c.kv_memory_gb,
        # the mean request length: pools split for the sequences a run actually holds
        expected_seq_len=int((1 - c.spread / 2) * max_len),
    )
    return make_engine(
        model, mode, max_len=max_len, engine_cfg=ecfg, bits=c.bits, sink=c.sink, keep=c.keep,
        page_size=c.page_size,
    )  # fmt: skip


def _pct(xs, q):
    return round(float(np.percentile(xs, q)), 5) if len(xs) else None


def run_workload(eng: Engine, reqs) -> dict:
    """Submits by arrival time, steps to the end; the metrics of one run."""
    t0 = time.perf_counter()
    pending, live, peak_pages = list(reqs), [], (0, 0)
    while pending or eng.has_work:
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now:
            _, prompt, n_out = pending.pop(0)
            r = eng.submit(prompt, n_out, stop_ids=())
            r.submitted_at = t0 + max(now, 0.0)
            live.append(r)
        if not eng.has_work:
            time.sleep(min(0.01, max(0.0, pending[0][0] - now)))
            continue
        eng.step()
        if eng.manager is not None:
            peak_pages = tuple(max(a, b) for a, b in zip(peak_pages, eng.manager.pages_in_use()))
    wall = time.perf_counter() - t0
    ttft = [r.first_token_at - r.submitted_at for r in live]
    tpot = [
        (r.finished_at - r.first_token_at) / (len(r.output) - 1) for r in live if len(r.output) > 1
    ]
    out_tokens = sum(len(r.output) for r in live)
    row = dict(
        wall_s=round(wall, 3),
        requests_per_s=round(len(live) / wall, 4),
        output_tok_per_s=round(out_tokens / wall, 1),
        output_tokens=out_tokens,
        prefill_tokens=int(eng.stats["prefill_tokens"]),
        prefill_tok_per_s=round(eng.stats["prefill_tokens"] / eng.stats["prefill_seconds"], 1),
        decode_s=round(eng.stats["decode_seconds"], 3),
        decode_step_ms=round(1e3 * eng.stats["decode_seconds"] / eng.stats["decode_steps"], 3),
        ttft_p50_s=_pct(ttft, 50),
        ttft_p99_s=_pct(ttft, 99),
        tpot_p50_s=_pct(tpot, 50),
        tpot_p99_s=_pct(tpot, 99),
        peak_concurrent=eng.peak_running,
        preemptions=int(eng.stats["preemptions"]),
    )
    if eng.manager is not None:
        row.update(
            pool_pages=(eng.manager.num_fp_pages, eng.manager.num_low_pages),
            peak_pages_in_use=peak_pages,
        )
    else:
        row.update(dense_rows=eng.num_slots)
    return row


def kernel_used(mode: str, eng: Engine) -> str:
    """The decode attention a mode's engine runs on this machine (the backend choosers the
    cache itself calls)."""
    if mode == "bf16_dense":
        return "XLA dense attention"
    if mode == "int2_reference":
        return "pure-jnp reference attention"
    cfg = eng.cache_cfg
    backend = eng.cache.decode_backend(0, eng.cfg.num_heads)
    name = {"gpu": "Triton", "gpu_mosaic": "Mosaic GPU", "tpu": "Mosaic TPU"}[backend]
    if jax.default_backend() == "cpu":
        name += ", interpret mode"
    if cfg.all_full_precision:
        return f"Pallas {name} BF16 body via PagedKVCache ({cfg.page_size}-token pages)"
    return (
        f"Pallas {name} body via PagedKVCache ({cfg.low_page}-token low-bit pages, "
        f"{cfg.value_layout}-major values)"
    )


def main(c: BenchServingConfig) -> dict:
    validate(c)
    shape = common.ModelShape(
        c.layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
        c.vocab_size,
    )  # fmt: skip
    model = common.random_model(shape, c.prompt_len + c.output_len)
    reqs = workload(c)
    rows = []
    payload = dict(
        **common.environment(),
        device=str(jax.devices()[0].device_kind),
        config=dataclasses.asdict(c),
        model_shape=dataclasses.asdict(shape),
        rows=rows,
    )
    for mode in c.modes:
        warm = engine_for(model, mode, c)
        for _, prompt, n in reqs:
            warm.submit(prompt, min(n, c.warmup_tokens), stop_ids=())
        warm.run()
        del warm
        for rep in range(c.repeats):
            eng = engine_for(model, mode, c)
            row = dict(mode=mode, repeat=rep, kernel=kernel_used(mode, eng))
            row["kv_bytes"] = eng.allocated_bytes()
            row.update(run_workload(eng, reqs))
            rows.append(row)
            print(row, flush=True)
            write(c, payload)  # after every row: a run cut short keeps what it measured
            del eng
    return write(c, payload, final=True)


def write(c: BenchServingConfig, payload: dict, final: bool = False) -> dict:
    rows = payload["rows"]
    header = ["mode", "kernel", "output tok/s", "req/s", "peak concurrent", "decode step ms",
              "TTFT p50/p99 s", "TPOT p50/p99 ms", "preemptions", "wall s"]  # fmt: skip
    table = [
        [r["mode"], r["kernel"], r["output_tok_per_s"], r["requests_per_s"], r["peak_concurrent"],
         r["decode_step_ms"], f"{r['ttft_p50_s']:.3f} / {r['ttft_p99_s']:.3f}",
         f"{1e3 * (r['tpot_p50_s'] or 0):.2f} / {1e3 * (r['tpot_p99_s'] or 0):.2f}",
         r["preemptions"], r["wall_s"]]
        for r in rows
    ]  # fmt: skip
    md = (
        f"# bench_serving\n\n`{payload['command']}` at {payload['commit']}, {payload['date']}, "
        f"{payload['device']}, jax {payload['jax_version']}\n\n"
        f"{c.requests} requests, prompts <= {c.prompt_len}, outputs <= {c.output_len} tokens, "
        f"{'all at once' if c.rate == 0 else f'{c.rate}/s'}, KV budget {c.kv_memory_gb} GiB\n\n"
        + common.markdown_table(header, table)
    )
    jpath, _ = common.write_results(c.out, "bench_serving", payload, md)
    if final:
        print(md)
        print(f"wrote {jpath}")
    return payload


def parse_args(argv=None) -> BenchServingConfig:
    parser = cli.dataclass_parser(BenchServingConfig, "python -m eval.bench_serving", __doc__)
    return cli.dataclass_from_args(BenchServingConfig, parser.parse_args(argv))


if __name__ == "__main__":
    cli.run(main, parse_args)
