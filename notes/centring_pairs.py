"""Centred against raw keys, per method, paired over the same 16 windows (SmolLM2, 2 bits,
16/128/16): reads the per-window NLLs that `eval.perplexity` keeps since 198e5ef and writes
results/perplexity_smollm2_w16_b2_centring_pairs.md.

    python notes/centring_pairs.py results/perplexity_smollm2_w16_b2_paired.json \
        results/perplexity_smollm2_w16_b2_centred.json
"""

import json
import pathlib
import sys

from eval.perplexity import paired_change


def main() -> None:
    raw_path, centred_path = sys.argv[1:3]
    raw, centred = (
        {r["transform"]: r for r in json.loads(pathlib.Path(p).read_text())["rows"][1:]}
        for p in (raw_path, centred_path)
    )
    lines = [
        f"2-bit perplexity with centred keys against raw keys, per method, paired over the same "
        f"windows (`python {' '.join(sys.argv)}`). Change of the centred row against the raw "
        "one ± its paired standard error:\n",
        "| transform | raw | centred | centred vs raw |",
        "|---|---:|---:|---:|",
    ]
    for m in sorted(set(raw) & set(centred)):
        if raw[m].get("window_nll") and centred[m].get("window_nll"):
            c, se = paired_change(centred[m]["window_nll"], raw[m]["window_nll"])
            lines.append(
                f"| {m} | {100 * raw[m]['rel_to_fp']:+.2f}% "
                f"| {100 * centred[m]['rel_to_fp']:+.2f}% | {100 * c:+.2f}% ± {100 * se:.2f} |"
            )
    lines += [
        "\nThe issue's three methods against each other, within each setting (the change of the "
        "first against the second ± its paired standard error):\n",
        "| pair | raw keys | centred keys |",
        "|---|---:|---:|",
    ]
    for a, b in (("kv_pca", "wush"), ("hadamard", "wush"), ("hadamard", "kv_pca")):
        cells = []
        for rows in (raw, centred):
            c, se = paired_change(rows[a]["window_nll"], rows[b]["window_nll"])
            cells.append(f"{100 * c:+.2f}% ± {100 * se:.2f}")
        lines.append(f"| {a} vs {b} | {cells[0]} | {cells[1]} |")
    out = pathlib.Path("results/perplexity_smollm2_w16_b2_centring_pairs.md")
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
