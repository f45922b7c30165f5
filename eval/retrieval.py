"""Retrieval from a long context: passkey and multi-key needle-in-a-haystack, full precision vs
low-bit cache.

    python -m eval.retrieval --calib-dir runs/calib --methods kv_pca wush   # 20 trials per cell
    python -m eval.retrieval --lengths 1024 2048 --tasks niah --needles 6 --data my_text.txt
    python -m eval.retrieval --model gemma3-270m --calib-dir runs/calib_gemma --lengths 4096

Tasks (`--tasks`):

- `passkey`: "The pass key is NNNNN. Remember it." hidden at a depth of the filler text, then
  "What is the pass key? The pass key is".
- `niah` (multi-key needle in a haystack, RULER's multikey style): `--needles` sentences "The
  special magic number for WORD is NNNNN." for distinct words, each at its own depth, then a
  question for one of the words; the other needles are distractors.

Trial i of `--trials` puts the needle that is asked for at depth (i + 0.5) / trials of the
filler (or cycles through `--depths`), so every cell covers the whole context evenly; keys,
words, distractor depths and the filler's stretch of text are drawn from `--seed` and the
length. The filler is the evaluation plays or `--data` (a user's text). A trial succeeds when
greedy decoding reproduces the number exactly. Greedy success is measured teacher-forced: the
answer " NNNNN" is appended and the trial passes iff the model's argmax at every digit position
is the next digit token, which is exactly the condition for greedy decoding to emit the number.
Where the tokenizer splits the space off (SmolLM2: " ", "5", "3", ...), the space token is
given, not scored: whether the model writes " " or " the" before the number is not retrieval
(a string match on generated text, as RULER scores, would not count it either).
Every setting sees the same prompts, so differences to full precision are paired.

Each cell reports accuracy, its binomial standard error sqrt(p (1 - p) / n), and for quantized
rows the change vs full precision with its paired standard error (the standard error of the
mean of per-trial differences, correct_method - correct_fp).

Cache semantics are those of serving: the prompt is prefilled in `chunk`-token calls through the
paged cache (sink/keep/flush 64/256/16 by default, so the needles sit in low-bit pages when the
question is read) and every answer token is a single-token decode step. The forward uses the
protocol-exact simulation of the paged cache (`eval.common.WindowedQuantCache`; tests compare
it with the real cache, decode steps included).

Lengths default to 1024, 2048, ... up to the model's context limit (SmolLM2 8192, Gemma 3
32768). Seconds per trial on a 2-core CPU (shipped SmolLM2, one full-precision or simulated
2-bit forward; `results/retrieval.md` has the measured figures): the cost is one forward over
the whole prompt, quadratic in its length. Prompts are batched `--batch-tokens` tokens per
model call.

Writes <out>/retrieval.json (rows: task, transform, quantizer, bits, windows, length, metric,
value, value_se, change_vs_fp, change_vs_fp_se, trials, seconds) and <out>/retrieval.md.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Sequence

import numpy as np

from eval import common
from kvjax import assets, cli
from kvjax.cache.paged import CacheConfig
from kvjax.cache.quantizers import QuantConfig
from kvjax.models.loading import LoadedModel, load_model

TASKS = ("passkey", "niah")

INTRO = (
    "There is a pass key hidden inside the following text. Find it and remember it; "
    "you will be asked for it at the end.\n\n"
)
NEEDLE = "\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"
ANSWER = " {key}"

NIAH_INTRO = (
    "Some special magic numbers are hidden inside the following text. Make sure to memorize "
    "them; you will be asked about one of them at the end.\n\n"
)
NIAH_NEEDLE = "\n\nThe special magic number for {word} is {key}.\n\n"
NIAH_QUESTION = (
    "\n\nWhat is the special magic number for {word}? The special magic number for {word} is"
)
# Keys of the needles: distinct common nouns (RULER draws words the same way).
WORDS = (
    "apple", "river", "garden", "window", "candle", "mountain", "violin", "harbor", "lantern",
    "meadow", "compass", "falcon", "teapot", "blanket", "castle", "pepper", "orchard", "ribbon",
    "saddle", "thunder", "marble", "pillow", "bucket", "feather", "island", "kettle", "ladder",
    "mirror", "needle", "oyster", "parrot", "quilt", "rocket", "shovel", "tunnel", "umbrella",
    "velvet", "walnut", "anchor", "barrel",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class RetrievalConfig:
    model: str | None = cli.option(None, "HF checkpoint dir, .gguf or shipped name (gemma3-270m)")
    calib_dir: str = cli.option("runs/calib", "the --out folder of python -m kvjax.calibrate")
    methods: tuple[str, ...] = cli.option(common.ALL_METHODS, "transforms to evaluate")
    bits: int = cli.option(2, "code width (2, 3, 4)")
    value_bits: int | None = cli.option(
        None, "the values' code width when it differs from the keys' (--bits)"
    )
    quantizer: str = cli.option("oscar", "oscar, quest or minmax")
    group_size: int | None = cli.option(
        None, "channels per scale/zero of the low-bit pages (none: the whole head)"
    )
    windows: tuple[int, int, int] = cli.option(
        (64, 256, 16), "cache windows", metavar=("SINK", "KEEP", "FLUSH")
    )
    page_size: int = cli.option(16, "tokens per cache page", cli=False)
    tasks: tuple[str, ...] = cli.option(TASKS, "passkey and/or niah", choices=TASKS)
    lengths: tuple[int, ...] | None = cli.option(
        None, "prompt lengths in tokens (default: 1024, 2048, ... up to the model's context)"
    )
    trials: int = cli.option(20, "trials per (task, length) cell")
    depths: tuple[float, ...] | None = cli.option(
        None, "depths (0-1) of the asked needle, cycled over the trials (default: evenly spaced)"
    )
    key_digits: int = cli.option(5, "digits of the numbers to retrieve (1-9)")
    needles: int = cli.option(4, "key-value needles per niah prompt (one is asked for)")
    chunk: int = cli.option(16, "prefill tokens per call")
    batch_tokens: int = cli.option(8192, "prompt tokens per model call (batch = this // length)")
    seed: int = cli.option(0, "seed of the keys, words, depths and filler offsets")
    data: str | None = cli.option(
        None, "haystack text (.txt, dir of .txt, .jsonl, .parquet); default: the evaluation plays"
    )
    out: str = cli.option("runs/eval", "output folder (results/ only when asked)")
    merge: tuple[str, ...] = cli.option(
        (),
        "retrieval.json files of runs with the same settings (e.g. one per task) to join "
        "into <out>/retrieval.{json,md}; nothing is run",
    )

    def __post_init__(self):
        common.check_methods(self.methods)
        if self.bits not in (2, 3, 4):
            raise ValueError(f"bits={self.bits}; supported 2, 3, 4")
        if self.value_bits not in (None, 2, 3, 4):
            raise ValueError(f"value_bits={self.value_bits}; supported 2, 3, 4")
        if self.quantizer not in ("oscar", "quest", "minmax"):
            raise ValueError(f"quantizer={self.quantizer!r}; use oscar, quest or minmax")
        self.quant_configs()  # a bad group size fails here
        bad_tasks = [t for t in self.tasks if t not in TASKS]
        if bad_tasks or not self.tasks:
            raise ValueError(f"tasks={self.tasks}: need at least one of {', '.join(TASKS)}")
        if not 1 <= self.key_digits <= 9:
            raise ValueError(f"key_digits={self.key_digits} must be in [1, 9]")
        if self.depths is not None:
            bad = [d for d in self.depths if not 0.0 <= d <= 1.0]
            if bad or not self.depths:
                raise ValueError(f"depths={self.depths}: need at least one, each in [0, 1]")
        if self.lengths is not None and (not self.lengths or min(self.lengths) < 32):
            raise ValueError(f"lengths={self.lengths}: need at least one, each >= 32")
        if not 1 <= self.needles <= len(WORDS):
            raise ValueError(f"needles={self.needles} must be in [1, {len(WORDS)}]")
        for name in ("trials", "batch_tokens", "chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")

    @property
    def value_width(self) -> int:
        return self.bits if self.value_bits is None else self.value_bits

    def quant_configs(self) -> tuple[QuantConfig, QuantConfig]:
        """The low-bit pages' key and value quantizers."""
        quant = QuantConfig(method=self.quantizer, bits=self.bits, group_size=self.group_size)
        return quant, dataclasses.replace(quant, bits=self.value_width)

    def trial_depths(self) -> list[float]:
        """Depth of the asked needle in each trial."""
        if self.depths is not None:
            return [self.depths[i % len(self.depths)] for i in range(self.trials)]
        return [(i + 0.5) / self.trials for i in range(self.trials)]


