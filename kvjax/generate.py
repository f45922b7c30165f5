"""Generate text with a full-precision or calibrated low-bit KV cache.

Examples:
    python -m kvjax.generate --prompt "The capital of France is" --max-new-tokens 8
    python -m kvjax.generate --transforms runs/calib/wush --bits 2 --sink 16 --keep 32 \
        --prompt-file prompt.txt   # a prompt past sink + keep: its middle sits in 2-bit pages
    python -m kvjax.generate --model /path/to/Qwen3-8B --temperature 0.7 --top-p 0.9 --seed 1
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

from kvjax import assets, cli
from kvjax.cache.paged import CacheConfig
from kvjax.cache.quantizers import QuantConfig
from kvjax.cache.transforms import fold_value_transforms
from kvjax.models.loading import load_model
from kvjax.serving.engine import Engine
from kvjax.storage import load_transforms


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    model: str | None = None  # HF checkpoint dir or .gguf; None = shipped SmolLM2
    prompt: str = "The capital of France is"
    prompt_file: str | None = None  # read the prompt from this UTF-8 file instead
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    transforms: str | None = None  # a calibrated transforms checkpoint directory
    bits: int | None = None  # low-bit cache (2, 3, 4); None = full-precision dense cache
    quantizer: str = "oscar"
    group_size: int | None = None
    sink: int = 64
    keep: int = 256
    flush: int = 16
    page_size: int = 16
    fold_values: bool = False  # fold the value transform into W_V / W_O
    attention: str = "reference"  # or "pallas" (decode kernels)
    add_bos: bool = False


def validate(cfg: GenerateConfig) -> None:
    """Every check that needs no model, before anything loads; raises `cli.UsageError`."""
    cli.check(cfg.max_new_tokens > 0, f"--max-new-tokens {cfg.max_new_tokens}: must be > 0")
    cli.check(cfg.temperature >= 0, f"--temperature {cfg.temperature}: must be >= 0")
    cli.check(0 < cfg.top_p <= 1, f"--top-p {cfg.top_p}: must be in (0, 1]")
    cli.check(cfg.bits in (None, 2, 3, 4), f"--bits {cfg.bits}: supported 2, 3, 4")
    cli.check(
        cfg.bits is not None or cfg.transforms is None,
        "--transforms needs --bits (the low-bit cache width)",
    )
    for flag, v in (("--page-size", cfg.page_size), ("--flush", cfg.flush)):
        cli.check(v > 0, f"{flag} {v}: must be > 0")
    cli.check(cfg.sink >= 0 and cfg.keep >= 0, f"--sink {cfg.sink} / --keep {cfg.keep}: >= 0")
    for flag, v in (("--sink", cfg.sink), ("--flush", cfg.flush)):
        cli.check(
            v % cfg.page_size == 0, f"{flag} {v} must be a multiple of --page-size {cfg.page_size}"
        )
    cli.check(
        cfg.group_size is None or cfg.group_size > 0, f"--group-size {cfg.group_size}: must be > 0"
    )
    for flag, path in (("--model", cfg.model), ("--transforms", cfg.transforms)):
        cli.check(
            path is None or pathlib.Path(path).expanduser().exists(),
            f"{flag} {path!r} does not exist",
        )
    cli.check(
        cfg.prompt_file is None or pathlib.Path(cfg.prompt_file).is_file(),
        f"--prompt-file {cfg.prompt_file!r} is not a file",
    )


def main(cfg: GenerateConfig) -> str:
    validate(cfg)
    prompt = cfg.prompt
    if cfg.prompt_file is not None:
        prompt = assets.load_text(cfg.prompt_file)
    lm = load_model(cfg.model)
    if cfg.group_size is not None:
        cli.check(
            lm.cfg.head_dim % cfg.group_size == 0,
            f"--group-size {cfg.group_size} must divide the model's head_dim={lm.cfg.head_dim}",
        )
    if cfg.bits is None:
        engine = Engine(lm.model, cache_kind="dense")
        mode = "full-precision cache"
    else:
        if cfg.transforms is not None:
            tf, meta = load_transforms(cfg.transforms, lm.cfg, lm.fingerprint)
            method = meta.get("method", "?")
        else:
            from kvjax.cache.transforms import KVTransforms

            tf, method = KVTransforms.identity(lm.cfg), "identity"
        if cfg.fold_values:
            tf = fold_value_transforms(lm.model, tf)
        qc = QuantConfig(method=cfg.quantizer, bits=cfg.bits, group_size=cfg.group_size)
        ccfg = CacheConfig(
            sink=cfg.sink,
            keep=cfg.keep,
            flush=cfg.flush,
            page_size=cfg.page_size,
            quant=qc,
            attention=cfg.attention,
        )
        engine = Engine(lm.model, cache_kind="paged", transforms=tf, cache_cfg=ccfg)
        mode = f"{cfg.bits}-bit {cfg.quantizer} cache, transforms={method}"
    ids = lm.tokenizer.encode(prompt, add_bos=cfg.add_bos)
    res = engine.generate(
        [ids],
        cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        seed=cfg.seed,
        eos_ids=lm.tokenizer.eos_ids,
    )
    text = lm.tokenizer.decode(res.tokens[0])
    print(prompt + text)
    print(
        f"[{mode}] prompt {len(ids)} tokens in {res.prefill_seconds:.2f}s (incl. compile); "
        f"{len(res.tokens[0])} new tokens, decode {res.decode_tokens_per_second:.1f} tokens/s",
        file=sys.stderr,
    )
    if cfg.bits is not None:
        total = len(ids) + len(res.tokens[0])
        low = ccfg.quant_end(total) - min(ccfg.sink, total)
        note = (
            ""
            if low
            else f" (sequence within sink {cfg.sink} + keep {cfg.keep}: use a longer prompt)"
        )
        print(
            f"[{mode}] {low} of {total} cached tokens in {cfg.bits}-bit pages{note}",
            file=sys.stderr,
        )
    return text


def parse_args(argv=None) -> GenerateConfig:
    p = argparse.ArgumentParser(
        prog="python -m kvjax.generate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = GenerateConfig()
    p.add_argument(
        "--model",
        default=d.model,
        help="HF checkpoint dir or .gguf (default: shipped SmolLM2-135M-Instruct)",
    )
    p.add_argument("--prompt", default=d.prompt)
    p.add_argument("--prompt-file", default=None, help="read the prompt from a UTF-8 file")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--transforms", default=None, help="calibrated transforms directory")
    p.add_argument(
        "--bits",
        type=int,
        default=None,
        help="low-bit KV cache width (default: full-precision cache)",
    )
    p.add_argument("--quantizer", choices=("oscar", "quest", "minmax"), default=d.quantizer)
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--sink", type=int, default=d.sink)
    p.add_argument("--keep", type=int, default=d.keep)
    p.add_argument("--flush", type=int, default=d.flush)
    p.add_argument("--page-size", type=int, default=d.page_size)
    p.add_argument("--fold-values", action="store_true")
    p.add_argument("--attention", choices=("reference", "pallas"), default=d.attention)
    p.add_argument("--add-bos", action="store_true")
    a = p.parse_args(argv)
    return GenerateConfig(
        **{f.name: getattr(a, f.name) for f in dataclasses.fields(GenerateConfig)}
    )


if __name__ == "__main__":
    cli.run(main, parse_args)
