"""Device timeline of the benchmark's timed jit for one low-bit variant: where a batch-1 call's
time goes between its kernels.

    python3 notes/batch1_timeline.py OUT_DIR 1x32768 int2_mosaic_vdims [int2_pallas ...]

Builds the inputs and the timed jit exactly as `eval.bench_decode` does (one cache copy per
call, `copies_for` copies), runs it under `jax.profiler.trace` and reads the device plane of
the trace: per call, the kernels in launch order with their durations and the idle gap before
each, the busy time (union of kernel intervals) and the span from the first kernel's start to
the last one's end. ncu measures each kernel alone and serialized; this shows what the
timed loop adds around them (launch gaps), which ncu cannot. Writes OUT_DIR/timeline_*.json
and prints a summary. XLA_FLAGS (for example command-buffer settings) apply as usual.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import tempfile
import time


def _device_events(pb_path: str) -> list[tuple[int, int, str]]:
    from jax.profiler import ProfileData

    data = ProfileData.from_file(pb_path)
    seen = set()
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            for e in line.events:
                if e.duration_ns <= 0:
                    continue
                key = (int(e.start_ns), int(e.duration_ns), e.name)
                seen.add(key)
    return sorted(seen)


def timeline(out_dir: str, point: str, name: str) -> dict:
    import jax

    from eval import bench_decode as bd
    from pallas_kernels import decode_attention as da

    batch, ctx = bd.parse_point(point)
    cfg = bd.BenchConfig()
    key = jax.random.key(0)
    bits, kw, override = bd.lowbit_variant(cfg, batch, ctx, name)
    override = dict(override)
    meta_dtype = override.pop("meta_dtype", "float16")
    nbytes, _, _ = bd._bytes_lowbit(cfg, batch, ctx, bits, kw.get("bits_v"), meta_dtype)
    page_q = override.pop("lowbit_page_size", None)
    vl = kw.get("value_layout", "tokens")
    caches = []
    for r in range(bd.copies_for(nbytes)):
        x = bd._make_lowbit_inputs(
            cfg,
            batch,
            ctx,
            bits,
            jax.random.fold_in(key, r),
            page_q,
            vl,
            bits_v=kw.get("bits_v"),
            meta_dtype=meta_dtype,
        )
        x.pop("q")
        caches.append(bd.with_overrides(x, override, batch))
    qs = bd._queries(cfg, batch, key, len(caches))
    sm = cfg.head_dim**-0.5
    n = len(caches)

    many = bd.unrolled_calls(
        lambda c, q: da.decode_attention_variant(q=q, **c, bits=bits, sm_scale=sm, **kw)
    )

    for _ in range(3):
        jax.block_until_ready(many(caches, qs))
    rounds = 4
    t0 = time.perf_counter()
    jax.block_until_ready([many(caches, qs) for _ in range(rounds)])
    wall_per_call_us = (time.perf_counter() - t0) / (rounds * n) * 1e6
    tdir = tempfile.mkdtemp()
    with jax.profiler.trace(tdir):
        jax.block_until_ready([many(caches, qs) for _ in range(rounds)])
    pbs = glob.glob(os.path.join(tdir, "**", "*.xplane.pb"), recursive=True)
    events = _device_events(pbs[0])
    if not events:
        return {"point": point, "variant": name, "error": "no device events in the trace"}
    # The trace's kernels: rounds * n calls of k kernels each, in launch order.
    per_call = len(events) // (rounds * n)
    busy = 0
    end = events[0][0]
    for s, d, _ in events:
        busy += max(0, s + d - max(s, end))
        end = max(end, s + d)
    span = events[-1][0] + events[-1][1] - events[0][0]
    # One call in the middle of the trace, kernel by kernel.
    mid = (len(events) // 2 // per_call) * per_call if per_call else 0
    one = []
    prev_end = events[mid - 1][0] + events[mid - 1][1] if mid else events[0][0]
    for s, d, nm in events[mid : mid + per_call]:
        one.append({"kernel": nm[:120], "gap_before_us": (s - prev_end) / 1e3, "us": d / 1e3})
        prev_end = s + d
    res = {
        "point": point,
        "variant": name,
        "copies": n,
        "rounds": rounds,
        "kernels": len(events),
        "kernels_per_call": per_call,
        "wall_per_call_us": wall_per_call_us,
        "span_per_call_us": span / 1e3 / (rounds * n),
        "busy_per_call_us": busy / 1e3 / (rounds * n),
        "one_call": one,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
    }
    tag = os.environ.get("TIMELINE_TAG", "default")
    path = os.path.join(out_dir, f"timeline_{tag}_{name}_{point}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if len(sys.argv) < 4:
        raise SystemExit("usage: batch1_timeline.py OUT_DIR BATCHxCONTEXT VARIANT [VARIANT ...]")
    out_dir, point, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    os.makedirs(out_dir, exist_ok=True)
    for nm in names:
        r = timeline(out_dir, point, nm)
        if "error" in r:
            print(nm, point, r["error"])
            continue
        print(
            f"{nm} {point} [{r['xla_flags']}]: wall {r['wall_per_call_us']:.1f} us/call, "
            f"span {r['span_per_call_us']:.1f}, busy {r['busy_per_call_us']:.1f}, "
            f"{r['kernels_per_call']} kernels/call"
        )
        for k in r["one_call"]:
            print(f"   gap {k['gap_before_us']:6.1f}  {k['us']:6.1f} us  {k['kernel']}")
