"""Generate text with a full-precision or calibrated low-bit KV cache.

Examples:
    python -m kvjax.generate --prompt "The capital of France is" --max-new-tokens 8
    python -m kvjax.generate --transforms runs/calib/wush --bits 2 --prompt "To be, or not"
    python -m kvjax.generate --model /path/to/Qwen3-8B --temperature 0.7 --top-p 0.9 --seed 1
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

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


def main(cfg: GenerateConfig) -> str:
    lm = load_model(cfg.model)
    if cfg.bits is None and cfg.transforms is not None:
        raise ValueError("--transforms needs --bits (the low-bit cache width)")
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
    ids = lm.tokenizer.encode(cfg.prompt, add_bos=cfg.add_bos)
    res = engine.generate(
        [ids],
        cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        seed=cfg.seed,
        eos_ids=lm.tokenizer.eos_ids,
    )
    text = lm.tokenizer.decode(res.tokens[0])
    print(cfg.prompt + text)
    print(
        f"[{mode}] prompt {len(ids)} tokens in {res.prefill_seconds:.2f}s (incl. compile); "
        f"{len(res.tokens[0])} new tokens, decode {res.decode_tokens_per_second:.1f} tokens/s",
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
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--transforms", default=None, help="calibrated transforms directory")
    p.add_argument(
        "--bits",
        type=int,
        choices=(2, 3, 4),
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
    main(parse_args())
