"""Calibration and evaluation token windows from text.

Text is tokenized once and cut into non-overlapping windows of `seq_len` tokens (the tail that
does not fill a window is dropped), so every window is a full causal sequence.
"""

from __future__ import annotations

import numpy as np

from kvjax.models.tokenizer import Tokenizer


def token_windows(
    text: str,
    tokenizer: Tokenizer,
    seq_len: int,
    max_windows: int | None = None,
) -> np.ndarray:  # i32[N, seq_len]
    """Non-overlapping `seq_len`-token windows of `text`, at most `max_windows` of them.

    Raises:
        ValueError: seq_len < 2, or the text is too short for a single window.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len} must be >= 2")
    if not text.strip():
        raise ValueError("calibration/evaluation text is empty")
    ids = np.asarray(tokenizer.encode(text), np.int32)
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"text has {len(ids)} tokens, fewer than one window of seq_len={seq_len}")
    if max_windows is not None:
        n = min(n, max_windows)
    return ids[: n * seq_len].reshape(n, seq_len)


def split_holdout(windows: np.ndarray, num_holdout: int) -> tuple[np.ndarray, np.ndarray]:
    """(calibration windows, held-out windows): the last `num_holdout` windows are held out."""
    if num_holdout < 0 or num_holdout >= len(windows):
        raise ValueError(
            f"num_holdout={num_holdout} must be in [0, {len(windows)}) for {len(windows)} windows"
        )
    if num_holdout == 0:
        return windows, windows[:0]
    return windows[:-num_holdout], windows[-num_holdout:]
