"""Run the evaluation set on a model and write a RESULTS.md report, in one command.

    python -m eval.report --calib-dir runs/calib --quick     # smoke run -> runs/report/
    python -m eval.report --calib-dir runs/calib             # full set (CPU: many hours)
    python -m eval.report --calib-dir runs/calib --out results --results-md RESULTS.md  # record
    python -m eval.report --calib-dir runs/calib --run retrieval --retrieval-methods kv_pca wush

Needs calibrated transforms (`python -m kvjax.calibrate --method wush wush_a oscar
oscar_tokenweight kv_pca hadamard random identity --bits 2 3 4 --out runs/calib`); the full
set evaluates every method, `--quick` those of QUICK_METHODS found in --calib-dir. Writes
{perplexity,attention_error,retrieval,memory}.{json,md} (+ PNG plots) into --out (default
runs/report, outside the tracked tree) and a report (default <out>/RESULTS.md) with the
tables (full-precision rows, changes vs full precision with their standard errors), the seconds
each row took, the attention-error plot, cache memory at 2 bits, the issue targets checked
against the measured numbers, the command that ran, the commit, date, machine and jax version,
and what each transform was calibrated on (from its metadata). Tracked files are written only
when --out / --results-md name them. Nothing is tuned on the evaluation plays: clips come from
the calibration plays. `--data` runs every evaluation on a user's text instead.

Defaults of the full run: perplexity on --ppl-windows 16 windows of 2048 tokens, every method
at 2, 3, 4 bits (oscar and quest) with the 16/128/16 protocol and the 64/256/16 serving column;
attention error on 2 x 1024 tokens; retrieval (passkey and multi-key needle in a haystack, 20
trials per cell, lengths 1024, 2048, ... up to the model's context limit) for full precision
and --retrieval-methods (default: every evaluated method). On a 2-core CPU the full run takes
days; results/retrieval.md and RESULTS.md give the seconds each row took.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from collections.abc import Sequence

from eval import attention_error, common, perplexity, retrieval
from kvjax import cli
from kvjax.cache.paged import CacheConfig, PagedKVCache
from kvjax.cache.quantizers import QuantConfig
from kvjax.cache.transforms import KVTransforms
from kvjax.config import ModelConfig
from kvjax.models.loading import load_model
from pallas_kernels.layout import PageLayout

QUICK_METHODS = ("identity", "hadamard", "oscar", "wush")


@dataclasses.dataclass(frozen=True)
class ReportConfig:
    quick: bool = cli.option(False, "smoke run: quick methods found in --calib-dir, short windows")
    model: str | None = cli.option(None, "HF checkpoint dir or .gguf (default: shipped SmolLM2)")
    calib_dir: str = cli.option("runs/calib", "the --out folder of python -m kvjax.calibrate")
    out: str = cli.option("runs/report", "folder for the JSON/markdown/PNG files")
    results_md: str | None = cli.option(None, "report path (default: <out>/RESULTS.md)")
    ppl_windows: int = cli.option(16, "2048-token windows for the full perplexity grid")
    memory_context: int = cli.option(32768, "tokens per sequence for the memory comparison")
    run: tuple[str, ...] = cli.option(
        ("perplexity", "attention_error", "retrieval"),
        "evaluations to run",
        choices=("perplexity", "attention_error", "retrieval"),
    )
    retrieval_methods: tuple[str, ...] = cli.option(
        (), "transforms for retrieval (default: every evaluated method)"
    )
    retrieval_lengths: tuple[int, ...] | None = cli.option(
        None, "retrieval prompt lengths (default: 1024, 2048, ... up to the model's context)"
    )
    retrieval_trials: int = cli.option(20, "retrieval trials per (task, length) cell")
    data: str | None = cli.option(
        None, "text for every evaluation (.txt, dir, .jsonl, .parquet); default: the plays"
    )

    def __post_init__(self):
        common.check_methods(self.retrieval_methods)
        if self.ppl_windows < 1 or self.retrieval_trials < 1:
            raise ValueError(
                f"ppl_windows={self.ppl_windows} and retrieval_trials={self.retrieval_trials} "
                f"must be >= 1"
            )


def memory_report(model_cfg: ModelConfig, context: int, bits: int = 2) -> dict:
    """Bytes the paged cache allocates for one sequence of `context` tokens at `bits` bits
    (serving windows 64/256/16, bf16 full-precision pages) vs a dense bf16 K/V cache."""
    qc = QuantConfig(method="oscar", bits=bits)
    ccfg = CacheConfig(
        sink=64,
        keep=256,
        flush=16,
        page_size=16,
        quant=qc,
        fp_dtype="bfloat16",
        max_seq_len=context,
    )
    cache = PagedKVCache.create(model_cfg, ccfg, KVTransforms.identity(model_cfg), 1)
    paged = cache.allocated_bytes()
    dense = 2 * context * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim * 2
    lay = PageLayout(
        page_size=16,
        num_kv_heads=model_cfg.num_kv_heads,
        head_dim=model_cfg.head_dim,
        bits=bits,
        group_size=qc.resolve_group_size(model_cfg.head_dim),
        meta_dtype=qc.meta_dtype,
        fp_dtype="bfloat16",
    )
    elements = 2 * context * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim
    return dict(
        context=context,
        bits=bits,
        windows="64/256/16",
        page_size=16,
        paged_allocated_bytes=int(paged),
        dense_bf16_bytes=int(dense),
        ratio=dense / paged,
        allocated_bits_per_element=8 * paged / elements,
        lowbit_page_bits_per_element=float(lay.bits_per_element),
        fp_pages=int(cache.num_fp_pages),
        lowbit_pages=int(cache.num_lowbit_pages),
    )


def _targets(ppl: dict) -> list[str]:
    """The issue's 16/128/16, 2-bit targets, checked against the measured grid (oscar quant)."""
    rows = ppl["rows"]
    fp = rows[0]["value"]
    prot = "/".join(map(str, ppl["config"]["protocol"]))
    at2 = {
        r["transform"]: r
        for r in rows[1:]
        if r["bits"] == 2 and r["quantizer"] == "oscar" and r["windows"] == prot
    }
    out = []
    if "wush" in at2:
        w = at2["wush"]
        ok = w["rel_to_fp"] <= 0.06
        out.append(
            f"- wush within 6% of full precision: **{'met' if ok else 'missed'}** — "
            f"{w['value']:.3f} vs {fp:.3f} ({100 * w['rel_to_fp']:+.2f}%"
            + ("" if ok else f", {100 * (w['rel_to_fp'] - 0.06):.2f} points over")
            + ")."
        )
        for other in ("hadamard", "oscar"):
            if other in at2:
                o = at2[other]
                out.append(
                    f"- wush ahead of {other}: **{'yes' if w['value'] < o['value'] else 'no'}"
                    f"** — {w['value']:.3f} vs {o['value']:.3f}."
                )
    if "identity" in at2:
        ident = at2["identity"]["value"]
        cal = [m for m in at2 if m not in ("identity", "random", "hadamard")]
        worst = max(cal, key=lambda m: at2[m]["value"]) if cal else None
        if worst:
            out.append(
                f"- every calibrated transform far ahead of identity ({ident:.2f}): "
                f"**{'yes' if at2[worst]['value'] < 0.5 * ident else 'no'}** — the worst "
                f"calibrated one is {worst} at {at2[worst]['value']:.2f}."
            )
    return out


