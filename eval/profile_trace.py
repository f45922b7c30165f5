"""Where device time goes: run a callable under `jax.profiler.trace` and total its events.

    rows = profile_trace.trace_and_summarize(lambda: eng.step(), "runs/prof", repeats=2)

The trace is the profiler's own xspace file, read back with `jax.profiler.ProfileData` (no
TensorBoard needed). On a GPU each kernel is an event on a stream line of the "/device:GPU:N"
plane; events of the same name are summed, so a decode window's 36 layers of attention become
one row with its count, total time and share of the busy time. Names are XLA's fusion and
kernel names (the Pallas kernels keep the name of their Python function).
"""

from __future__ import annotations

import collections
import glob
import os
from collections.abc import Callable

import jax

# Lines of a device plane that hold kernels (the others repeat them as XLA ops or modules).
_KERNEL_LINE_PREFIXES = ("Stream", "stream")


def summarize(trace_dir: str, plane_prefix: str = "/device:", lines: tuple[str, ...] = ()):
    """Per event name: count, total ns, on the kernel lines of planes named `plane_prefix*`.

    `lines` picks line names by prefix (default: the stream lines of a GPU plane). Returns
    (rows sorted by total time, busy ns summed over all rows).
    """
    from jax.profiler import ProfileData

    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir!r}: did the trace run?")
    data = ProfileData.from_file(paths[-1])
    prefixes = lines or _KERNEL_LINE_PREFIXES
    count: collections.Counter = collections.Counter()
    total: collections.Counter = collections.Counter()
    for plane in data.planes:
        if not plane.name.startswith(plane_prefix):
            continue
        for line in plane.lines:
            if not line.name.startswith(prefixes):
                continue
            for ev in line.events:
                count[ev.name] += 1
                total[ev.name] += float(ev.duration_ns)
    busy = sum(total.values())
    rows = [
        dict(name=n, count=count[n], total_us=round(t / 1e3, 1), share=round(t / max(busy, 1.0), 4))
        for n, t in total.most_common()
    ]
    return rows, busy


def trace_and_summarize(
    fn: Callable[[], object], trace_dir: str, repeats: int = 1, **kwargs
) -> tuple[list[dict], float]:
    """Runs `fn` `repeats` times under one trace (results blocked on) and summarizes it."""
    with jax.profiler.trace(trace_dir):
        for _ in range(repeats):
            jax.block_until_ready(fn())
    return summarize(trace_dir, **kwargs)


def markdown(rows: list[dict], busy_ns: float, top: int = 25, per: int = 1) -> str:
    """Top `top` rows as a table; times divided by `per` (e.g. per decode step)."""
    out = [
        f"busy {busy_ns / 1e6 / per:.3f} ms per unit ({per} units traced)\n",
        "| kernel | count | ms per unit | share |",
        "|---|---:|---:|---:|",
    ]
    for r in rows[:top]:
        name = r["name"] if len(r["name"]) <= 80 else r["name"][:77] + "..."
        out.append(
            f"| `{name}` | {r['count']} | {r['total_us'] / 1e3 / per:.3f} | {r['share']:.1%} |"
        )
    return "\n".join(out) + "\n"
