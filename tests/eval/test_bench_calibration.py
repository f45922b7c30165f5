"""eval.bench_calibration on a tiny random-weights model: every phase at every token budget."""

import json

import pytest

from eval import bench_calibration as bc

TINY = [
    "--random-weights", "--layers", "2", "--hidden-size", "64", "--intermediate-size", "128",
    "--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "16", "--vocab-size", "97",
    "--seq-len", "32", "--batch-size", "2",
]  # fmt: skip


def test_streams_each_budget_through_each_phase(tmp_path):
    cfg = bc.parse_args([*TINY, "--tokens", "64", "192", "--methods", "wush", "oscar"])
    bc.main(cfg.__class__(**{**cfg.__dict__, "out": str(tmp_path / "b")}))
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [(r["phase"].split("[")[0], r["tokens"]) for r in rows] == [
        ("forward", 64), ("forward", 192), ("statistics", 64), ("statistics", 192),
        ("statistics", 64), ("statistics", 192),
    ]  # fmt: skip
    assert all(r["tokens_per_s"] > 0 and r["peak_rss_mib"] > 0 for r in rows)
    assert "| forward | 192 |" in (tmp_path / "b.md").read_text()


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--tokens", "100"], "--tokens \\[100\\]: each must be a positive multiple of 64"),
        (["--methods", "nope"], "unknown method"),
        (["--model", "x.gguf"], "exclude each other"),
    ],
)
def test_bad_options_fail_before_any_work(argv, match):
    with pytest.raises((ValueError, SystemExit), match=match):
        bc.parse_args([*TINY, *argv])