def _retrieval_targets(ret: dict) -> list[str]:
    """Issue #14: the best 2-bit method within 5 points of full precision at every tested
    length, with >= 20 trials per cell (per task; best = the smallest worst-length gap)."""
    out = []
    rows = ret["rows"]
    for task in dict.fromkeys(r["task"] for r in rows):
        tr = [r for r in rows if r["task"] == task]
        lengths = sorted({r["length"] for r in tr})
        fp = {r["length"]: r for r in tr if r["transform"] == common.FULL_PRECISION}
        quant = [r for r in tr if r["transform"] != common.FULL_PRECISION and r["bits"] == 2]
        methods = list(dict.fromkeys(r["transform"] for r in quant))
        if not methods or not fp:
            continue
        by = {(r["transform"], r["length"]): r for r in quant}
        methods = [m for m in methods if all((m, n) in by for n in lengths)]
        if not methods:
            out.append(f"- {task}: no 2-bit method was measured at every length {lengths}.")
            continue
        worst = {m: min(by[(m, n)]["change_vs_fp"] for n in lengths) for m in methods}
        best = max(methods, key=lambda m: worst[m])
        trials = min(r["trials"] for r in tr)
        ok = worst[best] >= -0.05 and trials >= 20
        gaps = ", ".join(
            f"{n}: {100 * by[(best, n)]['value']:.0f} vs {100 * fp[n]['value']:.0f}"
            for n in lengths
        )
        out.append(
            f"- {task}: best 2-bit method {best} within 5 points of full precision at every "
            f"length, >= 20 trials per cell: **{'met' if ok else 'missed'}** — worst gap "
            f"{100 * worst[best]:+.0f} points, {trials} trials per cell ({gaps})."
        )
    return out


