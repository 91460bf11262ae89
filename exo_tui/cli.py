"""``exo-tui`` and its subcommands.

Each subcommand lives in its own module under :mod:`exo_tui.commands` and exposes
``add_parser(subparsers)``, which registers the parser and sets ``func`` to the function that
runs it (``func(args) -> int``). Modules import their heavy dependencies inside that function so
that ``exo-tui --help`` stays fast. ``exo-tui`` with no subcommand opens the console
(the ``tui`` command).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from exo_tui import __version__, commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="exo-tui",
        description="Run one LLM across the computers you already own, from a terminal console.",
    )
    parser.add_argument("--version", action="version", version=f"exo-tui {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        importlib.import_module(f"exo_tui.commands.{info.name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices if parser._subparsers else None
    known = set(commands or ())
    first = next((a for a in argv if not a.startswith("-")), None)
    if "tui" in known and first not in known and not {"-h", "--help", "--version"} & set(argv):
        argv = ["tui", *argv]
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    from exo_tui.paths import raise_open_files_limit

    raise_open_files_limit()  # before any listener: a flood of connections finds the hard limit, not 1,024
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except OSError as exc:
        from exo_tui.paths import storage_error

        message = storage_error(exc)
        if message is None:
            raise
        print(f"exo-tui {args.command}: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