def default_lengths(context: int) -> tuple[int, ...]:
    """1024, 2048, 4096, ... below the context limit, then the limit itself."""
    out, n = [], 1024
    while n < context:
        out.append(n)
        n *= 2
    return (*out, context)


def binomial_se(p: float, n: int) -> float:
    """Standard error of an accuracy p measured on n independent trials: sqrt(p (1 - p) / n)."""
    return math.sqrt(p * (1.0 - p) / n)


def paired_se(correct: np.ndarray, correct_fp: np.ndarray) -> float | None:
    """Standard error of mean(correct - correct_fp) over the same trials (None for one trial)."""
    d = correct.astype(np.float64) - correct_fp.astype(np.float64)
    if len(d) < 2:
        return None
    return float(d.std(ddof=1) / math.sqrt(len(d)))


def _encode_no_bos(tokenizer, text: str) -> list[int]:
    """Ids of a prompt piece: no BOS even from a tokenizer that adds one by default (Gemma)."""
    if getattr(tokenizer, "add_bos_default", False):
        return tokenizer.encode(text, add_bos=False)
    return tokenizer.encode(text)


def _random_key(rng: np.random.Generator, digits: int) -> str:
    return str(int(rng.integers(10 ** (digits - 1), 10**digits)))


def make_trials(
    tokenizer,
    filler: np.ndarray,  # i32[N] token ids of the filler text
    length: int,
    depths: Sequence[float],
    key_digits: int,
    seed: int,
    task: str = "passkey",
    needles: int = 4,
) -> tuple[np.ndarray, int, list[dict]]:
    """One prompt per depth, each exactly `length` tokens (answer included).

    Returns (ids i32[N, length], answer_start, per-trial info): ids[:, answer_start:] are the
    scored tokens, the number's (a leading space token, where the tokenizer splits one off, sits
    before answer_start). The answer is the same number of tokens in every trial, so one
    `answer_start` serves the batch; the filler takes up whatever the fixed text leaves.

    Raises:
        ValueError: the length cannot hold the fixed text, the filler is too short, or the
            answers tokenize to different lengths.
    """
    if task not in TASKS:
        raise ValueError(f"task={task!r}; use one of {', '.join(TASKS)}")
    rng = np.random.default_rng([seed, length, TASKS.index(task)])
    # Pieces are encoded without BOS and joined; a model that wants BOS first (Gemma) gets one
    # at the start of the prompt only.
    enc = lambda s: np.asarray(_encode_no_bos(tokenizer, s), np.int32)  # noqa: E731
    intro = enc(INTRO if task == "passkey" else NIAH_INTRO)
    if getattr(tokenizer, "add_bos_default", False):
        intro = np.concatenate([[tokenizer.bos_id], intro]).astype(np.int32)
    rows, info, answer_len, lead0 = [], [], None, 0
    for depth in depths:
        if task == "passkey":
            key = _random_key(rng, key_digits)
            inserts = [(float(depth), enc(NEEDLE.format(key=key)))]
            question = enc(QUESTION)
            extra: dict = {}
        else:
            words = [WORDS[j] for j in rng.choice(len(WORDS), needles, replace=False)]
            keys: list[str] = []
            while len(keys) < needles:  # distinct numbers, so a distractor is never right
                k = _random_key(rng, key_digits)
                keys += [] if k in keys else [k]
            key = keys[0]  # the first word is the one asked for
            other_depths = rng.uniform(0.0, 1.0, needles - 1)
            inserts = [
                (float(d), enc(NIAH_NEEDLE.format(word=w, key=k)))
                for d, w, k in zip([depth, *other_depths], words, keys)
            ]
            question = enc(NIAH_QUESTION.format(word=words[0]))
            extra = dict(word=words[0], distractors=dict(zip(words[1:], keys[1:])))
        answer = enc(ANSWER.format(key=key))
        digits = enc(key)
        # A tokenizer that splits the leading space off (SmolLM2: " 53798" -> " ", "5", ...)
        # gets the space with the question: only the number is scored (as a string match on
        # the output would), not whether the model writes " " or " the" before it.
        split = len(digits) < len(answer) and answer[-len(digits) :].tolist() == digits.tolist()
        lead = len(answer) - len(digits) if split else 0
        if answer_len is None:
            answer_len, lead0 = len(answer), lead
        elif len(answer) != answer_len or lead != lead0:
            raise ValueError(
                f"answer {ANSWER.format(key=key)!r} tokenizes to {len(answer)} "
                f"tokens, others to {answer_len}"
            )
        n_fixed = len(intro) + sum(len(x) for _, x in inserts) + len(question) + len(answer)
        n_fill = length - n_fixed
        if n_fill < 1:
            raise ValueError(
                f"length={length} is too short for the {task} prompt text "
                f"({n_fixed} tokens without filler)"
            )
        if len(filler) < n_fill:
            raise ValueError(
                f"filler text has {len(filler)} tokens, length={length} needs {n_fill}"
            )
        # A different stretch of the filler for every trial.
        start = int(rng.integers(0, len(filler) - n_fill + 1))
        fill = filler[start : start + n_fill]
        # Insert needles at their depths (stable order for equal depths: the asked one first).
        order = sorted(range(len(inserts)), key=lambda j: (inserts[j][0], j))
        pieces, pos, at_prev, asked_at = [intro], len(intro), 0, None
        for j in order:
            at = int(round(inserts[j][0] * n_fill))
            pieces.append(fill[at_prev:at])
            pos += at - at_prev
            if j == 0:
                asked_at = pos
            pieces.append(inserts[j][1])
            pos += len(inserts[j][1])
            at_prev = at
        pieces += [fill[at_prev:], question, answer]
        rows.append(np.concatenate(pieces))
        info.append(
            dict(depth=float(depth), key=key, needle_position=int(asked_at), filler_start=start)
            | extra
        )
    return np.stack(rows).astype(np.int32), length - answer_len + lead0, info


