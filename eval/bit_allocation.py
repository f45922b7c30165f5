"""Perplexity of bit allocations and cheaper scale/zero encodings at equal bits per element.

    python -m kvjax.calibrate --method wush --bits 2 3 4 --bpe-budget 2.5 --out runs/calib_alloc
    python -m eval.bit_allocation --calib-dir runs/calib_alloc --budgets 2.3 2.5 --windows 8

Rows (one transform, the oscar quantizer with the clips calibrated for each width, the
WUSH-KV protocol of `eval.perplexity`: 2048-token windows of the evaluation plays in 16-token
chunks, windows 16/128/16): full precision; uniform caches (default 2 bits with float16 and
with 8-bit scale/zero, `pallas_kernels.layout`); and for each budget the allocation that
`calib.allocation` chooses from the per-(layer, K/V) errors stored with the transforms
(`bit_errors`, measured at calibration on held-out calibration windows), plus the allocation
stored in the checkpoint itself. Each row gives its bits per element three ways
(`kvjax.cache.budget.cache_bpe`): low-bit pages alone (the budget's accounting with
``--bpe-context 0``), the evaluated protocol at its window length, and serving windows
64/256/16 at 32k tokens, full-precision pages at 16 bits.

Changes vs full precision carry their standard error paired over windows
(`eval.perplexity.paired_change_se`); comparisons between two rows (the ratio of changes, the
difference in points) carry delta-method standard errors from the per-window NLL changes.

Writes <out>/bit_allocation.json and <out>/bit_allocation.md.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

from calib import allocation, sensitivity
from eval import common
from eval.perplexity import paired_change_se, perplexity, window_nll
from kvjax import cli
from kvjax.cache.budget import BitAllocation, Format
from kvjax.cache.paged import CacheConfig
from kvjax.models.loading import load_model

SERVING_ACCOUNTING = dict(context=32768, sink=64, keep=256, flush=16)


@dataclasses.dataclass(frozen=True)
class BitAllocationConfig:
    model: str | None = cli.option(None, "HF checkpoint dir or .gguf (default: shipped SmolLM2)")
    calib_dir: str = cli.option("runs/calib", "the --out folder of python -m kvjax.calibrate")
    method: str = cli.option("wush", "transform (a sub-folder of --calib-dir)")
    budgets: tuple[float, ...] = cli.option(
        (2.3, 2.5), "budgets (bits per element in low-bit pages) to allocate at"
    )
    uniform: tuple[str, ...] = cli.option(
        ("2b/float16", "2b/uint8"), "uniform formats to compare with (BITSb/META)"
    )
    stored: bool = cli.option(True, "also evaluate the allocation stored with the transforms")
    seq_len: int = cli.option(2048, "tokens per evaluation window")
    num_windows: int = cli.option(8, "evaluation windows", flag="--windows")
    chunk: int = cli.option(16, "tokens per forward call")
    protocol: tuple[int, int, int] = cli.option(
        (16, 128, 16), "cache windows", metavar=("SINK", "KEEP", "FLUSH")
    )
    page_size: int = cli.option(16, "tokens per cache page")
    data: str | None = cli.option(None, "evaluation text (default: the shipped plays)")
    out: str = cli.option("runs/eval", "output folder (results/ only when asked)")

    def __post_init__(self):
        for b in self.budgets:
            if not (math.isfinite(b) and b > 0):
                raise ValueError(f"--budgets {b}: must be a positive bits per element")
        for u in self.uniform:
            Format.parse(u)
        if self.seq_len < 2 or self.num_windows < 1 or self.chunk < 1:
            raise ValueError(f"seq_len={self.seq_len}, windows, chunk must be positive")


def _delta_se(
    f: Callable[[float, float], float], da: np.ndarray, db: np.ndarray, eps: float = 1e-6
) -> float | None:
    """Delta-method standard error of f(mean da, mean db) from paired per-window values."""
    n = len(da)
    if n < 2:
        return None
    ma, mb = float(da.mean()), float(db.mean())
    ga = (f(ma + eps, mb) - f(ma - eps, mb)) / (2 * eps)
    gb = (f(ma, mb + eps) - f(ma, mb - eps)) / (2 * eps)
    cov = np.cov(np.stack([da, db]), ddof=1) / n
    var = ga * ga * cov[0, 0] + 2 * ga * gb * cov[0, 1] + gb * gb * cov[1, 1]
    return float(math.sqrt(max(var, 0.0)))


def _window_nll_change(lp: np.ndarray, fp_lp: np.ndarray) -> np.ndarray:  # f64[N]
    return window_nll(lp) - window_nll(fp_lp)


def compare(lp_a: np.ndarray, lp_b: np.ndarray, fp_lp: np.ndarray) -> dict:
    """Ratio of a's change to b's and their difference in points, with standard errors."""
    da, db = _window_nll_change(lp_a, fp_lp), _window_nll_change(lp_b, fp_lp)

    def ratio(x, y):
        return math.expm1(x) / math.expm1(y)

    def diff(x, y):
        return 100 * (math.expm1(x) - math.expm1(y))

    return dict(
        ratio=ratio(da.mean(), db.mean()),
        ratio_se=_delta_se(ratio, da, db),
        diff_points=diff(da.mean(), db.mean()),
        diff_points_se=_delta_se(diff, da, db),
    )


def _bpe_fields(alloc: BitAllocation, head_dim: int, cfg: BitAllocationConfig) -> dict:
    """Bits per element of `alloc` (pass the layers that hold low-bit pages only,
    `allocation.lowbit_part`)."""
    sink, keep, flush = cfg.protocol
    return dict(
        bpe_lowbit=alloc.bpe(head_dim, context=None),
        bpe_protocol=alloc.bpe(head_dim, context=cfg.seq_len, sink=sink, keep=keep, flush=flush),
        bpe_serving_32k=alloc.bpe(head_dim, **SERVING_ACCOUNTING),
    )


def main(cfg: BitAllocationConfig) -> dict:
    from eval.perplexity import score  # the same scorer loop as eval.perplexity

    text = None
    if cfg.data:
        from kvjax import assets

        text = assets.load_text(cfg.data)
    lm = load_model(cfg.model)
    d, n_layers = lm.cfg.head_dim, lm.cfg.num_layers
    # Layers without low-bit pages (Gemma 3's sliding layers keep full precision) are outside
    # the budget, the bits per element and the format counts.
    lowbit = allocation.lowbit_layers(lm.cfg)
    # The stored allocation and the errors it came from (`kvjax.calibrate --bpe-budget`).
    _, stored, meta = common.load_allocated(cfg.calib_dir, cfg.method, lm.cfg, lm.fingerprint)
    errs = {k: np.asarray(v) for k, v in meta["bit_errors"].items()}
    for b in cfg.budgets:  # every budget checked before the slow work
        allocation.check_budget(b, [Format.parse(n) for n in errs], d)
    windows = common.evaluation_windows(lm.tokenizer, cfg.seq_len, cfg.num_windows, text)
    scorer = common.TokenScorer(lm.model)
    pcfg = _ppl_cfg(cfg)

    settings: list[tuple[str, BitAllocation]] = []
    for u in cfg.uniform:
        settings.append((f"uniform {u}", BitAllocation.uniform(Format.parse(u), n_layers)))
    for b in cfg.budgets:
        settings.append((f"allocated @ {b}", allocation.allocate(errs, b, d, lowbit=lowbit)))
    if cfg.stored:
        settings.append((f"stored allocation @ {stored.budget}", stored))

    t0 = time.perf_counter()
    fp_lp = score(scorer, windows, None, None, pcfg)
    fp = perplexity(fp_lp)
    print(f"full precision: {fp:.3f}", file=sys.stderr)
    rows = [dict(name=common.FULL_PRECISION, value=fp, rel_to_fp=0.0, rel_to_fp_se=None)]
    logprobs = {}
    sink, keep, flush = cfg.protocol
    for name, alloc in settings:
        t1 = time.perf_counter()
        tf, _, _ = common.load_allocated(
            cfg.calib_dir, cfg.method, lm.cfg, lm.fingerprint, allocation=alloc
        )
        ccfg = CacheConfig(
            sink=sink,
            keep=keep,
            flush=flush,
            page_size=cfg.page_size,
            quant=alloc.layers[0][0].quant_config(),
            max_seq_len=windows.shape[1],
            layer_quant=alloc.layer_quant("oscar"),
        )
        lp = score(scorer, windows, ccfg, tf, pcfg)
        logprobs[name] = lp
        ppl = perplexity(lp)
        errsum = sum(float(errs[f.name][i][j]) for i, p in enumerate(alloc.layers) if lowbit[i]
                     for j, f in enumerate(p))  # fmt: skip
        part = allocation.lowbit_part(alloc, lowbit)
        rows.append(
            dict(
                name=name,
                value=ppl,
                rel_to_fp=ppl / fp - 1.0,
                rel_to_fp_se=paired_change_se(lp, fp_lp),
                formats=part.counts(),
                allocation=alloc.to_dict(),
                summed_calibration_error=errsum,
                seconds=time.perf_counter() - t1,
                **_bpe_fields(part, d, cfg),
            )
        )
        r = rows[-1]
        print(
            f"{name:>28}: {ppl:.3f} ({100 * r['rel_to_fp']:+.2f}%), "
            f"{r['bpe_lowbit']:.3f} BPE low-bit, {r['seconds']:.0f}s",
            file=sys.stderr,
        )
    comparisons = []
    names = [n for n, _ in settings]
    base16 = next((n for n in names if n.endswith("2b/float16")), None)
    if base16 is not None:
        for n in names:
            if n != base16:
                comparisons.append(
                    dict(a=n, b=base16, **compare(logprobs[n], logprobs[base16], fp_lp))
                )
    payload = dict(
        eval="bit_allocation",
        config=dataclasses.asdict(cfg),
        model=common.model_info(lm),
        lowbit_layers=[i for i, b in enumerate(lowbit) if b],
        environment=common.environment(),
        calibration=dict(
            dir=cfg.calib_dir,
            method=cfg.method,
            tokens=meta.get("tokens"),
            seq_len=meta.get("seq_len"),
            stored_allocation=stored.to_dict(),
            # what bit_errors measure (kvjax.calibrate --allocation-objective)
            allocation_objective=meta.get("allocation_objective", dict(objective="attention")),
        ),
        num_windows=int(len(windows)),
        seq_len=int(windows.shape[1]),
        tokens=int(windows.shape[0] * (windows.shape[1] - 1)),
        seconds=time.perf_counter() - t0,
        rows=rows,
        comparisons=comparisons,
    )
    common.write_results(cfg.out, "bit_allocation", payload, to_markdown(payload, cfg))
    return payload


def _ppl_cfg(cfg: BitAllocationConfig):
    from eval.perplexity import PerplexityConfig

    return PerplexityConfig(
        model=cfg.model,
        calib_dir=cfg.calib_dir,
        methods=(cfg.method,),
        seq_len=cfg.seq_len,
        num_windows=cfg.num_windows,
        chunk=cfg.chunk,
        protocol=cfg.protocol,
        page_size=cfg.page_size,
    )


def _pct(r: dict) -> str:
    se = r.get("rel_to_fp_se")
    return f"{100 * r['rel_to_fp']:+.2f}%" + ("" if se is None else f" ± {100 * se:.2f}")


def to_markdown(payload: dict, cfg: BitAllocationConfig) -> str:
    env = payload["environment"]
    rows = payload["rows"]
    cal = payload["calibration"]
    prot = "/".join(map(str, cfg.protocol))
    lines = [
        "# Bit allocation and 8-bit scale/zero: perplexity at equal bits per element\n",
        f"Command: `{env['command']}`  \nCommit {env['commit']}, {env['date']}, {env['machine']} "
        f"({env['cpu_count']} CPUs), jax {env['jax_version']} ({env['jax_backend']}).\n",
        f"Model {payload['model']['source']} (head_dim {payload['model']['head_dim']}); "
        f"transform `{cal['method']}` from `{cal['dir']}` ({cal['tokens']} calibration tokens, "
        f"{cal['seq_len']}-token windows), oscar quantizer with the clips calibrated per width. "
        f"Perplexity on {payload['num_windows']} x {payload['seq_len']}-token windows of "
        f"{cfg.data or 'the evaluation plays'} ({payload['tokens']} predicted tokens), "
        f"{cfg.chunk}-token chunks, cache windows {prot} (simulated paged cache). Full "
        f"precision: **{rows[0]['value']:.3f}**. Changes vs full precision ± standard error "
        f"paired over windows.\n",
        "Bits per element (`kvjax.cache.budget.cache_bpe`; codes + scale/zero, full-precision "
        "pages at 16 bits): *low-bit* = the low-bit pages alone (the budget's accounting); "
        f"*protocol* = this evaluation's {payload['seq_len']}-token windows with {prot}; "
        "*32k serving* = 32,768 tokens with windows 64/256/16.\n",
    ]
    low = payload.get("lowbit_layers")
    n_layers = payload["model"].get("num_layers")
    if low is not None and n_layers is not None and len(low) < n_layers:
        lines.append(
            f"Only layers {', '.join(map(str, low))} ({len(low)} of {n_layers}) hold low-bit "
            "pages; the other (sliding-window) layers keep full precision and are outside the "
            "budget, the bits per element and the cache counts below (their entries in "
            "`rows[].allocation.layers` are placeholders the cache never uses).\n"
        )
    table = []
    for r in rows[1:]:
        table.append(
            [
                r["name"],
                f"{r['value']:.3f}",
                _pct(r),
                f"{r['bpe_lowbit']:.3f}",
                f"{r['bpe_protocol']:.3f}",
                f"{r['bpe_serving_32k']:.3f}",
                ", ".join(f"{k} x{v}" for k, v in r["formats"].items()),
                f"{r['summed_calibration_error']:.4g}",
            ]
        )
    lines.append(
        common.markdown_table(
            [
                "cache",
                "perplexity",
                "change",
                "BPE low-bit",
                "BPE protocol",
                "BPE 32k serving",
                "(layer, K/V) caches",
                "summed calib. error",
            ],  # fmt: skip
            table,
        )
    )
    if payload["comparisons"]:
        lines.append("\nAgainst the uniform 2-bit cache with float16 scale/zero:\n")
        ct = []
        for c in payload["comparisons"]:
            rse = "" if c["ratio_se"] is None else f" ± {c['ratio_se']:.3f}"
            dse = "" if c["diff_points_se"] is None else f" ± {c['diff_points_se']:.2f}"
            ct.append([c["a"], f"{c['ratio']:.3f}{rse}", f"{c['diff_points']:+.2f}{dse}"])
        lines.append(
            common.markdown_table(
                ["cache", "change / uniform 2b/float16 change", "difference (points)"], ct
            )
        )
    how = cal.get("allocation_objective", dict(objective="attention"))
    obj = how.get("objective", "attention")
    detail = ""
    if obj != "attention":
        detail = (
            f" ({how['windows']} x {how['tokens_per_window']} tokens, cache windows "
            f"{'/'.join(map(str, how['cache_windows']))}, measured at "
            f"{', '.join(how['measured_formats'])})"
        )
    lines.append(
        "\nAllocations: formats per layer (keys / values) in `bit_allocation.json` "
        "(`rows[].allocation.layers`). The summed calibration error is the allocation's "
        f"objective (`--allocation-objective {obj}`): "
        f"{sensitivity.OBJECTIVE_TEXT.get(obj, obj)}{detail}.\n"
    )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> BitAllocationConfig:
    parser = cli.dataclass_parser(BitAllocationConfig, "python -m eval.bit_allocation", __doc__)
    return cli.dataclass_from_args(BitAllocationConfig, parser.parse_args(argv))


if __name__ == "__main__":
    cli.run(main, parse_args)
