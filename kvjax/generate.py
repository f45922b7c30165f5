"""Generate text with a full-precision or calibrated low-bit KV cache.

Examples:
    python -m kvjax.generate --prompt "The capital of France is" --max-new-tokens 8
    # a prompt longer than sink + keep: most of it sits in 2-bit pages
    python -m kvjax.generate --transforms runs/calib/wush --bits 2 --sink 16 --keep 32
        --prompt-file prompt.txt
    python -m kvjax.generate --model /path/to/Qwen3-8B --temperature 0.7 --top-p 0.9 --seed 1
    # many prompts (one per line) served as one batch by the engine, with continuous batching
    python -m kvjax.generate --prompts-file prompts.txt --max-seqs 8 --bits 2
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
from kvjax.serving.engine import Engine, EngineConfig
from kvjax.serving.sampling import SamplingParams
from kvjax.storage import load_transforms


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    model: str | None = cli.option(
        None, "HF checkpoint dir or .gguf (default: the shipped SmolLM2-135M-Instruct)"
    )
    prompt: str = cli.option("The capital of France is", "the prompt text")
    prompt_file: str | None = cli.option(None, "read the prompt from this UTF-8 file instead")
    prompts_file: str | None = cli.option(
        None, "a UTF-8 file of prompts, one per line, served together as requests"
    )
    max_new_tokens: int = cli.option(32, "tokens to generate")
    temperature: float = cli.option(0.0, "sampling temperature; 0 = greedy")
    top_p: float = cli.option(1.0, "nucleus sampling mass")
    top_k: int = cli.option(0, "sample among the k most likely tokens; 0 = off")
    max_seqs: int = cli.option(8, "requests decoded at once")
    decode_steps: int = cli.option(16, "decode steps per host sync")
    kv_memory_gb: float | None = cli.option(
        None, "GiB for the cache pools (default: sized so every request reaches its full length)"
    )
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
    add_bos: bool | None = cli.option(
        None, "prepend the BOS token (default: what the model's tokenizer metadata says)"
    )


def validate(cfg: GenerateConfig) -> None:
    """Every check that needs no model, before anything loads; raises `cli.UsageError`."""
    cli.check(cfg.max_new_tokens > 0, f"--max-new-tokens {cfg.max_new_tokens}: must be > 0")
    cli.check(cfg.temperature >= 0, f"--temperature {cfg.temperature}: must be >= 0")
    cli.check(0 < cfg.top_p <= 1, f"--top-p {cfg.top_p}: must be in (0, 1]")
    cli.check(cfg.top_k >= 0, f"--top-k {cfg.top_k}: must be >= 0")
    for flag, v in (("--max-seqs", cfg.max_seqs), ("--decode-steps", cfg.decode_steps)):
        cli.check(v >= 1, f"{flag} {v}: must be >= 1")
    cli.check(
        cfg.kv_memory_gb is None or cfg.kv_memory_gb > 0,
        f"--kv-memory-gb {cfg.kv_memory_gb}: must be > 0",
    )
    cli.check(
        cfg.prompt_file is None or cfg.prompts_file is None,
        "--prompt-file and --prompts-file: give one",
    )
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
    shipped = cfg.model in assets.MODELS  # a shipped model's name, fetched on first use
    cli.check_paths_exist(model=None if shipped else cfg.model, transforms=cfg.transforms)
    for flag, path in (("--prompt-file", cfg.prompt_file), ("--prompts-file", cfg.prompts_file)):
        cli.check(path is None or pathlib.Path(path).is_file(), f"{flag} {path!r} is not a file")


def read_prompts(cfg: GenerateConfig) -> list[str]:
    if cfg.prompts_file is not None:
        prompts = [ln for ln in assets.load_text(cfg.prompts_file).splitlines() if ln.strip()]
        cli.check(bool(prompts), f"--prompts-file {cfg.prompts_file!r} holds no prompt")
        return prompts
    if cfg.prompt_file is not None:
        return [assets.load_text(cfg.prompt_file)]
    return [cfg.prompt]


def main(cfg: GenerateConfig) -> list[str]:
    validate(cfg)
    prompts = read_prompts(cfg)
    lm = load_model(cfg.model)
    if cfg.group_size is not None:
        cli.check(
            lm.cfg.head_dim % cfg.group_size == 0,
            f"--group-size {cfg.group_size} must divide the model's head_dim={lm.cfg.head_dim}",
        )
    ids = [lm.tokenizer.encode(p, add_bos=cfg.add_bos) for p in prompts]
    longest = max(len(x) for x in ids) + cfg.max_new_tokens
    chunk = cfg.page_size * max(1, min(512, longest) // cfg.page_size)
    ecfg = EngineConfig(
        max_seqs=min(cfg.max_seqs, len(ids)),
        prefill_chunk=chunk,
        prefill_tokens_per_step=chunk * 4,
        decode_steps=cfg.decode_steps,
        kv_memory_gb=cfg.kv_memory_gb,
    )
    max_len = cfg.page_size * -(-longest // cfg.page_size)
    if cfg.bits is None:
        ccfg = CacheConfig(max_seq_len=max_len)
        engine = Engine(
            lm.model, cache_kind="dense", cache_cfg=ccfg, engine_cfg=ecfg, tokenizer=lm.tokenizer
        )
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
            max_seq_len=max_len,
        )
        engine = Engine(
            lm.model, cache_kind="paged", transforms=tf, cache_cfg=ccfg, engine_cfg=ecfg,
            tokenizer=lm.tokenizer,
        )  # fmt: skip
        mode = f"{cfg.bits}-bit {cfg.quantizer} cache, transforms={method}"
    sampling = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed)
    reqs = [engine.submit(x, cfg.max_new_tokens, sampling=sampling) for x in ids]
    engine.run()
    texts = [lm.tokenizer.decode(r.output) for r in reqs]
    for i, (p, t) in enumerate(zip(prompts, texts)):
        if len(prompts) > 1:
            print(f"--- request {i} ({reqs[i].finish_reason})")
        print(p + t)
    st = engine.stats
    print(
        f"[{mode}] {len(reqs)} request(s), {sum(len(x) for x in ids)} prompt tokens in "
        f"{st['prefill_seconds']:.2f}s (incl. compile); {sum(len(r.output) for r in reqs)} "
        f"new tokens, decode {st['decode_tokens'] / max(st['decode_seconds'], 1e-9):.1f} "
        f"tokens/s (incl. compile), at most {engine.peak_running} at once",
        file=sys.stderr,
    )
    if cfg.bits is not None:
        total = sum(len(x) + len(r.output) for x, r in zip(ids, reqs))
        low = sum(
            max(0, ccfg.quant_end(len(x) + len(r.output)) - ccfg.sink) for x, r in zip(ids, reqs)
        )
        note = (
            ""
            if low
            else f" (sequence within sink {cfg.sink} + keep {cfg.keep}: use a longer prompt)"
        )
        print(
            f"[{mode}] {low} of {total} cached tokens in {cfg.bits}-bit pages{note}",
            file=sys.stderr,
        )
    return texts


def parse_args(argv=None) -> GenerateConfig:
    parser = cli.dataclass_parser(GenerateConfig, "python -m kvjax.generate", __doc__)
    return cli.dataclass_from_args(GenerateConfig, parser.parse_args(argv))


if __name__ == "__main__":
    cli.run(main, parse_args)
