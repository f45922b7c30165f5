"""Perplexity of the evaluation plays with a low-bit KV cache (the WUSH-KV protocol).

    python -m eval.perplexity --windows 2                  # full grid, shipped SmolLM2
    python -m eval.perplexity --methods wush hadamard --bits 2 --quantizers oscar --windows 4
    python -m eval.perplexity --merge runs/a/perplexity.json runs/b/perplexity.json --out DIR

Protocol: non-overlapping 2048-token windows of the evaluation plays (tragedies, never seen by
calibration), each fed in 16-token chunks through the paged cache with full-precision windows
sink/keep/flush = 16/128/16 (page size 16); perplexity = exp(mean NLL) over every predicted
token. Grid: full precision, and every calibrated transform at 2, 3 and 4 bits with the oscar
and quest quantizers (each bit width uses the clips calibrated for it), plus the serving
defaults 64/256/16 at 2 bits.

Engines: `simulated` (default) runs each window in one forward whose attention mask reproduces
exactly what the chunked paged cache reads (`eval.common.WindowedQuantCache`, checked against the
real cache in the tests and, with --crosscheck-tokens, on the real model); `paged` feeds the
chunks through `kvjax.cache.paged` itself (about ten times slower on CPU).

Writes <out>/perplexity.json (one row per setting: transform, quantizer, bits, windows, metric,
value, rel_to_fp and its standard error paired over windows, rel_to_fp_se), <out>/perplexity.md,
and <out>/perplexity.png (perplexity vs bits per transform). `--data` scores a user's text
instead of the evaluation plays. `--allocation` adds each method's stored bit allocation
(`python -m kvjax.calibrate --bpe-budget`) as a column; `python -m eval.bit_allocation` compares
allocations and metadata encodings at equal bits per element. `--merge` joins runs made on the
same windows (one per bit width or group of methods) into one table, running nothing.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import sys
import time
from collections.abc import Sequence

import numpy as np

from eval import common
from kvjax import assets, cli
from kvjax.cache.paged import CacheConfig
from kvjax.cache.quantizers import QuantConfig
from kvjax.cache.transforms import KVTransforms
from kvjax.models.loading import LoadedModel, load_model

Windows = tuple[int, int, int]  # sink, keep, flush


@dataclasses.dataclass(frozen=True)
class PerplexityConfig:
    model: str | None = cli.option(None, "HF checkpoint dir or .gguf (default: shipped SmolLM2)")
    calib_dir: str = cli.option("runs/calib", "the --out folder of python -m kvjax.calibrate")
    methods: tuple[str, ...] = cli.option(common.ALL_METHODS, "transforms to evaluate")
    bits: tuple[int, ...] = cli.option((2, 3, 4), "code widths")
    quantizers: tuple[str, ...] = cli.option(("oscar", "quest"), "oscar, quest, minmax")
    seq_len: int = cli.option(2048, "tokens per evaluation window")
    num_windows: int = cli.option(2, "evaluation windows", flag="--windows")
    chunk: int = cli.option(16, "tokens per forward call")
    batch_size: int = cli.option(1, "windows per model call")
    protocol: Windows = cli.option(
        (16, 128, 16), "WUSH-KV perplexity windows", metavar=("SINK", "KEEP", "FLUSH")
    )
    serving: Windows | None = cli.option(
        (64, 256, 16),
        "serving windows of the extra column (oscar quantizer)",
        metavar=("SINK", "KEEP", "FLUSH"),
        none_flag="--no-serving",
    )
    serving_bits: tuple[int, ...] = cli.option((2,), "code widths of the serving column")
    page_size: int = cli.option(16, "tokens per cache page")
    engine: str = cli.option(
        "simulated", "the simulated cache or the real paged one", choices=("simulated", "paged")
    )
    crosscheck_tokens: int = cli.option(
        0, ">0: also run wush at 2 bits through the real paged cache"
    )
    data: str | None = cli.option(
        None, "evaluation text (.txt, dir of .txt, .jsonl, .parquet); default: the shipped plays"
    )
    allocation: bool = cli.option(
        False,
        "also score each method's stored bit allocation (kvjax.calibrate --bpe-budget; oscar "
        "quantizer, protocol windows): rows with bits 'allocated'",
    )
    out: str = cli.option("runs/eval", "output folder (results/ only when asked)")
    plot: bool = cli.option(True, "write the PNG plot")
    merge: tuple[str, ...] = cli.option(
        (),
        "perplexity.json files of runs on the same windows (model, text, window length and "
        "count, chunk, engine, protocol) to join into <out>/perplexity.{json,md,png}; nothing "
        "is run",
    )

    def __post_init__(self):
        common.check_methods(self.methods)
        for b in self.bits + self.serving_bits:
            if b not in (2, 3, 4):
                raise ValueError(f"bits={b}; supported 2, 3, 4")
        for q in self.quantizers:
            if q not in ("oscar", "quest", "minmax"):
                raise ValueError(f"quantizer={q!r}; use oscar, quest or minmax")
        if self.engine not in ("simulated", "paged"):
            raise ValueError(f"engine={self.engine!r}; use 'simulated' or 'paged'")
        if self.seq_len < 2 or self.num_windows < 1 or self.batch_size < 1 or self.chunk < 1:
            raise ValueError(
                f"seq_len={self.seq_len}, num_windows={self.num_windows}, "
                f"batch_size={self.batch_size}, chunk={self.chunk} must be positive "
                f"(seq_len >= 2)"
            )


def cache_config(
    windows: Windows, page_size: int, quant: QuantConfig | None, seq_len: int
) -> CacheConfig:
    sink, keep, flush = windows
    return CacheConfig(
        sink=sink, keep=keep, flush=flush, page_size=page_size, quant=quant, max_seq_len=seq_len
    )


def window_name(windows: Windows) -> str:
    return "/".join(str(x) for x in windows)


def score(
    scorer: common.TokenScorer,
    windows: np.ndarray,  # i32[N, T]
    cache_cfg: CacheConfig | None,
    transforms: KVTransforms | None,
    cfg: PerplexityConfig,
    engine: str | None = None,
) -> np.ndarray:  # f32[N, T-1] log-probabilities of the next token
    """Next-token log-probabilities of every window, `batch_size` windows per call."""
    engine = engine or cfg.engine
    out = []
    for i in range(0, len(windows), cfg.batch_size):
        batch = windows[i : i + cfg.batch_size]
        if engine == "paged" and cache_cfg is not None:
            out.append(scorer.chunked(batch, cache_cfg, transforms, cfg.chunk))
        else:
            out.append(scorer.one_pass(batch, cache_cfg, transforms, cfg.chunk))
    return np.concatenate(out, axis=0)


def perplexity(logprobs: np.ndarray) -> float:
    return float(math.exp(-float(np.mean(logprobs, dtype=np.float64))))


def window_nll(logprobs: np.ndarray) -> np.ndarray:
    """f64[W]: each window's mean negative log-likelihood (what the paired errors pair)."""
    return -logprobs.mean(axis=1, dtype=np.float64)


