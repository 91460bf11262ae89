"""Argument types shared by the subcommands: each says at once what is wrong with a value."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def whole_number(least: int, unit: str, too_small: str) -> Callable[[str], int]:
    """An argparse ``type`` for a whole number of ``unit`` of at least ``least``; ``too_small``
    (formatted with ``value``) says why a smaller one is refused."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of {unit}") from None
        if value < least:
            raise argparse.ArgumentTypeError(too_small.format(value=value))
        return value

    return parse


def secret_help(env: str) -> str:
    """What a secret option's help adds: the ways to pass it that keep it out of ``ps``."""
    return (f"; '-' reads it from stdin, '@FILE' from a file, and the option without a value from ${env}: "
            "each keeps it out of ps, which shows a command's arguments to every user of the machine")


def read_secret(value: str | None, env: str, what: str) -> str | None:
    """A secret option's value: ``None`` (not given), the text itself, ``-`` (the first line of
    stdin), ``@FILE`` (the file's text) or ``""`` (given without a value: the environment variable
    ``env``). Raises :class:`ValueError` saying what is wrong (an empty or unreadable source)."""
    import os
    import sys
    from pathlib import Path

    if value is None:
        return None
    if value == "":
        value, source = os.environ.get(env, ""), f"${env}"
    elif value == "-":
        value, source = sys.stdin.readline(), "stdin"
    elif value.startswith("@"):
        path = Path(value[1:]).expanduser()
        try:
            value, source = path.read_text(), str(path)
        except OSError as exc:
            raise ValueError(f"cannot read the {what} from {path}: {exc.strerror or exc}") from None
    else:
        return value
    if not value.strip():
        raise ValueError(f"no {what} in {source}: it is empty or unset")
    return value.strip()
