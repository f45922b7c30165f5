"""What every kvjax command line shares: bad input becomes one clear line and exit status 2.

    if __name__ == "__main__":
        cli.run(main, parse_args)

``--debug`` (anywhere on the command line) shows the full traceback instead. Errors that
are the user's to fix (a bad option, a missing or unreadable file, an unsupported model,
text that cannot calibrate anything) are `ValueError`s or `OSError`s raised before slow work
starts; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

USAGE_ERROR = 2


class UsageError(ValueError):
    """An option value or input the user must change; the message names it."""


def fail(message: str) -> NoReturn:
    """Raises `UsageError` (the CLI prints it as one line)."""
    raise UsageError(message)


def check(ok: bool, message: str) -> None:
    """`fail(message)` unless ``ok``."""
    if not ok:
        fail(message)


def run(
    main: Callable[[Any], Any],
    parse_args: Callable[[Sequence[str] | None], Any],
    argv: Sequence[str] | None = None,
) -> Any:
    """Parses ``argv`` (default ``sys.argv[1:]``), runs ``main``; user errors exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    try:
        return main(parse_args(argv))
    except (ValueError, OSError) as e:
        if debug:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: {first}", file=sys.stderr)
        print("(rerun with --debug for the traceback)", file=sys.stderr)
        raise SystemExit(USAGE_ERROR) from None
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
