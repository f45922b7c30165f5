# Diagnostic behind notes/wush_calibration_length.md (run from the repo root).
import json
import time

import numpy as np

from calib.calibrate import CalibrateConfig, build_method, to_kv_transforms
from calib.statistics import finalize_stats
from eval import common
from eval import perplexity as P
from kvjax import assets
from kvjax.cache.paged import CacheConfig
from kvjax.cache.quantizers import QuantConfig
from kvjax.models.loading import load_model

lm = load_model()


def from_stats(path, method):
    s = np.load(path)
    names = json.loads(str(s["key"]))["stats"]
    stats = [{n: s[f"{i}/{n}"] for n in names + ["count"]} for i in range(lm.cfg.num_layers)]
    final = [finalize_stats(x) for x in stats]
    pairs = build_method(method, final, lm, CalibrateConfig())
    ones = np.ones(lm.cfg.num_layers, np.float32)
    return to_kv_transforms(pairs, ones, ones)


ids = np.asarray(lm.tokenizer.encode(assets.calibration_text()[-400000:]), np.int32)
w = ids[: (len(ids) // 2048) * 2048].reshape(-1, 2048)[-2:]
scorer = common.TokenScorer(lm.model)
cfg = P.PerplexityConfig()


def ppl(tf, qc):
    cc = (
        None
        if qc is None
        else CacheConfig(sink=16, keep=128, flush=16, page_size=16, quant=qc, max_seq_len=2048)
    )
    return P.perplexity(P.score(scorer, w, cc, tf, cfg))


q = QuantConfig(method="quest", bits=2)
print("fp", round(ppl(None, None), 3), flush=True)
for label, path, m in [
    ("wush seq512", "/work/main/runs/calib/stats.npz", "wush"),
    ("wush seq2048", "/tmp/cal2048/out/stats.npz", "wush"),
    ("hadamard", "/tmp/cal2048/out/stats.npz", "hadamard"),
    ("kv_pca seq2048", "/tmp/cal2048/out/stats.npz", "kv_pca"),
    ("kv_pca seq512", "/work/main/runs/calib/stats.npz", "kv_pca"),
]:
    t = time.time()
    print(label, round(ppl(from_stats(path, m), q), 3), round(time.time() - t), flush=True)
