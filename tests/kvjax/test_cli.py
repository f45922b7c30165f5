"""The shared CLI wrapper: user errors are one line and exit status 2; --debug re-raises."""

from __future__ import annotations

import pytest

from kvjax import cli
from kvjax import generate as gen


def _main(cfg):
    cli.check(cfg != "bad", f"--thing {cfg!r}: must not be bad")
    return cfg


def _parse(argv):
    return argv[0] if argv else "ok"


def test_user_error_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli.run(_main, _parse, ["bad"])
    assert e.value.code == cli.USAGE_ERROR
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "error: --thing 'bad': must not be bad"
    assert "Traceback" not in "\n".join(err)


def test_debug_shows_the_exception():
    with pytest.raises(cli.UsageError, match="must not be bad"):
        cli.run(_main, _parse, ["bad", "--debug"])


def test_success_returns_mains_value():
    assert cli.run(_main, _parse, []) == "ok"


@pytest.mark.parametrize(
    ("argv", "msg"),
    [
        (["--max-new-tokens", "-1"], "--max-new-tokens -1: must be > 0"),
        (["--bits", "5"], "--bits 5: supported 2, 3, 4"),
        (["--top-p", "0"], "--top-p 0.0"),
        (["--temperature", "-1"], "--temperature -1.0"),
        (["--transforms", "/no/such/dir", "--bits", "2"], "'/no/such/dir' does not exist"),
        (["--transforms", "/no/such/dir"], "--transforms needs --bits"),
        (["--sink", "10"], "--sink 10 must be a multiple of --page-size 16"),
        (["--prompt-file", "/no/such/file"], "--prompt-file '/no/such/file' is not a file"),
        (["--prompts-file", "/no/such/file"], "--prompts-file '/no/such/file' is not a file"),
        (["--top-k", "-2"], "--top-k -2: must be >= 0"),
        (["--max-seqs", "0"], "--max-seqs 0: must be >= 1"),
        (["--kv-memory-gb", "0"], "--kv-memory-gb 0.0: must be > 0"),
    ],
)
def test_generate_checks_options_before_loading(argv, msg, monkeypatch, capsys):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(gen, "load_model", no_load)
    with pytest.raises(SystemExit) as e:
        cli.run(gen.main, gen.parse_args, argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err.splitlines()[0]


def test_generate_takes_a_shipped_models_name(monkeypatch):
    def loaded(path):
        raise RuntimeError(f"load {path}")

    monkeypatch.setattr(gen, "load_model", loaded)
    with pytest.raises(RuntimeError, match="load gemma3-270m"):  # past the path check
        gen.main(gen.parse_args(["--model", "gemma3-270m"]))
    assert gen.parse_args([]).add_bos is None  # the tokenizer's own default


def test_dataclass_parsers_default_to_the_config_and_round_trip():
    from calib import calibrate as cal
    from eval import (
        attention_error,
        bench_calibration,
        bench_decode,
        bench_engine,
        bench_serving,
        perplexity,
        report,
        retrieval,
    )

    for mod, cls in (
        (cal, cal.CalibrateConfig),
        (gen, gen.GenerateConfig),
        (attention_error, attention_error.AttentionErrorConfig),
        (retrieval, retrieval.RetrievalConfig),
        (bench_calibration, bench_calibration.BenchCalibrationConfig),
        (perplexity, perplexity.PerplexityConfig),
        (report, report.ReportConfig),
        (bench_engine, bench_engine.EngineBenchConfig),
        (bench_decode, bench_decode.BenchConfig),
        (bench_serving, bench_serving.BenchServingConfig),
    ):
        assert mod.parse_args([]) == cls(), cls.__name__
    c = cal.parse_args(["--method", "wush", "oscar", "--bits", "2", "4", "--no-progress"])
    assert (c.methods, c.bits, c.progress) == (("wush", "oscar"), (2, 4), False)
    p = perplexity.parse_args(["--no-serving", "--windows", "3", "--protocol", "8", "64", "8"])
    assert (p.serving, p.num_windows, p.protocol) == (None, 3, (8, 64, 8))
    with pytest.raises(SystemExit):  # argparse rejects a choice outside the list
        report.parse_args(["--run", "everything"])


def test_bench_decode_stage_rows_are_checked_by_name():
    from eval import bench_decode

    assert bench_decode.parse_args(["--stages", "loads", "loads_codes"]).stages == (
        "loads",
        "loads_codes",
    )
    with pytest.raises(ValueError, match=r"unknown --stages \['bogus'\]"):
        bench_decode.parse_args(["--stages", "loads", "bogus"])
