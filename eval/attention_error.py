"""Per-layer attention error of each calibrated transform at low bits, vs full precision.

    python -m eval.attention_error                          # shipped SmolLM2, 2 bits, oscar
    python -m eval.attention_error --methods wush hadamard identity --windows 1 --seq-len 512
    python -m eval.attention_error --data my_text.txt      # a user's text instead of the plays

On held-out evaluation windows (the tragedies; calibration never saw them) the post-RoPE q, k, v
of every layer are captured at full precision; then, per transform, the whole K and V sequences
are quantized (no full-precision windows, which isolates the transform, as WUSH-KV section 5.1
does) with the clips calibrated for that bit width, and per layer we report the relative squared
error of the q.k logits, of the softmax probabilities and of the attention module output (after
o_proj), and the mean KL(p || p_hat) of the attention distributions per query.

Writes <out>/attention_error.json (rows: transform, quantizer, bits, windows, layer, metric,
value), <out>/attention_error.md (per-layer means and the module-output error per layer) and
<out>/attention_error.png (module-output error per layer, one line per transform). `--data`
measures on a user's text (.txt, a folder of .txt, .jsonl, .parquet) instead of the plays.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from calib import errors
from calib.calibrate import capture_activations
from eval import common
from kvjax import assets, cli
from kvjax.cache.quantizers import QuantConfig
from kvjax.models.loading import LoadedModel, load_model

METRICS = ("logit_rel_err", "softmax_rel_err", "output_rel_err", "kl")


@dataclasses.dataclass(frozen=True)
class AttentionErrorConfig:
    model: str | None = cli.option(None, "HF checkpoint dir or .gguf (default: shipped SmolLM2)")
    calib_dir: str = cli.option("runs/calib", "the --out folder of python -m kvjax.calibrate")
    methods: tuple[str, ...] = cli.option(common.ALL_METHODS, "transforms to evaluate")
    bits: int = cli.option(2, "code width (2, 3, 4)")
    quantizer: str = cli.option("oscar", "oscar, quest or minmax")
    seq_len: int = cli.option(1024, "tokens per evaluation window")
    num_windows: int = cli.option(2, "evaluation windows", flag="--windows")
    data: str | None = cli.option(
        None, "evaluation text (.txt, dir of .txt, .jsonl, .parquet); default: the shipped plays"
    )
    out: str = cli.option("runs/eval", "output folder (results/ only when asked)")
    plot: bool = cli.option(True, "write the PNG plot")

    def __post_init__(self):
        common.check_methods(self.methods)
        if self.bits not in (2, 3, 4):
            raise ValueError(f"bits={self.bits}; supported 2, 3, 4")
        if self.quantizer not in ("oscar", "quest", "minmax"):
            raise ValueError(f"quantizer={self.quantizer!r}; use oscar, quest or minmax")
        if self.seq_len < 2 or self.num_windows < 1:
            raise ValueError(
                f"seq_len={self.seq_len} must be >= 2 and num_windows={self.num_windows} >= 1"
            )


def _o_proj_heads(lm: LoadedModel, layer: int) -> jax.Array:  # f32[Hkv, G, d, D]
    # flax kernel is [Hq*d, D] (y = x @ kernel); errors.w_o_heads takes the torch layout.
    w = lm.model.layers[layer].self_attn.o_proj.kernel[...].T.astype(jnp.float32)
    return errors.w_o_heads(w, lm.cfg.num_kv_heads, lm.cfg.head_dim)


def layer_errors(
    acts: list[tuple[np.ndarray, ...]],  # per layer (q, k, v) f32[B, T, H, d]
    lm: LoadedModel,
    transforms,  # KVTransforms
    qc: QuantConfig,
) -> dict[str, np.ndarray]:  # metric -> f32[L]
    """The four per-layer error metrics of one transform with both K and V quantized."""
    sm_scale = lm.cfg.attention_scale

    @jax.jit
    def one(q, k, v, a_k, b_k, a_v, b_v, ck, cv, w_o_h, mu):
        k_hat = errors.roundtrip(k, a_k, b_k, qc, ck, mu)
        v_hat = errors.roundtrip(v, a_v, b_v, qc, cv)
        e = errors.attention_errors(q, k, v, k_hat, v_hat, w_o_h, sm_scale)
        return jnp.stack(
            [
                e["logit_err"] / e["logit_ref"],
                e["prob_err"] / e["prob_ref"],
                e["out_err"] / e["out_ref"],
                e["kl_sum"] / e["kl_count"],
            ]
        )

    out = []
    for i, (q, k, v) in enumerate(acts):
        out.append(
            np.asarray(
                one(
                    q,
                    k,
                    v,
                    transforms.a_k[i],
                    transforms.b_k[i],
                    transforms.a_v[i],
                    transforms.b_v[i],
                    transforms.clip_k[i],
                    transforms.clip_v[i],
                    _o_proj_heads(lm, i),
                    None if transforms.key_mean is None else transforms.key_mean[i],
                )
            )
        )
    arr = np.stack(out)  # [L, 4]
    return {m: arr[:, j] for j, m in enumerate(METRICS)}


def to_markdown(
    per_method: dict[str, dict[str, np.ndarray]],
    cfg: AttentionErrorConfig,
    n_tokens: int,
    seconds: dict[str, float] | None = None,
    capture_seconds: float | None = None,
) -> str:
    lines = [
        f"Attention error per layer at {cfg.bits} bits ({cfg.quantizer} quantizer, "
        f"calibrated clips, whole K/V sequence quantized) on {cfg.num_windows} "
        f"{'' if cfg.data else 'held-out evaluation '}windows of {cfg.seq_len} tokens"
        f"{' of ' + cfg.data if cfg.data else ''} ({n_tokens} tokens). Relative squared "
        f"errors vs full precision; KL = mean KL(p || p_hat) per query and head."
        + (
            ""
            if capture_seconds is None
            else f" Full-precision q/k/v capture: {capture_seconds:.0f} s; seconds: each "
            f"transform's errors on the captured activations."
        )
        + "\n",
        "Mean over layers:\n",
    ]
    seconds = seconds or {}
    rows = [
        [m]
        + [f"{float(np.mean(e[k])):.4g}" for k in METRICS]
        + ([f"{seconds[m]:.0f}"] if m in seconds else [])
        for m, e in per_method.items()
    ]
    lines.append(
        common.markdown_table(["transform", *METRICS] + (["seconds"] if seconds else []), rows)
    )
    lines.append("\nModule-output relative error per layer:\n")
    n_layers = len(next(iter(per_method.values()))["output_rel_err"])
    rows = [
        [str(i)] + [f"{e['output_rel_err'][i]:.4f}" for e in per_method.values()]
        for i in range(n_layers)
    ]
    lines.append(common.markdown_table(["layer", *per_method], rows))
    return "\n".join(lines)


def plot(
    per_method: dict[str, dict[str, np.ndarray]], cfg: AttentionErrorConfig, path: pathlib.Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for m, e in per_method.items():
        y = e["output_rel_err"]
        ax.plot(np.arange(len(y)), y, marker=".", label=m)
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("relative squared error of attention output")
    ax.set_title(f"Module-output error per layer, {cfg.bits}-bit K and V ({cfg.quantizer})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(cfg: AttentionErrorConfig, lm: LoadedModel | None = None) -> dict:
    """Measures every method and writes attention_error.{json,md,png}; returns the payload."""
    text = assets.load_text(cfg.data) if cfg.data else None  # a bad file fails before the model
    lm = lm or load_model(cfg.model)
    t0 = time.perf_counter()
    windows = common.evaluation_windows(lm.tokenizer, cfg.seq_len, cfg.num_windows, text)
    acts = capture_activations(lm, windows)
    capture_seconds = time.perf_counter() - t0
    qc = QuantConfig(method=cfg.quantizer, bits=cfg.bits)
    per_method: dict[str, dict[str, np.ndarray]] = {}
    seconds: dict[str, float] = {}
    rows = []
    base = dict(
        quantizer=cfg.quantizer,
        bits=cfg.bits,
        windows="none (whole sequence quantized)",
        num_windows=cfg.num_windows,
        seq_len=cfg.seq_len,
    )
    for method in cfg.methods:
        t1 = time.perf_counter()
        tf = common.load_method(cfg.calib_dir, method, cfg.bits, lm.cfg, lm.fingerprint)
        e = layer_errors(acts, lm, tf, qc)
        per_method[method] = e
        seconds[method] = time.perf_counter() - t1
        for metric in METRICS:
            rows += [
                dict(transform=method, layer=i, metric=metric, value=float(x), **base)
                for i, x in enumerate(e[metric])
            ]
            rows.append(
                dict(
                    transform=method,
                    layer="mean",
                    metric=metric,
                    value=float(np.mean(e[metric])),
                    seconds=seconds[method],
                    **base,
                )
            )
        print(
            f"{method:>18}: mean output error {np.mean(e['output_rel_err']):.4f}", file=sys.stderr
        )
    payload = dict(
        eval="attention_error",
        config=dataclasses.asdict(cfg),
        model=common.model_info(lm),
        environment=common.environment(),
        seconds=time.perf_counter() - t0,
        capture_seconds=capture_seconds,
        rows=rows,
    )
    md = to_markdown(per_method, cfg, int(windows.size), seconds, capture_seconds)
    common.write_results(cfg.out, "attention_error", payload, md)
    if cfg.plot:
        plot(per_method, cfg, pathlib.Path(cfg.out) / "attention_error.png")
    return payload


def parse_args(argv: Sequence[str] | None = None) -> AttentionErrorConfig:
    parser = cli.dataclass_parser(AttentionErrorConfig, "python -m eval.attention_error", __doc__)
    return cli.dataclass_from_args(AttentionErrorConfig, parser.parse_args(argv))


if __name__ == "__main__":
    cli.run(main, parse_args)
