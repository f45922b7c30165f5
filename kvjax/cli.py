"""What every kvjax command line shares: bad input becomes one clear line and exit status 2.

    if __name__ == "__main__":
        cli.run(main, parse_args)

``--debug`` (anywhere on the command line) shows the full traceback instead. Errors that
are the user's to fix (a bad option, a missing or unreadable file, an unsupported model,
text that cannot calibrate anything) are `ValueError`s or `OSError`s raised before slow work
starts; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import types
import typing
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


def check_paths_exist(**paths: str | None) -> None:
    """`fail` for the first given path that does not exist (``data=...`` names ``--data``)."""

    for name, path in paths.items():
        flag = "--" + name.replace("_", "-")
        check(
            path is None or pathlib.Path(path).expanduser().exists(),
            f"{flag} {path!r} does not exist",
        )


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


# ------------------------------------------------------------------------------------------
# Options from a config dataclass: one flag per field, with its help text and its default
# ------------------------------------------------------------------------------------------
def option(default: Any = None, help: str = "", **meta: Any) -> Any:
    """A config field that is also a command-line option.

    ``meta`` may set ``flag`` (default ``--field-name``), ``type`` (parses one value),
    ``choices``, ``metavar``,
    ``none_flag`` (an extra flag that sets the field to None, e.g. ``--no-serving``), or
    ``cli=False`` (a field with no option). Mutable defaults are not allowed (configs are
    frozen dataclasses of scalars and tuples).
    """
    return dataclasses.field(default=default, metadata=dict(help=help, **meta))


def _kind(tp: Any) -> tuple[str, Any, Any]:
    """(``"bool"`` | ``"seq"`` | ``"scalar"``, element type, nargs) of a field annotation."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        tp = args[0]  # X | None: an option whose default may be None
    if tp is bool:
        return "bool", bool, None
    if typing.get_origin(tp) is tuple:
        elems = typing.get_args(tp)
        if len(elems) == 2 and elems[1] is Ellipsis:
            return "seq", elems[0], "+"
        return "seq", elems[0], len(elems)
    return "scalar", tp, None


def add_dataclass_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """Adds one option per field of the dataclass ``cls`` (see `option`)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = dict(f.metadata)
        if meta.pop("cli", True) is False:
            continue
        flag = meta.pop("flag", "--" + f.name.replace("_", "-"))
        help_text = meta.pop("help", "")
        none_flag = meta.pop("none_flag", None)
        if none_flag is not None:
            parser.add_argument(
                none_flag,
                dest=f.name,
                action="store_const",
                const=None,
                default=argparse.SUPPRESS,  # the field's own option sets the default
                help=f"no {flag[2:]}",
            )
        kind, elem, nargs = _kind(hints[f.name])
        elem = meta.pop("type", elem)  # a parser for one element (e.g. "8x131072" -> (8, 131072))
        default = f.default
        shown = " ".join(map(str, default)) if isinstance(default, tuple) else default
        suffix = "" if default is None else f" (default: {shown})"
        kw: dict[str, Any] = dict(dest=f.name, help=f"{help_text}{suffix}".strip())
        if kind == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, **kw)
        elif kind == "seq":
            parser.add_argument(flag, type=elem, nargs=nargs, default=default, **meta, **kw)
        else:
            parser.add_argument(flag, type=elem, default=default, **meta, **kw)


def dataclass_from_args(cls: type, namespace: argparse.Namespace) -> Any:
    """The config ``cls`` from parsed options (lists become tuples)."""
    values = {}
    for f in dataclasses.fields(cls):
        if hasattr(namespace, f.name):
            v = getattr(namespace, f.name)
            values[f.name] = tuple(v) if isinstance(v, list) else v
    return cls(**values)


def dataclass_parser(cls: type, prog: str, description: str | None) -> argparse.ArgumentParser:
    """An `argparse.ArgumentParser` with `add_dataclass_options` applied (and --debug listed)."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_dataclass_options(parser, cls)
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    return parser