def perplexity_seconds(ppl: dict) -> str:
    """The seconds each perplexity row took, full precision first (one row per setting)."""
    rows = ppl["rows"]
    fp = rows[0]
    cols = list(dict.fromkeys((r["quantizer"], r["bits"], r["windows"]) for r in rows[1:]))
    by = {(r["transform"], r["quantizer"], r["bits"], r["windows"]): r for r in rows[1:]}
    methods = list(dict.fromkeys(r["transform"] for r in rows[1:]))
    table = [
        [m] + [f"{by[(m, *c)]['seconds']:.0f}" if (m, *c) in by else "-" for c in cols]
        for m in methods
    ]
    return (
        f"Seconds per perplexity row ({fp['num_windows']} x {fp['seq_len']} tokens each); "
        f"full precision: perplexity **{fp['value']:.3f}** in {fp['seconds']:.0f} s.\n\n"
        + common.markdown_table(["transform"] + [f"{q} {b}b @ {w}" for q, b, w in cols], table)
    )


def calibration_lines(calib_dir: str, methods: Sequence[str]) -> list[str]:
    """What each evaluated transform was calibrated on, read from its stored metadata."""
    from kvjax.storage import read_metadata

    lines = []
    for m in methods:
        path = pathlib.Path(calib_dir) / m
        if not path.is_dir():
            lines.append(f"- {m}: no stored transforms (a baseline built in place)")
            continue
        meta = read_metadata(path)
        lines.append(
            f"- {m}: `{path}`, {meta.get('tokens')} tokens in {meta.get('seq_len')}-token "
            f"windows of {meta.get('data')}, clips {meta.get('clip_mode')} for bits "
            f"{', '.join(sorted(meta.get('clips_by_bits', {})))}"
        )
    return lines


def report_path(cfg: ReportConfig) -> pathlib.Path:
    return pathlib.Path(cfg.results_md or pathlib.Path(cfg.out) / "RESULTS.md")


def write_results_md(
    cfg: ReportConfig, results: dict, methods: Sequence[str], seconds: float
) -> str:
    env = common.environment()
    out = pathlib.Path(cfg.out)
    model = "SmolLM2-135M-Instruct (Q4_1 GGUF, shipped)" if cfg.model is None else f"`{cfg.model}`"
    parts = [
        f"# kvjax results on {'the default model' if cfg.model is None else cfg.model}\n",
        f"{model}, measured by `eval/` on {env['date']} at commit {env['commit']}; machine "
        f"{env['machine']} ({env['cpu_count']} CPUs visible, shared with other jobs), jax "
        f"{env['jax_version']} ({env['jax_backend']}). Run time {seconds / 60:.0f} min"
        f"{' (quick smoke run)' if cfg.quick else ''}"
        f"{'' if cfg.data is None else f'; every evaluation on `{cfg.data}`'}. Machine-readable "
        f"rows are in `{out}/*.json`.\n",
        "Command that made this report:\n",
        "```",
        env["command"],
        "```\n",
        "Transforms evaluated:\n",
        *calibration_lines(cfg.calib_dir, methods),
        "",
    ]
    if "perplexity" in results:
        ppl = results["perplexity"]
        parts += [
            "## Perplexity (WUSH-KV protocol)\n",
            (out / "perplexity.md").read_text(),
            f"![perplexity]({out}/perplexity.png)\n",
            perplexity_seconds(ppl),
            "### Issue targets (16/128/16, 2 bits, oscar quantizer)\n",
            *_targets(ppl),
            "",
        ]
    if "attention_error" in results:
        parts += [
            "## Attention error per layer\n",
            (out / "attention_error.md").read_text(),
            f"![attention error]({out}/attention_error.png)\n",
        ]
    if "retrieval" in results:
        parts += [
            "## Retrieval (passkey, multi-key needle in a haystack)\n",
            (out / "retrieval.md").read_text(),
            "### Issue target (retrieval at 2 bits)\n",
            *_retrieval_targets(results["retrieval"]),
            "",
        ]
    mem = results["memory"]
    parts += [
        "## Cache memory at 2 bits\n",
        f"One sequence of {mem['context']} tokens, model shapes above, serving windows "
        f"{mem['windows']}, bf16 full-precision pages, fp16 scale/zero per token and head: "
        f"the paged cache allocates **{mem['paged_allocated_bytes'] / 2**20:.2f} MiB** "
        f"(pools as created, every array counted) vs **"
        f"{mem['dense_bf16_bytes'] / 2**20:.2f} MiB** for a dense bf16 K/V cache: "
        f"**{mem['ratio']:.2f}x** smaller, {mem['allocated_bits_per_element']:.3f} "
        f"allocated bits per element overall; a low-bit page stores "
        f"{mem['lowbit_page_bits_per_element']:.3f} bits per element (codes + scale/zero).\n",
    ]
    text = "\n".join(parts)
    path = report_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text


