"""Passkey retrieval (needle in a haystack) in Shakespeare text, full precision vs low-bit cache.

    python -m eval.retrieval                                   # 512 / 1024 / 2000 tokens
    python -m eval.retrieval --lengths 512 --methods wush identity --key-digits 3

Each prompt hides "The pass key is NNNNN. Remember it." at a depth of the filler text (the
evaluation plays), then asks "What is the pass key? The pass key is". A trial succeeds when
greedy decoding reproduces the key exactly. Greedy success is measured teacher-forced: the
answer " NNNNN" is appended and the trial passes iff the model's argmax at every answer position
is the next answer token, which is exactly the condition for greedy decoding to emit the key.

Cache semantics are those of serving: the prompt is prefilled in `chunk`-token calls through the
paged cache (sink/keep/flush 64/256/16 by default, so the needle sits in low-bit pages when the
question is read) and every answer token is a single-token decode step. The forward uses the
protocol-exact simulation of the paged cache (`eval.common.WindowedQuantCache`; tests compare
it with the real cache, decode steps included).

Writes <out>/retrieval.json (rows: transform, quantizer, bits, windows, context length, metric)
and <out>/retrieval.md.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence

import numpy as np

from eval import common
from kvjax import assets, cli
from kvjax.cache.paged import CacheConfig
from kvjax.cache.quantizers import QuantConfig
from kvjax.models.loading import LoadedModel, load_model

INTRO = (
    "There is a pass key hidden inside the following text. Find it and remember it; "
    "you will be asked for it at the end.\n\n"
)
NEEDLE = "\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"
ANSWER = " {key}"


@dataclasses.dataclass(frozen=True)
class RetrievalConfig:
    model: str | None = cli.option(None, "HF checkpoint dir or .gguf (default: shipped SmolLM2)")
    calib_dir: str = cli.option("runs/calib", "the --out folder of python -m kvjax.calibrate")
    methods: tuple[str, ...] = cli.option(common.ALL_METHODS, "transforms to evaluate")
    bits: int = cli.option(2, "code width (2, 3, 4)")
    quantizer: str = cli.option("oscar", "oscar, quest or minmax")
    windows: tuple[int, int, int] = cli.option(
        (64, 256, 16), "cache windows", metavar=("SINK", "KEEP", "FLUSH")
    )
    page_size: int = cli.option(16, "tokens per cache page", cli=False)
    lengths: tuple[int, ...] = cli.option((512, 1024, 2000), "haystack lengths in tokens")
    depths: tuple[float, ...] = cli.option((0.1, 0.3, 0.5, 0.7, 0.9), "passkey depths (0-1)")
    keys_per_depth: int = cli.option(1, "trials per depth")
    key_digits: int = cli.option(5, "digits of the passkey (1-9)")
    chunk: int = cli.option(16, "prefill tokens per call")
    batch_size: int = cli.option(5, "sequences per call")
    seed: int = cli.option(0, "seed of the passkeys and filler")
    out: str = cli.option("runs/eval", "output folder (results/ only when asked)")

    def __post_init__(self):
        common.check_methods(self.methods)
        if self.bits not in (2, 3, 4):
            raise ValueError(f"bits={self.bits}; supported 2, 3, 4")
        if not 1 <= self.key_digits <= 9:
            raise ValueError(f"key_digits={self.key_digits} must be in [1, 9]")
        bad = [d for d in self.depths if not 0.0 <= d <= 1.0]
        if bad or not self.depths:
            raise ValueError(f"depths={self.depths}: need at least one, each in [0, 1]")
        if not self.lengths or min(self.lengths) < 32:
            raise ValueError(f"lengths={self.lengths}: need at least one, each >= 32")
        if self.keys_per_depth < 1 or self.batch_size < 1 or self.chunk < 1:
            raise ValueError(
                f"keys_per_depth={self.keys_per_depth}, batch_size="
                f"{self.batch_size}, chunk={self.chunk} must be >= 1"
            )


def make_trials(
    tokenizer,
    filler: np.ndarray,  # i32[N] token ids of the filler text
    length: int,
    depths: Sequence[float],
    keys_per_depth: int,
    key_digits: int,
    seed: int,
) -> tuple[np.ndarray, int, list[dict]]:
    """Prompts of exactly `length` tokens (answer included) and where the answer starts.

    Returns (ids i32[N, length], answer_start, per-trial info). The answer is the same number of
    tokens for every key, so one `answer_start` serves the batch.

    Raises:
        ValueError: the length cannot hold the fixed text, or the filler is too short.
    """
    rng = np.random.default_rng(seed + length)
    # Pieces are encoded without BOS and joined; a model that wants BOS first (Gemma) gets one
    # at the start of the prompt only.
    enc = lambda s: np.asarray(_encode_no_bos(tokenizer, s), np.int32)  # noqa: E731
    intro, question = enc(INTRO), enc(QUESTION)
    if getattr(tokenizer, "add_bos_default", False):
        intro = np.concatenate([[tokenizer.bos_id], intro]).astype(np.int32)
    rows, info, answer_len = [], [], None
    for di, depth in enumerate(depths):
        for r in range(keys_per_depth):
            key = str(int(rng.integers(10 ** (key_digits - 1), 10**key_digits)))
            needle, answer = enc(NEEDLE.format(key=key)), enc(ANSWER.format(key=key))
            if answer_len is None:
                answer_len = len(answer)
            elif len(answer) != answer_len:
                raise ValueError(
                    f"answer {ANSWER.format(key=key)!r} tokenizes to {len(answer)} "
                    f"tokens, others to {answer_len}"
                )
            n_fill = length - len(intro) - len(needle) - len(question) - len(answer)
            if n_fill < 1:
                raise ValueError(
                    f"length={length} is too short for the prompt text "
                    f"({length - n_fill} tokens without filler)"
                )
            # A different stretch of the plays for every trial (offsets spread over the text).
            start = ((di * keys_per_depth + r) * 7919 * 13) % max(1, len(filler) - n_fill)
            fill = filler[start : start + n_fill]
            if len(fill) < n_fill:
                raise ValueError(f"filler text has {len(filler)} tokens, need {n_fill}")
            at = int(round(depth * n_fill))
            rows.append(np.concatenate([intro, fill[:at], needle, fill[at:], question, answer]))
            info.append(dict(depth=float(depth), key=key, needle_position=int(len(intro) + at)))
    return np.stack(rows).astype(np.int32), length - answer_len, info


def _encode_no_bos(tokenizer, text: str) -> list[int]:
    """Ids of a prompt piece: no BOS even from a tokenizer that adds one by default (Gemma)."""
    if getattr(tokenizer, "add_bos_default", False):
        return tokenizer.encode(text, add_bos=False)
    return tokenizer.encode(text)


def score_trials(
    scorer: common.TokenScorer,
    ids: np.ndarray,  # i32[N, L]
    answer_start: int,
    cache_cfg: CacheConfig | None,
    transforms,
    cfg: RetrievalConfig,
) -> tuple[np.ndarray, np.ndarray]:  # bool[N] exact, f32[N] fraction of answer tokens right
    exact, frac = [], []
    for i in range(0, len(ids), cfg.batch_size):
        batch = ids[i : i + cfg.batch_size]
        _, top = scorer.one_pass(
            batch, cache_cfg, transforms, cfg.chunk, decode_from=answer_start, return_argmax=True
        )
        hit = top[:, answer_start - 1 :] == batch[:, answer_start:]  # [n, answer_len]
        exact.append(hit.all(axis=1))
        frac.append(hit.mean(axis=1))
    return np.concatenate(exact), np.concatenate(frac)


def main(cfg: RetrievalConfig, lm: LoadedModel | None = None) -> dict:
    """Runs every (setting, length) and writes retrieval.{json,md}; returns the payload."""
    lm = lm or load_model(cfg.model)
    t0 = time.perf_counter()
    filler = np.asarray(_encode_no_bos(lm.tokenizer, assets.evaluation_text()), np.int32)
    scorer = common.TokenScorer(lm.model)
    sink, keep, flush = cfg.windows
    win = f"{sink}/{keep}/{flush}"
    settings: list[tuple[str, object, CacheConfig | None]] = [(common.FULL_PRECISION, None, None)]
    for m in cfg.methods:
        tf = common.load_method(cfg.calib_dir, m, cfg.bits, lm.cfg, lm.fingerprint)
        settings.append((m, tf, None))
    rows = []
    for length in cfg.lengths:
        ids, a0, info = make_trials(
            lm.tokenizer, filler, length, cfg.depths, cfg.keys_per_depth, cfg.key_digits, cfg.seed
        )
        ccfg = CacheConfig(
            sink=sink,
            keep=keep,
            flush=flush,
            page_size=cfg.page_size,
            quant=QuantConfig(method=cfg.quantizer, bits=cfg.bits),
            max_seq_len=length,
        )
        for name, tf, _ in settings:
            fp = name == common.FULL_PRECISION
            t1 = time.perf_counter()
            exact, frac = score_trials(scorer, ids, a0, None if fp else ccfg, tf, cfg)
            rows.append(
                dict(
                    transform=name,
                    quantizer=None if fp else cfg.quantizer,
                    bits=None if fp else cfg.bits,
                    windows=None if fp else win,
                    length=int(length),
                    metric="passkey_accuracy",
                    value=float(exact.mean()),
                    answer_token_accuracy=float(frac.mean()),
                    trials=int(len(exact)),
                    key_digits=cfg.key_digits,
                    per_trial=[dict(i, correct=bool(e)) for i, e in zip(info, exact)],
                    seconds=time.perf_counter() - t1,
                )
            )
            print(
                f"{length:>5} {name:>18}: {exact.mean():.2f} ({frac.mean():.2f} of answer "
                f"tokens) {time.perf_counter() - t1:.0f}s",
                file=sys.stderr,
            )
    payload = dict(
        eval="retrieval",
        config=dataclasses.asdict(cfg),
        model=common.model_info(lm),
        environment=common.environment(),
        seconds=time.perf_counter() - t0,
        prompt=dict(intro=INTRO, needle=NEEDLE, question=QUESTION, answer=ANSWER),
        rows=rows,
    )
    common.write_results(cfg.out, "retrieval", payload, to_markdown(rows, cfg))
    return payload


def to_markdown(rows: list[dict], cfg: RetrievalConfig) -> str:
    names = list(dict.fromkeys(r["transform"] for r in rows))
    by = {(r["transform"], r["length"]): r for r in rows}
    n = rows[0]["trials"]
    table = [
        [m]
        + [
            f"{by[(m, L)]['value']:.2f} ({by[(m, L)]['answer_token_accuracy']:.2f})"
            for L in cfg.lengths
        ]
        for m in names
    ]
    head = (
        f"Passkey retrieval: {cfg.key_digits}-digit key at depths "
        f"{', '.join(str(d) for d in cfg.depths)} ({n} trials per length), greedy exact "
        f"match; in brackets the fraction of answer tokens right. Quantized rows: "
        f"{cfg.bits}-bit {cfg.quantizer} cache, windows {'/'.join(map(str, cfg.windows))}, "
        f"prefill {cfg.chunk} tokens per call, answer decoded token by token.\n"
    )
    return (
        head
        + "\n"
        + common.markdown_table(["transform"] + [f"{L} tokens" for L in cfg.lengths], table)
    )


def parse_args(argv: Sequence[str] | None = None) -> RetrievalConfig:
    parser = cli.dataclass_parser(RetrievalConfig, "python -m eval.retrieval", __doc__)
    return cli.dataclass_from_args(RetrievalConfig, parser.parse_args(argv))


if __name__ == "__main__":
    cli.run(main, parse_args)
