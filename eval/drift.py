"""Does the drift check fire on text unlike the calibration text, and stay quiet on its kind?

    python -m eval.drift --transforms runs/calib/wush                  # shipped model and texts
    python -m eval.drift --transforms runs/calib/wush --data my_traffic.txt

Serves windows of each text through `kvjax.Engine` with `EngineConfig(drift_check=True)` and the
calibrated 2-bit cache, and prints `Engine.drift_report` against the reference stored with the
transforms (`kvjax.serving.drift`). Texts: `heldout`, the evaluation plays (disjoint from the
calibration plays, same kind of text); `code`, the Python source of the standard library's
`asyncio` package (the same on every Python 3.11); `shuffled`, the held-out plays' tokens in a
random order (same token frequencies, no language); and `--data` files. The transforms must
carry a drift reference (calibrated by this kvjax).

Writes <out>/drift.json and <out>/drift.md: per text and layer the key and value scores, the
maximum, and the layers over `drift.THRESHOLD`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import pathlib
import time

import numpy as np

from calib.data import token_windows
from eval import common
from kvjax import assets, cli
from kvjax.cache.paged import CacheConfig
from kvjax.cache.quantizers import QuantConfig
from kvjax.models.loading import LoadedModel, load_model
from kvjax.serving import drift
from kvjax.serving.engine import Engine, EngineConfig
from kvjax.storage import load_drift_reference, load_transforms


@dataclasses.dataclass(frozen=True)
class DriftConfig:
    transforms: str = cli.option("runs/calib/wush", "a transforms checkpoint (one method)")
    model: str | None = cli.option(
        None, "HF checkpoint dir, .gguf or asset name (default: SmolLM2)"
    )
    data: tuple[str, ...] = cli.option((), "extra texts to score (.txt, dir, .jsonl, .parquet)")
    windows: int = cli.option(4, "windows served per text")
    seq_len: int = cli.option(512, "tokens per window")
    bits: int = cli.option(2, "code width of the cache", choices=(2, 3, 4))
    seed: int = cli.option(0, "seed of the shuffled text")
    out: str = cli.option("runs/eval", "output folder (results/ only when asked)")


def code_text(package: str = "asyncio") -> str:
    """The Python source of a stdlib package's top-level `*.py` files, joined in name order
    (`python -c "from eval.drift import code_text; print(code_text('email'))" > email.txt`)."""
    mod = asyncio if package == "asyncio" else importlib.import_module(package)
    root = pathlib.Path(mod.__file__).parent
    return "\n\n".join(p.read_text() for p in sorted(root.glob("*.py")))


def prose_text(part: str = "evaluation") -> str:
    """English prose of another kind than the plays: the Python language reference's topics
    (the stdlib's `pydoc_data.topics`), in topic-name order; ``part`` "calibration" is the
    first half of the topics, "evaluation" the second, so the two never share text
    (`python -c "from eval.drift import prose_text; print(prose_text('calibration'))"`)."""
    from pydoc_data import topics

    names = sorted(topics.topics)
    halves = {"calibration": names[: len(names) // 2], "evaluation": names[len(names) // 2 :]}
    if part not in halves:
        raise ValueError(f"part={part!r} must be 'calibration' or 'evaluation'")
    return "\n\n".join(topics.topics[k] for k in halves[part])


def main(c: DriftConfig, lm: LoadedModel | None = None) -> dict:
    cli.check(c.windows >= 1 and c.seq_len >= 16, "--windows >= 1 and --seq-len >= 16")
    ref = load_drift_reference(c.transforms)  # before the model: a file without one fails fast
    texts = {f"data:{p}": assets.load_text(p) for p in c.data}
    lm = lm or load_model(c.model)
    tf, meta = load_transforms(c.transforms, lm.cfg, lm.fingerprint)
    n = c.windows
    heldout = token_windows(assets.load_text(None, split="evaluation"), lm.tokenizer, c.seq_len, n)
    windows = {
        "heldout": heldout,
        "code": token_windows(code_text(), lm.tokenizer, c.seq_len, n, "asyncio source"),
        "shuffled": np.random.default_rng(c.seed)
        .permutation(heldout.reshape(-1))
        .reshape(heldout.shape),
    }
    for name, text in texts.items():
        windows[name] = token_windows(text, lm.tokenizer, c.seq_len, n, name)
    ccfg = CacheConfig(
        sink=64, keep=256, flush=16, page_size=16, quant=QuantConfig(bits=c.bits),
        max_seq_len=c.seq_len + 16,
    )  # fmt: skip
    ecfg = EngineConfig(
        max_seqs=n, prefill_chunk=128, prefill_tokens_per_step=128 * n, drift_check=True,
        prefix_sharing=False,
    )  # fmt: skip
    rows = []
    for name, w in windows.items():
        t0 = time.perf_counter()
        eng = Engine(lm.model, cache_kind="paged", transforms=tf, cache_cfg=ccfg, engine_cfg=ecfg)
        eng.generate(w.tolist(), 1)
        rep = eng.drift_report(ref)
        rows.append(dict(text=name, windows=len(w), seconds=round(time.perf_counter() - t0, 1),
                         **rep))  # fmt: skip
        print(f"{name:>10}: max {rep['max']:.3f}, flagged {len(rep['flagged_layers'])} of "
              f"{len(rep['k'])} layers ({rows[-1]['seconds']} s)", flush=True)  # fmt: skip
    payload = dict(
        **common.environment(),
        config=dataclasses.asdict(c),
        method=meta.get("method"),
        calibration_data=meta.get("data"),
        threshold=drift.THRESHOLD,
        rows=rows,
    )
    header = ["text", "windows x tokens", "max score", "mean key score", "mean value score",
              "layers over threshold", "s"]  # fmt: skip
    table = [
        [r["text"], f"{r['windows']} x {c.seq_len}", r["max"], round(float(np.mean(r["k"])), 3),
         round(float(np.mean(r["v"])), 3), f"{len(r['flagged_layers'])} / {len(r['k'])}",
         r["seconds"]]
        for r in rows
    ]  # fmt: skip
    md = (
        f"# drift check\n\n`{payload['command']}` at {payload['commit']}, {payload['date']}, "
        f"jax {payload['jax_version']}; transforms {meta.get('method')} calibrated on "
        f"{meta.get('data')}; {c.bits}-bit cache; threshold {drift.THRESHOLD}\n\n"
        + common.markdown_table(header, table)
    )
    jpath, _ = common.write_results(c.out, "drift", payload, md)
    print(md, "->", jpath)
    return payload


def parse_args(argv=None) -> DriftConfig:
    parser = cli.dataclass_parser(DriftConfig, "python -m eval.drift", __doc__)
    return cli.dataclass_from_args(DriftConfig, parser.parse_args(argv))


if __name__ == "__main__":
    cli.run(main, parse_args)