def select_methods(cfg: ReportConfig) -> tuple[str, ...]:
    """The methods to evaluate: all of them, or (quick) those of QUICK_METHODS calibrated in
    --calib-dir; raises `cli.UsageError` naming the calibrate command when one is missing."""
    calib = pathlib.Path(cfg.calib_dir)
    cli.check(
        calib.is_dir(),
        f"--calib-dir {cfg.calib_dir!r} does not exist; run python -m "
        f"kvjax.calibrate --method {' '.join(QUICK_METHODS if cfg.quick else common.ALL_METHODS)} "
        f"--out {cfg.calib_dir}",
    )
    found = {m for m in common.ALL_METHODS if (calib / m).is_dir()}
    if cfg.quick:
        methods = tuple(m for m in QUICK_METHODS if m in found)
        cli.check(bool(methods), f"--calib-dir {cfg.calib_dir!r} holds none of {QUICK_METHODS}")
        return methods
    missing = [m for m in common.ALL_METHODS if m not in found]
    cli.check(
        not missing,
        f"--calib-dir {cfg.calib_dir!r} lacks {missing}; run python -m kvjax.calibrate "
        f"--method {' '.join(missing)} --bits 2 3 4 --out {cfg.calib_dir} (or use --quick)",
    )
    return common.ALL_METHODS


def main(cfg: ReportConfig) -> dict:
    t0 = time.perf_counter()
    methods = select_methods(cfg)
    ret_methods = cfg.retrieval_methods or methods
    missing = [m for m in ret_methods if not (pathlib.Path(cfg.calib_dir) / m).is_dir()]
    cli.check(not missing, f"--retrieval-methods {missing} are not in --calib-dir {cfg.calib_dir}")
    cli.check_paths_exist(data=cfg.data)
    lm = load_model(cfg.model)
    q = cfg.quick
    results: dict = {}
    results["memory"] = memory_report(lm.cfg, cfg.memory_context)
    mem_md = common.markdown_table(list(results["memory"]), [list(results["memory"].values())])
    common.write_results(cfg.out, "memory", dict(eval="memory", **results["memory"]), mem_md)
    # Attention error first (minutes), then perplexity, then retrieval; RESULTS.md is rewritten
    # after each stage so a long CPU run shows what it has measured so far.
    if "attention_error" in cfg.run:
        ac = attention_error.AttentionErrorConfig(
            calib_dir=cfg.calib_dir,
            methods=methods,
            seq_len=256 if q else 1024,
            num_windows=1 if q else 2,
            data=cfg.data,
            out=cfg.out,
        )
        results["attention_error"] = attention_error.main(ac, lm)
        write_results_md(cfg, results, methods, time.perf_counter() - t0)
    if "perplexity" in cfg.run:
        pc = perplexity.PerplexityConfig(
            calib_dir=cfg.calib_dir,
            methods=methods,
            bits=(2,) if q else (2, 3, 4),
            seq_len=512 if q else 2048,
            num_windows=1 if q else cfg.ppl_windows,
            crosscheck_tokens=0 if q else 256,
            data=cfg.data,
            out=cfg.out,
        )
        results["perplexity"] = perplexity.main(pc, lm)
        write_results_md(cfg, results, methods, time.perf_counter() - t0)
    if "retrieval" in cfg.run:
        rc = retrieval.RetrievalConfig(
            calib_dir=cfg.calib_dir,
            methods=ret_methods,
            lengths=(512,) if q else cfg.retrieval_lengths,
            trials=2 if q else cfg.retrieval_trials,
            data=cfg.data,
            out=cfg.out,
        )
        results["retrieval"] = retrieval.main(rc, lm)
    write_results_md(cfg, results, methods, time.perf_counter() - t0)
    return results


def parse_args(argv: Sequence[str] | None = None) -> ReportConfig:
    parser = cli.dataclass_parser(ReportConfig, "python -m eval.report", __doc__)
    return cli.dataclass_from_args(ReportConfig, parser.parse_args(argv))


if __name__ == "__main__":
    cli.run(main, parse_args)