def paired_change(nll: np.ndarray, base_nll: np.ndarray) -> tuple[float, float | None]:
    """(relative perplexity change of one setting against a base on the same windows, its
    standard error paired over windows).

    The change is exp(mean_w d_w) - 1 with d_w a window's mean NLL minus the base's on the
    same window (windows have equal token counts); its delta-method standard error is
    exp(mean d) * std(d) / sqrt(N). None with one window.
    """
    d = np.asarray(nll, np.float64) - np.asarray(base_nll, np.float64)
    se = None if len(d) < 2 else float(math.exp(d.mean()) * d.std(ddof=1) / math.sqrt(len(d)))
    return float(math.expm1(d.mean())), se


def paired_change_se(logprobs: np.ndarray, fp_logprobs: np.ndarray) -> float | None:
    """Standard error of the relative perplexity change vs full precision, paired over windows
    (`paired_change`)."""
    return paired_change(window_nll(logprobs), window_nll(fp_logprobs))[1]


def run_grid(cfg: PerplexityConfig, lm: LoadedModel, windows: np.ndarray) -> list[dict]:
    """Every row of the grid, full precision first."""
    scorer = common.TokenScorer(lm.model)
    n_tok = int(windows.shape[0] * (windows.shape[1] - 1))
    base = dict(
        num_windows=int(len(windows)),
        seq_len=int(windows.shape[1]),
        tokens=n_tok,
        metric="perplexity",
        engine=cfg.engine,
        chunk=cfg.chunk,
    )
    rows = []
    t0 = time.perf_counter()
    fp_lp = score(scorer, windows, None, None, cfg)
    fp = perplexity(fp_lp)
    rows.append(
        dict(
            transform=common.FULL_PRECISION,
            quantizer=None,
            bits=None,
            windows=None,
            value=fp,
            rel_to_fp=0.0,
            rel_to_fp_se=None,
            seconds=time.perf_counter() - t0,
            window_nll=window_nll(fp_lp).tolist(),
            **base,
        )
    )
    print(f"full precision: {fp:.3f}", file=sys.stderr)

    settings = [(q, b, cfg.protocol) for q in cfg.quantizers for b in cfg.bits]
    if cfg.serving is not None:
        settings += [("oscar", b, cfg.serving) for b in cfg.serving_bits]
    transforms_cache: dict[tuple[str, int], KVTransforms] = {}
    for quantizer, bits, win in settings:
        ccfg = cache_config(
            win, cfg.page_size, QuantConfig(method=quantizer, bits=bits), windows.shape[1]
        )
        for method in cfg.methods:
            key = (method, bits)
            if key not in transforms_cache:
                transforms_cache[key] = common.load_method(
                    cfg.calib_dir, method, bits, lm.cfg, lm.fingerprint
                )
            t0 = time.perf_counter()
            lp = score(scorer, windows, ccfg, transforms_cache[key], cfg)
            ppl = perplexity(lp)
            se = paired_change_se(lp, fp_lp)
            rows.append(
                dict(
                    transform=method,
                    quantizer=quantizer,
                    bits=bits,
                    windows=window_name(win),
                    value=ppl,
                    rel_to_fp=ppl / fp - 1.0,
                    rel_to_fp_se=se,
                    seconds=time.perf_counter() - t0,
                    window_nll=window_nll(lp).tolist(),
                    **base,
                )
            )
            print(
                f"{method:>18} {quantizer:>6} {bits}b {window_name(win):>10}: {ppl:.3f} "
                f"({100 * (ppl / fp - 1):+.2f}%) {time.perf_counter() - t0:.0f}s",
                file=sys.stderr,
            )
    if cfg.allocation:
        for method in cfg.methods:
            tf, alloc, _ = common.load_allocated(cfg.calib_dir, method, lm.cfg, lm.fingerprint)
            ccfg = dataclasses.replace(
                cache_config(cfg.protocol, cfg.page_size, QuantConfig(), windows.shape[1]),
                layer_quant=alloc.layer_quant("oscar"),
            )
            t0 = time.perf_counter()
            lp = score(scorer, windows, ccfg, tf, cfg)
            ppl = perplexity(lp)
            rows.append(
                dict(
                    transform=method,
                    quantizer="oscar",
                    bits="allocated",
                    windows=window_name(cfg.protocol),
                    value=ppl,
                    rel_to_fp=ppl / fp - 1.0,
                    rel_to_fp_se=paired_change_se(lp, fp_lp),
                    seconds=time.perf_counter() - t0,
                    allocation=alloc.to_dict(),
                    bpe_lowbit=alloc.bpe(lm.cfg.head_dim, context=None),
                    window_nll=window_nll(lp).tolist(),
                    **base,
                )
            )
            print(
                f"{method:>18} allocated @ {alloc.budget} BPE: {ppl:.3f} "
                f"({100 * (ppl / fp - 1):+.2f}%)",
                file=sys.stderr,
            )
    return rows


