"""Joins the schedule A/B logs of runs 122 and 124 (session 36, one H100 80GB HBM3; each log is
one `python -m eval.bench_decode --repeats 3 --variants int2_mosaic_vdims --no-quantize-pack`
process, its rows one JSON line each) into results/bench_decode_schedule_ab_h100.{json,md}.

    python notes/schedule_ab_results.py

The device command toggled the tree's defaults between processes with sed: `overlap`
("values" / "copies") and `TARGET_PROGRAMS` (256 / 384 / 512, rounded up at the time).
"""

import json
import pathlib
import re

LOGS = pathlib.Path(__file__).parent / "logs"
OUT = pathlib.Path(__file__).parent.parent / "results" / "bench_decode_schedule_ab_h100"
COMMAND = (
    "KVJAX_COMMIT=c43bdb2 python3 -m eval.bench_decode --repeats 3 --points POINTS "
    "--variants int2_mosaic_vdims --no-quantize-pack, once per configuration (run 122: "
    "8x32768 8x131072 1x131072 in the order A B C D E; run 124: 8x131072 32x32768 8x32768 in "
    "the order A1 C1 A2 C2)"
)


def main() -> None:
    rows = []
    for path in sorted(LOGS.glob("run12[24]_*.log")):
        run, name = re.match(r"run(\d+)_(.+)\.log", path.name).groups()
        overlap = "copies" if "copies" in name or name.startswith("C") else "values"
        m = re.search(r"_(\d+)$", name)
        target = int(m.group(1)) if m else (384 if name.startswith("C") else 256)
        for line in path.read_text().splitlines():
            if line.startswith("{") and '"time_ms"' in line:
                r = json.loads(line)
                rows.append(dict(run=int(run), config=name, overlap=overlap,
                                 target_programs=target, batch=r["batch"],
                                 context=r["context"], time_ms=r["time_ms"],
                                 fraction_of_ceiling=r["fraction_of_ceiling"]))  # fmt: skip
    points = sorted({(r["batch"], r["context"]) for r in rows})
    configs = list(dict.fromkeys((r["run"], r["config"]) for r in rows))
    cell = {(r["run"], r["config"], r["batch"], r["context"]): r["time_ms"] for r in rows}
    head = "| run | configuration | overlap | target programs | " + " | ".join(
        f"{b} x {c // 1024}k" for b, c in points
    )
    lines = [head + " |", "|---" * (4 + len(points)) + "|"]
    for run, name in configs:
        r0 = next(r for r in rows if (r["run"], r["config"]) == (run, name))
        vals = [cell.get((run, name, b, c)) for b, c in points]
        lines.append(
            f"| {run} | {name} | {r0['overlap']} | {r0['target_programs']} | "
            + " | ".join("-" if v is None else f"{v:.4f}" for v in vals)
            + " |"
        )
    md = (
        "Whole int2 decode call (ms), Mosaic GPU body, H100 80GB HBM3, jax 0.11.2, 2026-12-08: "
        "the MMA schedule (`overlap`) and the split count's program target. Command: "
        f"`{COMMAND}`; joined by `python notes/schedule_ab_results.py`.\n\n" + "\n".join(lines)
    )
    OUT.with_suffix(".md").write_text(md + "\n")
    OUT.with_suffix(".json").write_text(
        json.dumps(
            dict(
                command=COMMAND,
                device="NVIDIA H100 80GB HBM3",
                jax_version="0.11.2",
                date="2026-12-08",
                commit="c43bdb2",
                rows=rows,
            ),
            indent=1,
        )  # fmt: skip
    )
    print(md)


if __name__ == "__main__":
    main()
