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