def crosscheck(cfg: PerplexityConfig, lm: LoadedModel, windows: np.ndarray) -> dict:
    """wush at 2 bits (oscar quantizer, protocol windows) through both engines on a prefix."""
    n = min(cfg.crosscheck_tokens, windows.shape[1])
    w = windows[:1, :n]
    method = "wush" if "wush" in cfg.methods else cfg.methods[0]
    tf = common.load_method(cfg.calib_dir, method, 2, lm.cfg, lm.fingerprint)
    ccfg = cache_config(cfg.protocol, cfg.page_size, QuantConfig(method="oscar", bits=2), n)
    scorer = common.TokenScorer(lm.model)
    t0 = time.perf_counter()
    sim = scorer.one_pass(w, ccfg, tf, cfg.chunk)
    t1 = time.perf_counter()
    paged = scorer.chunked(w, ccfg, tf, cfg.chunk)
    t2 = time.perf_counter()
    return dict(
        transform=method,
        quantizer="oscar",
        bits=2,
        windows=window_name(cfg.protocol),
        tokens=int(n - 1),
        ppl_simulated=perplexity(sim),
        ppl_paged=perplexity(paged),
        max_abs_logprob_diff=float(np.max(np.abs(sim - paged))),
        seconds_simulated=t1 - t0,
        seconds_paged=t2 - t1,
    )


