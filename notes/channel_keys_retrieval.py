"""Where is the 2-bit retrieval loss (issue #14), and would per-channel key scales (KIVI's axis)
close it?

Every low-bit key page today has one scale/zero per token (over its head_dim channels, after
the calibrated transform). This probe keeps the values as they are and quantizes the keys per
channel instead: one float16 scale/zero per (128-token block, KV head, channel), min/max,
blocks aligned at the sink as a flush of 128 tokens moves them (windows SINK/KEEP/128, so a
block is complete before any query reads it as low-bit). Same prompts, scorer and
simulated cache as `eval.retrieval`; only the keys' round trip differs (patched in at trace
time, one scorer per setting so no compiled call is shared).

    python notes/channel_keys_retrieval.py CALIB_DIR OUT_DIR [--model gemma3-270m]
        [--methods identity wush] [--length 1024] [--trials 20] [--task niah]

Writes OUT_DIR/channel_keys.{json,md}. Bits per key element: per token 2 + 32 / head_dim,
per channel 2 + 32 / 128.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax.numpy as jnp
import numpy as np

from eval import common, retrieval
from kvjax import assets
from kvjax.cache.paged import CacheConfig
from kvjax.cache.quantizers import QuantConfig
from kvjax.models.loading import load_model

BLOCK = 128


def channel_roundtrip(k_t: jnp.ndarray, bits: int, sink: int) -> jnp.ndarray:
    """Keys [B, T, H, d] with every complete BLOCK-token block past the sink quantized per
    (block, head, channel): asymmetric min/max, scale and zero stored as float16."""
    b, t, h, d = k_t.shape
    n = (t - sink) // BLOCK * BLOCK
    if n <= 0:
        return k_t
    blocks = k_t[:, sink : sink + n].astype(jnp.float32).reshape(b, n // BLOCK, BLOCK, h, d)
    lo = blocks.min(axis=2, keepdims=True).astype(jnp.float16).astype(jnp.float32)
    hi = blocks.max(axis=2, keepdims=True)
    scale = ((hi - lo) / (2**bits - 1)).astype(jnp.float16).astype(jnp.float32)
    scale = jnp.where(scale > 0, scale, 1.0)
    codes = jnp.clip(jnp.round((blocks - lo) / scale), 0, 2**bits - 1)
    deq = (codes * scale + lo).reshape(b, n, h, d).astype(k_t.dtype)
    return jnp.concatenate([k_t[:, :sink], deq, k_t[:, sink + n :]], axis=1)


# How the simulated cache rounds the low-bit pages: both per token ("token", what
# `eval.retrieval` does), keys per channel ("channel"), or only the keys / only the values
# per token, the other kept exact ("keys_only" / "values_only": where the loss is).
MODES = ("token", "channel", "keys_only", "values_only")


def patched_scorer(model, mode: str, bits: int) -> common.TokenScorer:
    """A TokenScorer whose simulated cache rounds the low-bit pages as ``mode`` says."""
    if mode == "token":
        return common.TokenScorer(model)
    orig_attend = common.WindowedQuantCache.attend
    orig_roundtrip = common._roundtrip_stored

    def attend(self, layer, q, k, v, positions):
        calls = []

        def roundtrip(x, qc, clip):
            calls.append(qc)
            keys = len(calls) == 1  # `attend` rounds the keys first, then the values
            if qc is None or (mode == "keys_only" and not keys) or (mode == "values_only" and keys):
                return x
            if mode == "channel" and keys:
                return channel_roundtrip(x, bits, self.cfg.sink)
            return orig_roundtrip(x, qc, clip)

        common._roundtrip_stored = roundtrip
        try:
            return orig_attend(self, layer, q, k, v, positions)
        finally:
            common._roundtrip_stored = orig_roundtrip

    scorer = common.TokenScorer(model)
    common.WindowedQuantCache.attend = attend
    return scorer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("calib_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--model", default=None)
    ap.add_argument("--methods", nargs="+", default=["identity", "wush"])
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--task", default="niah", choices=retrieval.TASKS)
    ap.add_argument("--sink", type=int, default=64)
    ap.add_argument("--keep", type=int, default=256)
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=["token", "channel"], choices=MODES)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    args = ap.parse_args()
    lm = load_model(args.model)
    tfs = {m: common.load_method(args.calib_dir, m, args.bits, lm.cfg, lm.fingerprint)
           for m in args.methods}  # fmt: skip
    rcfg = retrieval.RetrievalConfig(trials=args.trials, tasks=(args.task,))
    filler = np.asarray(retrieval._encode_no_bos(lm.tokenizer, assets.evaluation_text()), np.int32)
    ids, a0, _ = retrieval.make_trials(
        lm.tokenizer, filler, args.length, rcfg.trial_depths(), rcfg.key_digits, rcfg.seed,
        args.task, rcfg.needles,
    )  # fmt: skip
    quant = QuantConfig(method="oscar", bits=args.bits)
    ccfg = CacheConfig(
        sink=args.sink, keep=args.keep, flush=BLOCK, page_size=16, quant=quant, quant_v=quant,
        max_seq_len=args.length,
    )  # fmt: skip
    batch = max(1, args.batch_tokens // args.length)
    orig_attend = common.WindowedQuantCache.attend
    rows, fp_exact = [], None
    settings = [("full precision", "token", None)]
    settings += [(m, mode, tf) for m, tf in tfs.items() for mode in args.modes]
    for name, mode, tf in settings:
        scorer = patched_scorer(lm.model, mode, args.bits)
        t0 = time.perf_counter()
        exact, frac = retrieval.score_trials(
            scorer, ids, a0, None if tf is None else ccfg, tf, 16, batch
        )
        common.WindowedQuantCache.attend = orig_attend
        secs = time.perf_counter() - t0
        fp_exact = exact if tf is None else fp_exact
        acc = float(exact.mean())
        rows.append(dict(
            transform=name, pages=None if tf is None else mode, accuracy=acc,
            se=retrieval.binomial_se(acc, len(exact)),
            change_vs_fp=acc - float(fp_exact.mean()),
            change_se=None if tf is None else retrieval.paired_se(exact, fp_exact),
            digits=float(frac.mean()), seconds=secs,
        ))  # fmt: skip
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    d = lm.cfg.head_dim
    head = (
        f"{args.task} at {args.length} tokens, {args.trials} trials, windows "
        f"{args.sink}/{args.keep}/{BLOCK}, {args.bits}-bit keys and values (values per token, "
        f"oscar quantizer); keys per token ({args.bits + 32 / d:.2f} bits/element) or per "
        f"channel over {BLOCK}-token blocks ({args.bits + 32 / BLOCK:.2f}). Command: "
        f"`python {' '.join(sys.argv)}`, commit {common.git_commit()}.\n\n"
        "| transform | low-bit pages | accuracy | change vs FP (points) | digits right "
        "| seconds |\n"
        "|---|---|---:|---:|---:|---:|\n"
    )
    lines = [
        f"| {r['transform']} | {r['pages'] or '-'} | {100 * r['accuracy']:.0f} ± "
        f"{100 * r['se']:.0f} | "
        + (
            "-"
            if r["change_se"] is None
            else f"{100 * r['change_vs_fp']:+.0f} ± {100 * r['change_se']:.0f}"
        )
        + f" | {r['digits']:.2f} | {r['seconds']:.0f} |"
        for r in rows
    ]
    (out / "channel_keys.md").write_text(head + "\n".join(lines) + "\n")
    (out / "channel_keys.json").write_text(
        json.dumps(dict(command=sys.argv, commit=common.git_commit(), rows=rows), indent=1)
    )
    print(head + "\n".join(lines))


if __name__ == "__main__":
    main()
