"""Generate text with a full-precision or calibrated low-bit KV cache.

Examples:
    python -m kvjax.generate --prompt "The capital of France is" --max-new-tokens 8
    # a prompt longer than sink + keep: most of it sits in 2-bit pages
    python -m kvjax.generate --transforms runs/calib/wush --bits 2 --sink 16 --keep 32
        --prompt-file prompt.txt
    python -m kvjax.generate --model /path/to/Qwen3-8B --temperature 0.7 --top-p 0.9 --seed 1
"""

from __future__ import annotations

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
    model: str | None = cli.option(
        None, "HF checkpoint dir or .gguf (default: the shipped SmolLM2-135M-Instruct)"
    )
    prompt: str = cli.option("The capital of France is", "the prompt text")
    prompt_file: str | None = cli.option(None, "read the prompt from this UTF-8 file instead")
    max_new_tokens: int = cli.option(32, "tokens to generate")
    temperature: float = cli.option(0.0, "sampling temperature; 0 = greedy")
    top_p: float = cli.option(1.0, "nucleus sampling mass")
    seed: int = cli.option(0, "sampling seed")
    transforms: str | None = cli.option(None, "a calibrated transforms directory (needs --bits)")
    bits: int | None = cli.option(None, "low-bit KV cache width 2, 3 or 4 (none: full precision)")
    quantizer: str = cli.option(
        "oscar", "per-token quantizer", choices=("oscar", "quest", "minmax")
    )
    group_size: int | None = cli.option(None, "channels per scale/zero (none: the whole head)")
    sink: int = cli.option(64, "first tokens kept in full precision")
    keep: int = cli.option(256, "recent tokens kept in full precision")
    flush: int = cli.option(16, "tokens moved to low-bit pages at a time")
    page_size: int = cli.option(16, "tokens per cache page")
    fold_values: bool = cli.option(False, "fold the value transform into W_V / W_O")
    attention: str = cli.option(
        "reference",
        "decode attention: pure jnp or the Pallas kernels",
        choices=("reference", "pallas"),
    )
    add_bos: bool = cli.option(False, "prepend the BOS token")


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
    cli.check_paths_exist(model=cfg.model, transforms=cfg.transforms)
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
    parser = cli.dataclass_parser(GenerateConfig, "python -m kvjax.generate", __doc__)
    return cli.dataclass_from_args(GenerateConfig, parser.parse_args(argv))


if __name__ == "__main__":
    cli.run(main, parse_args)