def cell(r: dict) -> str:
    """perplexity (change vs full precision ± its paired standard error over windows)."""
    se, rel = r.get("rel_to_fp_se"), r["rel_to_fp"]
    pm = "" if se is None else f" ± {100 * se:.{1 if se >= 0.001 else 2}f}"  # 4 bits: ~0.05
    return f"{r['value']:.2f} ({100 * rel:+.{1 if abs(rel) >= 0.01 else 2}f}%{pm})"


def to_markdown(rows: list[dict], cfg: PerplexityConfig, extra: dict) -> str:
    fp = rows[0]["value"]
    n_win, n_tok = rows[0]["num_windows"], rows[0]["tokens"]
    lines = [
        f"Perplexity on {n_win} x {rows[0]['seq_len']}-token windows of "
        f"{cfg.data or 'the evaluation plays'} ({n_tok} predicted tokens), {cfg.chunk}-token "
        f"chunks, engine `{cfg.engine}`. Full precision: **{fp:.3f}**. Cells: perplexity "
        f"(change vs full precision ± its standard error, paired over windows).\n"
    ]
    prot = window_name(cfg.protocol)
    cols = [(q, b) for q in cfg.quantizers for b in cfg.bits]
    header = ["transform"] + [f"{q} {b}b" for q, b in cols]
    serv = window_name(cfg.serving) if cfg.serving is not None else None
    if serv is not None:
        header += [f"oscar {b}b @ {serv}" for b in cfg.serving_bits]
    if cfg.allocation:
        header.append("oscar allocated")
    by = {(r["transform"], r["quantizer"], r["bits"], r["windows"]): r for r in rows[1:]}
    table = []
    for m in cfg.methods:
        cells = [m]
        keys = [(m, q, b, prot) for q, b in cols]
        if serv is not None:
            keys += [(m, "oscar", b, serv) for b in cfg.serving_bits]
        if cfg.allocation:
            keys.append((m, "oscar", "allocated", prot))
        for k in keys:
            r = by.get(k)
            cells.append("-" if r is None else cell(r))
        table.append(cells)
    lines.append(
        f"Windows sink/keep/flush = {prot}"
        + (f"; last column(s): serving defaults {serv}" if serv else "")
        + ".\n"
    )
    lines.append(common.markdown_table(header, table))
    pairs = method_pairs(rows)
    if pairs:
        lines.append(
            "Neighbouring methods of each column against each other (ranked by perplexity; the "
            "change of the worse against the better, ± its standard error paired over windows; "
            "rows measured before per-window values were kept have none):\n"
        )
        lines += [f"- {p}" for p in pairs]
    if extra.get("crosscheck"):
        c = extra["crosscheck"]
        lines.append(
            f"\nEngine cross-check ({c['transform']}, {c['quantizer']} {c['bits']}b, "
            f"{c['windows']}, first {c['tokens'] + 1} tokens of window 0): simulated "
            f"{c['ppl_simulated']:.4f} vs real paged cache {c['ppl_paged']:.4f}, max "
            f"|log p| difference {c['max_abs_logprob_diff']:.2e} ({c['seconds_simulated']:.0f}s "
            f"vs {c['seconds_paged']:.0f}s).\n"
        )
    return "\n".join(lines)


