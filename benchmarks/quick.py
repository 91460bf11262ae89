"""``--quick`` for every benchmark: tiny parameters that show it still runs end to end (the suite
runs each one so: tests/integration/test_benchmarks.py). Its figures mean nothing."""

from __future__ import annotations

import argparse
import importlib.util
import sys

QUICK_HELP = "tiny parameters: check that the benchmark runs (its figures mean nothing)"


def parse(ap: argparse.ArgumentParser, argv: list[str] | None = None, **quick: object) -> argparse.Namespace:
    """``ap``'s arguments, with ``--quick`` added: given it, ``quick``'s values are the defaults
    (an option also given on the command line still wins)."""
    ap.add_argument("--quick", action="store_true", help=QUICK_HELP)
    argv = sys.argv[1:] if argv is None else argv
    if "--quick" in argv:
        ap.set_defaults(**quick)
    return ap.parse_args(argv)


def have_llama_cpp() -> bool:
    """Whether llama.cpp's Python binding is installed; where it is not, say that the peer is skipped."""
    if importlib.util.find_spec("llama_cpp") is not None:
        return True
    print("llama.cpp: skipped (llama_cpp is not installed: make bench builds it); "
          "exo-tui's side only", flush=True)
    return False
