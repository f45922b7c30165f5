"""`python -m kvjax.calibrate`: the entry users run; the work lives in `calib.calibrate`.

This shim is the one place `kvjax` reaches up into `calib` (the product brief fixes the command
name); serving code never imports it.
"""

from calib.calibrate import main, parse_args
from kvjax import cli

if __name__ == "__main__":
    cli.run(main, parse_args)
