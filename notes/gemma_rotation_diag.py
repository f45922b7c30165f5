"""Why orthogonal rotations fail on Gemma 3's global layers (issue #14): per global layer,
the key/value statistics that a per-token quantizer meets, and the module-output error with
only K or only V quantized at 2 bits, per method, with and without the calibration mean of
the keys subtracted (softmax is invariant to a key offset shared by all tokens).

    python notes/gemma_rotation_diag.py runs/calib_gemma_b2_diag OUT_DIR [methods...]

Writes OUT_DIR/gemma3_rotation_keys.{json,md}.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from calib import errors
from calib.calibrate import capture_activations
from eval import common
from kvjax.cache.quantizers import QuantConfig
from kvjax.models.loading import load_model


def main():
    calib_dir, out_dir = sys.argv[1], sys.argv[2]
    methods = sys.argv[3:] or ["kv_pca", "oscar", "wush"]
    env = common.environment()
    layer_rows, rows = [], []
    lm = load_model("gemma3-270m")
    cal = common.evaluation_windows(lm.tokenizer, 1024, 1)
    acts = capture_activations(lm, cal)
    sm = lm.cfg.attention_scale
    qc = QuantConfig(method="oscar", bits=2)
    layers = [i for i, t in enumerate(lm.cfg.layer_types) if t == "full_attention"]
    for i in layers:
        q, k, v = (jnp.asarray(x, jnp.float32) for x in acts[i])
        kf = np.asarray(k).reshape(-1, k.shape[-1])
        mu = kf.mean(0)
        share = float(np.sum(mu**2) / np.mean(np.sum(kf**2, 1)))
        top = np.sort(np.abs(kf).mean(0))[::-1]
        qn = float(jnp.sqrt((q**2).sum(-1)).mean())
        kn = float(jnp.sqrt((k**2).sum(-1)).mean())
        layer_rows.append(
            [i, f"{share:.3f}", f"{top[0]:.1f}", f"{top[3]:.1f}", f"{np.median(top):.2f}",
             f"{qn:.1f}", f"{kn:.1f}"]
        )  # fmt: skip
        w = lm.model.layers[i].self_attn.o_proj.kernel[...].T.astype(jnp.float32)
        w_o = errors.w_o_heads(w, lm.cfg.num_kv_heads, lm.cfg.head_dim)
        for m in methods:
            tf = common.load_method(calib_dir, m, 2, lm.cfg, lm.fingerprint)
            a_k, b_k, a_v, b_v = tf.a_k[i], tf.b_k[i], tf.a_v[i], tf.b_v[i]
            ck, cv = tf.clip_k[i], tf.clip_v[i]
            row = []
            for centred in (False, True):
                off = jnp.asarray(mu) if centred else 0.0
                k_hat = errors.roundtrip(k - off, a_k, b_k, qc, ck) + off
                v_hat = errors.roundtrip(v, a_v, b_v, qc, cv)
                for kk, vv in ((k_hat, v), (k, v_hat)):
                    e = errors.attention_errors(q, k, v, kk, vv, w_o, sm)
                    row.append(float(e["out_err"] / e["out_ref"]))
            rows.append([i, m, *(f"{x:.3f}" for x in (row[0], row[1], row[2]))])
            print(rows[-1], file=sys.stderr)
        jax.clear_caches()
    md = [
        "# Gemma 3 270M global layers: keys and values at 2 bits, per method",
        "",
        f"`{env['command']}` at {env['commit']}, {env['date']}, {env['machine']}, jax "
        f"{env['jax_version']}; one held-out 1024-token window; transforms and clips from "
        f"`{calib_dir}` (8,192 play tokens); oscar quantizer, no full-precision windows.",
        "",
        common.markdown_table(
            ["layer", "|mean k|^2 / mean |k|^2", "largest mean |k_c|", "4th", "median",
             "mean |q|", "mean |k|"],
            layer_rows,
        ),
        "",
        "Relative module-output error with only the keys or only the values quantized; "
        "'K only, centred': the keys less their mean over this window before the transform "
        "(a key offset shared by all tokens leaves the softmax unchanged).",
        "",
        common.markdown_table(["layer", "method", "K only", "V only", "K only, centred"], rows),
    ]  # fmt: skip
    payload = dict(environment=env, layers=layer_rows, rows=rows, methods=methods)
    common.write_results(out_dir, "gemma3_rotation_keys", payload, "\n".join(md))


if __name__ == "__main__":
    main()
