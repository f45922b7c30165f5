"""Numpy model of the Mosaic body's e4m3 value operands (``int_to_float="s8_e4m3x2"``):
the weights w = p * s_v under the shifted max (at most 2^8), rounded to float16, then to an
e4m3 high part and an e4m3 low part stored 2^4 larger; the value product over 2-bit codes
with the zero-point term in float32. Prints the attention output's relative error against
float64 for float16 weights (today's operand), two e4m3 parts and one.

    python notes/probes/e4m3_weights_accuracy.py
"""

import ml_dtypes
import numpy as np


def e4m3(x):
    return x.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def main():
    rng = np.random.default_rng(0)
    for tokens, spread in ((4096, 1.0), (131072, 1.0), (131072, 3.0)):
        logits = rng.standard_normal(tokens) * spread
        vs = np.exp2(rng.uniform(-2, 2, tokens)) * 0.05
        codes = rng.integers(0, 4, (tokens, 128)).astype(np.float64)
        z = 1.5
        p = np.exp2(logits - logits.max())
        want = (p[:, None] * vs[:, None] * (codes - z)).sum(0) / p.sum()
        m = np.max(logits + np.log2(vs)) - 8.0
        pp = np.exp2(logits - m)
        w = pp * vs
        w16 = w.astype(np.float16).astype(np.float64)
        hi = e4m3(w16)
        lo = e4m3((w16 - hi) * 16.0) / 16.0
        for name, ww in (("float16", w16), ("e4m3 x2", hi + lo), ("e4m3", hi)):
            got = ((ww[:, None] * codes).sum(0) - (w * z).sum()) / pp.sum()
            err = np.linalg.norm(got - want) / np.linalg.norm(want)
            print(f"{tokens:7d} tokens, logit std {spread}: {name:8s} rel err {err:.2e}")


if __name__ == "__main__":
    main()