def method_pairs(rows: list[dict]) -> list[str]:
    """For each (quantizer, bits, windows) column, each quantized method against the next
    better one, where both rows keep their per-window NLLs: "oscar 2b 16/128/16: kv_pca vs
    wush +0.87% ± 0.21"."""
    cols: dict[tuple, list[dict]] = {}
    for r in rows[1:]:
        if r.get("window_nll") and r["transform"] != "identity":
            cols.setdefault((r["quantizer"], r["bits"], r["windows"]), []).append(r)
    out = []
    for (q, b, w), rs in cols.items():
        rs = sorted(rs, key=lambda r: r["value"])
        for better, worse in zip(rs, rs[1:]):
            change, se = paired_change(worse["window_nll"], better["window_nll"])
            pm = "" if se is None else f" ± {100 * se:.2f}"
            out.append(
                f"{q} {b}b {w}: {worse['transform']} vs {better['transform']} "
                f"{100 * change:+.2f}%{pm}"
            )
    return out


def plot(rows: list[dict], cfg: PerplexityConfig, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fp = rows[0]["value"]
    prot = window_name(cfg.protocol)
    fig, axes = plt.subplots(
        1, len(cfg.quantizers), figsize=(5.5 * len(cfg.quantizers), 4.2), squeeze=False
    )
    for ax, q in zip(axes[0], cfg.quantizers):
        for m in cfg.methods:
            pts = sorted(
                (r["bits"], r["value"])
                for r in rows[1:]
                if r["transform"] == m
                and r["quantizer"] == q
                and r["windows"] == prot
                and isinstance(r["bits"], int)  # not the 'allocated' rows
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", label=m)
        ax.axhline(fp, color="k", ls="--", lw=1, label="full precision")
        ax.set_yscale("log")
        ax.set_xticks(list(cfg.bits))
        ax.set_xlabel("bits")
        ax.set_ylabel("perplexity")
        ax.set_title(f"{q} quantizer, windows {prot}")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# What makes two runs' rows comparable: the same windows of the same text through the same
# model and cache protocol (each row's change and its standard error are paired with its own
# run's full-precision row, which must then agree).
_SAME_WINDOWS = ("seq_len", "num_windows", "chunk", "engine", "protocol", "page_size", "data")
_FP_AGREEMENT = 1e-5  # relative; runs on other commits agree to ~1e-7 (float32 sums)


def merge_runs(paths: Sequence[str], out: str, plot_png: bool = True) -> dict:
    """Joins the rows of perplexity.json files measured on the same windows into
    <out>/perplexity.{json,md,png}; a setting found in several files keeps the first. Fails,
    naming the file and the field, where a run's windows, model or full-precision value differ
    from the first file's."""
    payloads = common.read_runs(paths, "perplexity")
    first = payloads[0]
    fp = first["rows"][0]["value"]
    for p, q in zip(paths[1:], payloads[1:]):
        for k in _SAME_WINDOWS:
            if q["config"].get(k) != first["config"].get(k):
                raise ValueError(
                    f"--merge {p}: {k}={q['config'].get(k)!r}, but {paths[0]} has "
                    f"{first['config'].get(k)!r}"
                )
        if abs(q["rows"][0]["value"] - fp) > _FP_AGREEMENT * fp:
            raise ValueError(
                f"--merge {p}: full precision {q['rows'][0]['value']:.6f}, {paths[0]} has "
                f"{fp:.6f}: not the same windows"
            )
    rows, seen = [first["rows"][0]], set()
    for r in (r for q in payloads for r in q["rows"][1:]):
        key = (r["transform"], r["quantizer"], r["bits"], r["windows"])
        if key not in seen:
            seen.add(key)
            rows.append(r)
    conf = first["config"]
    kw = common.config_fields(conf, PerplexityConfig)
    prot = window_name(tuple(conf["protocol"]))
    present = {r["transform"] for r in rows[1:]}
    serving = next((q["config"]["serving"] for q in payloads if q["config"]["serving"]), None)
    kw.update(
        methods=tuple(m for m in common.ALL_METHODS if m in present),
        bits=tuple(sorted({r["bits"] for r in rows[1:] if r["windows"] == prot} - {"allocated"})),
        quantizers=tuple(dict.fromkeys(r["quantizer"] for r in rows[1:] if r["windows"] == prot)),
        serving=None if serving is None else tuple(serving),
        serving_bits=tuple(sorted({r["bits"] for r in rows[1:] if r["windows"] != prot}) or (2,)),
        allocation=any(q["config"].get("allocation") for q in payloads),
        calib_dir=None,
        merge=tuple(paths),
        out=out,
        plot=plot_png,
    )
    cfg = PerplexityConfig(**kw)
    payload = dict(
        first,
        config=dataclasses.asdict(cfg),
        environment=common.environment(),
        seconds=sum(q["seconds"] for q in payloads),
        merged=[
            dict(path=str(p), calib_dir=q["config"]["calib_dir"], environment=q["environment"])
            for p, q in zip(paths, payloads)
        ],
        rows=rows,
    )
    payload.pop("crosscheck", None)
    common.write_results(out, "perplexity", payload, to_markdown(rows, cfg, {}))
    if cfg.plot:
        plot(rows, cfg, pathlib.Path(out) / "perplexity.png")
    return payload


def main(cfg: PerplexityConfig, lm: LoadedModel | None = None) -> dict:
    """Runs the grid and writes perplexity.{json,md,png} under cfg.out; returns the payload."""
    if cfg.merge:
        return merge_runs(cfg.merge, cfg.out, cfg.plot)
    text = assets.load_text(cfg.data) if cfg.data else None  # a bad file fails before the model
    lm = lm or load_model(cfg.model)
    windows = common.evaluation_windows(lm.tokenizer, cfg.seq_len, cfg.num_windows, text)
    t0 = time.perf_counter()
    rows = run_grid(cfg, lm, windows)
    extra = {}
    if cfg.crosscheck_tokens > 0:
        extra["crosscheck"] = crosscheck(cfg, lm, windows)
    payload = dict(
        eval="perplexity",
        config=dataclasses.asdict(cfg),
        model=common.model_info(lm),
        environment=common.environment(),
        seconds=time.perf_counter() - t0,
        rows=rows,
        **extra,
    )
    common.write_results(cfg.out, "perplexity", payload, to_markdown(rows, cfg, extra))
    if cfg.plot:
        plot(rows, cfg, pathlib.Path(cfg.out) / "perplexity.png")
    return payload


def parse_args(argv: Sequence[str] | None = None) -> PerplexityConfig:
    parser = cli.dataclass_parser(PerplexityConfig, "python -m eval.perplexity", __doc__)
    return cli.dataclass_from_args(PerplexityConfig, parser.parse_args(argv))


if __name__ == "__main__":
    cli.run(main, parse_args)
