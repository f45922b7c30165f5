"""`python -m kvjax.calibrate`: the entry users run; the work lives in `calib.calibrate`.

This shim is the one place `kvjax` reaches up into `calib` (the product brief fixes the command
name); serving code never imports it. It also turns a shipped model's name
(`--model gemma3-270m`, `kvjax.assets.MODELS`) into the path of its cached file, fetching it on
first use, since `calib.calibrate` checks that `--model` exists on disk.
"""

import dataclasses
import pathlib
from collections.abc import Sequence

from calib.calibrate import CalibrateConfig, main
from calib.calibrate import parse_args as _parse_args
from kvjax import assets, cli


def parse_args(argv: Sequence[str] | None = None) -> CalibrateConfig:
    """`calib.calibrate.parse_args`, with a shipped model's name resolved to its file."""
    cfg = _parse_args(argv)
    name = cfg.model
    if name in assets.MODELS and not pathlib.Path(name).expanduser().exists():
        cfg = dataclasses.replace(cfg, model=str(assets.model_path(name)))
    return cfg


__all__ = ["main", "parse_args"]

if __name__ == "__main__":
    cli.run(main, parse_args)