def score_trials(
    scorer: common.TokenScorer,
    ids: np.ndarray,  # i32[N, L]
    answer_start: int,
    cache_cfg: CacheConfig | None,
    transforms,
    chunk: int,
    batch_size: int,
) -> tuple[np.ndarray, np.ndarray]:  # bool[N] exact, f32[N] fraction of answer tokens right
    exact, frac = [], []
    for i in range(0, len(ids), batch_size):
        batch = ids[i : i + batch_size]
        n = ids.shape[1] - answer_start  # argmax at positions answer_start - 1 ... L - 2
        top = scorer.tail_argmax(batch, cache_cfg, transforms, chunk, answer_start, n)
        hit = top == batch[:, answer_start:]  # [batch, answer_len]
        exact.append(hit.all(axis=1))
        frac.append(hit.mean(axis=1))
    return np.concatenate(exact), np.concatenate(frac)


def resolve_lengths(cfg: RetrievalConfig, context: int) -> tuple[int, ...]:
    """The lengths to run; raises ValueError naming one past the model's context limit."""
    lengths = cfg.lengths or default_lengths(context)
    over = [n for n in lengths if n > context]
    if over:
        raise ValueError(f"lengths {over} exceed the model's context limit of {context} tokens")
    return tuple(lengths)


def merge_runs(paths: Sequence[str], out: str) -> dict:
    """Joins the rows of retrieval.json files of one model (runs split by task or length)
    into <out>/retrieval.{json,md}; the first file's settings describe the table."""
    payloads = common.read_runs(paths, "retrieval")
    kw = common.config_fields(payloads[0]["config"], RetrievalConfig)
    rows, seen = [], set()
    # Rows written before they carried their value width and group size take their run's.
    runs = [
        r if r["bits"] is None
        else dict(
            r,
            value_bits=r.get("value_bits", r["bits"]),
            group_size=r.get("group_size", p["config"].get("group_size")),
        )
        for p in payloads
        for r in p["rows"]
    ]  # fmt: skip
    for r in runs:
        key = (r["task"], r["transform"], r["length"], r["quantizer"], r["bits"], r["windows"])
        key += (r.get("value_bits"), r.get("group_size"), bool(r.get("center_keys")))
        if key not in seen:  # a setting measured twice (full precision in every run): the first
            seen.add(key)
            rows.append(r)
    kw.update(
        tasks=tuple(dict.fromkeys(r["task"] for r in rows)),
        lengths=tuple(sorted({r["length"] for r in rows})),
        methods=tuple(
            dict.fromkeys(r["transform"] for r in rows if r["transform"] != common.FULL_PRECISION)
        ),
        merge=tuple(paths),
        out=out,
    )
    cfg = RetrievalConfig(**kw)
    payload = dict(
        payloads[0],
        config=dataclasses.asdict(cfg),
        lengths=sorted({r["length"] for r in rows}),
        seconds=sum(p["seconds"] for p in payloads),
        merged=[dict(path=str(p), environment=q["environment"]) for p, q in zip(paths, payloads)],
        rows=rows,
    )
    common.write_results(out, "retrieval", payload, to_markdown(rows, cfg))
    return payload


