"""Calibration throughput: statistics-pass tokens/s next to plain forward tokens/s, and memory.

    python -m eval.bench_calibration                       # shipped SmolLM2 on this machine
    python -m eval.bench_calibration --batches 4 --seq-len 512 --batch-size 4
    # GPU: random weights of the whole Qwen3-8B, streaming 64k and 1M tokens per phase
    python -m eval.bench_calibration --random-weights --layers 36 --seq-len 4096 \\
        --batch-size 4 --tokens 65536 1048576

For each statistics set (the ones wush, oscar, oscar_tokenweight and wush_a need) it streams
the batches through the jitted statistics step (`calib.calibrate.make_stats_step`, the sums
accumulated and donated from batch to batch, as `kvjax.calibrate` does) and times it against
the jitted plain forward on the same batches, after one warm-up call each. Both skip the LM
head over the window (neither needs logits; the forward returns the last position's). With
``--tokens`` each phase runs once per token budget, batches drawn on the device, so the peak
device memory (``memory_stats``; peak RSS on CPU) after the smaller and after the larger budget
shows whether the statistics pass is flat in tokens. Writes ``OUT.json`` and ``OUT.md``.
"""

from __future__ import annotations

import dataclasses
import pathlib
import resource
import time

import jax
import jax.numpy as jnp
from flax import nnx

from calib.calibrate import make_stats_step
from calib.data import token_windows
from calib.statistics import init_stats, required_stats
from eval import common
from kvjax import assets, cli
from kvjax.models.loading import LoadedModel, load_model


@dataclasses.dataclass(frozen=True)
class BenchCalibrationConfig:
    model: str | None = cli.option(None, "HF checkpoint dir or .gguf (default: shipped SmolLM2)")
    methods: tuple[str, ...] = cli.option(
        ("wush", "oscar", "oscar_tokenweight", "wush_a"), "methods whose statistics to time"
    )
    seq_len: int = cli.option(512, "tokens per window")
    batch_size: int = cli.option(4, "windows per batch")
    batches: int = cli.option(4, "timed batches per phase (after one warm-up), without --tokens")
    tokens: tuple[int, ...] = cli.option(
        (), "token budgets streamed per phase (each a multiple of batch-size x seq-len)"
    )
    random_weights: bool = cli.option(
        False, "random weights of the shapes below (random token ids) instead of a checkpoint"
    )
    layers: int = cli.option(36, "random-weights decoder layers (36 = the whole Qwen3-8B)")
    hidden_size: int = cli.option(4096, "random-weights model width")
    intermediate_size: int = cli.option(12288, "random-weights MLP width")
    num_heads: int = cli.option(32, "random-weights query heads")
    num_kv_heads: int = cli.option(8, "random-weights KV heads")
    head_dim: int = cli.option(128, "random-weights head dimension")
    vocab_size: int = cli.option(151936, "random-weights vocabulary")
    out: str = cli.option("runs/bench_calibration", "output path stem (.json and .md)")

    def __post_init__(self):
        common.check_methods(self.methods)
        cli.check(self.seq_len >= 1 and self.batch_size >= 1, "--seq-len, --batch-size >= 1")
        cli.check(self.batches >= 1, f"--batches {self.batches}: must be >= 1")
        per = self.batch_size * self.seq_len
        bad = [t for t in self.tokens if t < per or t % per]
        cli.check(
            not bad, f"--tokens {bad}: each must be a positive multiple of {per} (batch x seq)"
        )
        cli.check(
            not (self.random_weights and self.model),
            "--random-weights and --model exclude each other",
        )


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _peak_device_mib() -> float | None:
    stats = jax.local_devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**20


def _random_lm(c: BenchCalibrationConfig) -> LoadedModel:
    shape = common.ModelShape(
        c.layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
        c.vocab_size,
    )  # fmt: skip
    model = common.random_model(shape, c.seq_len)
    return LoadedModel(
        model=model,
        tokenizer=None,
        cfg=model.cfg,
        fingerprint="random",
        source=f"random weights, {dataclasses.asdict(shape)}",
    )


