"""The trace summarizer reads the profiler's own file back (CPU: the host plane's XLA lines)."""

import jax
import jax.numpy as jnp
import pytest

from eval import profile_trace


def test_trace_and_summarize_counts_repeats(tmp_path):
    f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
    x = jnp.ones((256, 256))
    f(x).block_until_ready()
    rows, busy = profile_trace.trace_and_summarize(
        lambda: f(x), str(tmp_path), repeats=3, plane_prefix="/host:CPU", lines=("python",)
    )
    assert busy > 0 and rows
    assert abs(sum(r["share"] for r in rows) - 1.0) < 1e-3
    assert rows == sorted(rows, key=lambda r: -r["total_us"])
    md = profile_trace.markdown(rows, busy, top=5, per=3)
    assert md.count("\n| `") == min(5, len(rows))


def test_summarize_names_missing_trace(tmp_path):
    with pytest.raises(FileNotFoundError, match="xplane"):
        profile_trace.summarize(str(tmp_path))
