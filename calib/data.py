"""Calibration and evaluation token windows from text.

Text is tokenized once and cut into non-overlapping windows of `seq_len` tokens (the tail that
does not fill a window is dropped), so every window is a full causal sequence.
"""

from __future__ import annotations

import numpy as np

from kvjax.models.tokenizer import Tokenizer

# Text that calibrates nothing: statistics of a handful of token ids (200 KB of NUL bytes gave
# "error 0.0000" on every layer and saved transforms) describe no real traffic.
MIN_ALPHA_FRACTION = 0.05
MIN_DISTINCT_TOKENS = 64


def check_text(text: str, source: str = "text") -> None:
    """Rejects text that is empty or has (almost) no letters, naming ``source``.

    Raises:
        ValueError: with a one-line reason.
    """
    if not text.strip():
        raise ValueError(f"{source} is empty")
    sample = text[: 1 << 20]
    alpha = sum(c.isalpha() for c in sample) / len(sample)
    if alpha < MIN_ALPHA_FRACTION:
        raise ValueError(
            f"{source} is not natural-language text: {alpha:.1%} of its characters are letters "
            f"(need >= {MIN_ALPHA_FRACTION:.0%})"
        )


def token_windows(
    text: str,
    tokenizer: Tokenizer,
    seq_len: int,
    max_windows: int | None = None,
    source: str = "text",
) -> np.ndarray:  # i32[N, seq_len]
    """Non-overlapping `seq_len`-token windows of `text`, at most `max_windows` of them; BOS
    first in each when the tokenizer starts sequences with it (`add_bos_default`).

    Raises:
        ValueError: seq_len < 2, degenerate text (`check_text`, or fewer than
            `MIN_DISTINCT_TOKENS` distinct tokens), or text too short for a single window.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len} must be >= 2")
    check_text(text, source)
    ids = np.asarray(tokenizer.encode(text), np.int32)
    distinct = len(np.unique(ids))
    need = min(MIN_DISTINCT_TOKENS, max(2, tokenizer.vocab_size // 2))  # tiny test vocabularies
    if distinct < need:
        raise ValueError(
            f"{source} has {distinct} distinct tokens in {len(ids)}; need >= "
            f"{need} for statistics that describe real text"
        )
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"text has {len(ids)} tokens, fewer than one window of seq_len={seq_len}")
    if max_windows is not None:
        n = min(n, max_windows)
    w = ids[: n * seq_len].reshape(n, seq_len).copy()
    if getattr(tokenizer, "add_bos_default", False):
        # Each window is a sequence of its own: a model whose tokenizer starts sequences with
        # BOS (Gemma) gets it first in every window, not only in the first.
        w[:, 0] = tokenizer.bos_id
    return w


def split_holdout(windows: np.ndarray, num_holdout: int) -> tuple[np.ndarray, np.ndarray]:
    """(calibration windows, held-out windows): the last `num_holdout` windows are held out."""
    if num_holdout < 0 or num_holdout >= len(windows):
        raise ValueError(
            f"num_holdout={num_holdout} must be in [0, {len(windows)}) for {len(windows)} windows"
        )
    if num_holdout == 0:
        return windows, windows[:0]
    return windows[:-num_holdout], windows[-num_holdout:]