def main(cfg: BenchCalibrationConfig) -> dict:
    lm = _random_lm(cfg) if cfg.random_weights else load_model(cfg.model)
    shape = (cfg.batch_size, cfg.seq_len)
    budgets = cfg.tokens or (cfg.batches * cfg.batch_size * cfg.seq_len,)
    if cfg.random_weights:
        vocab = lm.cfg.vocab_size
        draw = jax.jit(lambda i: jax.random.randint(jax.random.key(i), shape, 0, vocab))

        def batches(n_tokens):  # drawn on the device one at a time: no host copy of the set
            return (draw(i) for i in range(n_tokens // (cfg.batch_size * cfg.seq_len)))

        first = draw(-1)
    else:
        n_windows = max(budgets) // cfg.seq_len
        windows = token_windows(assets.calibration_text(), lm.tokenizer, cfg.seq_len, n_windows)

        def batches(n_tokens):
            n = n_tokens // cfg.seq_len
            return (
                jnp.asarray(windows[i : i + cfg.batch_size]) for i in range(0, n, cfg.batch_size)
            )

        first = jnp.asarray(windows[: cfg.batch_size])
    graphdef, params = nnx.split(lm.model)

    @jax.jit
    def forward(params, tokens):
        return nnx.merge(graphdef, params)(tokens)[0][:, -1]

    c = lm.cfg

    def phases():
        yield "forward", lambda b, acc: forward(params, b), None
        for method in cfg.methods:
            names = required_stats([method])
            step = make_stats_step(lm, names)

            def init(names=names):
                return [init_stats(names, c.num_kv_heads, c.head_dim) for _ in range(c.num_layers)]

            label = f"statistics[{method}: {','.join(sorted(names))}]"
            yield label, lambda b, acc, step=step: step(params, acc, b), init

    rows = []
    fwd_s = {}
    result = dict(
        common.environment(),
        model=lm.source,
        seq_len=cfg.seq_len,
        batch_size=cfg.batch_size,
        device=str(jax.local_devices()[0].device_kind),
        rows=rows,
    )
    for label, fn, init in phases():
        jax.block_until_ready(fn(first, init() if init else None))  # compile + warm up
        for n_tokens in budgets:
            acc = init() if init else None
            t0 = time.perf_counter()
            for b in batches(n_tokens):
                out = fn(b, acc)
                acc = out if init else None
            jax.block_until_ready(out)
            secs = time.perf_counter() - t0
            if init is None:
                fwd_s[n_tokens] = secs
            rows.append(
                dict(
                    phase=label,
                    tokens=n_tokens,
                    seconds=secs,
                    tokens_per_s=n_tokens / secs,
                    ratio_to_forward=fwd_s[n_tokens] / secs,
                    peak_device_mib=_peak_device_mib(),
                    peak_rss_mib=_peak_rss_mib(),
                )
            )
            print(rows[-1], flush=True)
            write_report(result, cfg.out)  # after every row: a run cut short keeps its rows
    print(report_markdown(result))
    return result


def report_markdown(result: dict) -> str:
    """The markdown record of a `main` result (its rows so far)."""
    lines = [
        f"`{result['command']}` at commit {result['commit']}, {result['date']}, "
        f"{result['device']} ({result['machine']}, {result['cpu_count']} CPUs), jax "
        f"{result['jax_version']}; {result['model']}; batch {result['batch_size']} x "
        f"{result['seq_len']}",
        "",
        "Tokens/s of each phase over the same streamed batches (statistics accumulated across "
        "batches); peak memory is the process's high-water mark after the row (device memory "
        "on accelerators), so a flat statistics pass shows the same peak at every budget.",
        "",
    ]
    table = [
        [
            r["phase"],
            r["tokens"],
            f"{r['tokens_per_s']:.0f}",
            f"{r['ratio_to_forward']:.0%}",
            "-" if r["peak_device_mib"] is None else f"{r['peak_device_mib']:.0f}",
            f"{r['peak_rss_mib']:.0f}",
        ]
        for r in result["rows"]
    ]
    header = ["phase", "tokens", "tokens/s", "vs forward", "peak device (MiB)", "peak RSS (MiB)"]
    lines.append(common.markdown_table(header, table))
    if result.get("note"):
        lines += ["", result["note"]]
    return "\n".join(lines)


def write_report(result: dict, out: str) -> None:
    stem = pathlib.Path(out)
    stem = stem.with_suffix("") if stem.suffix in (".json", ".md") else stem
    common.write_results(stem.parent, stem.name, result, report_markdown(result))


def parse_args(argv=None) -> BenchCalibrationConfig:
    parser = cli.dataclass_parser(
        BenchCalibrationConfig, "python -m eval.bench_calibration", __doc__
    )
    return cli.dataclass_from_args(BenchCalibrationConfig, parser.parse_args(argv))


if __name__ == "__main__":
    main(parse_args())
