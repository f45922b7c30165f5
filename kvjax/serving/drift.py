"""Does the served traffic still look like the calibration text? A per-layer drift score.

The transforms are fitted to the calibration text's key and value statistics. What the 2-bit
quantizer sees is each token's vector in the stored frame (`k A_K`, `v A_V`); when traffic
moves energy to other stored-frame channels than calibration put it in, the per-token scale
grows and the codes lose precision. The check compares per-channel second moments in that frame:

    m_serve[h, c] = mean over served tokens of (k A_K)[h, c]^2     (kept by the cache, opt-in)
    m_ref[h, c]   = diag(A_K^T E[k^T k] A_K)[h, c]                  (from calibration's KK sums)
    score         = mean over (h, c) of |log2((m_serve + eps) / (m_ref + eps))|

per layer, for keys and values, with ``eps = EPS_FRACTION * mean(m_ref)`` so near-empty
channels cannot dominate. 0 means the same profile; 1 means channels off by 2x on average. The
reference is stored with the transforms (`kvjax.calibrate` writes it; read it with
`kvjax.storage.load_drift_reference`); the engine keeps the sums when
`EngineConfig(drift_check=True)` (`PagedKVCache.with_moments`) and reports them through
`Engine.drift_report(reference)`. Off, nothing is computed. The sums cover the tokens the
model computes: a prefix adopted from the prefix cache is not counted again, a preempted
request's re-prefill is. The threshold is measured, not
derived: `eval.drift` scores held-out text of the calibration kind against other text on the
shipped model (RESULTS.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

# Floor of the moments, relative to the layer's mean reference moment.
EPS_FRACTION = 1e-2
# A layer is flagged when its key or value score exceeds this. Measured on the shipped model
# with wush transforms calibrated on 2048-token windows, served 2 x 2048 tokens per text
# (results/drift.md): held-out plays score at most 0.195 in any layer; the asyncio source
# exceeds 0.3 in every layer. Keys carry RoPE, so their moments depend on the positions served:
# contexts much shorter than the calibration windows score higher (0.57 at 512 tokens).
THRESHOLD = 0.3


@dataclasses.dataclass(frozen=True)
class DriftReference:
    """Calibration's stored-frame second moments per layer: f32[L, Hkv, d] each."""

    k: np.ndarray
    v: np.ndarray

    def __post_init__(self):
        if self.k.shape != self.v.shape or self.k.ndim != 3:
            raise ValueError(f"drift reference shapes k={self.k.shape} v={self.v.shape}: want "
                             "two equal [layers, kv_heads, head_dim] arrays")  # fmt: skip

    def arrays(self) -> dict[str, np.ndarray]:
        return {"drift_k": self.k, "drift_v": self.v}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> DriftReference:
        return cls(k=np.asarray(arrays["drift_k"]), v=np.asarray(arrays["drift_v"]))


def reference_from_grams(
    kk: Sequence[np.ndarray],  # per layer f[Hkv, d, d]: mean over tokens of k^T k
    vv: Sequence[np.ndarray],  # per layer f[Hkv, d, d]: mean of v^T v
    a_k: np.ndarray,  # f32[L, Hkv, d, d]
    a_v: np.ndarray,  # f32[L, Hkv, d, d]
) -> DriftReference:
    """diag(A^T G A) per layer and head: the stored frame's mean squared channel."""

    def diag(g, a):
        return np.einsum("hij,hik,hkj->hj", a, np.asarray(g, np.float64), a)

    k = np.stack([diag(g, np.asarray(a, np.float64)) for g, a in zip(kk, a_k)])
    v = np.stack([diag(g, np.asarray(a, np.float64)) for g, a in zip(vv, a_v)])
    return DriftReference(k=k.astype(np.float32), v=v.astype(np.float32))


def layer_scores(served: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """f[L, Hkv, d] mean served moments vs reference -> f[L] scores (module docstring)."""
    if served.shape != ref.shape:
        raise ValueError(f"served moments {served.shape} vs reference {ref.shape}")
    eps = EPS_FRACTION * ref.mean(axis=(1, 2), keepdims=True)
    return np.abs(np.log2((served + eps) / (ref + eps))).mean(axis=(1, 2))


def report(moments, ref: DriftReference) -> dict:
    """Scores from a cache's `KVMoments` per layer: {k, v: [L] scores, tokens, flagged layers}."""
    count = float(np.asarray(moments[0].count))
    if count <= 0:
        raise ValueError("no tokens were served with the drift check on")
    k = np.stack([np.asarray(m.k2) / np.asarray(m.count) for m in moments])
    v = np.stack([np.asarray(m.v2) / np.asarray(m.count) for m in moments])
    sk, sv = layer_scores(k, ref.k), layer_scores(v, ref.v)
    flagged = [i for i in range(len(sk)) if max(sk[i], sv[i]) > THRESHOLD]
    return dict(
        tokens=int(count),
        k=[round(float(x), 4) for x in sk],
        v=[round(float(x), 4) for x in sv],
        max=round(float(max(sk.max(), sv.max())), 4),
        threshold=THRESHOLD,
        flagged_layers=flagged,
    )
