"""Calibration throughput: statistics-pass tokens/s next to plain forward tokens/s, and memory.

    python -m eval.bench_calibration                       # shipped SmolLM2 on this machine
    python -m eval.bench_calibration --batches 4 --seq-len 512 --batch-size 4

For each statistics set (the ones wush, oscar, oscar_tokenweight and wush_a need) it times the
jitted statistics step (`calib.calibrate.make_stats_step`) against the jitted plain forward on the
same batches, after one warm-up call each, and reports the ratio. Peak resident memory of the
process is read after each phase. Writes `results/bench_calibration.json` and `.md`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
import platform
import resource
import time

import jax
import jax.numpy as jnp
from flax import nnx

from calib.calibrate import make_stats_step
from calib.data import token_windows
from calib.statistics import init_stats, required_stats
from kvjax import assets, cli
from kvjax.models.loading import load_model


@dataclasses.dataclass(frozen=True)
class BenchCalibrationConfig:
    model: str | None = cli.option(None, "HF checkpoint dir or .gguf (default: shipped SmolLM2)")
    methods: tuple[str, ...] = cli.option(
        ("wush", "oscar", "oscar_tokenweight", "wush_a"), "methods whose statistics to time"
    )
    seq_len: int = cli.option(512, "tokens per window")
    batch_size: int = cli.option(4, "windows per batch")
    batches: int = cli.option(4, "timed batches per phase (after one warm-up)")
    out: str = cli.option("runs/bench_calibration", "output path stem (.json and .md)")


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _time(fn, batches) -> float:
    jax.block_until_ready(fn(batches[0]))  # compile + warm up
    t0 = time.perf_counter()
    for b in batches:
        jax.block_until_ready(fn(b))
    return time.perf_counter() - t0


def main(cfg: BenchCalibrationConfig) -> dict:
    lm = load_model(cfg.model)
    windows = token_windows(
        assets.calibration_text(), lm.tokenizer, cfg.seq_len, cfg.batch_size * cfg.batches
    )
    batches = [
        jnp.asarray(windows[i * cfg.batch_size : (i + 1) * cfg.batch_size])
        for i in range(cfg.batches)
    ]
    n_tokens = sum(b.size for b in batches)
    graphdef, params = nnx.split(lm.model)

    @jax.jit
    def forward(params, tokens):
        return nnx.merge(graphdef, params)(tokens)[0]

    fwd_s = _time(lambda b: forward(params, b), batches)
    rows = [
        dict(
            phase="forward",
            tokens_per_s=n_tokens / fwd_s,
            ratio_to_forward=1.0,
            peak_rss_mib=_peak_rss_mib(),
        )
    ]
    for method in cfg.methods:
        names = required_stats([method])
        step = make_stats_step(lm, names)
        c = lm.cfg

        def run(b, names=names, step=step, c=c):
            stats = [init_stats(names, c.num_kv_heads, c.head_dim) for _ in range(c.num_layers)]
            return step(params, stats, b)

        s = _time(run, batches)
        rows.append(
            dict(
                phase=f"statistics[{method}: {','.join(sorted(names))}]",
                tokens_per_s=n_tokens / s,
                ratio_to_forward=fwd_s / s,
                peak_rss_mib=_peak_rss_mib(),
            )
        )
    result = dict(
        date=datetime.date.today().isoformat(),
        machine=f"{platform.machine()} "
        f"{platform.processor() or ''} cpus={jax.local_device_count()} backend="
        f"{jax.default_backend()}",
        jax_version=jax.__version__,
        model=lm.source,
        seq_len=cfg.seq_len,
        batch_size=cfg.batch_size,
        timed_tokens=n_tokens,
        rows=rows,
    )
    out = pathlib.Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    lines = [
        f"Calibration throughput, {result['date']}, {result['machine']}, jax "
        f"{result['jax_version']}, batch {cfg.batch_size} x {cfg.seq_len} tokens, "
        f"{n_tokens} timed tokens per phase",
        "",
        "| phase | tokens/s | vs forward | peak RSS (MiB) |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['phase']} | {r['tokens_per_s']:.0f} | {r['ratio_to_forward']:.0%} | "
            f"{r['peak_rss_mib']:.0f} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


def parse_args(argv=None) -> BenchCalibrationConfig:
    parser = cli.dataclass_parser(
        BenchCalibrationConfig, "python -m eval.bench_calibration", __doc__
    )
    return cli.dataclass_from_args(BenchCalibrationConfig, parser.parse_args(argv))


if __name__ == "__main__":
    cli.run(main, parse_args)