def _payload(cfg: RetrievalConfig, lm: LoadedModel, lengths, rows: list[dict], seconds) -> dict:
    return dict(
        eval="retrieval",
        config=dataclasses.asdict(cfg),
        lengths=list(lengths),
        model=common.model_info(lm),
        environment=common.environment(),
        seconds=seconds,
        prompt=dict(
            passkey=dict(intro=INTRO, needle=NEEDLE, question=QUESTION, answer=ANSWER),
            niah=dict(intro=NIAH_INTRO, needle=NIAH_NEEDLE, question=NIAH_QUESTION, answer=ANSWER),
        ),
        rows=rows,
    )


def main(cfg: RetrievalConfig, lm: LoadedModel | None = None) -> dict:
    """Runs every (task, length, setting) and writes retrieval.{json,md}; returns the payload."""
    if cfg.merge:
        return merge_runs(cfg.merge, cfg.out)
    text = assets.load_text(cfg.data) if cfg.data else None  # a bad file fails before the model
    lm = lm or load_model(cfg.model)
    quant, quant_v = cfg.quant_configs()
    vbits = cfg.value_width
    quant.resolve_group_size(lm.cfg.head_dim)  # a group that does not divide head_dim fails here
    t0 = time.perf_counter()
    lengths = resolve_lengths(cfg, lm.cfg.max_position_embeddings)
    text = assets.evaluation_text() if text is None else text
    filler = np.asarray(_encode_no_bos(lm.tokenizer, text), np.int32)
    # Every prompt is built (and every transform loaded) before the first forward, so a short
    # text or a missing checkpoint fails in seconds.
    prompts = {
        (task, n): make_trials(
            lm.tokenizer, filler, n, cfg.trial_depths(), cfg.key_digits, cfg.seed, task, cfg.needles
        )
        for task in cfg.tasks
        for n in lengths
    }
    settings: list[tuple[str, object]] = [(common.FULL_PRECISION, None)]
    for m in cfg.methods:
        tf = common.load_method(cfg.calib_dir, m, cfg.bits, lm.cfg, lm.fingerprint)
        if vbits != cfg.bits:  # the values' clips are those calibrated for their own width
            tf_v = common.load_method(cfg.calib_dir, m, vbits, lm.cfg, lm.fingerprint)
            tf = dataclasses.replace(tf, clip_v=tf_v.clip_v)
        settings.append((m, tf))
    scorer = common.TokenScorer(lm.model)
    sink, keep, flush = cfg.windows
    win = f"{sink}/{keep}/{flush}"
    rows = []
    for task in cfg.tasks:
        for length in lengths:
            ids, a0, info = prompts[(task, length)]
            ccfg = CacheConfig(
                sink=sink,
                keep=keep,
                flush=flush,
                page_size=cfg.page_size,
                quant=quant,
                quant_v=quant_v,
                max_seq_len=length,
            )
            batch = max(1, cfg.batch_tokens // length)
            fp_exact = None
            for name, tf in settings:
                fp = name == common.FULL_PRECISION
                t1 = time.perf_counter()
                exact, frac = score_trials(
                    scorer, ids, a0, None if fp else ccfg, tf, cfg.chunk, batch
                )
                seconds = time.perf_counter() - t1
                if fp:
                    fp_exact = exact
                acc = float(exact.mean())
                rows.append(
                    dict(
                        task=task,
                        transform=name,
                        quantizer=None if fp else cfg.quantizer,
                        bits=None if fp else cfg.bits,
                        value_bits=None if fp else vbits,
                        group_size=None if fp else cfg.group_size,
                        center_keys=None if fp else tf.key_mean is not None,
                        windows=None if fp else win,
                        length=int(length),
                        metric=f"{task}_accuracy",
                        value=acc,
                        value_se=binomial_se(acc, len(exact)),
                        change_vs_fp=acc - float(fp_exact.mean()),
                        change_vs_fp_se=None if fp else paired_se(exact, fp_exact),
                        answer_token_accuracy=float(frac.mean()),
                        trials=int(len(exact)),
                        key_digits=cfg.key_digits,
                        needles=1 if task == "passkey" else cfg.needles,
                        batch_size=batch,
                        seconds=seconds,
                        seconds_per_trial=seconds / len(exact),
                        per_trial=[dict(i, correct=bool(e)) for i, e in zip(info, exact)],
                    )
                )
                print(
                    f"{task:>7} {length:>6} {name:>18}: {acc:.2f} ± {rows[-1]['value_se']:.2f}"
                    f" ({frac.mean():.2f} of digits) {seconds:.0f}s "
                    f"({seconds / len(exact):.1f}s per trial)",
                    file=sys.stderr,
                    flush=True,
                )
                # Rewritten after every row: a long CPU run keeps what it has measured so far.
                payload = _payload(cfg, lm, lengths, rows, time.perf_counter() - t0)
                common.write_results(cfg.out, "retrieval", payload, to_markdown(rows, cfg))
    return payload


def _pts(x: float) -> str:
    return f"{100 * x:.0f}"


def cell(r: dict) -> str:
    """accuracy ± binomial SE (change vs full precision ± paired SE), in percentage points."""
    s = f"{_pts(r['value'])} ± {_pts(r['value_se'])}"
    if r["transform"] != common.FULL_PRECISION:
        se = r.get("change_vs_fp_se")
        s += f" ({100 * r['change_vs_fp']:+.0f}" + ("" if se is None else f" ± {_pts(se)}") + ")"
    return s


def to_markdown(rows: list[dict], cfg: RetrievalConfig) -> str:
    parts = []
    for task in dict.fromkeys(r["task"] for r in rows):
        tr = [r for r in rows if r["task"] == task]
        lengths = sorted(dict.fromkeys(r["length"] for r in tr))

        # Rows at another width or group size than the table's (joined runs) are named with it.
        def label(r: dict) -> str:
            name = r["transform"]
            if r["bits"] is None:  # full precision
                return name
            bits, vbits = r["bits"], r["value_bits"]
            if (bits, vbits) != (cfg.bits, cfg.value_width):
                name += f" {bits}-bit" if vbits == bits else f" {bits}k{vbits}v"
            if r["group_size"] != cfg.group_size:
                name += f" ({r['group_size'] or 'whole-head'} channels per scale)"
            if r.get("center_keys"):
                name += " (centred keys)"
            if r["quantizer"] != cfg.quantizer:
                name += f" ({r['quantizer']} quantizer)"
            return name

        names = list(dict.fromkeys(label(r) for r in tr))
        by = {(label(r), r["length"]): r for r in tr}
        n = tr[0]["trials"]
        what = (
            f"Passkey retrieval: one {cfg.key_digits}-digit key"
            if task == "passkey"
            else f"Multi-key needle in a haystack: {cfg.needles} word -> {cfg.key_digits}-digit "
            f"number needles, one asked for"
        )
        cache = f"{cfg.bits}-bit"
        if cfg.value_width != cfg.bits:
            cache += f" keys, {cfg.value_bits}-bit values,"
        cache += f" {cfg.quantizer} cache"
        if cfg.group_size is not None:
            cache += f" ({cfg.group_size} channels per scale/zero)"
        head = (
            f"{what}, {n} trials per cell (asked needle at depths "
            + (
                "evenly spaced over the context"
                if cfg.depths is None
                else ", ".join(str(d) for d in cfg.depths)
            )
            + f"), filler {cfg.data or 'the evaluation plays'}; greedy exact match. Cells: "
            f"accuracy % ± binomial SE (change vs full precision in points ± its SE, paired "
            f"over trials). Quantized rows: {cache}, windows "
            f"{'/'.join(map(str, cfg.windows))}, prefill {cfg.chunk} tokens per call, answer "
            f"decoded token by token.\n"
        )
        table = [[m] + [cell(by[(m, L)]) if (m, L) in by else "-" for L in lengths] for m in names]
        secs = [
            [m]
            + [f"{by[(m, L)]['seconds_per_trial']:.1f}" if (m, L) in by else "-" for L in lengths]
            for m in names
        ]
        parts += [
            head,
            common.markdown_table(["transform"] + [f"{L} tokens" for L in lengths], table),
            "Seconds per trial (the row's seconds / trials):\n",
            common.markdown_table(["transform"] + [f"{L}" for L in lengths], secs),
        ]
    return "\n".join(parts)


def parse_args(argv: Sequence[str] | None = None) -> RetrievalConfig:
    parser = cli.dataclass_parser(RetrievalConfig, "python -m eval.retrieval", __doc__)
    return cli.dataclass_from_args(RetrievalConfig, parser.parse_args(argv))


if __name__ == "__main__":
    cli.run(main, parse_args)
