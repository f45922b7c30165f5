"""Token windows: non-overlapping, BOS first in each for tokenizers that start with BOS."""

import numpy as np

from calib.data import token_windows


class _Tok:
    vocab_size = 256

    def __init__(self, bos: bool):
        self.add_bos_default, self.bos_id = bos, 255

    def encode(self, text, add_bos=None):
        bos = self.add_bos_default if add_bos is None else add_bos
        return ([self.bos_id] if bos else []) + [ord(c) % 200 for c in text]


TEXT = "".join(chr(32 + (i * 13) % 90) for i in range(1000))


def test_windows_without_bos_are_the_token_stream():
    w = token_windows(TEXT, _Tok(False), 100, 3)
    assert w.shape == (3, 100)
    np.testing.assert_array_equal(w.reshape(-1), _Tok(False).encode(TEXT)[:300])


def test_every_window_starts_with_bos_when_the_tokenizer_does():
    w = token_windows(TEXT, _Tok(True), 100, 3)
    assert (w[:, 0] == 255).all()
    ids = _Tok(True).encode(TEXT)
    np.testing.assert_array_equal(w[:, 1:], np.asarray(ids[:300]).reshape(3, 100)[:, 1:])
